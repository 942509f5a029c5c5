"""A storage tier in a directory: pages packed into segment files, the embedded default (no server needed).

Segments. Each process appends to segment files of its own, `DIR/<created>-<pid>-<nonce>.kvseg`, a new one once
the last holds `segment_bytes`, and never rewrites a byte. A record is a header (b"KVSR", its kind, a time in ns,
its length) and a body: a page's stored value (`kvmem.storage.page_format`: header, payload, CRC-32), or, in a
capped store, the digests of pages used, each with the time of its use (the order of eviction, below). A store
finds pages by walking the records' headers: the whole folder when a process first opens it, then, when a lookup
misses, what other processes have appended or added since, so that every process finds the pages any of them
wrote. A page is loaded only once its value decodes as the page asked for (`PageStore.batch_get`): a torn or
damaged record is a miss, counted and dropped, never a wrong load. A walk stops at a record that is not whole (one
being written, or the torn tail of a crash) and resumes there later. A page's key is the digest its own value
carries, so no value is ever filed under another page's key.

The cap. With `capacity_bytes` the store evicts its least recently used pages once their values total more than
that, each prefix chain kept whole (`kvmem.storage.lru`). Every store of one folder in a process shares one index
(a cluster's replicas over one store); other processes learn the order from the records' times (each page's write
and each use, a nanosecond apart, whatever the clock's resolution): when they open the folder, and for what they
catch up with later. Each process enforces the cap over the pages it knows of, so processes sharing a capped
folder should each take a share of the cap. An evicted page's bytes stay in its segment until the segment is
rewritten: once the folder's segments hold more than twice the cap and a segment, a capped store copies the live
pages of the segment with the fewest, and the last use recorded there of each, to its own newest segment and deletes it
(another process's segment too: that process starts a new one when it finds its own gone, and finds the copies
when it catches up). A process opening a capped folder finds the evicted pages whose bytes are still there, and
evicts down to its cap again, least recently used first.

The disk. A cap larger than the room on the disk is refused (ValueError). A store stops writing while its disk has
less than `min_free_bytes` free: each write is then a counted failure, with one warning for the folder.
"""

from __future__ import annotations

import heapq
import os
import secrets
import shutil
import struct
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path

from kvmem._checks import check_int
from kvmem.storage.base import PageStore
from kvmem.storage.lru import PageLRU
from kvmem.storage.page_format import HEADER_BYTES, value_extent

DEFAULT_SEGMENT_BYTES = 256 << 20
DEFAULT_MIN_FREE_BYTES = 512 << 20
SUFFIX = ".kvseg"
_RECORD = struct.Struct("<4sB3xQI")  # magic, kind, time (ns), body length
RECORD_BYTES = _RECORD.size
_MAGIC = b"KVSR"
_PAGE, _USE = 1, 2
_USE_ENTRY = struct.Struct("<Q32s")  # a use: its time (ns), the page's digest
_WALK_CHUNK = 1 << 20  # bytes read at a time while walking records
# A location packs (segment number, offset of the value in it, its length) into one int: an index of millions of
# pages then costs one small int each.
_LENGTH_BITS, _OFFSET_BITS = 32, 40


def _loc(segment: int, offset: int, length: int) -> int:
    return (segment << (_OFFSET_BITS + _LENGTH_BITS)) | (offset << _LENGTH_BITS) | length


def _unpack(loc: int) -> tuple[int, int, int]:
    return (loc >> (_OFFSET_BITS + _LENGTH_BITS), (loc >> _LENGTH_BITS) & ((1 << _OFFSET_BITS) - 1),
            loc & ((1 << _LENGTH_BITS) - 1))


def _length(loc: int) -> int:
    return loc & ((1 << _LENGTH_BITS) - 1)


_last_ns = 0
_CLOCK_LOCK = threading.Lock()


def _times_ns(n: int = 1) -> int:
    """The first of `n` consecutive ns reserved now, never reserved twice: records' times stay distinct and
    increasing however coarse the clock (a chain's pages are used within microseconds)."""
    global _last_ns
    with _CLOCK_LOCK:
        first = max(time.time_ns(), _last_ns + 1)
        _last_ns = first + n - 1
        return first


class _Segment:
    """One segment file as this process knows it: how far its records were walked, its size when last looked at,
    the bytes of the pages it holds that are in the index, and whether this process writes it."""

    __slots__ = ("name", "walked", "size", "live", "own")

    def __init__(self, name: str, own: bool) -> None:
        self.name, self.own = name, own
        self.walked = self.size = self.live = 0


class _Folder:
    """The pages of one folder that this process knows of (digest -> location, least recently used first), its
    segments, and the segment it appends to. Shared by every FileStore of the folder in the process; every method
    runs under `lock`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.RLock()
        self.pages = PageLRU(_length)
        self.segments: dict[int, _Segment] = {}
        self.numbers: dict[str, int] = {}
        self.disk_bytes = 0  # the known segments' sizes
        self.warned_full = False
        self._next_number = 0
        self._writer: tuple[int, int, int] | None = None  # (segment number, fd, pid)
        self._fds: dict[int, int] = {}  # segment number -> read fd (the writer's fd is under -1)
        weakref.finalize(self, _close_all, self._fds)
        self.catch_up()

    # ---- finding pages ----------------------------------------------------------------------------------
    def catch_up(self) -> bool:
        """Walks what other processes appended or added since the last look, in time order, and forgets the
        segments gone; False when the folder cannot be listed."""
        try:
            names = sorted(e.name for e in os.scandir(self.path) if e.name.endswith(SUFFIX))
        except OSError:
            return False
        present = set(names)
        for name, number in list(self.numbers.items()):
            if name not in present:
                self._forget(number)
        walks = []
        for name in names:  # oldest first: they start with their creation time
            number = self.numbers.get(name)
            if number is None:
                number = self._add_segment(name, own=False)
            segment = self.segments[number]
            if segment.own:
                continue
            try:
                size = os.stat(self.path / name).st_size
            except OSError:
                continue
            if size < segment.size:
                self._cut(number, size)
            elif size > segment.size:
                self.disk_bytes += size - segment.size
                segment.size = size
                walks.append(self._walk(number))
        for when, kind, digest, loc in heapq.merge(*walks, key=lambda record: record[0]):
            if kind == _PAGE:
                self._index(digest, loc)
            elif digest in self.pages:
                self.pages.entries.move_to_end(digest)
        return True

    def _walk(self, number: int, start: int | None = None, end: int | None = None
              ) -> Iterator[tuple[int, int, bytes, int]]:
        """The records of segment `number` in [start, end) (default: from where its last walk stopped to its size,
        noting how far it got), as (time, kind, digest, location; 0 for a use). Stops at a record that is not whole,
        or not a record."""
        segment = self.segments[number]
        fd = self._read_fd(number)
        if fd is None:
            return
        onward = start is None
        pos, end = (segment.walked if onward else start), (segment.size if end is None else end)
        buf, at, want = b"", pos, _WALK_CHUNK
        while pos + RECORD_BYTES <= end:
            need = min(RECORD_BYTES + HEADER_BYTES, end - pos)
            if pos + need > at + len(buf):
                try:
                    buf, at = os.pread(fd, min(want, end - pos), pos), pos
                except OSError:
                    return
                if len(buf) < need:  # cut short since it was measured
                    return
            magic, kind, when, length = _RECORD.unpack_from(buf, pos - at)
            body, stop = pos + RECORD_BYTES, pos + RECORD_BYTES + length
            if magic != _MAGIC or stop > end:
                return
            if kind == _PAGE:
                extent = value_extent(buf[body - at:body - at + HEADER_BYTES])
                if extent is not None and extent[1] == length and body < 1 << _OFFSET_BITS:
                    yield when, _PAGE, extent[0], _loc(number, body, length)
            elif kind == _USE:
                try:
                    uses = os.pread(fd, length, body) if stop > at + len(buf) else buf[body - at:stop - at]
                except OSError:
                    return
                for i in range(0, len(uses) - _USE_ENTRY.size + 1, _USE_ENTRY.size):
                    used_at, digest = _USE_ENTRY.unpack_from(uses, i)
                    yield used_at, _USE, digest, 0
            want = RECORD_BYTES + HEADER_BYTES if length > _WALK_CHUNK else _WALK_CHUNK  # skip big pages' bytes
            pos = stop
            if onward:
                segment.walked = pos

    def _cut(self, number: int, size: int) -> None:
        """Segment `number` was cut to `size` bytes (by hand, or a disk error): forgets the pages past its end."""
        segment = self.segments[number]
        for digest in [d for d, loc in self.pages.entries.items()
                       if _unpack(loc)[0] == number and sum(_unpack(loc)[1:]) > size]:
            self.drop(digest)
        self.disk_bytes -= segment.size - size
        segment.size, segment.walked = size, min(segment.walked, size)

    def _index(self, digest: bytes, loc: int) -> None:
        old = self.pages.get(digest)
        if old is not None:
            self.segments[_unpack(old)[0]].live -= _length(old)
        self.pages.add(digest, loc)
        self.segments[_unpack(loc)[0]].live += _length(loc)

    def drop(self, digest: bytes) -> None:
        loc = self.pages.remove(digest)
        if loc is not None:
            self.segments[_unpack(loc)[0]].live -= _length(loc)

    def evicted(self, pairs: list) -> None:
        """Accounts for pages the LRU evicted (their bytes stay in their segment until it is rewritten)."""
        for _, loc in pairs:
            self.segments[_unpack(loc)[0]].live -= _length(loc)

    def read(self, loc: int) -> bytes | None:
        """The value at `loc`; None when its segment is gone (another process rewrote it)."""
        number, offset, length = _unpack(loc)
        fd = self._read_fd(number)
        if fd is None:
            return None
        return os.pread(fd, length, offset)

    def _read_fd(self, number: int) -> int | None:
        fd = self._fds.get(number)
        if fd is None:
            try:
                fd = self._fds[number] = os.open(self.path / self.segments[number].name, os.O_RDONLY)
            except FileNotFoundError:
                self._forget(number)
                return None
        return fd

    def _add_segment(self, name: str, own: bool) -> int:
        number = self._next_number
        self._next_number += 1
        self.segments[number], self.numbers[name] = _Segment(name, own), number
        return number

    def _forget(self, number: int) -> None:
        """Drops a segment gone from the folder, and its pages from the index."""
        segment = self.segments.pop(number)
        del self.numbers[segment.name]
        self.disk_bytes -= segment.size
        if segment.live:
            for digest in [d for d, loc in self.pages.entries.items() if _unpack(loc)[0] == number]:
                self.pages.remove(digest)
        fd = self._fds.pop(number, None)
        if fd is not None:
            os.close(fd)
        if self._writer is not None and self._writer[0] == number:
            self._close_writer()

    # ---- writing ----------------------------------------------------------------------------------------
    def position(self, nbytes: int, segment_bytes: int) -> tuple[int, int]:
        """(segment number, offset) where the next `nbytes` will be appended: this process's own segment, a new
        one when it has none (a fork's child, or one another process deleted) or it would outgrow `segment_bytes`.
        Raises OSError when no segment can be created."""
        writer = self._writer
        if writer is not None and writer[2] != os.getpid():  # a fork's child: the parent's segments are another's
            self._close_writer()
            for segment in self.segments.values():
                segment.own = False
        elif writer is not None:
            segment, stat = self.segments[writer[0]], os.fstat(writer[1])
            if stat.st_size != segment.size:  # changed by another hand: its offsets are no longer this process's
                self._cut(writer[0], min(stat.st_size, segment.size))
                self._close_writer()
            elif stat.st_nlink == 0 or (segment.size and segment.size + nbytes > segment_bytes):
                self._close_writer()
        if self._writer is None:
            name = f"{time.time_ns():016x}-{os.getpid()}-{secrets.token_hex(4)}{SUFFIX}"
            fd = os.open(self.path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o666)
            number = self._add_segment(name, own=True)
            self._writer = (number, fd, os.getpid())
            self._fds[-1] = fd
        return self._writer[0], self.segments[self._writer[0]].size

    def append(self, data: bytes) -> None:
        """Appends `data` (whole records) to this process's segment (`position` first); on a failure, cuts the
        segment back and raises OSError, and the next write starts a new segment."""
        number, fd, _ = self._writer
        segment = self.segments[number]
        view, start = memoryview(data), segment.size
        try:
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass
            self._close_writer()
            raise
        segment.size = segment.walked = start + len(data)
        self.disk_bytes += len(data)

    def add_written(self, digest: bytes, loc: int) -> None:
        self._index(digest, loc)

    def record_use(self, chain: list[bytes], segment_bytes: int) -> None:
        """Appends a use record of `chain` (root first: the root is the most recently used), so that other processes
        learn the order; a store that cannot write it only loses that order."""
        if chain:
            first = _times_ns(len(chain))
            self._append_uses([(first + i, digest) for i, digest in enumerate(reversed(chain))], segment_bytes)

    def _append_uses(self, uses: list[tuple[int, bytes]], segment_bytes: int) -> None:
        body = b"".join(_USE_ENTRY.pack(when, digest) for when, digest in uses)
        try:
            self.position(RECORD_BYTES + len(body), segment_bytes)
            self.append(_RECORD.pack(_MAGIC, _USE, uses[0][0], len(body)) + body)
        except OSError:
            pass

    def _close_writer(self) -> None:
        if self._writer is not None:
            os.close(self._fds.pop(-1))
            self._writer = None

    # ---- rewriting segments ----------------------------------------------------------------------------
    def rewrite(self, capacity_bytes: int, segment_bytes: int) -> None:
        """While the segments hold more than twice `capacity_bytes` and a segment, copies the live pages of the one
        with the fewest (records as they are: their times keep the order) to this process's segment and deletes
        it."""
        tried, first_new = set(), self._next_number
        while self.disk_bytes > 2 * capacity_bytes + segment_bytes:
            # Only a segment at most half live is worth its copy; the copies' segments are not rewritten in the same
            # pass (a segment of use records alone was copied to a new one, and that one again, for ever).
            candidates = [n for n, seg in self.segments.items()
                          if n < first_new and n not in tried and 2 * seg.live < seg.size]
            if not candidates:
                return
            number = min(candidates, key=lambda n: (self.segments[n].live, n))
            tried.add(number)
            if self._writer is not None and self._writer[0] == number:
                self._close_writer()  # its live pages go to a new segment
            try:
                self._copy_live(number, segment_bytes)
                os.unlink(self.path / self.segments[number].name)
            except OSError:
                continue
            self._forget(number)

    def _copy_live(self, number: int, segment_bytes: int) -> None:
        """Copies the records of segment `number` that still count: its live pages (as they are, their times
        with them) and the last use it recorded of each live page."""
        segment, uses, batch, batch_bytes = self.segments[number], {}, [], 0
        for when, kind, digest, loc in list(self._walk(number, 0, segment.size)):
            if kind == _USE:
                if digest in self.pages and uses.get(digest, -1) < when:
                    uses[digest] = when
            elif self.pages.get(digest) == loc:
                _, offset, length = _unpack(loc)
                batch.append((digest, os.pread(self._fds[number], RECORD_BYTES + length, offset - RECORD_BYTES)))
                batch_bytes += RECORD_BYTES + length
                if batch_bytes >= _WALK_CHUNK * 16:
                    self._append_copies(number, batch, segment_bytes)
                    batch, batch_bytes = [], 0
        self._append_copies(number, batch, segment_bytes)
        if uses:
            self._append_uses(sorted((when, digest) for digest, when in uses.items()), segment_bytes)

    def _append_copies(self, source: int, batch: list[tuple[bytes, bytes]], segment_bytes: int) -> None:
        """Appends copied page records together, and points the index at the copies (keeping their places)."""
        if not batch:
            return
        target, at = self.position(sum(len(record) for _, record in batch), segment_bytes)
        self.append(b"".join(record for _, record in batch))
        for digest, record in batch:
            length = len(record) - RECORD_BYTES
            self.segments[source].live -= length
            self.segments[target].live += length
            self.pages.entries[digest] = _loc(target, at + RECORD_BYTES, length)
            at += len(record)


def _close_all(fds: dict[int, int]) -> None:
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


_FOLDERS: weakref.WeakValueDictionary[str, _Folder] = weakref.WeakValueDictionary()
_FOLDERS_LOCK = threading.Lock()


def _folder(path: Path) -> _Folder:
    real = os.path.realpath(path)
    with _FOLDERS_LOCK:
        folder = _FOLDERS.get(real)
        if folder is None:
            folder = _FOLDERS[real] = _Folder(path)
        return folder


class FileStore(PageStore):
    """Pages packed into segment files under `path` (created if missing); `capacity_bytes` None: unbounded.

    segment_bytes: how large a segment file grows before the next is started. min_free_bytes: the free space the
    store leaves on its disk (it stops writing below it). Raises TypeError or ValueError, naming the argument, for
    a path that is not a directory it can write, a cap larger than the disk can hold, or a bad count.
    """

    def __init__(self, path: str | os.PathLike, capacity_bytes: int | None = None, batch_size: int = 64, *,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES, min_free_bytes: int = DEFAULT_MIN_FREE_BYTES) -> None:
        super().__init__(batch_size)
        if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str):
            raise TypeError(f"path must be a str or os.PathLike naming a directory, got {type(path).__name__}")
        text = os.fspath(path)
        if not text.strip() or "\0" in text:
            raise ValueError(f"path must name a directory, got {text!r}")
        if capacity_bytes is not None:
            capacity_bytes = check_int("capacity_bytes", capacity_bytes, minimum=1)
        self.segment_bytes = check_int("segment_bytes", segment_bytes, minimum=1, maximum=1 << (_OFFSET_BITS - 1))
        self.min_free_bytes = check_int("min_free_bytes", min_free_bytes, minimum=0)
        self.path = Path(text)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"path {text!r} cannot hold a store: {e.strerror or e}") from None
        if not os.access(self.path, os.W_OK):
            raise ValueError(f"path {text!r} is not writable")
        self.capacity_bytes = capacity_bytes
        folder = self._folder = _folder(self.path)
        if capacity_bytes is not None:
            room = shutil.disk_usage(self.path).free - self.min_free_bytes + folder.disk_bytes
            if capacity_bytes > room:
                raise ValueError(f"capacity_bytes {capacity_bytes} is more than {text!r} can hold: {max(room, 0)} "
                                 f"bytes (its disk's free space less min_free_bytes, with the store's own)")
            with folder.lock:  # pages evicted before, whose bytes are still there, go again
                folder.evicted(folder.pages.make_room(0, capacity_bytes)[0])
        self._chain: dict[bytes, None] | None = None  # the digests of the batch_set under way that are stored

    def used_bytes(self) -> int:
        """Bytes of the values of the folder's pages this process knows of."""
        return self._folder.pages.used

    def locate(self, key: str) -> tuple[Path, int, int] | None:
        """Where the value of page `key` lies, as (segment file, offset, length); None for a page it does not
        know of."""
        digest = bytes.fromhex(key)
        with self._folder.lock:
            loc = self._folder.pages.get(digest)
            if loc is None:
                return None
            number, offset, length = _unpack(loc)
            return self.path / self._folder.segments[number].name, offset, length

    def batch_get(self, keys, host_pool, host_slots) -> int:
        folder = self._folder
        with folder.lock:
            got = super().batch_get(keys, host_pool, host_slots)
            chain = [bytes.fromhex(k) for k in list(keys)[:got]]
            folder.pages.use(chain)
            if self.capacity_bytes is not None:
                folder.record_use(chain, self.segment_bytes)
        return got

    def batch_set(self, keys, host_pool, host_slots) -> int:
        folder = self._folder
        with folder.lock:
            self._chain = {}
            try:
                stored = super().batch_set(keys, host_pool, host_slots)
                chain = list(self._chain)
                folder.pages.use(chain)
                if self.capacity_bytes is not None:
                    folder.record_use(chain, self.segment_bytes)
                    folder.rewrite(self.capacity_bytes, self.segment_bytes)
            finally:
                self._chain = None
        return stored

    def _exists(self, keys: list[str]) -> int:
        pages, caught_up = self._folder.pages, False
        for i, key in enumerate(keys):
            if bytes.fromhex(key) in pages:
                continue
            if caught_up or not self._catch_up():
                return i
            caught_up = True
            if bytes.fromhex(key) not in pages:
                return i
        return len(keys)

    def _catch_up(self) -> bool:
        """Looks for pages other processes wrote, unless this process's store calls hold the folder (a lookup
        never waits for a write or a read): True if it looked."""
        folder = self._folder
        if not folder.lock.acquire(blocking=False):
            return False
        try:
            if not folder.catch_up():
                self.stats.failed_ops += 1  # a folder it cannot list: the pages it has not seen are missing
                return False
            if self.capacity_bytes is not None:  # what it found counts against its cap
                folder.evicted(folder.pages.make_room(0, self.capacity_bytes)[0])
            return True
        finally:
            folder.lock.release()

    def _read(self, keys: list[str], value_bytes: int) -> list[bytes | None]:
        folder, values = self._folder, []
        for key in keys:
            loc = folder.pages.get(bytes.fromhex(key))
            if loc is None:
                break
            try:
                value = folder.read(loc)
            except OSError:
                self.stats.failed_ops += 1
                break
            if value is None:  # its segment was rewritten by another process: gone here
                break
            values.append(value)
        return values

    def _write(self, keys: list[str], values: list[bytes]) -> int:
        """Appends the pages not yet stored, in order, and stops at the first that cannot be stored: the ones
        after it would hang from a missing page, unreachable."""
        folder, chain = self._folder, self._chain if self._chain is not None else {}
        digests = [bytes.fromhex(key) for key in keys]
        missing = sum(RECORD_BYTES + len(v) for d, v in zip(digests, values) if d not in folder.pages)
        if missing and not self._room_on_disk(missing):
            return 0
        stored, records, added = 0, [], []
        try:
            target, at = folder.position(missing, self.segment_bytes) if missing else (None, 0)
        except OSError:
            self.stats.failed_ops += 1
            return 0
        when = _times_ns(len(digests))
        for i, (digest, value) in enumerate(zip(digests, values)):
            if digest not in folder.pages:
                evicted, fits = folder.pages.make_room(len(value), self.capacity_bytes, chain)
                folder.evicted(evicted)
                if not fits:
                    self.stats.failed_ops += 1  # no room left but the chain's own pages
                    break
                records += (_RECORD.pack(_MAGIC, _PAGE, when + i, len(value)), value)
                folder.add_written(digest, _loc(target, at + RECORD_BYTES, len(value)))
                added.append(digest)
                at += RECORD_BYTES + len(value)
            chain[digest] = None
            stored += 1
        if records:
            try:
                folder.append(b"".join(records))
            except OSError:
                self.stats.failed_ops += 1
                for digest in added:
                    folder.drop(digest)
                    chain.pop(digest, None)
                return digests.index(added[0])  # the pages before the first it was to write were there
        return stored

    def _room_on_disk(self, nbytes: int) -> bool:
        """Whether `nbytes` more leave min_free_bytes free; when not, the write is a counted failure, and the folder
        warns once."""
        try:
            free = shutil.disk_usage(self.path).free
        except OSError:
            free = 0
        if free - nbytes >= self.min_free_bytes:
            return True
        self.stats.failed_ops += 1
        folder = self._folder
        if not folder.warned_full:
            folder.warned_full = True
            warnings.warn(f"FileStore {str(self.path)!r}: its disk has {free} bytes free, under min_free_bytes "
                          f"{self.min_free_bytes}: pages are not stored until there is room", RuntimeWarning,
                          stacklevel=2)
        return False

    def _discard(self, key: str) -> None:
        with self._folder.lock:
            self._folder.drop(bytes.fromhex(key))
