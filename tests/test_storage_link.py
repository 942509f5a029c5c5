"""The link between a tiered cache and its store, at what happens rarely: reads that end after admission took their
prefetch, one after another, and stores that fail without keeping any statistics."""

import pytest

from kvmem import HiRadixCache, ReqToTokenPool, TokenAllocator
from kvmem.storage import FileStore, SimStore, StorageStats
from kvmem.tiers import HostSlotPool
from tests.test_storage import PROMPT, PS, ChunkGatedStore, cache_over, put, store_prompt


def test_every_read_that_ends_after_admission_adds_its_pages_to_the_dropped_count(tmp_path):
    store_prompt(tmp_path)
    store = ChunkGatedStore(FileStore(tmp_path), open_reads=0)  # every read waits at the gate
    cache, _, _ = cache_over(store, "best_effort")
    free = cache.host_allocator.available_size()
    for late in (1, 2):                                          # the same prompt, late twice
        store.gate.clear()
        store.waiting.clear()
        prefetch = cache.prefetch(PROMPT + [1])
        assert store.waiting.wait(timeout=10)                    # the read has started: it cannot be cancelled
        assert cache.finish_prefetch(prefetch) == 0              # admission went on without it
        store.gate.set()
        assert prefetch.wait(timeout=10)
        cache.writing_check()                                    # the read ended: its slots are released
        assert cache.storage_link.stats.dropped_prefetch_tokens == late * len(PROMPT)
        assert cache.host_allocator.available_size() == free
    cache.check_invariants()


class StatlessStore:
    """A store that keeps no statistics, and whose lookups fail."""

    calls = 0

    def batch_exists(self, keys):
        self.calls += 1
        raise OSError("store down")

    def batch_get(self, keys, host_pool, host_slots):
        raise OSError("store down")

    def batch_set(self, keys, host_pool, host_slots):
        raise OSError("store down")


class CountingStore(StatlessStore):
    def __init__(self):
        self.stats = StorageStats()


def test_a_failing_store_is_a_miss_each_time_counted_where_it_keeps_stats(tmp_path):
    for store in (StatlessStore(), CountingStore()):
        cache, _, _ = cache_over(store, "best_effort")
        assert cache.prefetch(PROMPT + [1]) is None and cache.prefetch(PROMPT + [2]) is None
        assert store.calls == 2
        if isinstance(store, CountingStore):
            assert store.stats.failed_ops == 2
        cache.check_invariants()
        cache.close()


class OverReportingStore:
    """A file store that reports one page more than it read when asked for fewer than three."""

    def __init__(self, inner):
        self.inner, self.stats = inner, inner.stats

    def batch_exists(self, keys):
        return self.inner.batch_exists(keys)

    def batch_get(self, keys, host_pool, host_slots):
        got = self.inner.batch_get(keys, host_pool, host_slots)
        return got + 1 if len(keys) < 3 else got

    def batch_set(self, keys, host_pool, host_slots):
        return self.inner.batch_set(keys, host_pool, host_slots)


def test_a_store_that_over_reports_its_last_short_chunk_fails_that_chunk_alone(tmp_path):
    store_prompt(tmp_path)
    store = OverReportingStore(FileStore(tmp_path))
    cache, _, _ = cache_over(store)
    cache.storage_link.read_chunk_pages = 3  # PROMPT's 8 pages: chunks of 3, 3 and 2
    prefetch = cache.prefetch(PROMPT + [1])
    assert cache.finish_prefetch(prefetch) == 6 * PS and store.stats.failed_ops == 1
    cache.check_invariants()
    cache.close()


def test_the_link_counts_the_tokens_of_every_write(tmp_path):
    cache, device, alloc = cache_over(FileStore(tmp_path))
    put(cache, device, alloc, PROMPT)
    put(cache, device, alloc, list(range(500, 500 + 4 * PS)))
    cache.storage_link.drain_writes()
    assert cache.storage_link.stats.stored_tokens == len(PROMPT) + 4 * PS
    cache.close()


def test_a_cache_names_the_kind_of_a_store_that_is_not_one():
    with pytest.raises(TypeError, match="^storage must implement batch_exists, batch_get and batch_set "
                                        r"\(kvmem.storage\), got object$"):
        cache_over(object())


def test_a_link_keeps_writing_after_a_thousand_writes_and_counts_them_all():
    # Past 1,024 writes the link forgets the finished ones; every later write is still queued and counted.
    alloc = TokenAllocator(4096)
    cache = HiRadixCache(ReqToTokenPool(2, 64), alloc, HostSlotPool(8192), storage=SimStore())
    for i in range(1100):
        cache.insert([i, 100_000 + i], alloc.alloc(2))
        cache.writing_check()
        cache.evict(4)
    cache.storage_link.drain_writes()
    assert cache.storage_link.stats.stored_tokens == 2200
    cache.check_invariants()
    cache.close()
