"""A simulated store: a storage tier's keys, capacity and eviction, with no payload bytes and no I/O.

What a capacity planner replaying a trace needs from a storage tier is which pages it holds when they are asked
for, not their bytes. `SimStore` keeps the names of the pages written to it, each page counting its page size in
tokens against `capacity_tokens`, evicts them least recently used first with chains kept whole, exactly as a
capped `FileStore` does (`kvmem.storage.lru`), and answers the storage protocol from memory. What its reads would
cost (bandwidth and latency) is the replay clock's to charge (`kvmem.replay.cost`), as for any store.

It holds no KV, so it serves only a host pool that holds none (`kvmem.tiers.HostSlotPool`, the replay's host
tier): any other is refused, and no page is ever loaded from it. Pages are named by the first 64 bits of their
digest (as the KV events name them): two of n pages share a name with probability about n**2 / 2**65 (3e-8 for a
million), which at worst makes one simulated page look present.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvmem._checks import check_int
from kvmem.storage.base import StorageStats, check_keys, check_slots
from kvmem.storage.lru import PageLRU


class SimStore:
    """Page names in memory, at most `capacity_tokens` tokens of pages (None: unbounded); the storage protocol
    (`kvmem.storage.base`) over them. Shared by threads (a cluster's replicas): every call takes its lock.

    >>> from kvmem.page_hash import page_digests, storage_key
    >>> from kvmem.tiers import HostSlotPool
    >>> pool = HostSlotPool(64, 4)
    >>> keys = [storage_key(d) for d in page_digests(range(16), 4)]
    >>> store = SimStore(capacity_tokens=12)
    >>> store.batch_set(keys, pool, pool.allocator.alloc(16))   # 3 pages fit: the leading ones
    3
    >>> store.batch_exists(keys), store.used_tokens(), store.stats.failed_ops
    (3, 12, 1)
    """

    keeps_payloads = False  # what kvmem.tiers checks before it puts a host pool of KV bytes over a store

    def __init__(self, capacity_tokens: int | None = None) -> None:
        if capacity_tokens is not None:
            capacity_tokens = check_int("capacity_tokens", capacity_tokens, minimum=1)
        self.capacity_tokens = capacity_tokens
        self.stats = StorageStats()
        self._pages = PageLRU(int)  # name -> tokens
        self._lock = threading.Lock()

    def used_tokens(self) -> int:
        """Tokens of the pages it holds."""
        return self._pages.used

    def batch_exists(self, keys: Sequence[str]) -> int:
        names = _names(check_keys(keys))
        with self._lock:
            return self._leading(names)

    def batch_get(self, keys: Sequence[str], host_pool, host_slots) -> int:
        keys = check_keys(keys)
        slots = _check_pool(keys, host_pool, host_slots)
        names = _names(keys)
        with self._lock:
            got = self._leading(names)
            self._pages.use(names[:got])
        host_pool.write_pages(slots[:got * host_pool.page_size], [b""] * got)  # no bytes: it checks the slots
        self.stats.hits += got
        return got

    def batch_set(self, keys: Sequence[str], host_pool, host_slots) -> int:
        keys = check_keys(keys)
        _check_pool(keys, host_pool, host_slots)
        tokens, pages = host_pool.page_size, self._pages
        chain: dict[int, None] = {}
        with self._lock:
            for name in _names(keys):
                if name not in pages:
                    _, fits = pages.make_room(tokens, self.capacity_tokens, chain)
                    if not fits:
                        self.stats.failed_ops += 1  # no room left but the chain's own pages
                        break
                    pages.add(name, tokens)
                chain[name] = None
            pages.use(chain)
        self.stats.stored += len(chain)
        return len(chain)

    def _leading(self, names: list[int]) -> int:
        for i, name in enumerate(names):
            if name not in self._pages:
                return i
        return len(names)

    def close(self) -> None:
        """Nothing to release."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _names(keys: list[str]) -> list[int]:
    return [int(key[:16], 16) for key in keys]


def _check_pool(keys: list[str], host_pool, host_slots):
    slots = check_slots(keys, host_pool, host_slots)
    if host_pool.page_payload_bytes():
        raise ValueError(f"host_pool holds KV bytes ({host_pool.page_payload_bytes()} a page), which a simulated "
                         f"store has none of: use it under a HostSlotPool (a replay's host tier)")
    return slots
