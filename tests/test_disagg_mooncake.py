"""kvmem.disagg over Mooncake's transfer engine for real, on 127.0.0.1: pages written bit for bit, a peer that is not
listening failing fast with one line, and two engine processes (prefill, decode) giving one engine's greedy tokens.

One Mooncake master (its HTTP metadata server on) serves the module; every process a test starts is stopped by pid,
and every wait is bounded.
"""

import json
import random
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvmem import MHAKVPool
from kvmem.disagg import ChannelListener, MooncakeTransport, TransferStatus, connect
from kvmem.disagg.transport import KVBuffers

pytestmark = pytest.mark.mooncake
WAIT_S = 180  # the two processes import torch and transformers on a loaded 2-core machine


@pytest.fixture(scope="module")
def metadata_server():
    try:
        from kvmem.disagg.mooncake_transport import _transfer_engine_class
        from kvmem.storage import MooncakeServer
        _transfer_engine_class()
    except RuntimeError as e:
        pytest.skip(f"the Mooncake transfer engine cannot load here: {e}")
    with MooncakeServer(16, metadata="http") as server:
        yield server.metadata_server


def filled_pool():
    pool = MHAKVPool(256, 16, torch.bfloat16, 2, 64, 3)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.view(torch.uint8).shape, dtype=torch.uint8))
    return pool


def test_the_mooncake_transport_writes_pages_bit_for_bit_on_loopback(metadata_server):
    sender, receiver = MooncakeTransport(metadata_server), MooncakeTransport(metadata_server)
    try:
        src, dst = filled_pool(), MHAKVPool(256, 16, torch.bfloat16, 2, 64, 3)
        a, b = sender.register(src), receiver.register(dst)
        sender.check_peer(b)
        pages = ([3, 4, 5, 9], [7, 8, 9, 2])  # runs of 2 + 1 + 1 pages on the receiving side
        assert sender.write(a, pages[0], b, pages[1]).wait(30) is TransferStatus.DONE
        for layer in range(3):
            for s, d in ((src.k_buffer[layer], dst.k_buffer[layer]), (src.v_buffer[layer], dst.v_buffer[layer])):
                s, d = s.view(torch.uint8), d.view(torch.uint8)  # random bytes hold NaNs, which equal nothing
                for sp, dp in zip(*pages):
                    assert torch.equal(s[sp * 16:(sp + 1) * 16], d[dp * 16:(dp + 1) * 16])
                assert not d[16:32].any()  # page 1 was not written
    finally:
        sender.close()
        receiver.close()


def test_one_transport_registers_a_hybrid_engines_pools_and_moves_a_state_slot_bit_for_bit(metadata_server):
    from kvmem.hybrid import StatePool

    sender, receiver = MooncakeTransport(metadata_server), MooncakeTransport(metadata_server)
    try:
        states = [StatePool(4, 2, (6, 4), (2, 4, 4), torch.bfloat16) for _ in range(2)]
        for buf in states[0].conv_states + states[0].ssm_states:
            buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.view(torch.uint8).shape, dtype=torch.uint8))
        a, b = sender.register(states[0]), receiver.register(states[1])
        kv = receiver.register(MHAKVPool(64, 16, torch.bfloat16, 2, 64, 1))  # a second pool beside it
        assert sender.write(a, [3], b, [1]).wait(30) is TransferStatus.DONE
        for src, dst in zip(states[0].conv_states + states[0].ssm_states, states[1].conv_states + states[1].ssm_states):
            src, dst = src.view(torch.uint8), dst.view(torch.uint8)  # random bytes hold NaNs, which equal nothing
            assert torch.equal(src[3], dst[1]) and not dst[2].any()
        receiver.unregister(kv)
        assert sender.write(a, [2], b, [2]).wait(30) is TransferStatus.DONE  # the state pool stays registered
    finally:
        sender.close()
        receiver.close()


def test_a_peer_that_is_not_listening_fails_fast_with_one_line(metadata_server):
    transport = MooncakeTransport(metadata_server)
    try:
        mine = transport.register(filled_pool())
        nobody = KVBuffers("127.0.0.1:1", mine.addresses, mine.page_bytes, mine.num_pages)
        with pytest.raises(RuntimeError, match="is not listening") as info:
            transport.check_peer(nobody)
        assert "\n" not in str(info.value)
        transfer = transport.write(mine, [1], nobody, [1])
        assert transfer.wait(10) is TransferStatus.FAILED and "is not listening" in transfer.error
    finally:
        transport.close()
    closed = ChannelListener()
    address = closed.address
    closed.close()
    with pytest.raises(RuntimeError, match=f"no KV prefill server listens at {address}") as info:
        connect(address)
    assert "\n" not in str(info.value)
    with pytest.raises(RuntimeError, match="no Mooncake metadata server answers"):
        MooncakeTransport(f"http://{address}/metadata")


def prompts_sharing_a_prefix(n=6, seed=0):
    rng = random.Random(seed)
    head = [rng.randrange(256) for _ in range(48)]
    return [head[:rng.randrange(32, 49)] + [rng.randrange(256) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


def _stop(proc):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _free_port():
    listener = ChannelListener()
    port = int(listener.address.rsplit(":", 1)[1])
    listener.close()
    return port


def test_two_engine_processes_over_mooncake_give_one_engines_greedy_tokens(metadata_server, tmp_path):
    from kvmem.engine import Engine, build_model

    presets = ["llama-tiny", "deepseek-v2-tiny", "gemma3-tiny"]  # Gemma 3: window tails' KV moves too
    prompts = prompts_sharing_a_prefix()
    waves = [prompts[:1], prompts[1:]]  # the first prompt's pages are in the decode side's cache for the others
    (tmp_path / "prompts.json").write_text(json.dumps(waves))
    common = [sys.executable, "-m", "kvmem.disagg.serve", "--metadata-server", metadata_server, "--page-size", "16"]
    ports = [_free_port() for _ in presets]
    for preset, port in zip(presets, ports):
        common += ["--preset", preset, "--port", str(port), "--prefill", f"127.0.0.1:{port}"]
    procs = []
    try:
        # Both start at once; the decode process retries connecting (within a bound) while the prefill one starts.
        procs.append(subprocess.Popen([*common, "prefill"], stdout=subprocess.DEVNULL))
        procs.append(subprocess.Popen([*common, "decode", "--prompts", str(tmp_path / "prompts.json"),
                                       "--connect-timeout-s", str(WAIT_S)], stdout=subprocess.PIPE, text=True))
        # The single engine's tokens, computed while the two processes start.
        expected = {p: Engine(build_model(p), capacity_tokens=4096, page_size=16).generate(prompts, 8)
                    for p in presets}
        out, _ = procs[1].communicate(timeout=WAIT_S)
        assert procs[1].returncode == 0
        results = json.loads(out)
    finally:
        for proc in reversed(procs):
            _stop(proc)
    for preset in presets:
        got = results[preset]
        assert got["outputs"] == expected[preset]
        stats = got["stats"]
        if preset != "gemma3-tiny":  # its decode side holds the shared head without window KV: it cannot resume there
            assert stats["cached_tokens"] >= 32 * (len(prompts) - 1)  # every later prompt found the shared head cached
        assert stats["engine_cached_tokens"] == stats["cached_tokens"] and stats["received_pages"] > 0
    assert procs[0].returncode == 0  # the prefill process stopped cleanly on SIGTERM


def test_the_transfer_benchmark_prints_its_figures_in_its_short_mode(metadata_server, capsys):
    bench = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "bench_kv_transfer.py"),
                           run_name="bench")
    threads = torch.get_num_threads()
    try:
        assert bench["main"](["--page-sizes", "16", "--pool-tokens", "64", "--repeats", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    (row,) = json.loads(capsys.readouterr().out)["results"]
    assert row["page_size"] == 16 and row["pages"] == 4 and row["bytes"] == 4 * 16 * 32 * 2 * 8 * 128 * 2
    for name in ("memcpy", "copy_transport_shuffled", "mooncake_transport_in_order", "mooncake_transport_shuffled",
                 "mooncake_batch_call_shuffled"):
        assert row[name]["pages_per_s"] > 0 and row[name]["gb_per_s"] > 0
