"""The storage tier's protocol, and what its backends share.

A backend stores KV pages under their keys (`kvmem.page_hash.storage_key`: the hex of the page's digest, which
names the page's whole prefix and namespace, so any process computing the same prefix finds the same key):

- `batch_exists(keys) -> int`: how many leading keys are present;
- `batch_get(keys, host_pool, host_slots) -> int`: reads the leading pages it has into host slots
  (`page_size` slots per key, in key order) and returns how many; a value that fails its checks
  (`kvmem.storage.page_format`) ends the run, counted, and is never loaded: another reader's page is left for it,
  any other failure (damage, a page filed under another key, a wrong length) is dropped, so that the next write
  of the right page repairs the key;
- `batch_set(keys, host_pool, host_slots) -> int`: writes pages from host slots, returns how many it stored.

A store is a cache, not a database: any page may be gone at the next call, a failed operation is a miss, and
none of the three raises for a fault of the store itself (they count it in `stats` instead); only bad
arguments raise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvmem._checks import check_int
from kvmem.storage.page_format import CHECKSUM_BYTES, HEADER_BYTES, decode_page, encode_page, fingerprint, is_foreign


class StorageBackend(Protocol):
    def batch_exists(self, keys: Sequence[str]) -> int: ...

    def batch_get(self, keys: Sequence[str], host_pool, host_slots) -> int: ...

    def batch_set(self, keys: Sequence[str], host_pool, host_slots) -> int: ...


@dataclass
class StorageStats:
    """What a store did, in pages, since it was opened."""

    hits: int = 0           # pages read and loaded into host slots
    stored: int = 0         # pages written
    corrupt: int = 0        # damaged, misfiled or wrong-length values (misses, never loaded; dropped for rewriting)
    foreign: int = 0        # intact values written for another model, format or page size (misses, kept)
    failed_ops: int = 0     # calls the store itself failed (down, full, I/O error): misses or unstored pages


class PageStore:
    """A backend over raw values: subclasses implement `_exists`, `_read` and `_write` on whole values, this
    class turns host pages into values and back (`kvmem.storage.page_format`) and checks the arguments.

    batch_size: keys per backend call (lookups stop at the first missing key of a batch).
    """

    def __init__(self, batch_size: int = 64) -> None:
        self.batch_size = check_int("batch_size", batch_size, minimum=1)
        self.stats = StorageStats()

    # ---- the protocol -------------------------------------------------------------------------------
    def batch_exists(self, keys: Sequence[str]) -> int:
        keys = check_keys(keys)
        found = 0
        for start in range(0, len(keys), self.batch_size):
            chunk = keys[start:start + self.batch_size]
            present = self._exists(chunk)
            found += present
            if present < len(chunk):
                break
        return found

    def batch_get(self, keys: Sequence[str], host_pool, host_slots) -> int:
        keys = check_keys(keys)
        slots = check_slots(keys, host_pool, host_slots)
        ps, fp, payload_bytes = host_pool.page_size, fingerprint(host_pool.storage_format()), \
            host_pool.page_payload_bytes()
        value_bytes = HEADER_BYTES + payload_bytes + CHECKSUM_BYTES
        payloads = []
        for start in range(0, len(keys), self.batch_size):
            chunk = keys[start:start + self.batch_size]
            values = self._read(chunk, value_bytes)
            for key, value in zip(chunk, values):
                digest = bytes.fromhex(key)
                payload = decode_page(value, digest, fp, ps, payload_bytes)
                if payload is None:
                    if value is not None and is_foreign(value, digest, fp, ps):  # another model's page: left for it
                        self.stats.foreign += 1
                    elif value is not None:
                        self.stats.corrupt += 1
                        self._discard(key)
                    break
                payloads.append(payload)
            if len(payloads) < start + len(chunk):
                break
        host_pool.write_pages(slots[:len(payloads) * ps], payloads)
        self.stats.hits += len(payloads)
        return len(payloads)

    def batch_set(self, keys: Sequence[str], host_pool, host_slots) -> int:
        keys = check_keys(keys)
        slots = check_slots(keys, host_pool, host_slots)
        ps, fp = host_pool.page_size, fingerprint(host_pool.storage_format())
        stored = 0
        for start in range(0, len(keys), self.batch_size):
            chunk = keys[start:start + self.batch_size]
            payloads = host_pool.read_pages(slots[start * ps:(start + len(chunk)) * ps])
            values = [encode_page(bytes.fromhex(key), fp, ps, payload) for key, payload in zip(chunk, payloads)]
            written = self._write(chunk, values)
            stored += written
            if written < len(chunk):  # the pages after a gap would hang from nothing
                break
        self.stats.stored += stored
        return stored

    # ---- what a backend implements --------------------------------------------------------------------
    def _exists(self, keys: list[str]) -> int:
        """How many leading keys are present."""
        raise NotImplementedError

    def _read(self, keys: list[str], value_bytes: int) -> list[bytes | None]:
        """The values of the leading keys it has (None or a short list where a key is missing); an intact
        value is `value_bytes` long (a backend reading into fixed buffers sizes them so)."""
        raise NotImplementedError

    def _write(self, keys: list[str], values: list[bytes]) -> int:
        """Stores values (a key already present keeps its value: pages are content-addressed); returns how
        many are stored."""
        raise NotImplementedError

    def _discard(self, key: str) -> None:
        """Drops a value that failed its checks, so that it can be written again."""

    def close(self) -> None:
        """Releases the store's resources."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_slots(keys: list[str], host_pool, host_slots) -> np.ndarray:
    """`host_slots` as an array of whole pages of `host_pool`, one per key; raises TypeError or ValueError naming
    the argument otherwise."""
    if not hasattr(host_pool, "read_pages") or not hasattr(host_pool, "storage_format"):
        raise TypeError(f"host_pool must be a HostKVPool or HostSlotPool, got {type(host_pool).__name__}")
    slots = host_pool.check_host_slots(host_slots)
    if len(slots) != len(keys) * host_pool.page_size:
        raise ValueError(f"host_slots has {len(slots)} slots for {len(keys)} pages of {host_pool.page_size}")
    return slots


def check_keys(keys) -> list[str]:
    """`keys` as a list of page keys (`kvmem.page_hash.storage_key`); raises TypeError or ValueError naming `keys`
    otherwise."""
    if isinstance(keys, (str, bytes)):
        raise TypeError(f"keys must be a sequence of page keys, got {type(keys).__name__}")
    try:
        keys = list(keys)
    except TypeError:
        raise TypeError(f"keys must be a sequence of page keys, got {type(keys).__name__}") from None
    if all(isinstance(key, str) and len(key) == 64 for key in keys) and _lowercase_hex("".join(keys)):
        return keys
    for key in keys:
        if not isinstance(key, str) or len(key) != 64 or not _lowercase_hex(key):
            raise ValueError(f"keys must hold page keys (64 lowercase hex digits, kvmem.page_hash.storage_key), got "
                             f"{key!r}")
    return keys


def _lowercase_hex(text: str) -> bool:
    """Whether `text` is lowercase hex digits only: bytes.fromhex also takes spaces and capitals, which its
    round trip does not give back."""
    try:
        return bytes.fromhex(text).hex() == text
    except ValueError:
        return False
