"""Cascade attention on the CPU: the log-sum-exp merge, and cascade levels built from the radix tree equal to
flat paged attention over the same batches (decode and extend, page sizes 1 and 16)."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem import PagedTokenAllocator, RadixCache, Req, ReqToTokenPool, Scheduler, SchedulerConfig, TokenAllocator
from kvmem.attention import (
    build_cascade_metadata,
    build_decode_metadata,
    merge_state,
    merge_states,
    reference_cascade_attention,
    reference_paged_attention,
)
from kvmem.batch import ForwardMode

HQ, HKV, D = 4, 2, 8
CAPACITY = 4096


# ---- the merge ----------------------------------------------------------------------------------------
def single_request_attention(q, k, v, causal=False):
    """reference_paged_attention over one request whose keys are k/v [n, HKV, D] (page_size 1)."""
    n = len(k)
    return reference_paged_attention(q, k[:, None], v[:, None], torch.tensor([0, len(q)]), torch.tensor([0, n]),
                                     torch.arange(n), torch.tensor([1 if n else 0]), causal=causal, return_lse=True)


def test_merging_the_states_of_two_key_segments_equals_attention_over_both():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, HQ, D, generator=g), torch.randn(11, HKV, D, generator=g), torch.randn(11, HKV, D,
                                                                                                    generator=g)
    v_a, s_a = single_request_attention(q, k[:4], v[:4])
    v_b, s_b = single_request_attention(q, k[4:], v[4:])
    want_v, want_s = single_request_attention(q, k, v)
    got_v, got_s = merge_state(v_a, s_a, v_b, s_b)
    torch.testing.assert_close(got_v, want_v)
    torch.testing.assert_close(got_s, want_s)
    assert got_s.dtype == torch.float32


def test_lse_is_in_base_two_as_flashinfer_returns_it():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, D, generator=g), torch.randn(5, 1, D, generator=g)
    _, lse = single_request_attention(q, k, k)
    scores = (q[0, 0] @ k[:, 0].T) / math.sqrt(D)
    torch.testing.assert_close(lse[0, 0], torch.logsumexp(scores, 0) / math.log(2))


def test_an_empty_state_changes_nothing_and_two_empty_states_stay_empty():
    g = torch.Generator().manual_seed(2)
    v, s = torch.randn(2, HQ, D, generator=g), torch.randn(2, HQ, generator=g)
    empty_v, empty_s = torch.zeros_like(v), torch.full_like(s, float("-inf"))
    got_v, got_s = merge_state(v, s, empty_v, empty_s)
    torch.testing.assert_close(got_v, v)
    torch.testing.assert_close(got_s, s)
    got_v, got_s = merge_state(empty_v, empty_s, empty_v, empty_s)
    assert got_v.count_nonzero() == 0 and torch.isneginf(got_s).all()


def test_attention_over_no_keys_is_the_empty_state():
    out, lse = single_request_attention(torch.randn(2, HQ, D), torch.zeros(0, HKV, D), torch.zeros(0, HKV, D))
    assert out.count_nonzero() == 0 and torch.isneginf(lse).all()


def test_merge_states_equals_pairwise_merges_in_any_order():
    g = torch.Generator().manual_seed(3)
    v, s = torch.randn(5, 3, HQ, D, generator=g), 4 * torch.randn(5, 3, HQ, generator=g)
    got_v, got_s = merge_states(v, s)
    left = merge_state(*merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1]), v[:, 2], s[:, 2])
    right = merge_state(v[:, 2], s[:, 2], *merge_state(v[:, 1], s[:, 1], v[:, 0], s[:, 0]))
    for want_v, want_s in (left, right):
        torch.testing.assert_close(got_v, want_v)
        torch.testing.assert_close(got_s, want_s)


def test_merge_states_of_no_states_is_zeros_with_lse_minus_infinity():
    v, s = merge_states(torch.zeros(3, 0, HQ, D, dtype=torch.float16), torch.zeros(3, 0, HQ))
    assert v.shape == (3, HQ, D) and v.dtype == torch.float16 and v.count_nonzero() == 0
    assert s.shape == (3, HQ) and torch.isneginf(s).all()


def test_merge_keeps_the_output_dtype_and_survives_large_lse():
    v = torch.ones(1, 1, D, dtype=torch.bfloat16)
    got_v, got_s = merge_state(v, torch.tensor([[1000.0]]), 3 * v, torch.tensor([[1000.0]]))
    assert got_v.dtype == torch.bfloat16
    torch.testing.assert_close(got_v.float(), torch.full((1, 1, D), 2.0))
    torch.testing.assert_close(got_s, torch.tensor([[1001.0]]))


@pytest.mark.parametrize("args, error, message", [
    ((torch.zeros(2, 4, 8), torch.zeros(2, 4), torch.zeros(2, 4, 7), torch.zeros(2, 4)), ValueError,
     "v_a and v_b must have the same shape"),
    ((torch.zeros(2, 4, 8), torch.zeros(2, 3), torch.zeros(2, 4, 8), torch.zeros(2, 4)), ValueError,
     "s_a its shape without the last dim"),
    ((torch.zeros(2, 4, 8, dtype=torch.int32), torch.zeros(2, 4), torch.zeros(2, 4, 8), torch.zeros(2, 4)),
     TypeError, "v_a must be a floating-point"),
])
def test_merge_state_rejects_mismatched_states(args, error, message):
    with pytest.raises(error, match=message):
        merge_state(*args)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_an_lse_of_nan_or_plus_infinity_is_refused_not_merged_into_zeros(bad):
    v, s = torch.ones(2, HQ, D), torch.zeros(2, HQ)
    broken = s.clone()
    broken[1, 2] = bad
    with pytest.raises(ValueError, match="s_a holds NaN or \\+inf"):
        merge_state(v, broken, v, s)
    with pytest.raises(ValueError, match="s_b holds NaN or \\+inf"):
        merge_state(v, s, v, broken)
    with pytest.raises(ValueError, match="s holds NaN or \\+inf"):
        merge_states(torch.stack((v, v), dim=1), torch.stack((s, broken), dim=1))


def test_positions_where_every_state_is_empty_merge_to_zeros_whatever_the_empty_states_outputs_hold():
    # An empty KV segment's output is undefined (a kernel may leave NaN or inf there): its weight is 0, and where
    # every weight is 0 the merge writes zeros instead of 0 x NaN.
    v = torch.full((2, 3, HQ, D), float("nan"))
    v[:, 1] = float("inf")
    out, lse = merge_states(v, torch.full((2, 3, HQ), float("-inf")))
    assert torch.equal(out, torch.zeros(2, HQ, D)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("v, s, error, message", [
    ("v", torch.zeros(2, 2, HQ), TypeError, "^v must be a floating-point torch.Tensor, got str$"),
    (torch.zeros(2, 2, HQ, D), torch.zeros(2, 2, HQ, dtype=torch.int32), TypeError,
     "^s must be a floating-point torch.Tensor, got torch.int32$"),
    (torch.zeros(2, 2, HQ, D), torch.zeros(2, 3, HQ), ValueError, r"^v must be 4-D and s its shape without the last")])
def test_merge_states_names_the_bad_state(v, s, error, message):
    with pytest.raises(error, match=message):
        merge_states(v, s)


# ---- cascade levels from the tree ----------------------------------------------------------------------
class Server:
    """A scheduler, its tree and random paged K/V for every slot of the pool."""

    def __init__(self, page_size, seed=0):
        self.pool = ReqToTokenPool(32, 1024)
        alloc = TokenAllocator(CAPACITY) if page_size == 1 else PagedTokenAllocator(CAPACITY, page_size)
        self.tree = RadixCache(self.pool, alloc, page_size=page_size)
        self.sched = Scheduler(self.pool, alloc, self.tree, SchedulerConfig(chunked_prefill_size=None))
        g = torch.Generator().manual_seed(seed)
        shape = (CAPACITY // page_size + 1, page_size, HKV, D)
        self.kv_cache = (torch.randn(shape, generator=g), torch.randn(shape, generator=g))
        self.g = g
        self.next_rid = 0

    def submit(self, prompts, max_new_tokens=3):
        for p in prompts:
            self.sched.add_request(Req(self.next_rid, p, max_new_tokens))
            self.next_rid += 1

    def step(self):
        batch = self.sched.step()
        self.sched.process_batch_result(batch, [7] * batch.batch_size())

    def next_batch(self, mode):
        """Runs steps until the scheduler hands out a batch in `mode`; returns it (not yet processed)."""
        while True:
            batch = self.sched.step()
            if batch.forward_mode is mode:
                return batch
            self.sched.process_batch_result(batch, [7] * batch.batch_size())

    def finish(self, batch):
        self.sched.process_batch_result(batch, [7] * batch.batch_size())
        while not self.sched.is_idle():
            self.step()

    def check_cascade_equals_flat(self, batch, **kwargs):
        md = build_cascade_metadata(batch, self.tree, **kwargs)
        flat = batch.attention_metadata()
        q = torch.randn(int(flat.qo_indptr[-1]), HQ, D, generator=self.g)
        want_out, want_lse = reference_paged_attention(q, *self.kv_cache, flat.qo_indptr, flat.kv_indptr,
                                                       flat.kv_indices, flat.kv_last_page_len, return_lse=True)
        got_out, got_lse = reference_cascade_attention(q, self.kv_cache, md, return_lse=True)
        torch.testing.assert_close(got_out, want_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5)
        check_layout(md, batch)
        return md


def check_layout(md, batch):
    """FlashInfer's invariants for every level, and each request's KV read exactly once over the levels."""
    ps, total_q = md.page_size, int(batch.extend_lens.sum())
    assert sorted(md.request_order.tolist()) == list(range(batch.batch_size()))
    x = torch.randn(total_q, 3)
    assert torch.equal(md.unpermute_outputs(md.permute_queries(x)), x)
    qo_rows = [row for i in md.request_order.tolist()
               for row in range(int(batch.extend_lens[:i].sum()), int(batch.extend_lens[:i + 1].sum()))]
    assert md.qo_order.tolist() == qo_rows
    tokens_read = np.zeros(batch.batch_size(), dtype=np.int64)
    order = md.request_order.numpy()
    cascade_qo = np.concatenate([[0], np.cumsum(batch.extend_lens.numpy()[order])])
    for lvl, level in enumerate(md.levels):
        qo, kv = level.qo_indptr.tolist(), level.kv_indptr.tolist()
        assert qo[0] == 0 and qo[-1] == total_q and kv[0] == 0 and kv[-1] == len(level.kv_indices)
        assert all(t.dtype == torch.int32 for t in (level.qo_indptr, level.kv_indptr, level.kv_indices,
                                                    level.kv_last_page_len))
        assert set(qo) <= set(cascade_qo.tolist()), "a level entry splits a request's queries"
        pages = np.diff(kv)
        last = level.kv_last_page_len.numpy()
        if lvl < md.num_levels - 1:  # shared entries hold whole pages (or none)
            assert ((last == ps) == (pages > 0)).all() and ((last == 0) == (pages == 0)).all()
        lens = np.where(pages > 0, (pages - 1) * ps + last, 0)
        for entry, n in enumerate(lens.tolist()):
            first, end = np.searchsorted(cascade_qo, [qo[entry], qo[entry + 1]])
            tokens_read[order[first:end]] += n
    assert tokens_read.tolist() == batch.seq_lens.tolist()


def tree_prompts(parents, segment_lens, picks, suffix_lens):
    """Prompts over a tree of token segments: node j hangs under parents[j] (-1: the root); request i takes
    the path to node picks[i] (-1: none) and its own suffix_lens[i] fresh tokens."""
    segments, start = [], 1000
    for n in segment_lens:
        segments.append(list(range(start, start + n)))
        start += n
    prompts = []
    for pick, n in zip(picks, suffix_lens):
        path, node = [], pick
        while node >= 0:
            path = segments[node] + path
            node = parents[node]
        prompts.append(path + list(range(start, start + n)))
        start += n
    return prompts


@st.composite
def shared_prompts(draw, max_requests=8):
    """Two or more prompts over a random tree of shared segments, some perhaps sharing nothing (a single
    request and a batch sharing nothing have tests of their own)."""
    num_nodes = draw(st.integers(1, 6))
    parents = [draw(st.integers(-1, j - 1)) for j in range(num_nodes)]
    segment_lens = draw(st.lists(st.integers(1, 48), min_size=num_nodes, max_size=num_nodes))
    num_reqs = draw(st.integers(2, max_requests))
    picks = draw(st.lists(st.integers(-1, num_nodes - 1), min_size=num_reqs, max_size=num_reqs))
    suffix_lens = draw(st.lists(st.integers(1, 20), min_size=num_reqs, max_size=num_reqs))
    return tree_prompts(parents, segment_lens, picks, suffix_lens)


LEVEL_LIMITS = st.sampled_from([dict(min_shared_tokens=0, max_levels=4), dict(min_shared_tokens=16, max_levels=3),
                                dict(min_shared_tokens=40, max_levels=2), dict(min_shared_tokens=0, max_levels=1)])


@settings(max_examples=15, deadline=None)
@given(page_size=st.sampled_from([1, 16]), prompts=shared_prompts(), limits=LEVEL_LIMITS)
def test_cascade_decode_equals_flat_decode_over_random_trees(page_size, prompts, limits):
    server = Server(page_size)
    server.submit(prompts)
    batch = server.next_batch(ForwardMode.DECODE)
    server.check_cascade_equals_flat(batch, **limits)


@settings(max_examples=10, deadline=None)
@given(page_size=st.sampled_from([1, 16]), prompts=shared_prompts(max_requests=10), limits=LEVEL_LIMITS,
       split=st.integers(0, 10))
def test_cascade_extend_over_cached_prefixes_equals_flat_extend(page_size, prompts, limits, split):
    server = Server(page_size)
    server.submit(prompts[:split], max_new_tokens=1)  # these finish and leave their prompts in the tree
    while not server.sched.is_idle():
        server.step()
    server.submit(prompts[split:])
    if server.sched.is_idle():
        return
    batch = server.next_batch(ForwardMode.EXTEND)
    server.check_cascade_equals_flat(batch, **limits)
    server.finish(batch)


def system_prompt_batch(page_size=1, chat_len=40):
    """Six decoding requests over a 64-token system prompt; the odd ones also share a chat_len-token history;
    one request shares nothing."""
    system, chat = list(range(100, 164)), list(range(500, 500 + chat_len))
    prompts = [system + (chat if i % 2 else []) + [1000 + i] * (3 + i) for i in range(6)] + [[7, 8, 9]]
    server = Server(page_size)
    server.submit(prompts)
    return server, server.next_batch(ForwardMode.DECODE)


def test_requests_sharing_a_prefix_are_contiguous_and_each_shared_segment_is_one_entry():
    server, batch = system_prompt_batch()
    md = server.check_cascade_equals_flat(batch, min_shared_tokens=32)
    assert md.num_levels == 3
    # The request sharing nothing first, then the system prompt's six: evens, then the odds with the chat.
    assert md.request_order.tolist() == [6, 0, 2, 4, 1, 3, 5]
    system, chat, own = md.levels
    assert system.qo_indptr.tolist() == [0, 1, 7] and system.kv_indptr.tolist() == [0, 0, 64]
    assert system.kv_last_page_len.tolist() == [0, 1]
    assert chat.qo_indptr.tolist() == [0, 4, 7] and chat.kv_indptr.tolist() == [0, 0, 40]
    assert own.qo_indptr.tolist() == list(range(8))
    # Flat reads 64 system tokens six times and the chat three times; cascade once each.
    flat = batch.attention_metadata()
    assert int(flat.kv_indptr[-1]) - sum(int(m.kv_indptr[-1]) for m in md.levels) == 5 * 64 + 2 * 40


def test_a_short_shared_segment_is_read_with_what_follows_it():
    server, batch = system_prompt_batch(chat_len=8)
    md = server.check_cascade_equals_flat(batch, min_shared_tokens=32)
    # The 8-token chat history is below the threshold: the odd requests read it with their own tokens.
    assert md.num_levels == 2 and md.levels[0].kv_indptr.tolist() == [0, 0, 64]


@pytest.mark.parametrize("page_size, chat_len, at_least, kept", [
    (1, 40, 40, [[0, 0, 64], [0, 0, 40]]),  # the 40-token chat holds exactly min_shared_tokens: kept
    (1, 40, 41, [[0, 0, 64]]),              # one token short: read with the requests' own tokens
    (1, 40, 64, [[0, 0, 64]]),              # the system prompt at the boundary, the chat below it
    (1, 40, 65, [[0, 0, 104]]),             # system prompt and chat together: one span for the odd requests
    (1, 8, 72, [[0, 0, 72]]),               # a span of two segments, exactly at the boundary
    (1, 8, 73, []),
    (16, 32, 96, [[0, 0, 6]]),              # whole pages: 96 tokens are 6 pages
    (16, 32, 97, []),
])
def test_a_shared_entry_holds_at_least_min_shared_tokens_and_exactly_that_many_is_enough(page_size, chat_len,
                                                                                        at_least, kept):
    server, batch = system_prompt_batch(page_size=page_size, chat_len=chat_len)
    md = server.check_cascade_equals_flat(batch, min_shared_tokens=at_least)
    assert [level.kv_indptr.tolist() for level in md.levels[:-1]] == kept


def test_prefixes_shared_at_three_depths_give_four_levels():
    a, b, c = list(range(100, 164)), list(range(300, 348)), list(range(500, 532))
    prompts = [a + [900], a + b + [901], a + b + [902], a + b + c + [903], a + b + c + [904, 905]]
    for page_size in (1, 16):
        server = Server(page_size)
        server.submit(prompts)
        batch = server.next_batch(ForwardMode.DECODE)
        md = server.check_cascade_equals_flat(batch, min_shared_tokens=0, max_levels=4)
        assert md.num_levels == 4
        assert [m.kv_indptr.tolist() for m in md.levels[:3]] == [[0, 64 // page_size], [0, 0, 48 // page_size],
                                                                 [0, 0, 32 // page_size]]
        assert [m.qo_indptr.tolist() for m in md.levels[:3]] == [[0, 5], [0, 1, 5], [0, 3, 5]]


def test_max_levels_caps_the_shared_levels():
    server, batch = system_prompt_batch(page_size=16)
    md = server.check_cascade_equals_flat(batch, min_shared_tokens=0, max_levels=2)
    assert md.num_levels == 2 and md.levels[0].kv_indptr.tolist() == [0, 0, 4]  # 64 tokens: 4 pages


@pytest.mark.parametrize("kwargs", [dict(min_shared_tokens=10_000), dict(max_levels=1)])
def test_below_the_thresholds_the_metadata_is_the_flat_metadata(kwargs):
    server, batch = system_prompt_batch(page_size=16)
    md = build_cascade_metadata(batch, server.tree, **kwargs)
    flat = batch.attention_metadata()
    assert md.num_levels == 1 and md.request_order.tolist() == list(range(batch.batch_size()))
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"):
        assert torch.equal(getattr(md.levels[0], name), getattr(flat, name)), name


def test_a_single_request_gets_one_flat_level():
    server = Server(16)
    server.submit([list(range(50))])
    batch = server.next_batch(ForwardMode.DECODE)
    md = server.check_cascade_equals_flat(batch, min_shared_tokens=0)
    assert md.num_levels == 1
    pool = server.pool
    want = build_decode_metadata(pool.req_to_token, batch.req_pool_indices, batch.seq_lens, 16)
    assert torch.equal(md.levels[0].kv_indices, want.kv_indices)


def test_cascade_metadata_needs_a_prepared_batch():
    from kvmem import ScheduleBatch

    server = Server(1)
    batch = ScheduleBatch([Req(0, [1, 2], 1)], server.pool, server.sched.token_allocator, server.tree)
    with pytest.raises(RuntimeError, match="needs prepare_for_extend"):
        build_cascade_metadata(batch, server.tree)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(min_shared_tokens=-1), ValueError, "min_shared_tokens must be a non-negative int"),
    (dict(min_shared_tokens=2.5), TypeError, "min_shared_tokens"),
    (dict(max_levels=0), ValueError, "max_levels must be a positive int"),
])
def test_cascade_metadata_rejects_bad_limits(kwargs, error, message):
    server, batch = system_prompt_batch()
    with pytest.raises(error, match=message):
        build_cascade_metadata(batch, server.tree, **kwargs)


@pytest.mark.parametrize("args, name", [
    (lambda server, batch: (None, server.tree), "batch must be a ScheduleBatch, got NoneType"),
    (lambda server, batch: (server.sched, server.tree), "batch must be a ScheduleBatch, got Scheduler"),
    (lambda server, batch: (batch, None), "tree must be the batch's radix cache .*, got NoneType"),
    (lambda server, batch: (batch, server.sched), "tree must be the batch's radix cache .*, got Scheduler"),
    (lambda server, batch: (batch, batch.req_to_token_pool), "tree must be"),
])
def test_cascade_metadata_rejects_arguments_of_the_wrong_type_by_name(args, name):
    server, batch = system_prompt_batch()
    with pytest.raises(TypeError, match=name):
        build_cascade_metadata(*args(server, batch))
    for kwargs in (dict(min_shared_tokens=None), dict(max_levels="2")):
        with pytest.raises(TypeError, match=next(iter(kwargs))):
            build_cascade_metadata(batch, server.tree, **kwargs)


def test_cascade_metadata_rejects_another_tree():
    server, batch = system_prompt_batch()
    other = Server(1)
    with pytest.raises(ValueError, match="is not in this tree"):
        build_cascade_metadata(batch, other.tree)
    paged = Server(16)
    with pytest.raises(ValueError, match="tree.page_size 16 != the batch's page_size 1"):
        build_cascade_metadata(batch, paged.tree)


def test_cascade_metadata_rejects_a_request_whose_path_disagrees_with_its_row():
    server, batch = system_prompt_batch()
    batch.reqs[0].cache_protected_len -= 1
    with pytest.raises(ValueError, match="request 0: its cached path holds") as refused:
        build_cascade_metadata(batch, server.tree)
    held, protected, before = map(int, re.fullmatch(
        r"request 0: its cached path holds (\d+) tokens; need exactly cache_protected_len \((\d+)\) and at most "
        r"the (\d+) tokens before its queries", str(refused.value)).groups())
    assert held == protected + 1 <= before


def test_cascade_benchmark_reports_kv_read_and_build_times():
    # Without the interpreter flag conftest sets, as a user's run: the torch fallbacks on the CPU.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_cascade.py"
    proc = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    names = [w["workload"] for w in report["workloads"]]
    assert names == ["synthetic-system", "synthetic-chat", "synthetic-agent"]
    for w in report["workloads"]:
        assert w["snapshots"] == 2 and 0 < w["kv_read_ratio"] <= 1
        assert all(r["cascade_kv_tokens"] <= r["flat_kv_tokens"] and r["cascade_build_us"] > 0 for r in w["rows"])
