"""Bad input from an adversarial user: each gets a clear error naming the argument, and nothing changes.

The first part holds one test per reported reproducer (crashes, corruption, silent wrap-around, wrong error
types); the second drives the public API with random bad arguments (hypothesis) and checks the promise
itself: a ValueError, IndexError or TypeError whose message names the argument, and every invariant and
size as it was.
"""

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvmem import (
    MHAKVPool,
    MLAKVPool,
    PagedTokenAllocator,
    RadixCache,
    Req,
    ReqToTokenPool,
    ScheduleBatch,
    Scheduler,
    SchedulerConfig,
    TokenAllocator,
    sizing,
)
from kvmem.attention import build_decode_metadata
from kvmem.kernels import create_kv_indices, create_kv_indptr, kv_last_page_len, write_req_to_token

PROMISED = (ValueError, IndexError, TypeError)


def allocator_state(alloc):
    return alloc.available_size(), alloc.backup_state().free_pages.tolist()


# ---- crashes and corruption -----------------------------------------------------------------------------
@pytest.mark.parametrize("size, page_size, seq", [(64, 1, [2**62] * 4), (64, 16, [2**63 - 1]), (64, 4, [2**62, 5])])
def test_huge_extend_lengths_are_a_shortage_not_a_crash(size, page_size, seq):
    # In a subprocess: the reported failure was a segfault that would take pytest down with it.
    code = (f"from kvmem import PagedTokenAllocator\n"
            f"a = PagedTokenAllocator({size}, {page_size})\n"
            f"print(a.alloc_extend([0] * {len(seq)}, {seq}, [0] * {len(seq)}), a.available_size())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["None", str(size)]


def test_huge_decode_lengths_are_refused_without_changing_the_allocator():
    a = PagedTokenAllocator(64, 16)
    before = allocator_state(a)
    with pytest.raises(ValueError, match="last_loc|seq_lens"):
        a.alloc_decode([2**63 - 1], [15])
    assert allocator_state(a) == before


def test_two_decodes_continuing_the_same_page_are_refused():
    a = PagedTokenAllocator(64, 16)
    a.alloc(16)  # page 1: slots 16..31
    before = allocator_state(a)
    with pytest.raises(ValueError, match="last_loc"):
        a.alloc_decode([2, 2], [16, 16])
    with pytest.raises(ValueError, match="last_loc"):
        a.alloc_extend([1, 1], [3, 3], [16, 16])
    assert allocator_state(a) == before


def test_a_node_of_another_tree_is_refused_by_lock_and_unlock():
    pool, alloc = ReqToTokenPool(2, 8), TokenAllocator(32)
    mine, other = RadixCache(pool, TokenAllocator(32)), RadixCache(pool, alloc)  # an allocator serves one cache
    other.insert([1, 2, 3], alloc.alloc(3))
    node = other.match_prefix([1, 2, 3]).last_node
    for call in (mine.inc_lock_ref, mine.dec_lock_ref):
        with pytest.raises(ValueError, match="node .* not in this tree"):
            call(node)
    other.inc_lock_ref(node)
    with pytest.raises(ValueError, match="not in this tree"):
        mine.dec_lock_ref(node)
    mine.check_invariants()
    other.check_invariants()
    assert (mine.total_size(), other.protected_size()) == (0, 3)


@pytest.mark.parametrize("page_size", [1, 4])
def test_insert_refuses_a_slot_repeated_inside_its_value(page_size):
    pool = ReqToTokenPool(2, 8)
    alloc = TokenAllocator(64) if page_size == 1 else PagedTokenAllocator(64, page_size)
    cache = RadixCache(pool, alloc, page_size=page_size)
    slots = alloc.alloc(2 * page_size)
    value = torch.cat([slots[:page_size], slots[:page_size]])  # the first page twice
    with pytest.raises(ValueError, match="value holds slot .* more than once"):
        cache.insert(list(range(2 * page_size)), value)
    assert cache.total_size() == 0
    cache.check_invariants()


@pytest.mark.parametrize("priority", [1.5, None, "high", True, 2**63])
def test_a_request_priority_must_be_an_int(priority):
    with pytest.raises(PROMISED, match="priority"):
        Req("a", [1, 2, 3], 1, priority=priority)


def test_parts_of_another_scheduler_are_refused():
    pool_a, pool_b = ReqToTokenPool(2, 16), ReqToTokenPool(2, 16)
    alloc_a, alloc_b = TokenAllocator(64), TokenAllocator(64)
    with pytest.raises(ValueError, match="req_to_token_pool"):
        Scheduler(pool_a, alloc_a, RadixCache(pool_b, alloc_a))
    with pytest.raises(ValueError, match="token_allocator"):
        Scheduler(pool_a, alloc_a, RadixCache(pool_a, alloc_b))
    with pytest.raises(ValueError, match="token_allocator"):
        ScheduleBatch([], pool_a, alloc_a, RadixCache(pool_a, alloc_b))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
@pytest.mark.parametrize("make", [
    lambda d: TokenAllocator(8, device=d), lambda d: PagedTokenAllocator(8, 4, device=d),
    lambda d: ReqToTokenPool(2, 8, device=d), lambda d: MHAKVPool(8, 1, torch.float16, 1, 8, 1, device=d),
    lambda d: MLAKVPool(8, 1, torch.float16, 8, 4, 1, device=d)])
@pytest.mark.parametrize("device", ["cuda", "cuda:3", "bogus", "meta", 7.5])
def test_a_device_that_cannot_hold_the_pool_is_refused_in_the_constructor(make, device):
    with pytest.raises(ValueError, match="device"):
        make(device)


def test_req_to_token_values_outside_int32_are_refused_not_wrapped():
    pool = ReqToTokenPool(2, 8)
    row = pool.alloc(1)[0]
    for values in (torch.tensor([2**31]), torch.tensor([-1]), np.array([2**40])):
        with pytest.raises(ValueError, match="values"):
            pool.write((row, slice(0, 1)), values)
    with pytest.raises(ValueError, match="out_cache_loc"):
        write_req_to_token(pool.req_to_token, torch.tensor([row]), torch.tensor([0]), torch.tensor([1]),
                           torch.tensor([2**32 + 7]))
    assert pool.req_to_token.count_nonzero() == 0


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4", "fp8_e4m3"])
def test_inf_and_nan_saturate_in_quantized_pools_without_spoiling_their_group(kv_cache_dtype):
    pool = MHAKVPool(8, 1, torch.float32, 1, 8, 1, kv_cache_dtype=kv_cache_dtype)
    k = torch.tensor([[[1.0, -2.0, float("inf"), 0.5, float("-inf"), 0.25, float("nan"), 3.0]]])
    pool.set_kv_buffer(0, torch.tensor([1]), k, k)
    got = pool.read_kv(0, torch.tensor([1]))[0][0, 0]
    finite = torch.tensor([0, 1, 3, 5, 7])
    assert torch.isfinite(got[finite]).all()
    torch.testing.assert_close(got[finite], k[0, 0, finite], atol=0.25, rtol=0.1)
    top = got[[0, 1, 3, 5, 7]].abs().max()
    assert got[2] >= top and got[4] <= -top  # +-inf saturate to the largest magnitude stored
    if kv_cache_dtype != "fp8_e4m3":
        assert got[6] == 0  # integer codes have no NaN


def test_a_group_of_only_infinities_reads_back_as_the_dtype_limits():
    pool = MHAKVPool(8, 1, torch.float16, 1, 2, 1, kv_cache_dtype="int8")
    k = torch.tensor([[[float("inf"), float("-inf")]]], dtype=torch.float16)
    pool.set_kv_buffer(0, torch.tensor([1]), k, k)
    got = pool.read_kv(0, torch.tensor([1]))[0][0, 0]
    assert got.tolist() == [torch.finfo(torch.float16).max, -torch.finfo(torch.float16).max]


# ---- error types and messages -----------------------------------------------------------------------------
@pytest.mark.parametrize("call, name", [
    (lambda: Req("a", [2**63], 1), "input_ids"),
    (lambda: Req("a", torch.tensor([1.0], dtype=torch.bfloat16), 1), "input_ids"),
    (lambda: Req("a", b"\x01\x02", 1), "input_ids"),
    (lambda: RadixCache(ReqToTokenPool(1, 4), TokenAllocator(8)).match_prefix(b"\x01" * 7), "key"),
    (lambda: RadixCache(ReqToTokenPool(1, 4), TokenAllocator(8)).match_prefix([2**64]), "key"),
    (lambda: RadixCache(ReqToTokenPool(1, 4), TokenAllocator(8)).inc_lock_ref(None), "node"),
    (lambda: RadixCache(ReqToTokenPool(1, 4), TokenAllocator(8)).dec_lock_ref(None), "node"),
    (lambda: RadixCache(ReqToTokenPool(1, 4), None), "token_allocator"),
    (lambda: RadixCache(None, TokenAllocator(8)), "req_to_token_pool"),
    (lambda: SchedulerConfig(init_new_token_ratio="0.5"), "init_new_token_ratio"),
    (lambda: SchedulerConfig(max_running_requests=True), "max_running_requests"),
    (lambda: ReqToTokenPool(2, 8).free(True), "index"),
    (lambda: TokenAllocator(2**40), "size"),
    (lambda: sizing.tokens_for_budget(sizing.get_model_config("llama-3-8b"), gpu_mem_gb=math.inf), "gpu_mem_gb"),
    (lambda: create_kv_indptr(torch.tensor([5]), page_size=2**31), "page_size"),
    (lambda: kv_last_page_len(torch.tensor([5]), page_size=2**40), "page_size"),
    (lambda: create_kv_indices(torch.zeros(1, 8, dtype=torch.int32), torch.tensor([0]), torch.tensor([4]),
                               torch.tensor([0, 1]), page_size=2**32), "page_size"),
    (lambda: build_decode_metadata(torch.zeros(1, 8, dtype=torch.int32, device="meta"), torch.tensor([0]),
                                   torch.tensor([4])), "req_to_token"),
    (lambda: TokenAllocator(8).free(torch.tensor([1], device="meta")), "slots"),
])
def test_bad_arguments_raise_the_promised_errors_naming_the_argument(call, name):
    with pytest.raises(PROMISED, match=name):
        call()


def test_a_scheduler_refuses_none_for_its_parts_and_requests():
    pool, alloc = ReqToTokenPool(2, 16), TokenAllocator(64)
    tree = RadixCache(pool, alloc)
    with pytest.raises(TypeError, match="config"):
        Scheduler(pool, alloc, tree, config=None)
    sched = Scheduler(pool, alloc, tree)
    with pytest.raises(TypeError, match="req"):
        sched.add_request(None)
    with pytest.raises(RuntimeError, match="no batch is pending"):
        sched.process_batch_result(None, [1])
    sched.add_request(Req("a", [1, 2, 3], 2))
    batch = sched.step()
    with pytest.raises(ValueError, match="next_token_ids"):
        sched.process_batch_result(batch, [2**63])
    sched.process_batch_result(batch, [4])  # the refused call changed nothing
    sched.check_invariants()


def test_prepare_for_decode_on_requests_never_extended_names_them():
    pool, alloc = ReqToTokenPool(2, 16), TokenAllocator(64)
    batch = ScheduleBatch([Req("fresh", [1, 2, 3], 2)], pool, alloc, RadixCache(pool, alloc))
    with pytest.raises(ValueError, match="'fresh'.*not running"):
        batch.prepare_for_decode()
    assert alloc.available_size() == 64 and pool.available_size() == 2


def test_a_wrong_length_req_to_token_write_is_a_value_error():
    pool = ReqToTokenPool(2, 8)
    row = pool.alloc(1)[0]
    with pytest.raises(ValueError, match="values"):
        pool.write((row, slice(0, 3)), torch.tensor([1, 2]))


# ---- the command line ---------------------------------------------------------------------------------------
def run_cli(capsys, *argv):
    from kvmem.replay.cli import main

    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_request_with_an_absurd_output_length_is_rejected_not_the_machine(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1000000000000, "hash_ids": [1, 2]}\n'
                     '{"timestamp": 1, "input_length": 600, "output_length": 5, "hash_ids": [1, 3]}\n')
    code, out, err = run_cli(capsys, str(trace), "--capacity-tokens", "4096", "--no-progress")
    assert code == 0 and "skipped: request 0" in err
    report = __import__("json").loads(out)
    assert report["rejected"] == 1 and report["requests"] == 1


def test_the_replay_rows_are_no_longer_than_the_capacity():
    from kvmem.replay.config import ReplayConfig

    config = ReplayConfig(capacity_tokens=4100, max_context_len=10**12, page_size=16)
    assert config.context_len == 4096


@pytest.mark.parametrize("argv, message", [
    (["--capacity-tokens", "1000000000000"], "host memory"),
    (["--sweep", "4096,1000000000000"], "host memory"),
    (["--gpu-mem-gb", "100000000", "--model", "llama-3-8b"], "host memory"),  # 25,940 GiB: more than any host
    (["--gpu-mem-gb", "1e300", "--model", "llama-3-8b"], "gpu_mem_gb"),
    (["--page-size", "1000000000000"], "page"),
    (["--seed", "-1"], "--seed"),
])
def test_absurd_options_end_in_one_line_naming_the_problem(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv, "--limit", "3", "--no-progress")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err and "Traceback" not in err


@pytest.mark.parametrize("input_ids, message", [({1, 2}, "must be a sequence of ints, got set"),
                                                 ({1: 2}, "must be a sequence of ints, got dict"),
                                                 ([1.0, 2.0], "must hold ints, got float"),
                                                 ([1, "2"], "must hold ints, got str")])
def test_a_prompt_in_no_order_or_of_other_kinds_is_refused_naming_what_it_holds(input_ids, message):
    with pytest.raises(TypeError, match=f"request 'a': input_ids {message}"):
        Req("a", input_ids, 1)


def test_a_request_the_tree_refuses_on_queueing_is_not_queued():
    from kvmem.scheduler import Scheduler

    pool, alloc = ReqToTokenPool(2, 64), TokenAllocator(64)
    tree = RadixCache(pool, alloc)
    sched = Scheduler(pool, alloc, tree)

    def refuse(rid, key, namespace=None):
        raise ValueError(f"request id {rid!r} is not in the trace")

    tree.request_waiting = refuse
    req = Req("stranger", [1, 2, 3], 1)
    with pytest.raises(ValueError, match="not in the trace"):
        sched.add_request(req)
    assert not sched.waiting and req.status.value == "new" and sched.is_idle()
