"""RadixCache's event_sink: every page that enters or leaves the tree is reported, so that an index rebuilt
from the events alone (through the wire encoding) always equals the tree's own pages."""

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvmem import PagedTokenAllocator, RadixCache, Req, ReqToTokenPool, Scheduler, SchedulerConfig, TokenAllocator
from kvmem.events import AllBlocksCleared, BlockRemoved, BlockStored, EventCollector, decode_batch, encode_batch
from kvmem.page_hash import DIGEST_BYTES, event_hashes, page_hashes
from kvmem.router import BlockIndex

CAPACITY = 48
keys = st.lists(st.integers(0, 2), max_size=12)


def tree_page_hashes(cache: RadixCache) -> set[int]:
    """The hash of every page in the tree, computed from the tokens of its path (not from the nodes)."""
    out, stack = set(), [(cache.root_node, [])]
    while stack:
        node, prefix = stack.pop()
        path = prefix + node.token_ids()
        if node is not cache.root_node:
            out.update(page_hashes(path, cache.page_size)[len(prefix) // cache.page_size:])
        stack.extend((child, path) for child in node.children.values())
    return out


def stored_hashes_on_nodes(cache: RadixCache) -> set[int]:
    out, stack = set(), list(cache.root_node.children.values())
    while stack:
        node = stack.pop()
        assert len(node.page_digests) == node.num_tokens // cache.page_size * DIGEST_BYTES
        out.update(event_hashes(node.page_digests))
        stack.extend(node.children.values())
    return out


def make_cache(page_size=1, capacity=CAPACITY, **kw):
    alloc = TokenAllocator(capacity) if page_size == 1 else PagedTokenAllocator(capacity, page_size)
    sink = EventCollector()
    return RadixCache(ReqToTokenPool(4, 64), alloc, page_size=page_size, event_sink=sink, **kw), alloc, sink


class EventedCacheMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2, 4]), policy=st.sampled_from(["lru", "lfu", "fifo"]))
    def setup(self, page_size, policy):
        self.ps = page_size
        self.cache, self.alloc, self.sink = make_cache(page_size, eviction_policy=policy)
        self.index = BlockIndex(1)
        self.locked = []
        self.steps = 0

    @rule(key=keys)
    def insert(self, key):
        key = key[:len(key) // self.ps * self.ps]
        if not key:
            return
        short = len(key) - self.alloc.available_size()
        if short > 0 and self.cache.evict(short) < short:
            return
        slots = self.alloc.alloc(len(key))
        n = self.cache.insert(key, slots)
        if n:
            self.alloc.free(slots[:n])

    @rule(key=keys)
    def match_splits_without_events(self, key):
        before = len(self.sink)
        self.cache.match_prefix(key)
        assert len(self.sink) == before

    @rule(key=keys)
    def lock(self, key):
        node = self.cache.match_prefix(key).last_node
        self.cache.inc_lock_ref(node)
        self.locked.append(node)

    @precondition(lambda self: self.locked)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        self.cache.dec_lock_ref(self.locked.pop(i % len(self.locked)))

    @rule(n=st.integers(0, 20))
    def evict(self, n):
        self.cache.evict(n)

    @precondition(lambda self: not self.locked)
    @rule()
    def reset(self):
        self.cache.reset()

    @rule(wire_format=st.sampled_from(["map", "array"]))
    def end_step(self, wire_format):
        batch = self.sink.take_batch()
        if batch is not None:
            self.index.apply(0, decode_batch(encode_batch(batch, wire_format)))
        self.steps += 1

    @invariant()
    def index_equals_tree_after_each_step(self):
        batch = self.sink.take_batch()
        if batch is not None:
            self.index.apply(0, batch)
        expected = tree_page_hashes(self.cache)
        assert self.index.blocks(0) == expected
        assert stored_hashes_on_nodes(self.cache) == expected
        self.cache.check_invariants()


TestEventedCache = EventedCacheMachine.TestCase
TestEventedCache.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


def test_insert_reports_the_new_pages_with_their_parent_and_tokens():
    cache, alloc, sink = make_cache(page_size=2)
    cache.insert([1, 2, 3, 4], alloc.alloc(4))
    cache.insert([1, 2, 3, 4, 5, 6], alloc.alloc(6)[:6])
    first, second = sink.take_batch().events
    h = page_hashes([1, 2, 3, 4, 5, 6], 2)
    assert first == BlockStored(h[:2], None, [1, 2, 3, 4], 2)
    assert second == BlockStored(h[2:], h[1], [5, 6], 2)


def test_a_fully_cached_insert_reports_nothing():
    cache, alloc, sink = make_cache()
    cache.insert([1, 2], alloc.alloc(2))
    sink.take_batch()
    slots = alloc.alloc(2)
    assert cache.insert([1, 2], slots) == 2
    assert sink.take_batch() is None


def test_each_evict_call_reports_one_removal_of_every_page_it_freed():
    cache, alloc, sink = make_cache()
    cache.insert([1, 2, 3], alloc.alloc(3))
    cache.insert([1, 2, 9], alloc.alloc(3))
    sink.take_batch()
    assert cache.evict(100) == 4
    (removed,) = sink.take_batch().events
    assert isinstance(removed, BlockRemoved) and removed.medium == "GPU"
    assert sorted(removed.block_hashes) == sorted(page_hashes([1, 2, 3], 1) + page_hashes([1, 2, 9], 1)[2:])
    assert cache.evict(5) == 0 and sink.take_batch() is None


def test_reset_reports_all_blocks_cleared():
    cache, alloc, sink = make_cache()
    cache.insert([4, 5], alloc.alloc(2))
    cache.reset()
    assert sink.take_batch().events[-1] == AllBlocksCleared()


def test_a_cache_without_a_sink_keeps_no_page_digests():
    alloc = TokenAllocator(16)
    cache = RadixCache(ReqToTokenPool(2, 8), alloc)
    cache.insert([1, 2, 3], alloc.alloc(3))
    cache.match_prefix([1, 2])
    assert all(n.page_digests is None for n in cache.root_node.children.values())


def test_a_sink_that_is_not_callable_is_refused():
    alloc = TokenAllocator(16)
    with pytest.raises(TypeError, match="event_sink"):
        RadixCache(ReqToTokenPool(2, 8), alloc, event_sink="stdout")


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_scheduler_loop_batches_its_caches_events_per_step(page_size):
    alloc = TokenAllocator(96) if page_size == 1 else PagedTokenAllocator(96, page_size)
    sink = EventCollector()
    pool = ReqToTokenPool(4, 64)
    cache = RadixCache(pool, alloc, page_size=page_size, event_sink=sink)
    sched = Scheduler(pool, alloc, cache, SchedulerConfig(max_running_requests=2))
    index = BlockIndex(1)
    system = list(range(100, 124))
    for i in range(8):
        sched.add_request(Req(i, system + [200 + i] * (3 + i), max_new_tokens=4))
    batches = 0
    while not sched.is_idle():
        batch = sched.step()
        if batch is not None:
            sched.process_batch_result(batch, torch.full((batch.batch_size(),), 7))
        events = sink.take_batch()
        if events is not None:
            batches += 1
            index.apply(0, decode_batch(encode_batch(events)))
        assert index.blocks(0) == tree_page_hashes(cache)
    assert batches > 1 and index.num_blocks(0) > 0


def test_pages_of_a_namespace_are_named_in_that_namespace():
    cache, alloc, sink = make_cache(page_size=2)
    cache.insert([1, 2, 3, 4], alloc.alloc(4), namespace="tenant-a")
    (stored,) = sink.take_batch().events
    assert stored.block_hashes == tuple(page_hashes([1, 2, 3, 4], 2, namespace="tenant-a"))
    assert set(stored.block_hashes).isdisjoint(page_hashes([1, 2, 3, 4], 2))


def test_stored_pages_carry_their_token_ids_negative_ones_included():
    cache, alloc, sink = make_cache(page_size=2)
    cache.insert([-1, 2, -(2**63), 4], alloc.alloc(4))
    (stored,) = sink.take_batch().events
    assert stored.token_ids == (-1, 2, -(2**63), 4)


def test_a_child_names_the_last_page_of_a_long_parent_as_its_parent():
    cache, alloc, sink = make_cache(page_size=2)
    cache.insert([1, 2, 3, 4, 5, 6], alloc.alloc(6))
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], alloc.alloc(8))
    _, child = sink.take_batch().events
    assert child.parent_block_hash == page_hashes([1, 2, 3, 4, 5, 6], 2)[-1]


def test_a_host_tier_reports_its_copies_and_host_evictions_on_the_cpu_medium():
    from kvmem import HiRadixCache
    from kvmem.tiers import HostSlotPool

    sink = EventCollector()
    alloc = TokenAllocator(8)
    cache = HiRadixCache(ReqToTokenPool(2, 16), alloc, HostSlotPool(16), event_sink=sink)
    cache.insert([1, 2, 3, 4], alloc.alloc(4))
    gpu, cpu = sink.take_batch().events
    assert (gpu.medium, cpu.medium) == ("GPU", "CPU_PINNED") and gpu.block_hashes == cpu.block_hashes
    cache.evict(4)  # device copy gone, host copy stays
    cache.evict_host(4)
    removed = [e for e in sink.take_batch().events if isinstance(e, BlockRemoved)]
    assert [e.medium for e in removed] == ["GPU", "CPU_PINNED"]
