"""A storage tier in a directory: one file per page, the embedded default (no server needed).

Files are `DIR/ab/cd/<key>.page` (two levels of 256 folders, so no folder grows huge). A write goes to a
temporary file in the same folder and is renamed into place, so a reader sees a whole value or none, even
across processes and crashes.

With `capacity_bytes` the store deletes its least recently used pages once it holds more than that. A lookup
stops at a chain's first missing page, so the order keeps each prefix chain whole: a call's pages (a chain,
root first) count as used deepest first, root last, and a write never makes room by deleting a page of its own
chain (it stores the leading pages that fit). Every capped store of one folder in a process shares one index (a
cluster's replicas over one store); other processes learn the order from the files' modification times, which
each call sets, a nanosecond apart, when a store opens the folder. Each process enforces the cap over the pages
it knows of: those there when it opened the folder and those it wrote or read since, so processes sharing a
capped folder should each take a share of the cap.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import OrderedDict
from pathlib import Path

from kvmem._checks import check_int
from kvmem.storage.base import PageStore


class _FolderIndex:
    """The pages of one folder that this process knows of, least recently used first, and their bytes."""

    def __init__(self, path: Path) -> None:
        self.lock = threading.RLock()
        self.lru: OrderedDict[str, int] = OrderedDict()  # key -> bytes
        self.bytes = 0
        entries = []
        for file in path.glob("*/*/*.page"):
            try:
                st = file.stat()
            except OSError:
                continue
            entries.append((st.st_mtime_ns, file.stem, st.st_size))
        for _, key, size in sorted(entries):
            self.lru[key] = size
            self.bytes += size


_INDEXES: weakref.WeakValueDictionary[str, _FolderIndex] = weakref.WeakValueDictionary()
_INDEXES_LOCK = threading.Lock()


_last_ns = 0
_CLOCK_LOCK = threading.Lock()


def _file_time_ns() -> int:
    """Now, in ns, and never twice the same: page files' times stay distinct however coarse the file system's
    clock (a chain's pages are refreshed within microseconds)."""
    global _last_ns
    with _CLOCK_LOCK:
        _last_ns = max(time.time_ns(), _last_ns + 1)
        return _last_ns


def _folder_index(path: Path) -> _FolderIndex:
    real = os.path.realpath(path)
    with _INDEXES_LOCK:
        index = _INDEXES.get(real)
        if index is None:
            index = _INDEXES[real] = _FolderIndex(path)
        return index


class FileStore(PageStore):
    """Pages as files under `path` (created if missing); `capacity_bytes` None: unbounded."""

    def __init__(self, path: str | os.PathLike, capacity_bytes: int | None = None, batch_size: int = 64) -> None:
        super().__init__(batch_size)
        if capacity_bytes is not None:
            capacity_bytes = check_int("capacity_bytes", capacity_bytes, minimum=1)
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"path {str(path)!r} cannot hold a store: {e.strerror or e}") from None
        if not os.access(self.path, os.W_OK):
            raise ValueError(f"path {str(path)!r} is not writable")
        self.capacity_bytes = capacity_bytes
        self._index = _folder_index(self.path) if capacity_bytes is not None else None
        self._lock = self._index.lock if self._index is not None else threading.RLock()
        self._chain: dict[str, None] | None = None  # the keys of the batch_set under way that are on disk

    def used_bytes(self) -> int:
        """Bytes of the folder's pages this process knows of (0 without a capacity: nothing is counted)."""
        return self._index.bytes if self._index is not None else 0

    def batch_get(self, keys, host_pool, host_slots) -> int:
        with self._lock:
            got = super().batch_get(keys, host_pool, host_slots)
            self._refresh(list(keys)[:got])
        return got

    def batch_set(self, keys, host_pool, host_slots) -> int:
        with self._lock:
            self._chain = {}
            try:
                stored = super().batch_set(keys, host_pool, host_slots)
                self._refresh(list(self._chain))
            finally:
                self._chain = None
        return stored

    def _file(self, key: str) -> Path:
        return self.path / key[:2] / key[2:4] / f"{key}.page"

    def _exists(self, keys: list[str]) -> int:
        for i, key in enumerate(keys):
            try:
                if not self._file(key).exists():
                    return i
            except OSError:  # a folder it cannot search, an I/O error: the page is missing for this lookup
                self.stats.failed_ops += 1
                return i
        return len(keys)

    def _read(self, keys: list[str], value_bytes: int) -> list[bytes | None]:
        values = []
        for key in keys:
            try:
                values.append(self._file(key).read_bytes())
            except FileNotFoundError:
                break
            except OSError:
                self.stats.failed_ops += 1
                break
            self._touch(key, len(values[-1]))
        return values

    def _write(self, keys: list[str], values: list[bytes]) -> int:
        """Writes the pages in order and stops at the first that cannot be stored: the ones after it would hang
        from a missing page, unreachable."""
        chain, stored = self._chain, 0
        for key, value in zip(keys, values):
            file = self._file(key)
            try:
                present = file.exists()
                if not present:
                    if not self._make_room(len(value)):
                        self.stats.failed_ops += 1  # no room left but the chain's own pages
                        break
                    tmp = file.with_name(f".{key}.{os.getpid()}.{threading.get_ident()}.tmp")  # unique per writer
                    file.parent.mkdir(parents=True, exist_ok=True)
                    try:
                        tmp.write_bytes(value)
                        os.replace(tmp, file)
                    finally:
                        tmp.unlink(missing_ok=True)
            except OSError:
                self.stats.failed_ops += 1
                break
            stored += 1
            self._touch(key, len(value))
            if chain is not None:
                chain[key] = None
        return stored

    def _discard(self, key: str) -> None:
        with self._lock:
            try:
                self._file(key).unlink(missing_ok=True)
            except OSError:  # a read-only store keeps the bad page; each read finds it bad again, and only it
                self.stats.failed_ops += 1
            if self._index is not None:
                self._index.bytes -= self._index.lru.pop(key, 0)

    # ---- the size cap -------------------------------------------------------------------------------
    def _refresh(self, keys: list[str]) -> None:
        """Marks `keys` (a prefix chain, root first) used now, the root last, and sets their files' times so
        (distinct, increasing: another process opening the folder reads the same order from them)."""
        index = self._index
        for key in reversed(keys):
            now = _file_time_ns()
            try:
                os.utime(self._file(key), ns=(now, now))
            except OSError:
                self.stats.failed_ops += 1
            if index is not None and key in index.lru:
                index.lru.move_to_end(key)

    def _touch(self, key: str, size: int) -> None:
        index = self._index
        if index is None:
            return
        if key in index.lru:
            index.lru.move_to_end(key)
            return
        index.lru[key] = size
        index.bytes += size

    def _make_room(self, size: int) -> bool:
        """Deletes least recently used pages until `size` more bytes fit; False when only pages of the chain
        being written (the most recently used) would have to go, or the page is larger than the store."""
        index = self._index
        if index is None:
            return True
        if size > self.capacity_bytes:
            return False
        chain = self._chain or {}
        while index.bytes + size > self.capacity_bytes and index.lru:
            key = next(iter(index.lru))
            if key in chain:
                return False
            freed = index.lru.pop(key)
            try:
                self._file(key).unlink(missing_ok=True)
            except OSError:
                self.stats.failed_ops += 1
            index.bytes -= freed
        return True
