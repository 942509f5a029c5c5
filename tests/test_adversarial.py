"""The public API under fire: hypothesis throws hostile arguments (wrong types, huge and negative values,
repeats, foreign objects, tensors on the meta device, wrong order) at each component, and checks the
promise: a call either works (and the component's invariants still hold) or raises ValueError, IndexError or
TypeError whose message names one of the call's arguments, with the component exactly as it was.

Each component gets a world of its own: misuse across objects (freeing, through the allocator, a slot that a
tree owns) is not something either object can see.
"""

import inspect

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvmem import (
    MHAKVPool,
    MLAKVPool,
    PagedTokenAllocator,
    RadixCache,
    Req,
    ReqToTokenPool,
    Scheduler,
    SchedulerConfig,
    TokenAllocator,
    sizing,
)
from kvmem.attention import build_decode_metadata, build_extend_metadata, reference_paged_attention
from kvmem.kernels import create_kv_indices, create_kv_indptr, kv_last_page_len, write_req_to_token

PROMISED = (ValueError, IndexError, TypeError)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))

SCALARS = [None, True, False, 1.5, float("nan"), float("inf"), -1, 0, 1, 3, 2**31, 2**63, -(2**63) - 1, 2**64,
           "3", b"\x01" * 8, object(), [], [1, 1], [0], [-1], [2**63], (1, 2), [[1]]]


def tensors(values=st.lists(st.integers(-3, 40), max_size=6)):
    dtypes = st.sampled_from([torch.int64, torch.int32, torch.int8, torch.float32, torch.bool])
    return st.builds(lambda xs, dt: torch.tensor(xs).to(dt), values, dtypes)


NASTY = st.one_of(
    st.sampled_from(SCALARS), st.integers(-5, 40), st.lists(st.integers(-3, 40), max_size=6), tensors(),
    st.just(torch.zeros(2, 2, dtype=torch.int64)), st.just(torch.tensor([1, 2], device="meta")),
    st.just(np.array([2**63, 1], dtype=np.uint64)), st.just(torch.arange(8)[::2]))


def attempt(call, args, snapshot, check):
    """Calls call(*args): on success `check()` must hold; on failure the error must be promised, name an
    argument, and leave `snapshot()` unchanged."""
    before = snapshot()
    try:
        call(*args)
    except PROMISED as e:
        names = list(inspect.signature(call).parameters)
        assert any(n in str(e) for n in names) or "request" in str(e), (call.__name__, names, str(e))
        assert snapshot() == before, f"{call.__name__}{args!r} raised {e!r} and changed state"
        return
    check()


def arity(call):
    return len(inspect.signature(call).parameters)


# ---- allocators --------------------------------------------------------------------------------------------
def allocator_snapshot(alloc):
    state = alloc.backup_state()
    return alloc.available_size(), state.free_pages.tolist(), state.allocated.tobytes()


@pytest.mark.parametrize("paged", [False, True])
@SETTINGS
@given(data=st.data())
def test_allocators_refuse_hostile_arguments_and_stay_consistent(paged, data):
    alloc = PagedTokenAllocator(32, 4) if paged else TokenAllocator(32)
    held = alloc.alloc(8)
    calls = [alloc.alloc, alloc.free, alloc.is_allocated, alloc.restore_state]
    if paged:
        calls += [alloc.alloc_extend, alloc.alloc_decode]
    for _ in range(6):
        call = data.draw(st.sampled_from(calls))
        args = [data.draw(st.one_of(NASTY, st.just(held), st.just(held[:4]))) for _ in range(arity(call))]

        def check():  # usable slots are page_size .. size + page_size - 1 (page 0 holds the padding slot)
            slots = torch.arange(alloc.page_size, 32 + alloc.page_size)
            assert alloc.available_size() + int(alloc.is_allocated(slots).sum()) == 32

        attempt(call, args, lambda: allocator_snapshot(alloc), check)


# ---- req_to_token -------------------------------------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def test_req_to_token_pool_refuses_hostile_arguments(data):
    pool = ReqToTokenPool(4, 8)
    row = pool.alloc(1)[0]
    for _ in range(6):
        call = data.draw(st.sampled_from([pool.alloc, pool.free, pool.write]))
        args = [data.draw(st.one_of(NASTY, st.just(row), st.just((row, slice(0, 2))))) for _ in range(arity(call))]
        def snapshot():
            return ((pool.available_size(), pool._is_free.copy(), pool.req_to_token.clone().tolist()))
        attempt(call, args, snapshot, lambda: None)


# ---- the radix cache ---------------------------------------------------------------------------------------
def tree_snapshot(cache):
    cache.check_invariants()
    return (cache.evictable_size(), cache.protected_size(), len(cache._policy),
            allocator_snapshot(cache.token_allocator))


@pytest.mark.parametrize("page_size", [1, 4])
@SETTINGS
@given(data=st.data())
def test_the_radix_cache_refuses_hostile_arguments(page_size, data):
    alloc = TokenAllocator(64) if page_size == 1 else PagedTokenAllocator(64, page_size)
    cache = RadixCache(ReqToTokenPool(2, 16), alloc, page_size=page_size)
    cache.insert(list(range(2 * page_size)), alloc.alloc(2 * page_size))
    node = cache.match_prefix(list(range(2 * page_size))).last_node
    cache.inc_lock_ref(node)
    other = RadixCache(ReqToTokenPool(2, 16), TokenAllocator(16))
    other.insert([1, 2, 3, 4], other.token_allocator.alloc(4))
    foreign = other.match_prefix([1, 2, 3, 4]).last_node
    fresh = alloc.alloc(page_size)
    nodes = st.sampled_from([node, foreign, cache.root_node, None])
    values = st.sampled_from([fresh, torch.cat([fresh, fresh]), node.value, torch.tensor([0] * page_size)])
    for _ in range(6):
        call = data.draw(st.sampled_from([cache.match_prefix, cache.prefix_len, cache.insert, cache.inc_lock_ref,
                                          cache.dec_lock_ref, cache.evict]))
        args = [data.draw(st.one_of(NASTY, nodes, values)) for _ in range(arity(call))]
        attempt(call, args, lambda: tree_snapshot(cache), cache.check_invariants)


# ---- KV pools -------------------------------------------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def test_kv_pools_refuse_hostile_arguments(data):
    mha = MHAKVPool(8, 1, torch.float32, 2, 4, 2, kv_cache_dtype=data.draw(st.sampled_from(["auto", "int4"])))
    mla = MLAKVPool(8, 1, torch.float32, 4, 2, 2)
    good = st.sampled_from([torch.tensor([1, 2]), torch.randn(2, 2, 4), torch.randn(2, 1, 6), 0, 1])
    for _ in range(4):
        call = data.draw(st.sampled_from([mha.set_kv_buffer, mha.read_kv, mha.get_key_buffer, mha.get_paged_kv_buffer,
                                          mla.set_kv_buffer, mla.set_mla_kv_buffer, mla.read_kv]))
        args = [data.draw(st.one_of(NASTY, good)) for _ in range(arity(call))]
        def snapshot():
            return ([b.clone() for b in mha._all_buffers() + mla._all_buffers()])

        def same(a, b):
            return all(torch.equal(x, y) for x, y in zip(a, b))

        before = snapshot()
        try:
            call(*args)
        except PROMISED:
            assert same(snapshot(), before), f"{call.__name__} raised and changed the buffers"


# ---- kernels, metadata, attention, sizing: functions without state ------------------------------------------
@SETTINGS
@given(data=st.data())
def test_stateless_functions_refuse_hostile_arguments(data):
    table = torch.arange(32, dtype=torch.int32).reshape(2, 16)
    good = st.sampled_from([table, torch.tensor([0, 1]), torch.tensor([3, 5]), torch.tensor([0, 3, 8]), 4, 1])
    functions = [create_kv_indices, create_kv_indptr, kv_last_page_len, write_req_to_token, build_decode_metadata,
                 build_extend_metadata, reference_paged_attention, sizing.bytes_per_token, sizing.tokens_for_budget,
                 sizing.get_model_config]
    for _ in range(4):
        call = data.draw(st.sampled_from(functions))
        required = [p for p in inspect.signature(call).parameters.values()
                    if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
        args = [data.draw(st.one_of(NASTY, good)) for _ in required]
        table_before = table.clone()
        try:
            call(*args)
        except PROMISED as e:
            assert any(p.name in str(e) for p in inspect.signature(call).parameters.values()) \
                or "request" in str(e), (call.__name__, str(e))
            assert torch.equal(table, table_before)


# ---- the scheduler: valid and hostile operations in any order -----------------------------------------------
class HostileScheduler(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        pool, alloc = ReqToTokenPool(4, 48), PagedTokenAllocator(96, 4)
        self.sched = Scheduler(pool, alloc, RadixCache(pool, alloc, page_size=4),
                               SchedulerConfig(chunked_prefill_size=16))
        self.batch = None
        self.count = 0

    def snapshot(self):
        s = self.sched
        return ([r.rid for r in s.waiting], [r.rid for r in s.running], s.chunked_req and s.chunked_req.rid,
                s._batch is not None, allocator_snapshot(s.token_allocator), s.req_to_token_pool.available_size(),
                s.tree_cache.total_size())

    @rule(length=st.integers(1, 30), new=st.integers(1, 8), shared=st.booleans())
    def add_valid(self, length, new, shared):
        self.count += 1
        ids = list(range(100, 100 + length)) if shared else list(range(1000 * self.count, 1000 * self.count + length))
        self.sched.add_request(Req(self.count, ids, new))

    @rule(req=NASTY)
    def add_hostile(self, req):
        attempt(self.sched.add_request, [req], self.snapshot, self.sched.check_invariants)

    @rule(rid=st.integers(0, 3), ids=NASTY, new=NASTY, priority=NASTY)
    def build_hostile_request(self, rid, ids, new, priority):
        try:
            Req(rid, ids, new, priority=priority)
        except PROMISED as e:
            assert "request" in str(e) or "input_ids" in str(e), str(e)

    @precondition(lambda self: self.batch is None)
    @rule()
    def step(self):
        self.batch = self.sched.step()

    @precondition(lambda self: self.batch is not None)
    @rule(tokens=NASTY)
    def process_hostile(self, tokens):
        attempt(self.sched.process_batch_result, [self.batch, tokens], self.snapshot, self.sched.check_invariants)
        self.batch = self.sched._batch  # None when the hostile tokens happened to be right

    @precondition(lambda self: self.batch is not None)
    @rule()
    def process(self):
        self.sched.process_batch_result(self.batch, [7] * self.batch.batch_size())
        self.batch = None

    @rule(batch=NASTY)
    def process_a_stranger(self, batch):
        try:
            self.sched.process_batch_result(batch, [7])
        except (ValueError, RuntimeError):
            pass
        else:
            raise AssertionError("a batch that step() did not return was accepted")

    @invariant()
    def memory_adds_up(self):
        self.sched.check_invariants()


HostileScheduler.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None,
                                              suppress_health_check=list(HealthCheck))
test_the_scheduler_survives_hostile_operations_in_any_order = HostileScheduler.TestCase
