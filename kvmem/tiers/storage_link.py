"""The hierarchical cache's link to a storage tier: writes behind host backups, prefetches ahead of admission.

Store calls run on one background thread, in the order they were issued, so a request's admission never waits
for a slow store unless its prefetch policy says so. Two rules keep them safe and repeatable:

- A write copies its pages' bytes out of the host pool before it is queued (`_PageSnapshot`), so the host tier
  may evict or reuse those slots at once.
- A lookup (`lookup`) finds what the cache stored itself ("read your writes"): under "wait_complete" it first
  waits for the writes queued before it, so that a replay gives the same result on every run; under the other
  policies, whose admission must not wait for the store, it counts the pages of queued writes as present (their
  read runs after them) and never waits, not even for a slow read queued before those writes.

A store is not trusted to count: an answer that is not a count of the pages asked about (negative, too large, not
an int, or an exception) is the store failing, a miss counted in its `stats.failed_ops`.

Prefetch policies (when admission takes a prefetch's pages): "best_effort" takes what has arrived, "wait_complete"
waits for the whole read, "timeout" waits at most `prefetch_timeout_s` for it. A read is issued in chunks of
`read_chunk_pages` pages (one `batch_get` each, in order), so a prefetch taken while its read is still running gives
the leading chunks that have landed whole, as SGLang's HiCache keeps the pages a terminated prefetch has fetched.
The chunks not yet started are cancelled; the one being read keeps its host slots until its read ends (`reap`),
and they are then released.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from kvmem._checks import check_int, check_number
from kvmem.page_hash import DIGEST_BYTES

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


@dataclass
class Prefetch:
    """Pages read from storage into host slots for a request, to be attached to the tree at its admission.

    namespace / key: where they go (`key`: the token bytes up to the end of the last page read); start: the
    tokens the tree held when the prefetch began; digests: the pages' digests; host_slots: where they are read
    into (held by the prefetch, not the tree, until attached); pages: how many the store said it had; chunk_pages
    and futures: the reads, one per chunk of pages, in order (each returns how many of its pages it loaded)."""

    namespace: str | None
    key: bytes
    start: int
    digests: bytes
    host_slots: np.ndarray
    pages: int
    chunk_pages: int
    futures: list[concurrent.futures.Future] = field(repr=False)

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until every chunk's read has ended, at most `timeout` seconds; True when they all have."""
        return not concurrent.futures.wait(self.futures, timeout).not_done


@dataclass
class StorageTierStats:
    """What the link moved, in tokens."""

    prefetched_tokens: int = 0      # read from storage and attached to the tree as host-only pages
    stored_tokens: int = 0          # written to storage
    dropped_prefetch_tokens: int = 0  # read, but no longer attachable (their prefix left the tree) or too late


class _PageSnapshot:
    """The bytes of some host pages, copied when a write is queued: what the worker stores, whatever the host
    tier does meanwhile. Looks like a host pool to a store, its pages addressed by position (page i: slots
    i * page_size ..)."""

    def __init__(self, host_pool, host_slots: np.ndarray) -> None:
        self.page_size = host_pool.page_size
        self._format = host_pool.storage_format()
        self._payload_bytes = host_pool.page_payload_bytes()
        self._payloads = host_pool.read_pages(host_slots)

    def storage_format(self) -> str:
        return self._format

    def page_payload_bytes(self) -> int:
        return self._payload_bytes

    def check_host_slots(self, host_slots) -> np.ndarray:
        return np.asarray(host_slots)

    def read_pages(self, host_slots: np.ndarray) -> list[bytes]:
        return [self._payloads[int(first) // self.page_size] for first in host_slots[::self.page_size]]


class StorageLink:
    """A store, its worker thread, and the writes and reads a hierarchical cache issues to it."""

    def __init__(self, storage, host_pool, prefetch_policy: str = "best_effort",
                 prefetch_timeout_s: float = 0.05, read_chunk_pages: int = 64) -> None:
        for method in ("batch_exists", "batch_get", "batch_set"):
            if not callable(getattr(storage, method, None)):
                raise TypeError(f"storage must implement batch_exists, batch_get and batch_set "
                                f"(kvmem.storage), got {type(storage).__name__}")
        if not getattr(storage, "keeps_payloads", True) and host_pool.page_payload_bytes():
            raise ValueError(f"storage {type(storage).__name__} keeps no KV bytes, and host_pool holds them: a "
                             f"simulated store serves only a HostSlotPool (a replay's host tier)")
        if prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"prefetch_policy must be one of {PREFETCH_POLICIES}, got {prefetch_policy!r}")
        self.storage = storage
        self.host_pool = host_pool
        self.prefetch_policy = prefetch_policy
        self.prefetch_timeout_s = check_number("prefetch_timeout_s", prefetch_timeout_s, 0)
        self.read_chunk_pages = check_int("read_chunk_pages", read_chunk_pages, 1)
        self.stats = StorageTierStats()
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmem-storage")
        self._writes: list[concurrent.futures.Future] = []
        self._late: list[tuple[concurrent.futures.Future, np.ndarray]] = []  # chunk reads taken before they ended
        self._queued_keys: Counter[str] = Counter()  # keys of writes not yet done (the worker takes them off)
        self._queued_lock = threading.Lock()
        self._closed = False

    def write(self, digests: bytes, host_slots: np.ndarray) -> None:
        """Queues the pages in `host_slots` (named by `digests`) for the store."""
        keys = [digests[i:i + DIGEST_BYTES].hex() for i in range(0, len(digests), DIGEST_BYTES)]
        snapshot = _PageSnapshot(self.host_pool, host_slots)
        positions = np.arange(len(host_slots), dtype=np.int64)

        def store() -> int:
            try:
                stored = self.storage.batch_set(keys, snapshot, positions)
            except Exception:  # noqa: BLE001 - a store that raises is a store that failed: nothing stored
                stored = None
            finally:  # written, or failed: either way the store now says what it has
                with self._queued_lock:
                    queued = self._queued_keys
                    for key in keys:
                        queued[key] -= 1
                        if not queued[key]:
                            del queued[key]
            stored = self._count(stored, len(keys))
            self.stats.stored_tokens += stored * snapshot.page_size
            return stored
        with self._queued_lock:
            self._queued_keys.update(keys)
        self._writes.append(self._worker.submit(store))
        if len(self._writes) > 1024:
            self._writes = [f for f in self._writes if not f.done()]

    def lookup(self, digests: bytes) -> int:
        """How many leading pages of `digests` the store has, or will have once the writes queued so far are done
        (see the module docstring)."""
        keys = [digests[i:i + DIGEST_BYTES].hex() for i in range(0, len(digests), DIGEST_BYTES)]
        if self.prefetch_policy == "wait_complete":
            self.drain_writes()
            return self._exists(keys)
        # Writes are queued from this thread only: a key not queued now was written already, or never.
        with self._queued_lock:
            queued = {k for k in keys if k in self._queued_keys}
        found = 0
        while found < len(keys):
            if keys[found] in queued:
                found += 1
                continue
            present = self._exists(keys[found:])
            found += present
            if not present or found == len(keys) or keys[found] not in queued:
                break
        return found

    def _exists(self, keys: list[str]) -> int:
        try:
            found = self.storage.batch_exists(keys)
        except Exception:  # noqa: BLE001 - a store that raises is a store that failed: a miss
            found = None
        return self._count(found, len(keys))

    def _count(self, pages, most: int) -> int:
        """`pages`, a store's answer to a call on `most` pages, if it is a count of them; anything else (None for a
        call that raised, a negative, too large or non-integer count) is the store failing: 0, counted."""
        if isinstance(pages, (int, np.integer)) and not isinstance(pages, (bool, np.bool_)) and 0 <= pages <= most:
            return int(pages)
        stats = getattr(self.storage, "stats", None)
        if stats is not None:
            stats.failed_ops += 1
        return 0

    def read(self, namespace, key: bytes, start: int, digests: bytes, host_slots: np.ndarray) -> Prefetch:
        """Starts reading the pages `digests` into `host_slots` on the worker, a chunk at a time."""
        keys = [digests[i:i + DIGEST_BYTES].hex() for i in range(0, len(digests), DIGEST_BYTES)]
        step, ps = self.read_chunk_pages, self.host_pool.page_size
        futures = [self._worker.submit(self.storage.batch_get, keys[i:i + step], self.host_pool,
                                       host_slots[i * ps:(i + step) * ps]) for i in range(0, len(keys), step)]
        return Prefetch(namespace, key, start, digests, host_slots, len(keys), step, futures)

    def arrived(self, prefetch: Prefetch) -> tuple[int, np.ndarray]:
        """The leading pages of `prefetch` to attach now, by the prefetch policy, and a mask of its pages whose
        chunk is still being read (their slots stay held until the read ends: see `reap`). The chunks after the
        first one that is unfinished, short or failed are cancelled if not yet started."""
        futures = prefetch.futures
        if self.prefetch_policy == "wait_complete":
            concurrent.futures.wait(futures)
        elif self.prefetch_policy == "timeout":
            concurrent.futures.wait(futures, timeout=self.prefetch_timeout_s)
        step, pages, taken = prefetch.chunk_pages, 0, 0
        for i, future in enumerate(futures):
            if not future.done():
                break
            taken = i + 1
            asked = min(step, prefetch.pages - i * step)
            try:
                loaded = future.result()
            except Exception:  # noqa: BLE001 - a store that raises is a store that failed: a miss
                loaded = None
            loaded = self._count(loaded, asked)
            pages += loaded
            if loaded < asked:  # the pages after a gap hang from nothing
                break
        reading = np.zeros(prefetch.pages, dtype=bool)
        ps = self.host_pool.page_size
        for i in range(taken, len(futures)):
            if not futures[i].cancel() and not futures[i].done():
                reading[i * step:(i + 1) * step] = True
                self._late.append((futures[i], prefetch.host_slots[i * step * ps:(i + 1) * step * ps]))
        return pages, reading

    def reap(self) -> list[np.ndarray]:
        """The host slots of late chunk reads that have ended (for the cache to free)."""
        done, late = [], []
        for future, slots in self._late:  # done() once each: a read may end while this runs
            if future.done():
                done.append(slots)
            else:
                late.append((future, slots))
        self._late = late
        for slots in done:
            self.stats.dropped_prefetch_tokens += len(slots)
        return done

    def late_tokens(self) -> int:
        return sum(len(slots) for _, slots in self._late)

    def drain_writes(self) -> None:
        concurrent.futures.wait(self._writes)
        self._writes.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Waits for every queued write and read, then stops the worker."""
        self._closed = True
        self._worker.shutdown(wait=True)
