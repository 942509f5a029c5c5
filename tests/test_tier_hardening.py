"""Hostile input to the tiers: every bad argument is refused where it enters, before anything changes, and the
rarely reached branches (a device too short for a load, a store that miscounts, a write queued behind a slow
store) keep the bookkeeping and the KV right."""

import gc
import threading

import numpy as np
import pytest
import torch

from kvmem import (
    HiRadixCache,
    HostKVPool,
    MHAKVPool,
    PagedTokenAllocator,
    RadixCache,
    Req,
    ReqToTokenPool,
    TokenAllocator,
)
from kvmem.storage import FileStore, PageStore
from kvmem.tiers import HostSlotPool
from tests.test_hiradix_cache import World, tokens
from tests.test_storage import PROMPT, cache_over, put, store_prompt

LONE_SURROGATE = "tenant-\ud800"


def tree_state(cache):
    return (cache.total_size(), cache.evictable_size(), cache.protected_size(), len(cache._roots),
            cache.token_allocator.available_size())


# ---- namespaces that cannot name a page ---------------------------------------------------------------------
def test_a_request_refuses_a_namespace_that_utf8_cannot_encode():
    with pytest.raises(ValueError, match="namespace .* cannot be encoded as UTF-8"):
        Req("a", [1, 2, 3], 1, namespace=LONE_SURROGATE)


@pytest.mark.parametrize("named_pages", [False, True])
def test_the_tree_refuses_a_namespace_that_utf8_cannot_encode_before_changing(named_pages):
    alloc = TokenAllocator(32)
    cache = RadixCache(ReqToTokenPool(2, 16), alloc, event_sink=(lambda event: None) if named_pages else None)
    cache.insert([1, 2, 3], alloc.alloc(3))
    before = tree_state(cache)
    slots = alloc.alloc(3)
    for call in (lambda: cache.insert([4, 5, 6], slots, namespace=LONE_SURROGATE),
                 lambda: cache.match_prefix([1, 2, 3], namespace=LONE_SURROGATE),
                 lambda: cache.pin([1, 2, 3], namespace=LONE_SURROGATE),
                 lambda: cache.prefix_len([1, 2, 3], namespace=LONE_SURROGATE)):
        with pytest.raises(ValueError, match="cannot be encoded"):
            call()
    assert tree_state(cache)[:4] == before[:4]
    cache.check_invariants()
    assert cache.insert([4, 5, 6], slots, namespace="tenant-b") == 0  # a good namespace still works


# ---- construction of a hierarchical cache ---------------------------------------------------------------------
def slot_world(host=256):
    alloc = TokenAllocator(64)
    return ReqToTokenPool(2, 64), alloc, HostSlotPool(host)


@pytest.mark.parametrize("tp_group", [object(), "world", 0])
def test_a_tp_group_that_is_not_a_process_group_is_refused(tp_group):
    rows, alloc, host = slot_world()
    with pytest.raises(TypeError, match="tp_group must be a torch.distributed ProcessGroup"):
        HiRadixCache(rows, alloc, host, tp_group=tp_group)
    HiRadixCache(rows, alloc, host)  # the refusal left the host pool free for a cache


def test_two_caches_cannot_share_one_host_pool():
    rows, alloc, host = slot_world()
    first = HiRadixCache(rows, alloc, host)
    with pytest.raises(ValueError, match="already backs another HiRadixCache"):
        HiRadixCache(rows, TokenAllocator(64), host)
    assert first.host_pool is host
    del first
    gc.collect()  # the tree's nodes and policies refer back to it
    HiRadixCache(rows, alloc, host)  # once the first cache is gone, the pool may back another


@pytest.mark.parametrize("options, message", [({"prefetch_policy": "eager"}, "prefetch_policy"),
                                              ({"prefetch_timeout_s": -1.0}, "prefetch_timeout_s"),
                                              ({"prefetch_timeout_s": "1"}, "prefetch_timeout_s"),
                                              ({"prefetch_timeout_s": float("nan")}, "prefetch_timeout_s")])
def test_bad_prefetch_options_are_refused_even_without_a_store(options, message):
    rows, alloc, host = slot_world()
    with pytest.raises(ValueError, match=message):
        HiRadixCache(rows, alloc, host, **options)


# ---- the host pool ------------------------------------------------------------------------------------------
def test_a_host_pool_refuses_a_model_id_that_utf8_cannot_encode():
    device = MHAKVPool(16, 1, torch.float32, 1, 2, 1)
    with pytest.raises(ValueError, match="model_id .* cannot be encoded"):
        HostKVPool(device, model_id="llama\udfff")


def test_a_copy_listing_a_slot_twice_is_refused_and_copies_nothing():
    device = MHAKVPool(16, 1, torch.float32, 1, 2, 1)
    host = HostKVPool(device, ratio=2.0)
    slots = host.allocator.alloc(3)
    device.set_kv_buffer(0, torch.tensor([1, 2, 3]), torch.ones(3, 1, 2), torch.ones(3, 1, 2))
    twice = torch.tensor([slots[0], slots[0], slots[1]])
    with pytest.raises(ValueError, match="host_slots lists a slot more than once"):
        host.backup(twice, torch.tensor([1, 2, 3]))
    assert host.host_rows(slots, 0)[0].abs().sum() == 0
    with pytest.raises(ValueError, match="device_slots lists a slot more than once"):
        host.load(torch.tensor([4, 4, 5]), slots)


# ---- rarely reached branches ----------------------------------------------------------------------------------
def test_a_load_back_the_device_cannot_hold_returns_none_and_keeps_no_lock():
    w = World(device=16, host=64, page_size=1)
    prompt = tokens((100, 12))
    w.put(prompt)
    w.cache.writing_check()
    w.cache.evict(12)  # backed up: the prompt stays as host-only
    held = w.put(tokens((200, 16)))  # the device is full again ...
    assert held == 0
    m = w.cache.match_prefix(tokens((200, 16)))
    w.cache.inc_lock_ref(m.last_node)  # ... and locked, so nothing can make room
    hit = w.cache.match_prefix(prompt + [1])
    assert hit.host_hit_length == 12
    protected = w.cache.protected_size()
    assert w.cache.load_back(hit.last_host_node, hit.host_hit_length) is None
    assert hit.last_host_node.lock_ref == 0
    assert w.cache.protected_size() == protected
    w.cache.check_invariants()
    w.cache.dec_lock_ref(m.last_node)
    assert w.cache.load_back(hit.last_host_node, hit.host_hit_length) is not None  # and it can load later


class OverReportingStore(PageStore):
    """A store that reads what it has, then says it read more (or a negative count)."""

    def __init__(self, inner, answer):
        super().__init__()
        self.inner, self.answer = inner, answer

    def batch_exists(self, keys):
        return self.inner.batch_exists(keys)

    def batch_get(self, keys, host_pool, host_slots):
        self.inner.batch_get(keys, host_pool, host_slots)
        return self.answer(len(keys))

    def batch_set(self, keys, host_pool, host_slots):
        return self.inner.batch_set(keys, host_pool, host_slots)


@pytest.mark.parametrize("answer", [lambda n: n + 3, lambda n: -1, lambda n: 10**9])
def test_a_store_that_miscounts_its_reads_is_a_counted_miss(tmp_path, answer):
    store_prompt(tmp_path)
    store = OverReportingStore(FileStore(tmp_path), answer)
    cache, _, _ = cache_over(store)
    free = cache.host_allocator.available_size()
    assert cache.finish_prefetch(cache.prefetch(PROMPT + [1])) == 0
    assert store.stats.failed_ops == 1
    assert cache.host_total_size() == 0 and cache.host_allocator.available_size() == free
    cache.check_invariants()


class BlockedWriteStore(PageStore):
    """A store whose writes wait for a gate (a slow store, on demand), storing into `inner`."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.gate, self.writing = inner, threading.Event(), threading.Event()

    def batch_exists(self, keys):
        return self.inner.batch_exists(keys)

    def batch_get(self, keys, host_pool, host_slots):
        return self.inner.batch_get(keys, host_pool, host_slots)

    def batch_set(self, keys, host_pool, host_slots):
        self.writing.set()
        self.gate.wait(timeout=10)
        return self.inner.batch_set(keys, host_pool, host_slots)


def test_a_storage_write_stores_the_pages_as_they_were_when_queued(tmp_path):
    store = BlockedWriteStore(FileStore(tmp_path))
    cache, device, alloc = cache_over(store, policy="best_effort")
    put(cache, device, alloc, PROMPT)
    assert store.writing.wait(timeout=10)
    host = cache.host_pool
    # The host tier reuses the prompt's host slots while the store is still slow: the write must not see it.
    slots = np.concatenate([n.host_value for n in cache._all_nodes()])
    rows = torch.full((len(slots), 1, 1), -7.0)
    for layer in range(host.layer_num):
        for part in range(2):
            host._write_host(part, layer, torch.from_numpy(slots), rows)
    store.gate.set()
    cache.close()
    second, device2, _ = cache_over(FileStore(tmp_path))
    assert second.finish_prefetch(second.prefetch(PROMPT + [1])) == len(PROMPT)
    m = second.match_prefix(PROMPT + [1])
    indices = second.load_back(m.last_host_node, m.host_hit_length)
    assert device2.read_kv(0, indices)[0].flatten().long().tolist() == PROMPT


def test_a_paged_host_pool_refuses_a_cache_of_another_page_size():
    rows = ReqToTokenPool(2, 64)
    with pytest.raises(ValueError, match="page size"):
        HiRadixCache(rows, PagedTokenAllocator(64, 4), HostSlotPool(256, 8), page_size=4)
