"""The storage tier on the Mooncake distributed store (`pip install 'kvmem[storage]'`).

Mooncake pools the memory of many processes (and nodes) behind one master; every process that computes the
same prefix finds the same page keys, so replicas share what any of them stored. kvmem's clients mount no
memory segment of their own (`MooncakeServer` explains why): pages live in a long-lived storage process.

Calls go in batches through registered staging memory (`batch_put_from`, `batch_get_into`, `batch_is_exist`:
one master round trip per batch, no Python bytes per page). Mooncake reports every failure as a return code,
never an exception: a full store (-200), a missing key (-704), an RPC error (-900 to -999: -900 a dead
master, -901 one that does not answer in time). Every wait is bounded by `connect_timeout_s`: the store sets
Mooncake's RPC timeout to it (`MC_RPC_TIMEOUT_MS`, read when a client is set up) and makes one setup attempt, so
that joining a port where something else listens (which Mooncake retries for a minute) fails within it, with a
one-line RuntimeError; the client's log of that failure is summed up in the error instead of printed. Once the
master is gone every call blocks up to that long before it fails, and Mooncake's own `health_check()` keeps
answering "healthy" while the client is busy (measured), so the store keeps its own view: an RPC error marks it
down, and while down it skips every call (a miss, counted in `stats.failed_ops`), probing the master's port after
`retry_s` seconds and resuming when it answers. Each RPC error in a row doubles that wait, up to 64 x `retry_s`:
a hung master still accepts connections, so the probe alone cannot tell it from a live one.

A value larger than a page of the reader's format cannot be read into its buffer (Mooncake refuses the read): the
store counts it as corrupt and removes it, as any damaged value, so that the next write of the right page repairs
the key.

A store may be shared by threads (a cache's storage worker and a scheduler's lookups, replicas in one process):
its reads and writes take turns, as they share one registered staging buffer.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import sys
import tempfile
import threading
import time

import numpy as np

from kvmem._checks import check_int, check_number
from kvmem.storage.base import PageStore

SETUP_RETRIES = "1"  # Mooncake retries a failed setup 20 times unless told otherwise; the port probe comes first
DEFAULT_CONNECT_TIMEOUT_S = 5.0
RPC_ERRORS = range(-999, -899)  # Mooncake's RPC error codes: -900 failed, -901 timed out, ...
NOT_FOUND = -704
MAX_BACKOFF = 64  # the longest wait between probes of a master that keeps failing, in retry_s


def _mooncake_store_class():
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # before the import: the client logs every setup otherwise
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise RuntimeError(f"the Mooncake store is not installed: pip install 'kvmem[storage]' (on Debian, "
                           f"apt-get install libibverbs1 librdmacm1 first) ({e})") from None
    return MooncakeDistributedStore


_SETUP_LOCK = threading.Lock()  # setup reads its settings from the process's environment


@contextlib.contextmanager
def _mooncake_settings(**settings: str):
    """Sets Mooncake's environment settings for the block (a client reads them when it is set up), then restores
    what was there."""
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _KeptLog:
    """What the process wrote to its stderr (fd 2) during a block: Mooncake's C++ client logs there directly."""

    text = ""

    def first_error(self) -> str:
        """The first error logged (glog's "E" lines), without its prefix (time, thread, source); "" for none."""
        for line in self.text.splitlines():
            if line.startswith("E") and "] " in line:
                return line.split("] ", 1)[1].strip()
        return ""

    def replay(self) -> None:
        """Prints what was kept, once the block is over."""
        if self.text:
            sys.stderr.write(self.text)
            sys.stderr.flush()


@contextlib.contextmanager
def _stderr_kept():
    """Keeps what is written to fd 2 during the block in a `_KeptLog` instead of printing it."""
    sys.stderr.flush()
    log = _KeptLog()
    with tempfile.TemporaryFile() as file:
        saved = os.dup(2)
        try:
            os.dup2(file.fileno(), 2)
            yield log
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            file.seek(0)
            log.text = file.read().decode("utf-8", "replace")


def _one_at_a_time(method):
    """Runs a store call under the store's lock: reads and writes share one registered staging buffer. Lookups
    use none and do not take it, so that a lookup never waits behind a slow read."""
    @functools.wraps(method)
    def locked(self, *args):
        with self._lock:
            return method(self, *args)
    return locked


class MooncakeStore(PageStore):
    """Pages in a Mooncake store whose master is at `master_addr` ("host:port").

    metadata_server: "P2PHANDSHAKE" (the default) or the master's metadata URL ("http://host:port/metadata").
    local_buffer_mb: the client's transfer buffer. connect_timeout_s: the longest any wait on the master lasts (see
    the module docstring). Raises RuntimeError (one line) when the library is missing or no master answers in time.
    """

    def __init__(self, master_addr: str, metadata_server: str = "P2PHANDSHAKE", *, local_buffer_mb: int = 64,
                 batch_size: int = 32, retry_s: float = 1.0,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> None:
        super().__init__(batch_size)
        host, _, port = master_addr.rpartition(":") if isinstance(master_addr, str) else ("", "", "")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"master_addr must be 'host:port', got {master_addr!r}")
        if not isinstance(metadata_server, str) or not metadata_server:
            raise ValueError(f"metadata_server must be 'P2PHANDSHAKE' or a metadata URL, got {metadata_server!r}")
        local_buffer_mb = check_int("local_buffer_mb", local_buffer_mb, minimum=1)
        self.connect_timeout_s = check_number("connect_timeout_s", connect_timeout_s, 0, allow_minimum=False)
        self.master_addr = master_addr
        self.retry_s = check_number("retry_s", retry_s, 0)
        self._master = (host, int(port))
        self._down_since: float | None = None
        self._next_probe = 0.0
        self._backoff = 0  # the wait before the next probe, in retry_s (doubles with each RPC error in a row)
        self._lock = threading.Lock()
        self._store = None
        try:  # Mooncake's setup retries an absent master for seconds; a closed port says it at once
            socket.create_connection(self._master, timeout=self.connect_timeout_s).close()
        except OSError as e:
            raise RuntimeError(f"cannot join the Mooncake store at {master_addr}: no master answers there "
                               f"({e.strerror or e})") from None
        store = _mooncake_store_class()()
        with _SETUP_LOCK, _mooncake_settings(MC_RPC_TIMEOUT_MS=str(max(1, round(self.connect_timeout_s * 1000))),
                                             MC_STORE_CLIENT_SETUP_RETRIES=SETUP_RETRIES), _stderr_kept() as log:
            rc = store.setup("127.0.0.1", metadata_server, 0, local_buffer_mb << 20, "tcp", "", master_addr)
        if rc == 0:
            log.replay()  # nothing went wrong: what the client said is the user's to see
        else:
            said = log.first_error()
            raise RuntimeError(f"cannot join the Mooncake store at {master_addr}: no Mooncake master answered "
                               f"within {self.connect_timeout_s:g} s (connect_timeout_s; setup returned {rc}"
                               f"{'; ' + said if said else ''})")
        self._store = store
        self._staging = np.empty(0, dtype=np.uint8)

    def healthy(self) -> bool:
        """Whether calls should go to the store: not while it is known down (see the module docstring)."""
        if self._store is None:
            return False
        if self._down_since is not None:
            now = time.monotonic()
            if now < self._next_probe:
                return False
            self._next_probe = now + self.retry_s
            try:
                socket.create_connection(self._master, timeout=0.2).close()
            except OSError:
                return False
            self._down_since = None
        return self._store.health_check() == 0

    def _check_codes(self, codes) -> None:
        if any(c in RPC_ERRORS for c in codes):
            self._backoff = min(2 * self._backoff or 1, MAX_BACKOFF)
            self._down_since = time.monotonic()
            self._next_probe = self._down_since + self.retry_s * self._backoff
        else:
            self._backoff = 0

    def _exists(self, keys: list[str]) -> int:
        if not self.healthy():
            self.stats.failed_ops += 1
            return 0
        found = 0
        codes = self._store.batch_is_exist(keys)
        self._check_codes(codes)
        for present in codes:
            if present != 1:
                if present < 0:
                    self.stats.failed_ops += 1
                break
            found += 1
        return found

    @_one_at_a_time
    def _read(self, keys: list[str], value_bytes: int) -> list[bytes | None]:
        if not self.healthy():
            self.stats.failed_ops += 1
            return []
        buf = self._stage(len(keys) * value_bytes)
        ptrs = [buf.ctypes.data + i * value_bytes for i in range(len(keys))]
        values = []
        codes = self._store.batch_get_into(keys, ptrs, [value_bytes] * len(keys))
        self._check_codes(codes)
        for i, got in enumerate(codes):
            if got <= 0:
                if got != NOT_FOUND and got not in RPC_ERRORS and self._store.get_size(keys[i]) > value_bytes:
                    values.append(b"")  # larger than any page it could be: damaged, dropped by batch_get
                elif got != NOT_FOUND:  # anything else is the store failing
                    self.stats.failed_ops += 1
                break
            values.append(buf[i * value_bytes:i * value_bytes + got].tobytes())
        return values

    @_one_at_a_time
    def _write(self, keys: list[str], values: list[bytes]) -> int:
        if not self.healthy():
            self.stats.failed_ops += 1
            return 0
        sizes = [len(v) for v in values]
        buf = self._stage(sum(sizes))
        ptrs, offset = [], 0
        for value, size in zip(values, sizes):
            buf[offset:offset + size] = np.frombuffer(value, dtype=np.uint8)
            ptrs.append(buf.ctypes.data + offset)
            offset += size
        codes = self._store.batch_put_from(keys, ptrs, sizes)
        self._check_codes(codes)
        failed = sum(1 for c in codes if c != 0)  # -200: the store is full; the page is simply not stored
        self.stats.failed_ops += failed
        return len(keys) - failed

    def _discard(self, key: str) -> None:
        if self.healthy():
            self._store.remove(key, True)

    def _stage(self, nbytes: int) -> np.ndarray:
        """Staging memory of at least `nbytes`, registered with Mooncake (once per size increase)."""
        if len(self._staging) < nbytes:
            if len(self._staging):
                self._store.unregister_buffer(self._staging.ctypes.data)
            self._staging = np.empty(max(nbytes, 2 * len(self._staging)), dtype=np.uint8)
            self._store.register_buffer(self._staging.ctypes.data, len(self._staging))
        return self._staging

    @_one_at_a_time
    def close(self) -> None:
        if self._store is not None:
            if self._down_since is None and self.healthy():
                self._store.close()  # with the master gone, close() waits ~11 s for nothing
            self._store = None
