"""What a capacity planner runs: the capacity for a target hit rate, tier comparisons, honest clocks, the overload
warning, capacities as typed, Ctrl-C, and the replay without torch (issue 35)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from array import array
from pathlib import Path

import numpy as np
import pytest

from kvmem.replay import native_replay
from kvmem.replay.capacity import gpus_needed, parse_token_sizes
from kvmem.replay.cli import main
from kvmem.replay.cluster_report import ClusterReport, format_cluster_summary
from kvmem.replay.config import ReplayConfig
from kvmem.replay.cost import StepCost, cost_model
from kvmem.replay.report import ReplayReport, format_seconds, format_summary, format_tokens
from kvmem.replay.reuse import reuse_ceiling, unbounded_capacity
from kvmem.replay.traces import default_trace_path, read_trace

REPO = Path(__file__).resolve().parents[1]
NATIVE = native_replay.load_native()
needs_native = pytest.mark.skipif(isinstance(NATIVE, ImportError),
                                  reason=f"the native replay engine is not built ({NATIVE})")
FEW = ["--limit", "60", "--no-progress", "--jobs", "1"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---- every clock charges what it models ------------------------------------------------------------------------

def test_the_default_clock_charges_host_loads_and_storage_reads_overlapped_with_the_prefill():
    cost = StepCost(kv_bytes_per_token=1_000_000, h2d_gbps=1.0, storage_gbps=0.5, storage_latency_us=100.0)
    prefix, seq = np.array([0]), np.array([5000])  # 30 ms + 5,000 tokens at 50k/s: 0.13 s
    assert cost.extend_seconds(prefix, seq) == pytest.approx(0.13)
    assert cost.extend_seconds(prefix, seq, loaded_tokens=100) == pytest.approx(0.13)  # 0.1 s of loads: hidden
    assert cost.extend_seconds(prefix, seq, loaded_tokens=1000) == pytest.approx(1.0)  # 1 GB over 1 GB/s
    # 200 of the loaded tokens read from storage first: 100 us, then 0.2 GB at 0.5 GB/s, beside the host link's 1 s
    assert cost.extend_seconds(prefix, seq, 1000, 200) == pytest.approx(1.0 + 0.4 + 1e-4)


def test_the_default_clock_of_a_replay_prices_loads_at_the_configured_link_and_kv_size():
    config = ReplayConfig(capacity_tokens=4096, max_context_len=64, host_capacity_tokens=16384, h2d_gbps=0.5,
                          model="llama-3-70b", storage="sim", storage_gbps=2.0, storage_latency_us=7.0)
    cost = cost_model(config)
    assert isinstance(cost, StepCost) and cost.name == StepCost().name  # reports name the same clock
    assert (cost.kv_bytes_per_token, cost.h2d_gbps, cost.storage_gbps, cost.storage_latency_us) == (
        config.token_kv_bytes, 0.5, 2.0, 7.0)


def test_a_slower_host_link_costs_a_tiered_replay_time_to_first_token_on_the_default_clock(capsys, tmp_path):
    pytest.importorskip("torch")  # a host tier replays on the Python engine
    # A 20k-token prompt, another that evicts it to the host, then the first again: its prefix comes back over the
    # host link, 20,000 x 128 KiB of llama-3-8b's KV: 262 s at 0.01 GB/s, hidden under the prefill at 50 GB/s.
    a, b = list(range(1, 20001)), list(range(100001, 120001))
    trace = tmp_path / "reload.jsonl"
    trace.write_text("".join(json.dumps({"input_ids": p, "output_len": 2}) + "\n" for p in (a + [7], b + [8], a + [9])))
    ttft = {}
    for gbps in ("50", "0.01"):
        code, out, _ = run(capsys, str(trace), "--capacity-tokens", "24000", "--host-capacity-tokens", "100000",
                           "--schedule-policy", "fcfs", "--arrivals", "all-at-once", "--h2d-gbps", gbps,
                           "--no-progress", "--json-only")
        report = json.loads(out)
        assert code == 0 and report["loaded_tokens"] == 20000
        ttft[gbps] = report["ttft_p99_s"]
    assert ttft["50"] < 2 and ttft["0.01"] > 20000 * 131072 / 0.01e9 * 0.98


# ---- the overload warning --------------------------------------------------------------------------------------

def report_of(arrivals, first_tokens) -> ReplayReport:
    r = ReplayReport(1000, cost_model="fixed", start_s=float(arrivals[0]))
    r.ttft_s = array("d", np.asarray(first_tokens) - np.asarray(arrivals))
    r.first_token_s = array("d", first_tokens)
    return r


def test_a_queue_that_grows_without_bound_is_flagged_from_when_it_stopped_draining():
    # 200 arrivals at 2 a second; the first 50 served at once, the rest at 1 a second from t=25.
    arrivals = np.arange(200) / 2.0
    first = np.concatenate([arrivals[:50] + 0.1, 25.0 + np.arange(150)])
    overload = report_of(arrivals, first).overload()
    assert overload is not None and overload.from_s == 25.0  # the first token that left none waiting
    assert overload.offered_per_s == pytest.approx(2.0, rel=0.05) and overload.served_per_s < 1.1
    assert "arrivals outrun this server from t=25 s: TTFT reflects queueing (offered 2" in overload.message()


def test_a_server_that_keeps_up_or_a_batch_queued_at_once_is_not_flagged():
    arrivals = np.arange(200) / 2.0
    assert report_of(arrivals, arrivals + 0.3).overload() is None  # busy, never behind
    assert report_of(arrivals, arrivals + 5.0).overload() is None  # a steady backlog of 10 that does not grow
    burst = np.concatenate([arrivals[:190], np.full(10, arrivals[189])])
    assert report_of(arrivals, burst + 1.0).overload() is None
    assert report_of(np.zeros(200), np.arange(200) * 0.5).overload() is None  # --arrivals all-at-once


@needs_native
def test_an_overloaded_replay_says_so_in_its_summary_and_report(capsys):
    code, out, err = run(capsys, "--limit", "200", "--no-progress")  # 30 ms steps and 50k prefill tokens/s
    overload = json.loads(out)["overload"]
    assert code == 0 and overload["offered_requests_per_s"] > overload["served_requests_per_s"]
    assert "warning: arrivals outrun this server from t=" in err and "TTFT reflects queueing" in err
    code, out, err = run(capsys, "--limit", "200", "--no-progress", "--gpu", "H100", "--tp", "8")
    assert code == 0 and "overload" not in json.loads(out) and "outrun" not in err


# ---- the capacity for a target hit rate ------------------------------------------------------------------------

def test_the_reuse_ceiling_of_a_mooncake_trace_is_what_an_unbounded_cache_serves():
    trace = read_trace(default_trace_path(), limit=100)
    reused = 0
    seen = set()
    for i in np.argsort(trace.arrival_s, kind="stable"):
        ids = trace.hash_ids[trace.block_offsets[i]:trace.block_offsets[i + 1]].tolist()
        k = 0
        while k < len(ids) and ids[k] in seen:
            k += 1
        reused += min(k * 512, int(trace.input_lens[i]) - 1) if k else 0
        seen.update(ids)
    assert reuse_ceiling(trace) == pytest.approx(reused / trace.input_lens.sum())
    assert unbounded_capacity(trace, 16) >= len(np.unique(trace.hash_ids)) * 512 + int(trace.output_lens.sum())


def documents_trace(tmp_path) -> Path:
    """300 questions, one every 0.5 s, each about one of 20 documents of 2,000 tokens (Zipf-distributed): the hit
    rate grows with the capacity until it holds every document."""
    rng = np.random.default_rng(0)
    documents = [list(range(1 + 10000 * d, 2001 + 10000 * d)) for d in range(20)]
    path = tmp_path / "documents.jsonl"
    with path.open("w") as f:
        for i in range(300):
            question = list(range(500000 + 64 * i, 500050 + 64 * i))
            f.write(json.dumps({"input_ids": documents[min(int(rng.zipf(1.3)), 20) - 1] + question, "output_len": 4,
                                "arrival_s": i * 0.5}) + "\n")
    return path


@needs_native
def test_a_target_hit_fraction_finds_the_smallest_capacity_that_reaches_it(capsys, tmp_path):
    code, out, err = run(capsys, str(documents_trace(tmp_path)), "--no-progress", "--jobs", "1", "--page-size", "16",
                         "--target-hit-fraction", "0.9", "--gpu", "H100", "--tp", "2")
    assert code == 0
    report = json.loads(out)
    plan, curve = report["capacity_plan"], report["sweep"]
    assert plan["target_hit_rate"] == pytest.approx(0.9 * plan["achievable_hit_rate"], abs=1e-6)
    assert plan["trace_ceiling"] is None and plan["achievable_hit_rate"] > 0.9  # a kvmem JSONL trace: no ceiling
    capacities = [r["capacity_tokens"] for r in curve]
    assert capacities == sorted(capacities) and capacities[-1] == plan["unbounded_tokens"]
    answer = capacities.index(plan["tokens"])
    assert curve[answer]["hit_rate"] >= plan["target_hit_rate"] > curve[answer - 1]["hit_rate"]
    assert capacities[answer] - capacities[answer - 1] <= max(16, 0.02 * capacities[answer])  # the bracket
    assert plan["kv_gib"] == pytest.approx(plan["tokens"] * plan["kv_bytes_per_token"] / 2**30, abs=1e-3)
    assert plan["gpus"]["tp"] == 1 and all("fits_gpus" in r for r in curve)  # 20 documents fit one H100
    assert "answer (>):" in err and "GPUs: 1 x H100" in err and f"> {format_tokens(plan['tokens'])}" in err


@pytest.mark.parametrize("argv, fragment", [
    (["--target-hit-fraction", "0"], "(0, 1]"), (["--target-hit-fraction", "1.5"], "(0, 1]"),
    (["--target-hit-fraction", "x"], "(0, 1]"),
    (["--target-hit-fraction", "0.9", "--capacity-tokens", "1000"], "--capacity-tokens with --target-hit-fraction"),
    (["--target-hit-fraction", "0.9", "--sweep"], "--sweep with --target-hit-fraction"),
    (["--target-hit-fraction", "0.9", "--host-capacity-tokens", "1000000"], "--host-capacity-tokens with"),
    (["--target-hit-fraction", "0.9", "--replicas", "2"], "--replicas with --target-hit-fraction"),
    (["--sweep", "1M,2X"], "1M, 500k or 3000000"), (["--sweep", "0"], "positive token counts"),
    (["--sweep-gb", "40,-1"], "positive GiB"), (["--sweep-gb", "40"], "--sweep-gb needs --model"),
    (["--sweep", "1M", "--sweep-gb", "4", "--model", "llama-3-8b"], "give the capacities once"),
    (["--sweep-host", "1M", "--sweep-host-gb", "4", "--model", "llama-3-8b"], "give the host sizes once"),
    (["--sweep-host", "4M", "--host-capacity-tokens", "4000000"], "--sweep-host sets the host tiers' sizes"),
    (["--sweep-host", "100k"], "host_capacity_tokens 100000 must exceed the device's"),
    (["--sweep-host", "k"], "positive token counts"),
    (["--sweep", "1M", "--capacity-tokens", "5000"], "the list sets the capacities"),
])
def test_the_planners_options_refuse_bad_input_with_one_line(capsys, argv, fragment):
    code, out, err = run(capsys, "--limit", "5", "--no-progress", *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("kvmem-replay: error: ")
    assert fragment in err and "Traceback" not in err


def test_token_sizes_keep_what_was_typed_as_their_label():
    assert [(s.label, s.tokens) for s in parse_token_sizes("1M, 500k,3000000,1.5m")] == [
        ("1M", 1_000_000), ("500k", 500_000), ("3000000", 3_000_000), ("1.5m", 1_500_000)]


def test_the_gpus_needed_are_the_smallest_tensor_parallel_group_that_holds_the_capacity():
    one = gpus_needed(100_000, "H100", "llama-3-8b", 131072, 1)
    assert (one.tp, one.gpu) == (1, "H100")
    assert gpus_needed(1_000_000, "H100", "llama-3-8b", 131072, 1).tp == 4
    beyond = gpus_needed(10**9, "H100", "llama-3-8b", 131072, 1)
    assert beyond.tp is None and beyond.largest > 0  # past the KV heads a group keeps copies: no group holds it


# ---- sweeps as typed, marked, and tier comparisons ---------------------------------------------------------------

@needs_native
def test_a_sweep_labels_capacities_as_typed_and_marks_those_the_gpus_cannot_hold(capsys):
    code, out, err = run(capsys, *FEW, "--sweep", "100k,2M", "--gpu", "H100")
    sweep = json.loads(out)["sweep"]
    assert code == 0 and [(r["label"], r["fits_gpus"]) for r in sweep] == [("100k", True), ("2M", False)]
    assert "     2M*" in err and "* more KV than 1 x H100 hold (427k tokens)" in err


@needs_native
def test_a_sweep_of_a_mooncake_trace_reads_against_the_traces_reuse_ceiling(capsys, monkeypatch, tmp_path):
    drawn = {}
    monkeypatch.setattr("kvmem.replay.cli.write_sweep_plots",
                        lambda reports, directory, labels, ceilings=None, **_: drawn.update(ceilings) or [])
    code, out, err = run(capsys, *FEW, "--sweep", "100k,2M", "--plot", str(tmp_path))
    ceiling = reuse_ceiling(read_trace(default_trace_path(), limit=60))
    assert code == 0 and json.loads(out)["trace_ceiling"] == round(ceiling, 6)
    assert f"the trace's reuse ceiling (what an unbounded cache would serve): {ceiling:.3f}" in err
    assert drawn == {"the trace's reuse ceiling": ceiling}


@needs_native
def test_a_sweep_in_gib_sizes_each_capacity_by_the_models_kv(capsys):
    code, out, _ = run(capsys, *FEW, "--sweep-gb", "4,8", "--model", "llama-3-8b", "--page-size", "16")
    sweep = json.loads(out)["sweep"]
    assert code == 0 and [r["label"] for r in sweep] == ["4 GiB", "8 GiB"]
    assert [r["capacity_tokens"] for r in sweep] == [32752, 65520]  # 4 and 8 GiB at 128 KiB a token, less a page


def test_a_host_tier_sweep_has_a_baseline_row_and_shows_what_each_tier_buys(capsys, tmp_path):
    pytest.importorskip("torch")  # host and storage tiers replay on the Python engine
    code, out, err = run(capsys, str(documents_trace(tmp_path)), "--no-progress", "--jobs", "1", "--capacity-tokens",
                         "8000", "--page-size", "16", "--sweep-host", "64k", "--storage", "sim")
    sweep = json.loads(out)["sweep"]
    assert code == 0
    assert [(r.get("host_capacity_tokens"), r.get("storage")) for r in sweep] == [
        (None, None), (64000, None), (64000, "sim")]
    assert sweep[1]["hit_rate"] > sweep[0]["hit_rate"] + 0.3  # the host holds the documents the device cannot
    lines = err.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("capacity"))
    assert lines[header].split()[-8:] == ["vs", "Δ", "hit", "Δ", "TTFT", "p50", "Δ", "p90"]
    baseline, host, storage = (lines[header + k].split() for k in (1, 2, 3))
    assert host[host.index("none") + 1] == f"{sweep[1]['hit_rate'] - sweep[0]['hit_rate']:+.3f}"
    assert storage[storage.index("host") + 1] == f"{sweep[2]['hit_rate'] - sweep[1]['hit_rate']:+.3f}"
    assert "none" not in baseline and "Δ: what the row's lowest tier buys" in err


def test_a_host_tier_sweep_in_gib_names_each_host_tier_as_typed(capsys, tmp_path):
    pytest.importorskip("torch")  # a host tier replays on the Python engine
    code, out, err = run(capsys, str(documents_trace(tmp_path)), "--no-progress", "--jobs", "1", "--limit", "20",
                         "--capacity-tokens", "4000", "--page-size", "16", "--sweep-host-gb", "1", "--model",
                         "llama-3-8b")
    sweep = json.loads(out)["sweep"]
    assert code == 0 and [(r.get("host_label"), r.get("host_capacity_tokens")) for r in sweep] == [
        (None, None), ("1 GiB", 8176)]  # 1 GiB of llama-3-8b's KV at 128 KiB a token, less a page
    assert err.splitlines()[-2].split()[:3] == ["4k", "1", "GiB"]


def test_the_sweep_table_shows_each_tiers_gain_against_its_row_without_it():
    def report(host, hit, ttft):
        r = ReplayReport(1000, host_capacity_tokens=host, cost_model="fixed")
        r.record_admission(100, hit)
        r.ttft_s = array("d", [ttft])
        return r

    lines = format_summary([report(None, 10, 5.0), report(4000, 30, 2.0)], "T").splitlines()
    assert lines[2].endswith("retractions    vs   Δ hit  Δ TTFT p50  Δ p90")
    assert lines[3].split()[:2] == ["1k", "-"] and lines[3].endswith("0" + " " * 33)  # the baseline: no gain
    assert lines[4].endswith("0  none  +0.200        -3 s   -3 s")
    assert lines[5] == "Δ: what the row's lowest tier buys, against the row without it (vs)"
    same = format_summary([report(None, 10, 0.07), report(4000, 30, 0.07 + 1e-12)], "T").splitlines()
    assert same[4].endswith("none  +0.200           0      0")  # float noise is no change
    plain = format_summary([report(None, 10, 5.0), report(None, 30, 2.0)], "T").splitlines()
    assert plain[2].split() == ["capacity", "hit", "rate", "TTFT", "p50", "p90", "p99", "s", "saved", "pinned",
                                "peak", "evicted", "retractions"]  # no tier: no tier columns


# ---- the cluster summary ---------------------------------------------------------------------------------------

def test_a_cluster_replay_prints_the_summary_with_load_imbalance_and_a_row_per_replica(capsys):
    pytest.importorskip("torch")  # the cluster replays on the Python engine
    code, out, err = run(capsys, "--limit", "30", "--no-progress", "--replicas", "2", "--router", "round-robin",
                         "--page-size", "16")
    report = json.loads(out)
    assert code == 0 and "hit rate" in err and "TTFT p50 / p90 / p99" in err
    assert f"load imbalance {report['load_imbalance']:.2f}" in err
    header = next(line for line in err.splitlines() if line.split()[:2] == ["replica", "routed"])
    rows = err.splitlines()[err.splitlines().index(header) + 1:]
    assert [row.split()[0] for row in rows[:2]] == ["0", "1"]
    assert [int(row.split()[1]) for row in rows[:2]] == [r["routed"] for r in report["per_replica"]]


def test_a_cluster_that_keeps_up_names_the_replicas_its_router_overloads():
    fine = report_of(np.arange(200) / 2.0, np.arange(200) / 2.0 + 0.3)  # 2 a second, served at once
    behind = report_of(np.arange(25) * 4.0, np.arange(25) * 8.0 + 1.0)  # one every 4 s, served one every 8 s
    cluster = ClusterReport("round-robin", [fine, behind], routed=[100, 100], busy_seconds=[1.0, 1.0],
                            prefill_seconds=[1.0, 1.0])
    lines = format_cluster_summary([cluster], "T").splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["replica", "routed"])
    assert lines[header].split()[-1] == "outrun" and lines[header + 1].endswith("  ")  # replica 0 keeps up
    assert lines[header + 2].endswith(f"from {format_seconds(behind.overload().from_s)}")
    assert lines[-1] == (f"warning: arrivals outrun replica 1 of 2 (outrun) from t="
                         f"{format_seconds(behind.overload().from_s)} at the earliest: their TTFT reflects queueing, "
                         f"though the cluster keeps up") and cluster.total().overload() is None
    calm = ClusterReport("round-robin", [fine, fine], routed=[100, 100], busy_seconds=[1.0, 1.0],
                         prefill_seconds=[1.0, 1.0])
    assert "outrun" not in format_cluster_summary([calm], "T")


# ---- Ctrl-C and the light install ------------------------------------------------------------------------------

def _descendants(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    children = {int(p) for p in out.split()}
    for child in list(children):
        children |= _descendants(child)
    return children


def _default_sigint() -> None:
    # A shell runs a background job with SIGINT ignored, and Python keeps an ignored SIGINT ignored: the replay
    # gets the terminal's default, as when a person runs it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_in_a_sweep_says_interrupted_and_exits_130_without_a_traceback():
    pytest.importorskip("torch")  # the Python engine: replays long enough to be interrupted
    # A workload long enough to be running when the interrupt comes, whatever the machine's speed.
    proc = subprocess.Popen([sys.executable, "-m", "kvmem.replay.cli", "--engine", "python", "--format",
                             "synthetic-chat", "--limit", "100000", "--sweep", "100000,200000", "--jobs", "2",
                             "--no-progress"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=_default_sigint)
    children: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while len(children) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            children = _descendants(proc.pid)
        assert len(children) >= 2, "the sweep's workers never started"
        time.sleep(3.0)  # they are replaying
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole process group
        assert proc.wait(timeout=60) == 130
        err = proc.communicate(timeout=30)[1].decode()  # bounded: a worker left behind would hold stderr open
        # Notes a replay printed before the interrupt may come first (its skipped requests); nothing after it.
        assert err.endswith("kvmem-replay: error: interrupted\n") and "Traceback" not in err, err
        assert all(line.startswith("kvmem-replay: ") for line in err.splitlines()), err
    finally:
        for c in children | _descendants(proc.pid):
            try:
                os.kill(c, signal.SIGKILL)
            except OSError:
                pass
        proc.kill()


NO_TORCH = "import sys\nsys.modules['torch'] = sys.modules['triton'] = None\n"


def without_torch(code: str) -> subprocess.CompletedProcess:
    """`code` in a Python where torch and triton cannot be imported, as on an install without the torch extra (and
    the engine chosen as a user's is: KVMEM_ENGINE unset)."""
    env = {k: v for k, v in os.environ.items() if k != "KVMEM_ENGINE"}
    return subprocess.run([sys.executable, "-c", NO_TORCH + code], capture_output=True, text=True, cwd=REPO,
                          timeout=300, env=env)


def test_kvmem_imports_without_torch_and_its_library_names_the_extra_that_brings_it():
    done = without_torch("import kvmem, kvmem.replay.config, kvmem.eviction\n"
                         "assert sys.modules['torch'] is None\n"
                         "from kvmem import RadixCache\n")
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1].startswith("ModuleNotFoundError: kvmem's library and the replay's Python "
                                                   "engine need torch, which is not installed: pip install "
                                                   "'kvmem[torch]'")


@pytest.mark.parametrize("argv, fragment", [
    (["--engine", "python"], "--engine python: the Python engine would replay it, and it needs torch"),
    (["--eviction-policy", "s3fifo"], "does not cover s3fifo eviction yet: the Python engine would replay it"),
    (["--host-capacity-tokens", "400000", "--storage", "file:/nonexistent"], "does not cover a file store yet"),
])
def test_a_replay_that_needs_the_python_engine_without_torch_is_one_error_line_naming_the_extra(argv, fragment):
    done = without_torch(f"from kvmem.replay.cli import main\nsys.exit(main({['--limit', '5', *argv]!r}))\n")
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1
    assert done.stderr.startswith("kvmem-replay: error: ") and fragment in done.stderr
    assert "pip install 'kvmem[torch]'" in done.stderr and "download.pytorch.org/whl/cpu" in done.stderr
