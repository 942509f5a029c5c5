"""The link between a tiered cache and its store, at what happens rarely: reads that end after admission took their
prefetch, one after another, and stores that fail without keeping any statistics."""

from kvmem.storage import FileStore, StorageStats
from tests.test_storage import PROMPT, ChunkGatedStore, cache_over, store_prompt


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
