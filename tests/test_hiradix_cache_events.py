"""HiRadixCache's event_sink: an index rebuilt from the events alone (through the wire encoding) always holds
exactly the pages on device under "GPU" and the pages whose host copy has completed under "CPU_PINNED", through
backups (synchronous, delayed, failed), loads, device and host eviction, storage prefetches and resets; a shared
storage tier's pages are reported by no replica."""

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvmem import HiRadixCache, PagedTokenAllocator, ReqToTokenPool, TokenAllocator
from kvmem.events import MEDIUM_CPU_PINNED, MEDIUM_GPU, BlockStored, EventCollector, decode_batch, encode_batch
from kvmem.page_hash import page_hashes
from kvmem.router import BlockIndex
from kvmem.storage import FileStore
from kvmem.tiers import HostSlotPool, Transfer


class FlakyHost(HostSlotPool):
    """Host slots whose next `fail` copies fail and whose backups complete after `delay` polls."""

    fail = 0
    delay = 0

    def backup(self, host_slots, device_slots):
        if self.fail:
            self.fail -= 1
            return Transfer(error=RuntimeError("injected copy fault"))
        return Transfer(event=PolledCopy(self.delay))

    def load(self, device_slots, host_slots, layer_id=None):
        if self.fail:
            self.fail -= 1
            return Transfer(error=RuntimeError("injected copy fault"))
        return Transfer()


class PolledCopy:
    """Stands in for a copy's CUDA event: done after `polls` queries, or once synchronized."""

    def __init__(self, polls):
        self.polls = polls

    def query(self):
        self.polls -= 1
        return self.polls < 0

    def synchronize(self):
        self.polls = -1


def make_cache(page_size=1, device=24, host=60, storage=None, **kw):
    alloc = TokenAllocator(device) if page_size == 1 else PagedTokenAllocator(device, page_size)
    sink = EventCollector()
    host_pool = FlakyHost(host, page_size)
    cache = HiRadixCache(ReqToTokenPool(2, 64), alloc, host_pool, page_size=page_size, event_sink=sink,
                         storage=storage, prefetch_policy="wait_complete", **kw)
    return cache, alloc, host_pool, sink


def put(cache, alloc, tokens):
    """Inserts `tokens` as a finishing request does; None when locked prefixes leave no room."""
    short = len(tokens) - alloc.available_size()
    if short > 0:
        cache.evict(short)
    slots = alloc.alloc(len(tokens))
    if slots is None:
        return None
    cached = cache.insert(tokens, slots)
    if cached:
        alloc.free(slots[:cached])
    return cached


def tier_page_hashes(cache) -> tuple[set[int], set[int]]:
    """(pages on device, pages with a completed host copy), hashed from the tokens of each node's path."""
    device, host = set(), set()
    for node in cache._all_nodes():
        path, walker = [], node
        while walker.parent is not None:
            path = walker.token_ids() + path
            walker = walker.parent
        hashes = page_hashes(path, cache.page_size)[(len(path) - node.num_tokens) // cache.page_size:]
        if len(node.value):
            device.update(hashes)
        if node.host_value is not None and node.backup is None:
            host.update(hashes)
    return device, host


class EventedTieredCache(RuleBasedStateMachine):
    locks = Bundle("locks")

    def __init__(self):
        super().__init__()
        self.cache = None
        self.index = BlockIndex(1)

    @rule(page_size=st.sampled_from([1, 2]), policy=st.sampled_from(["write_through", "write_through_selective",
                                                                       "write_back"]))
    def start(self, page_size, policy):
        if self.cache is None:
            self.cache, self.alloc, self.host, self.sink = make_cache(page_size, write_policy=policy)

    def key(self, parts):
        ps = self.cache.page_size
        return [t for p in parts for t in range(100 * p, 100 * p + 2 * ps)]

    @rule(parts=st.lists(st.integers(1, 4), min_size=1, max_size=4))
    def insert(self, parts):
        if self.cache is not None:
            put(self.cache, self.alloc, self.key(parts))

    @rule(target=locks, parts=st.lists(st.integers(1, 4), min_size=1, max_size=4), load=st.booleans())
    def match(self, parts, load):
        if self.cache is None:
            return None
        m = self.cache.match_prefix(self.key(parts))
        node = m.last_node
        if load and m.host_hit_length and self.cache.load_back(m.last_host_node, m.host_hit_length) is not None:
            node = m.last_host_node
        self.cache.inc_lock_ref(node)
        return node

    @rule(node=consumes(locks))
    def unlock(self, node):
        if node is not None:
            self.cache.dec_lock_ref(node)

    @rule(n=st.integers(0, 30))
    def evict(self, n):
        if self.cache is not None:
            self.cache.evict(n)

    @rule(n=st.integers(0, 30))
    def evict_host(self, n):
        if self.cache is not None:
            self.cache.evict_host(n)

    @rule(fail=st.integers(0, 2), delay=st.integers(0, 2))
    def flaky_copies(self, fail, delay):
        if self.cache is not None:
            self.host.fail, self.host.delay = fail, delay

    @rule()
    def writing_check(self):
        if self.cache is not None:
            self.cache.writing_check()

    @rule(wire_format=st.sampled_from(["map", "array"]))
    def end_step(self, wire_format):
        if self.cache is not None:
            batch = self.sink.take_batch()
            if batch is not None:
                self.index.apply(0, decode_batch(encode_batch(batch, wire_format)))

    @invariant()
    def index_holds_each_tiers_pages(self):
        if self.cache is None:
            return
        batch = self.sink.take_batch()
        if batch is not None:
            self.index.apply(0, batch)
        device, host = tier_page_hashes(self.cache)
        assert self.index.blocks(0, MEDIUM_GPU) == device
        assert self.index.blocks(0, MEDIUM_CPU_PINNED) == host
        self.cache.check_invariants()


EventedTieredCache.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                                suppress_health_check=list(HealthCheck))
test_an_index_fed_by_a_tiered_caches_events_holds_each_tiers_pages = EventedTieredCache.TestCase


def test_a_backup_is_reported_on_the_host_only_once_its_copy_completes():
    cache, alloc, host, sink = make_cache()
    host.delay = 1
    put(cache, alloc, [1, 2, 3, 4])
    assert [e.medium for e in sink.take_batch().events] == [MEDIUM_GPU]
    cache.writing_check()
    cache.writing_check()
    (event,) = sink.take_batch().events
    assert type(event) is BlockStored and event.medium == MEDIUM_CPU_PINNED
    assert list(event.block_hashes) == page_hashes([1, 2, 3, 4], 1)


def test_a_split_during_a_backup_reports_the_parents_host_pages_before_its_childs():
    cache, alloc, host, sink = make_cache()
    host.delay = 5
    put(cache, alloc, [1, 2, 3, 4])
    sink.take_batch()
    cache.match_prefix([1, 2, 9])            # splits the node whose backup is in flight
    while cache.writing_check() == 0:
        pass
    hashes = page_hashes([1, 2, 3, 4], 1)
    # A consumer that indexes each medium in order (Dynamo's radix tree) drops a block whose parent it lacks.
    assert [(list(e.block_hashes), e.parent_block_hash) for e in sink.take_batch().events] == \
        [(hashes[:2], None), (hashes[2:], hashes[1])]


def test_reset_reports_all_blocks_cleared_for_both_tiers():
    cache, alloc, _, sink = make_cache()
    put(cache, alloc, [1, 2, 3, 4])
    index = BlockIndex(1)
    index.apply(0, sink.take_batch())
    assert index.num_blocks(0, MEDIUM_CPU_PINNED) == 4
    cache.reset()
    index.apply(0, sink.take_batch())
    assert index.num_blocks(0) == index.num_blocks(0, MEDIUM_CPU_PINNED) == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_shared_storage_tiers_pages_are_reported_by_no_replica(tmp_path, page_size):
    """What one replica stores is readable by all: reporting it as the writer's would send the writer every
    request on that prefix. A replica reports what it holds itself: pages it reads from the store show up as
    "CPU_PINNED" once they are in its host tier, never as "DISK"."""
    tokens = list(range(100, 100 + 8 * page_size))
    first, alloc, _, sink = make_cache(page_size, device=64, host=128, storage=FileStore(tmp_path))
    put(first, alloc, tokens)
    first.close()  # its writes are in the store
    assert {e.medium for e in sink.take_batch().events} == {MEDIUM_GPU, MEDIUM_CPU_PINNED}
    second, _, _, sink2 = make_cache(page_size, device=64, host=128, storage=FileStore(tmp_path))
    assert second.finish_prefetch(second.prefetch(tokens + [1])) == len(tokens)
    events = sink2.take_batch().events
    assert [e.medium for e in events] == [MEDIUM_CPU_PINNED]
    assert set(events[0].block_hashes) == set(page_hashes(tokens, page_size))
    second.close()
    np.testing.assert_equal(sorted(tier_page_hashes(second)[1]), sorted(page_hashes(tokens, page_size)))
