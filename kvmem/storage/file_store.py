"""A storage tier in a directory: one file per page, the embedded default (no server needed).

Files are `DIR/ab/cd/<key>.page` (two levels of 256 folders, so no folder grows huge). A write goes to a
temporary file in the same folder and is renamed into place, so a reader sees a whole value or none, even
across processes and crashes. With `capacity_bytes` the store deletes its least recently used pages (by file
modification time, which a read refreshes, so several processes sharing a folder agree on the order) once it
holds more than that.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

from kvmem._checks import check_int
from kvmem.storage.base import PageStore


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
        self._lru: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
        self._bytes = 0
        if capacity_bytes is not None:
            self._load_index()

    def used_bytes(self) -> int:
        """Bytes of the pages this process knows of (all of them when a capacity is set)."""
        return self._bytes

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
        self._refresh(keys[:len(values)], [len(v) for v in values])
        return values

    def _write(self, keys: list[str], values: list[bytes]) -> int:
        stored, written = 0, []
        for key, value in zip(keys, values):
            file = self._file(key)
            try:
                if file.exists():
                    stored += 1
                    continue
            except OSError:
                self.stats.failed_ops += 1
                continue
            if self.capacity_bytes is not None and not self._make_room(len(value)):
                self.stats.failed_ops += 1  # a page larger than the whole store
                continue
            tmp = file.with_name(f".{key}.{os.getpid()}.{threading.get_ident()}.tmp")  # unique per writer
            try:
                file.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_bytes(value)
                os.replace(tmp, file)
            except OSError:
                self.stats.failed_ops += 1
                tmp.unlink(missing_ok=True)
                continue
            stored += 1
            self._touch(key, len(value))
            written.append(key)
        self._refresh(written, [self._lru.get(key, 0) for key in written])
        return stored

    def _discard(self, key: str) -> None:
        try:
            self._file(key).unlink(missing_ok=True)
        except OSError:  # a read-only store keeps the bad page; each read finds it bad again, and only it
            self.stats.failed_ops += 1
        self._bytes -= self._lru.pop(key, 0)

    # ---- the size cap -------------------------------------------------------------------------------
    def _refresh(self, keys: list[str], sizes: list[int]) -> None:
        """Marks `keys` (a prefix chain, root first) used now, the root last: a lookup stops at the first
        missing page, so the cap must take a chain's deepest pages first, never its root before the rest (which
        would leave them unreachable, holding space). The files' times follow, for other processes' indexes."""
        for key, size in zip(reversed(keys), reversed(sizes)):
            try:
                os.utime(self._file(key))
            except OSError:
                self.stats.failed_ops += 1
            self._touch(key, size)

    def _touch(self, key: str, size: int) -> None:
        if self.capacity_bytes is None:
            return
        if key in self._lru:
            self._lru.move_to_end(key)
            return
        self._lru[key] = size
        self._bytes += size

    def _make_room(self, size: int) -> bool:
        if size > self.capacity_bytes:
            return False
        while self._bytes + size > self.capacity_bytes and self._lru:
            key, freed = self._lru.popitem(last=False)
            try:
                self._file(key).unlink(missing_ok=True)
            except OSError:
                self.stats.failed_ops += 1
            self._bytes -= freed
        return True

    def _load_index(self) -> None:
        """Indexes the pages already in the folder, oldest modification first."""
        entries = []
        for file in self.path.glob("*/*/*.page"):
            try:
                st = file.stat()
            except OSError:
                continue
            entries.append((st.st_mtime_ns, file.stem, st.st_size))
        for _, key, size in sorted(entries):
            self._lru[key] = size
            self._bytes += size
