"""End-to-end scheduler loops with a fake model that writes token ids into a fake KV store."""

import random
from time import perf_counter

import numpy as np
import pytest
import torch

from kvmem.allocator import PagedTokenAllocator, TokenAllocator
from kvmem.batch import ForwardMode, Req, ScheduleBatch
from kvmem.radix_cache import RadixCache
from kvmem.req_to_token import ReqToTokenPool
from kvmem.scheduler import Scheduler, SchedulerConfig
from kvmem.timing import LOOP_PHASES, PhaseTimer


def make_scheduler(capacity, page_size=1, max_context_len=4096, rows=64, **cfg):
    pool = ReqToTokenPool(rows, max_context_len)
    alloc = TokenAllocator(capacity) if page_size == 1 else PagedTokenAllocator(capacity, page_size)
    tree = RadixCache(pool, alloc, page_size=page_size)
    return Scheduler(pool, alloc, tree, SchedulerConfig(**cfg))


def next_token(tokens):
    """A deterministic 'model': the next token depends only on the sequence so far."""
    return (hash(tuple(tokens[-16:])) ^ len(tokens)) % 30000 + 10


class FakeModel:
    """Writes each computed token id into the slot the batch assigned, then checks every row."""

    def __init__(self, sched):
        self.sched = sched
        self.kv = torch.full((sched.token_allocator.size + sched.page_size,), -1, dtype=torch.int64)

    def forward(self, batch):
        tokens = []
        for r, p, s in zip(batch.reqs, batch.prefix_lens.tolist(), batch.seq_lens.tolist()):
            tokens += list(r.fill_ids[p:s])
        assert len(tokens) == len(batch.out_cache_loc)
        self.kv[batch.out_cache_loc] = torch.tensor(tokens, dtype=torch.int64)
        table = self.sched.req_to_token_pool.req_to_token
        for r, s in zip(batch.reqs, batch.seq_lens.tolist()):
            row = table[r.req_pool_idx, :s].to(torch.int64)
            assert self.kv[row].tolist() == list(r.fill_ids[:s]), f"{r.rid}: row slots do not hold its tokens"
        return [next_token(list(r.fill_ids[:s])) for r, s in zip(batch.reqs, batch.seq_lens.tolist())]


def run(sched, reqs, max_steps=100_000, model=None, batches=None):
    """Serves `reqs` (and whatever is queued) until idle through `model` (a new FakeModel by default), appending
    each batch's (rid, prefix length) pairs to `batches` if given; returns the model."""
    for r in reqs:
        sched.add_request(r)
    model = model or FakeModel(sched)
    for _ in range(max_steps):
        batch = sched.step()
        if batch is None:
            assert sched.is_idle(), "scheduler stalled with work left"
            return model
        if batches is not None:
            batches.append([(r.rid, int(n)) for r, n in zip(batch.reqs, batch.prefix_lens)])
        sched.process_batch_result(batch, model.forward(batch))
        sched.check_invariants()
    raise AssertionError("did not finish")


def shared_prefix_requests(n, seed=0, n_sys=3, sys_len=300, max_new=24):
    rng = random.Random(seed)
    systems = [[rng.randrange(10, 30000) for _ in range(sys_len)] for _ in range(n_sys)]
    return [Req(i, rng.choice(systems) + [rng.randrange(10, 30000) for _ in range(rng.randint(1, 120))],
                rng.randint(1, max_new)) for i in range(n)]


def shared_prefix_specs(seed, count, system_len, max_suffix, max_output):
    """`count` (prompt, max_new_tokens) pairs whose prompts start with one of two system prompts, and the
    random generator that drew them (for the outputs)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(10, 30000) for _ in range(system_len)] for _ in range(2)]
    return rng, [(rng.choice(systems) + [rng.randrange(10, 30000) for _ in range(rng.randint(1, max_suffix))],
                  rng.randint(1, max_output)) for _ in range(count)]


def expected_output(req):
    toks = list(req.input_ids)
    out = []
    for _ in range(req.max_new_tokens):
        out.append(next_token(toks + out))
    return out


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_loop_serves_shared_prefixes_and_leaves_no_leak(page_size, policy):
    reqs = shared_prefix_requests(40)
    sched = make_scheduler(8192, page_size, schedule_policy=policy, max_running_requests=8)
    run(sched, reqs)
    for r in reqs:
        assert r.output_ids == expected_output(r)
    # Idle: every slot is free or evictable, nothing protected or held.
    tree, alloc = sched.tree_cache, sched.token_allocator
    assert tree.protected_size() == 0
    assert alloc.available_size() + tree.evictable_size() == alloc.size
    assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size
    assert sched.stats.prefill_batches > 0 and sched.stats.decode_batches > 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_same_prefix_maps_to_same_slots_across_requests(page_size):
    sched = make_scheduler(4096, page_size)
    prompt = list(range(100, 180))
    a = Req("a", prompt + [1, 2, 3], 4)
    model = run(sched, [a])
    b = Req("b", prompt + [7, 8], 4)
    sched.add_request(b)
    batch = sched.step()
    row = sched.req_to_token_pool.req_to_token[b.req_pool_idx]
    cached = len(b.prefix_indices)
    assert cached == (80 // page_size) * page_size
    m = sched.tree_cache.match_prefix(prompt)
    assert row[:cached].tolist() == m.indices[:cached].tolist()
    sched.process_batch_result(batch, model.forward(batch))


@pytest.mark.parametrize("page_size", [1, 16])
def test_retracted_requests_resume_and_finish_with_the_same_output(page_size):
    reqs = [Req(i, [i * 7 + t for t in range(10, 60)], 200) for i in range(12)]
    sched = make_scheduler(1024, page_size, max_running_requests=12, init_new_token_ratio=0.05,
                           min_new_token_ratio=0.0)
    run(sched, reqs)
    assert sched.stats.retractions > 0
    assert any(r.num_retractions for r in reqs)
    for r in reqs:
        assert r.output_ids == expected_output(r)


@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill_caps_new_tokens_per_step(page_size):
    reqs = [Req(i, list(range(1000 + i, 2500 + i)), 5) for i in range(3)]
    sched = make_scheduler(16384, page_size, chunked_prefill_size=256)
    for r in reqs:
        sched.add_request(r)
    model = FakeModel(sched)
    extends = 0
    while not sched.is_idle():
        batch = sched.step()
        if batch.forward_mode is ForwardMode.EXTEND:
            extends += 1
            assert int(batch.extend_lens.sum()) <= 256
        sched.process_batch_result(batch, model.forward(batch))
        sched.check_invariants()
    assert extends >= 3 * 1500 // 256
    for r in reqs:
        assert r.output_ids == expected_output(r)


class MetadataCheckingModel(FakeModel):
    """Also checks each batch's FlashInfer metadata against the request rows before computing."""

    def __init__(self, sched):
        super().__init__(sched)
        self.chunked_batches = self.prefix_hit_batches = 0

    def forward(self, batch):
        check_attention_metadata(batch, self.sched.req_to_token_pool.req_to_token)
        if batch.forward_mode is ForwardMode.EXTEND:
            self.chunked_batches += any(r.is_chunked() for r in batch.reqs)
            self.prefix_hit_batches += bool((batch.prefix_lens > 0).any())
        return super().forward(batch)


def check_attention_metadata(batch, table):
    md = batch.attention_metadata()
    ps, bs = batch.page_size, batch.batch_size()
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"):
        assert getattr(md, name).dtype == torch.int32, name
    assert md.page_size == ps
    if batch.forward_mode is ForwardMode.EXTEND:
        assert md.qo_indptr.tolist() == [0] + torch.cumsum(batch.extend_lens, 0).tolist()
    else:
        assert md.qo_indptr.tolist() == list(range(bs + 1))
    kv_indptr, kv_indices = md.kv_indptr.tolist(), md.kv_indices.tolist()
    assert len(kv_indptr) == bs + 1 and kv_indptr[-1] == len(kv_indices)
    for i, (r, seq_len) in enumerate(zip(batch.reqs, batch.seq_lens.tolist())):
        row = table[r.req_pool_idx, :seq_len].tolist()
        pages = kv_indices[kv_indptr[i]:kv_indptr[i + 1]]
        if ps == 1:
            assert pages == row, f"{r.rid}: kv_indices are not its row's slots"
        else:
            assert pages == list(dict.fromkeys(slot // ps for slot in row)), f"{r.rid}: not its row's pages"
        last = md.kv_last_page_len[i].item()
        assert 1 <= last <= ps and (len(pages) - 1) * ps + last == seq_len


@pytest.mark.parametrize("page_size", [1, 16])
def test_attention_metadata_lists_each_requests_slots_from_its_row(page_size):
    # Shared prefixes (new requests with cached prefixes), chunked prefill and decode all in one loop.
    reqs = shared_prefix_requests(24, seed=3)
    sched = make_scheduler(8192, page_size, max_running_requests=6, chunked_prefill_size=160)
    model = MetadataCheckingModel(sched)
    for r in reqs:
        sched.add_request(r)
    modes = set()
    while not sched.is_idle():
        batch = sched.step()
        modes.add(batch.forward_mode)
        sched.process_batch_result(batch, model.forward(batch))
    assert modes == {ForwardMode.EXTEND, ForwardMode.DECODE}
    assert model.chunked_batches > 0 and model.prefix_hit_batches > 0
    for r in reqs:
        assert r.output_ids == expected_output(r)


def test_attention_metadata_needs_a_prepared_batch():
    sched = make_scheduler(1024)
    batch = ScheduleBatch([], sched.req_to_token_pool, sched.token_allocator, sched.tree_cache)
    with pytest.raises(RuntimeError, match="prepare_for_extend"):
        batch.attention_metadata()


@pytest.mark.parametrize("as_tensor", [torch.tensor, np.array])
def test_sampled_tokens_may_come_as_a_tensor_or_array(as_tensor):
    reqs = [Req(i, list(range(10 + i, 60 + i)), 5) for i in range(4)]
    sched = make_scheduler(2048)
    for r in reqs:
        sched.add_request(r)
    model = FakeModel(sched)
    while not sched.is_idle():
        batch = sched.step()
        sched.process_batch_result(batch, as_tensor(model.forward(batch)))
    for r in reqs:
        assert r.output_ids == expected_output(r)
        assert all(type(t) is int for t in r.output_ids)


def test_non_integer_tokens_are_rejected_and_the_batch_can_be_reported_again():
    sched = make_scheduler(1024)
    req = Req(0, [1, 2, 3], 2)
    sched.add_request(req)
    batch = sched.step()
    with pytest.raises(TypeError, match="next_token_ids"):
        sched.process_batch_result(batch, [1.5])
    with pytest.raises(ValueError, match="1-D"):
        sched.process_batch_result(batch, torch.tensor([[5]]))
    assert req.output_ids == []
    sched.process_batch_result(batch, [5])
    assert req.output_ids == [5]


def test_bad_requests_are_rejected_at_admission_and_the_loop_serves_the_rest():
    sched = make_scheduler(2048, max_context_len=256)
    with pytest.raises(ValueError, match="exceed max_context_len"):
        sched.add_request(Req("long", list(range(300)), 4))
    with pytest.raises(ValueError, match="max_new_tokens"):
        Req("zero", [1, 2], 0)
    with pytest.raises(ValueError, match="input_ids is empty"):
        Req("empty", [], 3)
    with pytest.raises(TypeError, match="must hold ints"):
        Req("floats", [1.5], 3)
    ok = Req("ok", list(range(50)), 3)
    run(sched, [ok])
    assert ok.output_ids == expected_output(ok)
    assert sched.stats.rejected == 1


def test_request_larger_than_kv_capacity_is_rejected():
    sched = make_scheduler(128, max_context_len=1024)
    with pytest.raises(ValueError, match="KV capacity"):
        sched.add_request(Req("big", list(range(200)), 4))


def test_step_requires_the_previous_result_first():
    sched = make_scheduler(1024)
    sched.add_request(Req(0, [1, 2, 3], 2))
    batch = sched.step()
    with pytest.raises(RuntimeError, match="process_batch_result"):
        sched.step()
    with pytest.raises(ValueError, match="tokens for a batch"):
        sched.process_batch_result(batch, [])


def test_scheduler_config_rejects_an_unknown_policy_and_an_empty_chunk():
    with pytest.raises(ValueError, match="schedule_policy"):
        SchedulerConfig(schedule_policy="random")
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        SchedulerConfig(chunked_prefill_size=0)


def count_evictions(tree):
    """Wraps tree.evict to record each call's request; returns the list it fills."""
    calls, evict = [], tree.evict

    def recording(num_tokens):
        calls.append(num_tokens)
        return evict(num_tokens)

    tree.evict = recording
    return calls


def fill_tree(sched, n_prefixes, length):
    """Caches n_prefixes distinct prompts (evictable once they finish)."""
    run(sched, [Req(f"c{i}", [10_000 + i * length + t for t in range(length)], 1) for i in range(n_prefixes)])


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_shortage_evicts_the_shortfall_in_one_call(page_size):
    sched = make_scheduler(1024, page_size, max_running_requests=8)
    fill_tree(sched, 12, 64)
    reqs = [Req(i, [i * 5 + t for t in range(1, 17)], 50) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    model = FakeModel(sched)
    batch = sched.step()  # all four prefilled
    sched.process_batch_result(batch, model.forward(batch))
    # Take every free slot, so that the next decode step must evict.
    hoard = sched.token_allocator.alloc(sched.token_allocator.available_size())
    calls = count_evictions(sched.tree_cache)
    batch = sched.step()
    assert batch.forward_mode is ForwardMode.DECODE and not batch.retracted
    assert len(calls) == 1 and calls[0] > 0
    sched.process_batch_result(batch, model.forward(batch))
    sched.token_allocator.free(hoard)
    sched.check_invariants()


@pytest.mark.parametrize("page_size", [1, 16])
def test_retract_decode_releases_the_least_advanced_request_first_and_only_as_many_as_needed(page_size):
    sched = make_scheduler(256, page_size, max_running_requests=4)
    reqs = [Req(i, [i * 9 + t for t in range(1, 33)], 20) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    model = FakeModel(sched)
    batch = sched.step()
    sched.process_batch_result(batch, model.forward(batch))
    reqs[2].output_ids += [5] * 3  # the most advanced: kept
    free_before = sched.token_allocator.available_size()
    hoard = sched.token_allocator.alloc(free_before)  # nothing free, nothing evictable
    batch = ScheduleBatch(list(sched.running), sched.req_to_token_pool, sched.token_allocator, sched.tree_cache)
    retracted = batch.retract_decode()
    # Each 32-token request needs a new slot (page) for its next token; freeing one request's 32 slots
    # covers the other two. Among the two least advanced, arrival order decides.
    assert retracted == [reqs[0]]
    assert batch.reqs == [reqs[1], reqs[2]]
    assert reqs[0].req_pool_idx is None and reqs[0].num_retractions == 1
    # Its prompt was published to the tree after prefill, so retraction leaves those 32 slots evictable.
    assert sched.token_allocator.available_size() + sched.tree_cache.evictable_size() == 32
    sched.token_allocator.free(hoard)


def test_prepare_for_extend_when_short_returns_false_and_changes_nothing():
    sched = make_scheduler(256, 1)
    pool, alloc = sched.req_to_token_pool, sched.token_allocator
    hoard = alloc.alloc(alloc.available_size() - 10)
    req = Req("r", list(range(1, 41)), 4)
    req.extend_end = len(req.input_ids)
    rows_before, free_before = pool.available_size(), alloc.available_size()
    batch = ScheduleBatch([req], pool, alloc, sched.tree_cache)
    assert batch.prepare_for_extend() is False
    assert (pool.available_size(), alloc.available_size()) == (rows_before, free_before)
    assert req.req_pool_idx is None
    alloc.free(hoard)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_prefilled_prompt_is_shared_while_its_request_still_decodes(page_size):
    sched = make_scheduler(4096, page_size)
    model = FakeModel(sched)
    first = Req("a", list(range(100, 164)), 50)
    sched.add_request(first)
    for _ in range(3):  # the prefill, then two decode steps: "a" is running, not finished
        batch = sched.step()
        sched.process_batch_result(batch, model.forward(batch))
    assert first in sched.running and sched.tree_cache.protected_size() == 64
    second = Req("b", list(range(100, 164)) + [7] * 20, 4)
    sched.add_request(second)
    batch = sched.step()
    assert batch.forward_mode is ForwardMode.EXTEND and batch.reqs == [second]
    assert batch.prefix_lens.tolist() == [64]
    table = sched.req_to_token_pool.req_to_token
    assert torch.equal(table[second.req_pool_idx, :64], table[first.req_pool_idx, :64])
    sched.process_batch_result(batch, model.forward(batch))
    sched.check_invariants()


def test_an_idle_scheduler_admits_a_request_that_fills_the_pool_at_page_16():
    # 33 prompt + 30 new tokens fit 64 slots, but the prompt rounded up to pages (48) plus the 0.7 output
    # reservation (21) would not: admission must never ask for more than the request can take.
    sched = make_scheduler(64, page_size=16)
    req = Req("a", list(range(100, 133)), 30)
    run(sched, [req])
    assert req.output_ids == expected_output(req)


def test_a_request_queued_twice_is_refused_and_the_first_copy_still_runs():
    sched = make_scheduler(256)
    req = Req("a", list(range(100, 140)), 4)
    sched.add_request(req)
    with pytest.raises(ValueError, match="already queued"):
        sched.add_request(req)
    assert list(sched.waiting) == [req]
    run(sched, [])
    assert req.output_ids == expected_output(req)
    with pytest.raises(ValueError, match="finished"):
        sched.add_request(req)


@pytest.mark.parametrize("bad", [{"lpm_window": 0}, {"lpm_window": 2.5}, {"new_token_ratio_decay": -0.1}])
def test_scheduler_config_rejects_bad_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SchedulerConfig(**bad)


def _snapshot(pool, alloc, reqs):
    return (pool.available_size(), alloc.available_size(),
            [(r.req_pool_idx, r.kv_len, r.cache_protected_len) for r in reqs])


def test_prepare_for_extend_past_max_context_len_raises_and_changes_nothing():
    pool, alloc = ReqToTokenPool(4, 64), TokenAllocator(256)
    tree = RadixCache(pool, alloc)
    req = Req("a", list(range(100)), 1)
    req.extend_end = 100
    before = _snapshot(pool, alloc, [req])
    with pytest.raises(ValueError, match="max_context_len"):
        ScheduleBatch([req], pool, alloc, tree).prepare_for_extend()
    assert _snapshot(pool, alloc, [req]) == before


def test_prepare_for_extend_refuses_a_request_twice_in_one_batch():
    pool, alloc = ReqToTokenPool(4, 64), TokenAllocator(256)
    req = Req("a", list(range(10, 20)), 1)
    req.extend_end = 10
    before = _snapshot(pool, alloc, [req])
    with pytest.raises(ValueError, match="more than once"):
        ScheduleBatch([req, req], pool, alloc, RadixCache(pool, alloc)).prepare_for_extend()
    assert _snapshot(pool, alloc, [req]) == before


def test_prepare_for_decode_at_max_context_len_raises_and_changes_nothing():
    pool, alloc = ReqToTokenPool(4, 8), TokenAllocator(64)
    tree = RadixCache(pool, alloc)
    req = Req("a", list(range(10, 18)), 1)
    req.extend_end = 8
    assert ScheduleBatch([req], pool, alloc, tree).prepare_for_extend()
    before = _snapshot(pool, alloc, [req])
    with pytest.raises(ValueError, match="max_context_len"):
        ScheduleBatch([req], pool, alloc, tree).prepare_for_decode()
    assert _snapshot(pool, alloc, [req]) == before


@pytest.mark.parametrize("page_size", [1, 4])
def test_the_documented_manual_flow_keeps_the_tree_and_the_allocator_consistent(page_size):
    # match_prefix + inc_lock_ref + prepare_for_extend + cache_finished_req, without the Scheduler: the
    # batch itself must record which leading slots belong to the tree.
    pool = ReqToTokenPool(4, 64)
    alloc = TokenAllocator(64) if page_size == 1 else PagedTokenAllocator(64, page_size)
    tree = RadixCache(pool, alloc, page_size=page_size)

    def serve(rid, ids):
        req = Req(rid, ids, 1)
        m = tree.match_prefix(ids[:-1])
        tree.inc_lock_ref(m.last_node)
        req.prefix_indices, req.last_node, req.extend_end = m.indices, m.last_node, len(ids)
        assert ScheduleBatch([req], pool, alloc, tree).prepare_for_extend()
        req.output_ids.append(0)
        tree.cache_finished_req(req)
        return m.indices.numel()

    assert serve("a", list(range(10, 30))) == 0
    assert serve("b", list(range(10, 30)) + [99]) == 20
    tree.check_invariants()
    assert alloc.available_size() + tree.total_size() == alloc.size


def test_an_empty_batch_is_refused_with_a_clear_error():
    pool, alloc = ReqToTokenPool(4, 64), TokenAllocator(64)
    with pytest.raises(ValueError, match="the batch is empty"):
        ScheduleBatch([], pool, alloc, RadixCache(pool, alloc)).prepare_for_extend()


# ---- output pages of running requests ---------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("cache_decode_pages", [True, False])
def test_a_request_that_continues_a_running_requests_output_hits_its_written_pages(page_size, cache_decode_pages):
    sched = make_scheduler(4096, page_size, cache_decode_pages=cache_decode_pages)
    prompt = list(range(100, 132))
    a = Req("a", prompt, 40)
    sched.add_request(a)
    model = FakeModel(sched)
    for _ in range(21):  # prefill, then 20 decode steps: a has 21 outputs, 20 of them in KV
        batch = sched.step()
        sched.process_batch_result(batch, model.forward(batch))
    b = Req("b", prompt + a.output_ids[:12] + [7, 7, 7], 2)  # a follow-up quoting 12 of a's outputs
    sched.add_request(b)
    batch = sched.step()
    expected = 32 + 12 // page_size * page_size if cache_decode_pages else 32
    assert len(b.prefix_indices) == expected and b in batch.reqs
    sched.process_batch_result(batch, model.forward(batch))
    while not sched.is_idle():
        batch = sched.step()
        sched.process_batch_result(batch, model.forward(batch))
        sched.check_invariants()
    assert a.output_ids == expected_output(a)


def three_decoding_with_no_free_slot(cache_decode_pages):
    """Three requests 40 tokens into their decode (8 tokens past their prompts, at page size 4), and every free
    slot held elsewhere (`hoard`), so that the next decode must retract."""
    sched = make_scheduler(256, 4, max_running_requests=4, cache_decode_pages=cache_decode_pages)
    for i in range(3):
        sched.add_request(Req(i, [i * 50 + t for t in range(1, 33)], 20))
    model = FakeModel(sched)
    for _ in range(9):  # prefill and 8 decode steps
        batch = sched.step()
        sched.process_batch_result(batch, model.forward(batch))
    return sched, model, sched.token_allocator.alloc(sched.token_allocator.available_size())


@pytest.mark.parametrize("cache_decode_pages", [True, False])
def test_a_retracted_request_leaves_its_written_output_pages_cached(cache_decode_pages):
    sched, model, hoard = three_decoding_with_no_free_slot(cache_decode_pages)
    batch = ScheduleBatch._of(list(sched.running), sched.req_to_token_pool, sched.token_allocator,
                              sched.tree_cache, cache_decode_pages=cache_decode_pages)
    victim = batch.retract_decode()[0]
    cached = len(sched.tree_cache.match_prefix(list(victim.fill_ids)).indices)
    assert cached == (40 if cache_decode_pages else 32)  # its prompt and, like vLLM, the pages it decoded
    assert sched.token_allocator.available_size() + sched.tree_cache.evictable_size() >= 8
    sched.token_allocator.free(hoard)


SYSTEM = list(range(1000, 1064))


def extend_batches(sched, reqs):
    """Serves `reqs` to idle (checking the invariants and every output) and returns each extend batch's
    (rid, cached prefix length) pairs."""
    for r in reqs:
        sched.add_request(r)
    model, admitted = FakeModel(sched), []
    while not sched.is_idle():
        batch = sched.step()
        if batch.forward_mode is ForwardMode.EXTEND:
            admitted.append([(r.rid, len(r.prefix_indices)) for r in batch.reqs])
        sched.process_batch_result(batch, model.forward(batch))
        sched.check_invariants()
    assert all(r.output_ids == expected_output(r) for r in reqs)
    return admitted


@pytest.mark.parametrize("page_size", [1, 16])
def test_in_batch_prefix_caching_makes_a_sharer_wait_a_step_and_hit(page_size):
    batches = {}
    for in_batch in (False, True):
        sched = make_scheduler(8192, page_size, schedule_policy="fcfs", in_batch_prefix_caching=in_batch)
        batches[in_batch] = extend_batches(sched, [Req("a", SYSTEM + [1, 2], 3), Req("b", SYSTEM + [3, 4], 3),
                                                   Req("c", [5] * 40, 3)])
    assert batches[False] == [[("a", 0), ("b", 0), ("c", 0)]]
    # b's next page is one a computes in the same batch: b (and c behind it) wait a step, and b hits it.
    assert batches[True] == [[("a", 0)], [("b", 64), ("c", 0)]]


@pytest.mark.parametrize("a, b, b_waits", [
    (SYSTEM[:16], SYSTEM[:16] + [3, 4], True),   # a computes exactly the page b would hit
    (SYSTEM + [1, 2], SYSTEM[:16] + [9], True),  # b's match key is exactly that page
    (SYSTEM + [1, 2], SYSTEM[:16], False),       # b's last token is on that page: it computes the page anyway
])
def test_in_batch_prefix_caching_waits_only_for_a_whole_page_it_could_hit(a, b, b_waits):
    sched = make_scheduler(8192, 16, schedule_policy="fcfs", in_batch_prefix_caching=True)
    admitted = extend_batches(sched, [Req("a", a, 2), Req("b", b, 2)])
    assert admitted == ([[("a", 0)], [("b", 16)]] if b_waits else [[("a", 0), ("b", 0)]])


def test_scheduler_config_refuses_non_bool_switches():
    with pytest.raises(ValueError, match="cache_decode_pages"):
        SchedulerConfig(cache_decode_pages=1)
    with pytest.raises(ValueError, match="in_batch_prefix_caching"):
        SchedulerConfig(in_batch_prefix_caching="yes")


# ---- admission order and fully cached prompts ------------------------------------------------------------
def admission_order(policy, **cfg):
    """Caches two prompts (P: 12 tokens, Q: 4), then queues in this order a stranger, a request sharing Q, one
    sharing all of P and one sharing P's first 8 tokens, and admits one request per step."""
    sched = make_scheduler(1024, schedule_policy=policy, max_running_requests=1, **cfg)
    p, q = list(range(100, 112)), [200, 201, 202, 203]
    model = run(sched, [Req("P", p, 1), Req("Q", q, 1)])
    queue = [Req("none", [300, 301, 302], 1), Req("Q4", q + [400, 401], 1), Req("P12", p + [500, 501], 1),
             Req("P8", p[:8] + [600], 1)]
    batches = []
    run(sched, queue, model=model, batches=batches)
    assert all(len(b) == 1 for b in batches)
    return [b[0] for b in batches]


def test_lpm_admits_the_longest_cached_prefix_first():
    assert admission_order("lpm") == [("P12", 12), ("P8", 8), ("Q4", 4), ("none", 0)]


def test_lpm_ranks_only_its_window_of_the_oldest_waiting_requests():
    # A window of 2 ranks only the two oldest waiting requests at each step.
    assert admission_order("lpm", lpm_window=2) == [("Q4", 4), ("P12", 12), ("P8", 8), ("none", 0)]


def test_fcfs_admits_in_arrival_order():
    assert admission_order("fcfs") == [("none", 0), ("Q4", 4), ("P12", 12), ("P8", 8)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_same_prompt_sent_twice_is_served_from_the_cache_and_computes_its_last_page(page_size):
    # The second request's prompt is wholly cached; its last token must still be computed (its logits give
    # the first output), so the match stops one token short, cut to whole pages.
    sched = make_scheduler(1024, page_size)
    prompt = list(range(100, 132))  # two whole pages of 16
    first = Req("a", prompt, 3)
    model = run(sched, [first])
    second = Req("b", prompt, 3)
    sched.add_request(second)
    batch = sched.step()
    assert batch.prefix_lens.tolist() == [31 // page_size * page_size]
    assert batch.extend_lens.tolist() == [32 - 31 // page_size * page_size]
    sched.process_batch_result(batch, model.forward(batch))
    run(sched, [], model=model)
    assert second.output_ids == first.output_ids == expected_output(first)


def test_a_phase_timer_counts_each_phase_of_the_loop_and_its_seconds_fit_the_loop():
    pool, alloc = ReqToTokenPool(4, 64), TokenAllocator(256)
    timer = PhaseTimer()
    sched = Scheduler(pool, alloc, RadixCache(pool, alloc), SchedulerConfig(), timer=timer)
    t0 = perf_counter()
    run(sched, [Req("a", [1, 2, 3], 3), Req("b", [4, 5], 2)])
    elapsed = perf_counter() - t0
    # One extend batch admitting both (the waiting queue ranked once, two matches), then two decode steps; every
    # batch processed once; one slot allocation per batch; each request enters the tree after its extend and again
    # when it finishes.
    assert dict(timer.calls) == {"rank": 1, "match": 2, "prepare_extend": 1, "alloc": 3, "cache": 4,
                                 "prepare_decode": 2, "process": 3}
    assert all(0 <= s <= elapsed for s in timer.seconds.values())
    assert sum(timer.seconds[p] for p in LOOP_PHASES) <= elapsed
    assert timer.seconds["cache"] <= timer.seconds["process"]
    assert timer.seconds["alloc"] <= timer.seconds["prepare_extend"] + timer.seconds["prepare_decode"]
    with pytest.raises(TypeError, match="^timer must be a PhaseTimer or None, got dict$"):
        Scheduler(pool, alloc, RadixCache(pool, alloc), timer={})


# ---- what mutation testing found unpinned (scripts/mutation.py scheduler) ----------------------------------
def serve_one_step(sched, model, reqs):
    for r in reqs:
        sched.add_request(r)
    batch = sched.step()
    sched.process_batch_result(batch, model.forward(batch))
    return batch


def test_admission_keeps_exactly_the_room_its_charge_says_and_no_more():
    # A running request with 7 output tokens to go reserves int(7 x 0.698) = 4 slots after two decode steps (the
    # ratio decays 0.001 a step). A new 4-token prompt with one output to go is charged 4: with 8 slots free it is
    # admitted, with 7 it waits.
    for free, admitted in ((8, True), (7, False)):
        sched = make_scheduler(64, max_running_requests=4)
        model = FakeModel(sched)
        serve_one_step(sched, model, [Req("a", [1, 2, 3, 4], 10)])
        for _ in range(2):
            serve_one_step(sched, model, [])
        assert sched.new_token_ratio == pytest.approx(0.698)
        sched.token_allocator.alloc(sched.token_allocator.available_size() - free)
        b = Req("b", [5, 6, 7, 8], 1)
        batch = serve_one_step(sched, model, [b])
        assert (b in batch.reqs) is admitted


@pytest.mark.parametrize("page_size, prompt, max_new, free, admitted", [
    # Prefix 8 cached: 8 new tokens + int(10 x 0.7) = 15 charged at page size 1.
    (1, 16, 10, 15, True), (1, 16, 10, 14, False),
    # Page 16, prefix 16 cached, 33 tokens + 30 to go: capped at what it can ever take, 64 - 16 = 48 slots.
    (16, 33, 30, 48, True), (16, 33, 30, 32, False)])
def test_a_new_request_with_a_cached_prefix_is_charged_only_for_the_rest(page_size, prompt, max_new, free, admitted):
    sched = make_scheduler(256, page_size)
    model = FakeModel(sched)
    cached = list(range(100, 100 + (8 if page_size == 1 else 16)))
    run(sched, [Req("p", cached, 1)], model=model)  # exactly the prefix is cached: nothing else evictable
    alloc = sched.token_allocator
    alloc.alloc(alloc.available_size() - free)
    req = Req("r", cached + list(range(500, 500 + prompt - len(cached))), max_new)
    sched.add_request(req)
    assert (sched.step() is not None) is admitted


def test_a_request_coming_back_with_outputs_is_charged_for_the_outputs_it_still_owes():
    # A retracted request resumes from prompt + outputs; only max_new_tokens - outputs are still to come.
    for free, admitted in ((6 + 4, True), (6 + 3, False)):  # 6 tokens to prefill + int(6 x 0.7) = 4 reserved
        sched = make_scheduler(64)
        req = Req("r", [1, 2, 3, 4], 8)
        req.output_ids = [5, 6]
        sched.token_allocator.alloc(sched.token_allocator.available_size() - free)
        sched.add_request(req)
        assert (sched.step() is not None) is admitted


def test_a_budget_that_fits_two_prompts_with_cached_prefixes_admits_both_in_one_step():
    sched = make_scheduler(256, chunked_prefill_size=8)
    model = FakeModel(sched)
    run(sched, [Req("p", [1, 2, 3, 4, 9], 1)], model=model)
    batch = serve_one_step(sched, model, [Req("a", [1, 2, 3, 4, 5, 6, 7, 8], 1), Req("b", [1, 2, 3, 4, 7, 7, 7, 7], 1)])
    assert [r.rid for r in batch.reqs] == ["a", "b"] and batch.extend_lens.tolist() == [4, 4]


def test_the_rest_of_a_chunk_s_budget_goes_to_the_best_ranked_request_and_none_when_spent():
    # Chunks of 4. "r" needs 4 + 3 tokens: its second step leaves a budget of 1, which lpm gives to "t" (its
    # prompt is cached) before the stranger "s"; with a 4 + 4 prompt nothing is left and nobody else is admitted.
    for tail, second in ((3, ["r", "t"]), (4, ["r"])):
        sched = make_scheduler(256, chunked_prefill_size=4)
        model = FakeModel(sched)
        run(sched, [Req("p", [1, 2, 3, 4, 5, 6], 1)], model=model)
        serve_one_step(sched, model, [Req("r", list(range(100, 104 + tail)), 1)])
        batch = serve_one_step(sched, model, [Req("s", [50, 51, 52], 1), Req("t", [1, 2, 3, 4, 5, 6, 7], 1)])
        assert [r.rid for r in batch.reqs] == second
        run(sched, [], model=model)


def test_chunked_prefill_at_page_16_extends_exactly_the_budget_each_step():
    sched = make_scheduler(1024, 16, chunked_prefill_size=20)
    model = FakeModel(sched)
    req = Req("a", list(range(100, 170)), 1)  # 70 tokens: 20, 20, 20, 10
    sched.add_request(req)
    lens = []
    while not sched.is_idle():
        batch = sched.step()
        lens.append(batch.extend_lens.tolist())
        sched.process_batch_result(batch, model.forward(batch))
    assert lens == [[20], [20], [20], [10]] and req.output_ids == expected_output(req)


def test_without_chunking_a_long_prompt_is_prefilled_in_one_step():
    sched = make_scheduler(20_000, max_context_len=10_001, rows=2, chunked_prefill_size=None)
    batch = serve_one_step(sched, FakeModel(sched), [Req("a", list(range(10, 10_010)), 1)])
    assert batch.extend_lens.tolist() == [10_000] and sched.is_idle()


def test_lpm_ranks_a_request_by_what_its_own_namespace_has_cached():
    sched = make_scheduler(1024, schedule_policy="lpm", max_running_requests=1)
    model = FakeModel(sched)
    p = list(range(100, 112))
    run(sched, [Req("p", p, 1)], model=model)  # cached in the default namespace only
    batches = []
    run(sched, [Req("other", p + [1], 1, namespace="tenant"), Req("short", p[:4] + [2], 1)], model=model,
        batches=batches)
    assert [b[0] for b in batches] == [("short", 4), ("other", 0)]


def test_a_plain_cache_reports_no_host_or_storage_hit_for_an_admitted_request():
    sched = make_scheduler(256)
    req = Req("a", [1, 2, 3], 1)
    run(sched, [req])
    assert (req.host_hit_len, req.storage_hit_len, req.prefetch) == (0, 0, None)


def test_a_batch_whose_rows_run_out_is_put_back_as_it_was():
    # Someone else holds one of the two rows: admission (two requests) passes, the batch cannot take its rows.
    sched = make_scheduler(256, rows=2)
    model = FakeModel(sched)
    run(sched, [Req("p", [1, 2, 3, 4], 1)], model=model)
    held = sched.req_to_token_pool.alloc(1)
    a, b = Req("a", [1, 2, 3, 4, 5], 1), Req("b", [9, 8, 7], 1)
    for r in (a, b):
        sched.add_request(r)
    free, evictable = sched.token_allocator.available_size(), sched.tree_cache.evictable_size()
    assert sched.step() is None
    assert list(sched.waiting) == [a, b] and sched.chunked_req is None and not sched.running
    assert (sched.tree_cache.protected_size(), sched.tree_cache.evictable_size()) == (0, evictable)
    assert sched.token_allocator.available_size() == free and sched.stats.prefill_batches == 1
    sched.check_invariants()
    sched.req_to_token_pool.free(held[0])
    run(sched, [], model=model)
    assert a.output_ids == expected_output(a) and b.output_ids == expected_output(b)


def test_a_chunked_prefill_short_of_slots_is_put_back_and_resumes():
    sched = make_scheduler(64, chunked_prefill_size=6)
    model = FakeModel(sched)
    req = Req("a", list(range(100, 112)), 1)
    serve_one_step(sched, model, [req])  # the first 6 tokens
    hoard = sched.token_allocator.alloc(sched.token_allocator.available_size())
    assert sched.step() is None and sched.chunked_req is req and req.kv_len == 6
    sched.token_allocator.free(hoard)
    run(sched, [], model=model)
    assert req.output_ids == expected_output(req)


def test_the_scheduler_counts_its_batches_evictions_and_retractions_across_steps():
    sched = make_scheduler(72, max_running_requests=8, init_new_token_ratio=0.05, min_new_token_ratio=0.0,
                           chunked_prefill_size=None)
    model = FakeModel(sched)
    fill_tree(sched, 2, 16)  # 32 evictable tokens: decode evicts them, then retracts
    prefill_batches, decode_batches, evicted, retractions = sched.stats.prefill_batches, 0, 0, 0
    for r in [Req(i, [i * 50 + t for t in range(1, 9)], 12) for i in range(4)]:
        sched.add_request(r)
    while not sched.is_idle():
        batch = sched.step()
        if batch.forward_mode is ForwardMode.EXTEND:
            prefill_batches += 1
        else:
            decode_batches += 1
            retractions += len(batch.retracted)
        evicted += batch.evicted_tokens
        sched.process_batch_result(batch, model.forward(batch))
    assert retractions > 0 and evicted > 0
    assert (sched.stats.prefill_batches, sched.stats.decode_batches, sched.stats.retractions) == (
        prefill_batches, decode_batches, retractions)
    assert sched.stats.evicted_tokens == evicted  # fill_tree evicted nothing


def test_the_new_token_ratio_decays_each_decode_step_and_jumps_back_after_a_retraction():
    sched = make_scheduler(256, init_new_token_ratio=0.5, min_new_token_ratio=0.497, new_token_ratio_decay=0.001)
    model = FakeModel(sched)
    serve_one_step(sched, model, [Req("a", [1, 2], 10)])
    ratios = []
    for _ in range(4):
        serve_one_step(sched, model, [])
        ratios.append(sched.new_token_ratio)
    assert ratios == pytest.approx([0.499, 0.498, 0.497, 0.497])


def test_misuse_of_the_step_protocol_is_refused_in_full_words():
    sched = make_scheduler(256)
    assert message_of_call(lambda: sched.process_batch_result(None, [])) == \
        "process_batch_result: no batch is pending (call step() first)"
    sched.add_request(Req("a", [1, 2], 2))
    batch = sched.step()
    sched.check_invariants()  # the pending batch's request holds its slots
    assert message_of_call(sched.step) == "step() called before process_batch_result() for the previous batch"
    other = ScheduleBatch(batch.reqs, sched.req_to_token_pool, sched.token_allocator, sched.tree_cache)
    assert message_of_call(lambda: sched.process_batch_result(other, [7])) == \
        "batch is not the one the last step() returned"
    assert message_of_call(lambda: sched.process_batch_result(batch, torch.empty(1, device="meta"))) == \
        "next_token_ids is on the 'meta' device, which holds no values"
    assert message_of_call(lambda: sched.process_batch_result(batch, [2**63])) == \
        "next_token_ids holds a token id outside int64"
    assert sched.process_batch_result(batch, [-5]) == [] and batch.reqs[0].output_ids == [-5]


def test_a_slot_lost_outside_the_scheduler_is_named_as_a_leak():
    sched = make_scheduler(64)
    run(sched, [Req("a", [1, 2, 3], 1)])
    sched.token_allocator.alloc(1)
    assert message_of_call(sched.check_invariants, AssertionError) == \
        "memory leak or double count: free 60 + evictable 3 + protected 0 + held by requests 0 != total 64"


def message_of_call(call, error=(ValueError, TypeError, RuntimeError)) -> str:
    with pytest.raises(error) as raised:
        call()
    return str(raised.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"lpm_window": 0}, "lpm_window must be a positive int, got 0"),
    ({"load_back_threshold": 0}, "load_back_threshold must be a positive int, got 0"),
    ({"init_new_token_ratio": -0.5}, "init_new_token_ratio must be a finite number >= 0, got -0.5"),
    ({"min_new_token_ratio": float("nan")}, "min_new_token_ratio must be a finite number >= 0, got nan"),
    ({"new_token_ratio_decay": -0.1}, "new_token_ratio_decay must be a finite number >= 0, got -0.1"),
    ({"min_new_token_ratio": 0.8}, "need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1, got 0.8 and 0.7"),
    ({"init_new_token_ratio": 1.5}, "need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1, got 0.1 and 1.5"),
])
def test_scheduler_config_names_what_is_wrong_in_full(kwargs, message):
    assert message_of_call(lambda: SchedulerConfig(**kwargs)) == message


def test_scheduler_config_takes_its_bounds_themselves():
    config = SchedulerConfig(lpm_window=1, load_back_threshold=1, init_new_token_ratio=1.0, min_new_token_ratio=1.0,
                             new_token_ratio_decay=0.0)
    assert (config.lpm_window, config.init_new_token_ratio, config.min_new_token_ratio) == (1, 1.0, 1.0)


def test_add_request_refuses_what_can_never_run_and_counts_it():
    sched = make_scheduler(64, max_context_len=16)
    assert message_of_call(lambda: sched.add_request("a")) == "req must be a Req, got str"
    assert message_of_call(lambda: sched.add_request(Req("a", list(range(12)), 5))) == \
        "request 'a': 12 prompt + 5 new tokens exceed max_context_len 16"
    assert sched.stats.rejected == 1
    sched = make_scheduler(16, max_context_len=64)
    assert message_of_call(lambda: sched.add_request(Req("b", list(range(12)), 5))) == \
        "request 'b': 12 prompt + 5 new tokens exceed the KV capacity 16"
    assert message_of_call(lambda: sched.add_request(Req("c", list(range(12)), 6))) == \
        "request 'c': 12 prompt + 6 new tokens exceed the KV capacity 16"
    assert sched.stats.rejected == 2
    sched = make_scheduler(16, max_context_len=16)  # both bounds: the capacity is named, as a replay caps rows by it
    assert message_of_call(lambda: sched.add_request(Req("e", list(range(12)), 5))) == \
        "request 'e': 12 prompt + 5 new tokens exceed the KV capacity 16"
    sched = make_scheduler(64, max_context_len=16)
    sched.add_request(Req("d", list(range(12)), 4))  # exactly max_context_len: it fits
    assert len(sched.waiting) == 1 and sched.stats.rejected == 0
    assert message_of_call(lambda: Scheduler(sched.req_to_token_pool, sched.token_allocator, sched.tree_cache,
                                             config={})) == "config must be a SchedulerConfig, got dict"


def test_the_phase_timer_counts_evictions_and_their_seconds_fit_the_loop():
    pool, alloc = ReqToTokenPool(8, 64), TokenAllocator(40)
    timer = PhaseTimer()
    sched = Scheduler(pool, alloc, RadixCache(pool, alloc), SchedulerConfig(schedule_policy="fcfs"), timer=timer)
    t0 = perf_counter()
    for i in range(4):  # each prompt evicts what the one before it cached
        run(sched, [Req(i, [100 * i + t for t in range(1, 33)], 2)])
    elapsed = perf_counter() - t0
    assert sched.stats.evicted_tokens > 0 and timer.calls["evict"] >= 1
    assert set(timer.calls) == set(timer.seconds) and None not in timer.calls
    assert 0 < timer.seconds["evict"] <= timer.seconds["prepare_extend"] + timer.seconds["prepare_decode"]
    assert sum(timer.seconds[p] for p in LOOP_PHASES) <= elapsed


# ---- the device path of the request table, run on the CPU -------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(2))
def test_a_pool_without_a_host_view_serves_what_the_host_path_serves(page_size, seed):
    # A CUDA request table has no numpy view: every write then goes through the kernels' entry points. The
    # same path runs here on CPU tensors when the pool's host view is taken away.
    _, specs = shared_prefix_specs(seed, 16, system_len=40, max_suffix=60, max_output=30)
    results = []
    for host in (True, False):
        sched = make_scheduler(400, page_size, schedule_policy="lpm", max_running_requests=6, chunked_prefill_size=32,
                               init_new_token_ratio=0.0, min_new_token_ratio=0.0)
        if not host:
            sched.req_to_token_pool.host_view = None
        reqs = [Req(i, p, n) for i, (p, n) in enumerate(specs)]
        run(sched, reqs)  # the FakeModel checks every row of every batch against the tokens it wrote
        sched.check_invariants()
        results.append(([r.output_ids for r in reqs], sched.stats, sched.tree_cache.evictable_size()))
    assert results[0] == results[1]
    assert all(r == expected_output(q) for r, q in zip(results[1][0], [Req(i, p, n) for i, (p, n) in enumerate(specs)]))
    assert results[1][1].retractions > 0 or results[1][1].evicted_tokens > 0


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(3))
def test_lpm_ranks_with_kept_walks_as_it_would_with_fresh_ones(page_size, seed):
    # Waiting requests keep their ranking walk between steps and take it again only where the tree changed; a
    # follow-up quoting a running request's output finds its decoded pages. Clearing the kept walks before every
    # step must change nothing: not the batches, not what they hit.
    rng = random.Random(seed)
    systems = [[rng.randrange(10, 30000) for _ in range(24)] for _ in range(3)]
    firsts = [Req(f"r{i}", rng.choice(systems) + [rng.randrange(10, 30000) for _ in range(rng.randint(1, 12))],
                  rng.randint(8, 24), namespace=rng.choice([None, None, "t"])) for i in range(10)]
    follow_ups = []
    for i, r in enumerate(firsts[:6]):
        quoted = expected_output(r)[:rng.randint(4, 8)]
        follow_ups.append((r, list(r.input_ids) + quoted + [rng.randrange(10, 30000) for _ in range(3)]))
    runs = []
    for fresh in (False, True):
        sched = make_scheduler(2000, page_size, schedule_policy="lpm", max_running_requests=3,
                               chunked_prefill_size=None)
        reqs = [Req(r.rid, r.input_ids, r.max_new_tokens, namespace=r.namespace) for r in firsts]
        reqs += [Req(f"{r.rid}+", prompt, 4, namespace=r.namespace) for r, prompt in follow_ups]
        for r in reqs:
            sched.add_request(r)
        model, batches = FakeModel(sched), []
        while not sched.is_idle():
            if fresh:
                sched.ranker._walks.clear()
            batch = sched.step()
            batches.append([(r.rid, len(r.prefix_indices)) for r in batch.reqs])
            sched.process_batch_result(batch, model.forward(batch))
            sched.check_invariants()
        runs.append((batches, [r.output_ids for r in reqs]))
    assert runs[0] == runs[1]
    hits = [n for batch in runs[0][0] for rid, n in batch if rid.endswith("+")]
    assert max(hits) > 24  # some follow-up found the decoded pages of the request it quotes


def test_every_rejection_and_every_retraction_is_counted():
    sched = make_scheduler(96, 1, max_running_requests=4, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    for rid in ("long1", "long2"):
        with pytest.raises(ValueError):
            sched.add_request(Req(rid, list(range(1, 90)), 10))
    assert sched.stats.rejected == 2
    reqs = [Req(i, [i * 40 + t for t in range(1, 9)], 30) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    model, retracted = FakeModel(sched), 0
    while not sched.is_idle():
        batch = sched.step()
        retracted += len(batch.retracted)
        sched.process_batch_result(batch, model.forward(batch))
    assert retracted >= 2 and sched.stats.retractions == retracted
    assert all(r.output_ids == expected_output(r) for r in reqs)


@pytest.mark.parametrize("cache_decode_pages", [True, False])
def test_the_scheduler_s_retraction_follows_its_cache_decode_pages_setting(cache_decode_pages):
    sched, model, hoard = three_decoding_with_no_free_slot(cache_decode_pages)
    batch = sched.step()  # no free slot for the next decode: a retraction
    # The victim's 8 decoded tokens are cached (cache_decode_pages) or freed; cached, they are the only evictable
    # leaf, and the decode of the two left evicts them at once. Either way its prompt stays.
    victim = batch.retracted[0]
    assert batch.evicted_tokens == (8 if cache_decode_pages else 0)
    assert len(sched.tree_cache.match_prefix(list(victim.fill_ids)).indices) == 32
    sched.process_batch_result(batch, model.forward(batch))
    sched.token_allocator.free(hoard)
    sched.check_invariants()


def test_a_stopped_request_finishes_with_its_token_and_frees_its_reservation():
    sched = make_scheduler(256)
    a, b, c = Req("a", list(range(1, 9)), 50), Req("b", list(range(20, 28)), 50), Req("c", [40, 41], 50)
    for req in (a, b, c):
        sched.add_request(req)
    batch = sched.step()
    assert sched.process_batch_result(batch, [7, 8, 9], stopped=[2]) == [c]  # its first token stops it
    assert c.output_ids == [9] and c.max_new_tokens == 1
    sched.check_invariants()
    batch = sched.step()
    assert [r.rid for r in batch.reqs] == ["a", "b"]
    assert sched.process_batch_result(batch, [10, 11], stopped=[1]) == [b]
    assert b.output_ids == [8, 11] and b.req_pool_idx is None
    sched.check_invariants()  # the tokens b no longer generates are not owed any more
    assert sched._tokens_left == 48


@pytest.mark.parametrize("stopped, error, match", [
    ([2], ValueError, r"stopped: a position must be .*at most 1.*got 2"),
    ([-1], ValueError, "stopped: a position must be"),
    ([0, 0], ValueError, "stopped: position 0 is given twice"),
    (0, TypeError, "stopped must be positions in the batch"),
    ("0", TypeError, "stopped must be positions in the batch"),
])
def test_bad_stopped_positions_raise_and_change_nothing(stopped, error, match):
    sched = make_scheduler(256)
    for rid in ("a", "b"):
        sched.add_request(Req(rid, [1, 2, 3], 5))
    batch = sched.step()
    with pytest.raises(error, match=match):
        sched.process_batch_result(batch, [7, 8], stopped=stopped)
    assert [r.output_ids for r in batch.reqs] == [[], []] and [r.max_new_tokens for r in batch.reqs] == [5, 5]
    assert len(sched.process_batch_result(batch, [7, 8])) == 0  # the batch is still pending
    sched.check_invariants()


def test_a_middle_chunk_cannot_be_stopped():
    sched = make_scheduler(256, chunked_prefill_size=4)
    sched.add_request(Req("a", list(range(1, 11)), 5))
    batch = sched.step()
    with pytest.raises(ValueError, match="stopped: request 'a' samples nothing in this step"):
        sched.process_batch_result(batch, [7], stopped=[0])


def test_in_batch_prefix_caching_waits_only_for_pages_of_its_own_namespace():
    prompt = list(range(100, 164))
    for namespace, waits in (("tenant", False), (None, True)):
        sched = make_scheduler(512, chunked_prefill_size=None, in_batch_prefix_caching=True)
        sched.add_request(Req("A", prompt, 2))
        sched.add_request(Req("B", prompt[:10] + [1, 2], 2, namespace=namespace))
        batch = sched.step()
        # Another tenant's pages can never be B's hit: waiting for them delays it for nothing, and would let it
        # time another tenant's prompt.
        assert [r.rid for r in batch.reqs] == (["A"] if waits else ["A", "B"])
        sched.process_batch_result(batch, [7] * batch.batch_size())


def test_process_batch_result_refuses_a_list_of_arrays_as_not_int_tokens():
    sched = make_scheduler(128)
    for rid in ("a", "b"):
        sched.add_request(Req(rid, [1, 2, 3], 4))
    batch = sched.step()
    with pytest.raises(TypeError, match="next_token_ids must hold int token ids"):
        sched.process_batch_result(batch, [np.array([1, 2]), 7])


@pytest.mark.parametrize("tokens", [[True, 7], [7, False], torch.tensor([True, False]), np.array([True, False])])
def test_process_batch_result_refuses_bool_tokens(tokens):
    sched = make_scheduler(128)
    for rid in ("a", "b"):
        sched.add_request(Req(rid, [1, 2, 3], 4))
    batch = sched.step()
    with pytest.raises(TypeError, match="next_token_ids must hold int token ids"):
        sched.process_batch_result(batch, tokens)
    assert [r.output_ids for r in batch.reqs] == [[], []]
    sched.process_batch_result(batch, [1, 0])  # the ints equal to True and False are tokens
    assert [r.output_ids for r in batch.reqs] == [[1], [0]]



# ---- abort: the one release path ---------------------------------------------------------------------------
def test_aborting_a_waiting_request_takes_it_off_the_queue():
    sched = make_scheduler(256, max_running_requests=1)
    a, b = Req("a", [1, 2, 3, 4], 5), Req("b", [1, 2, 9], 5)
    sched.add_request(a)
    sched.add_request(b)
    sched.process_batch_result(sched.step(), [7])  # a runs; b waits for a row
    sched.abort(b)
    assert list(sched.waiting) == [] and b.status.value == "finished" and b.req_pool_idx is None
    sched.check_invariants()
    with pytest.raises(ValueError, match="request 'b' is not queued or running here"):
        sched.abort(b)


def test_aborting_a_running_request_caches_what_it_computed_and_releases_the_rest():
    sched = make_scheduler(256, page_size=4)
    a, b = Req("a", list(range(1, 11)), 20), Req("b", list(range(50, 60)), 20)
    for req in (a, b):
        sched.add_request(req)
    model = FakeModel(sched)
    for _ in range(4):  # a prefill and three decode steps: 13 tokens of KV, the last in a partial page
        batch = sched.step()
        sched.process_batch_result(batch, model.forward(batch))
    free = sched.token_allocator.available_size()
    sched.abort(a)
    assert sched.running == [b] and a.status.value == "finished" and a.req_pool_idx is None
    assert sched.token_allocator.available_size() > free  # its partial page went back
    sched.check_invariants()  # and its owed tokens are no longer reserved
    assert sched.tree_cache.match_prefix(list(a.input_ids) + a.output_ids).indices.numel() == 12  # whole pages
    run(sched, [], model=model)
    assert b.finished() and sched.tree_cache.protected_size() == 0


def test_aborting_a_request_mid_chunked_prefill_or_in_a_pending_batch():
    sched = make_scheduler(512, chunked_prefill_size=8)
    a = Req("a", list(range(1, 30)), 4)
    sched.add_request(a)
    batch = sched.step()
    with pytest.raises(RuntimeError, match="request 'a' is in the pending batch"):
        sched.abort(a)
    sched.process_batch_result(batch, [7])  # a middle chunk: a is the chunked request now
    assert sched.chunked_req is a
    sched.abort(a)
    assert sched.chunked_req is None and sched.is_idle()
    sched.check_invariants()
    assert sched.tree_cache.protected_size() == 0 and sched.tree_cache.total_size() == 8
