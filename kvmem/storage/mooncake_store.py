"""The storage tier on the Mooncake distributed store (`pip install 'kvmem[storage]'`).

Mooncake pools the memory of many processes (and nodes) behind one master; every process that computes the
same prefix finds the same page keys, so replicas share what any of them stored. kvmem's clients mount no
memory segment of their own (`MooncakeServer` explains why): pages live in a long-lived storage process.

Calls go in batches through registered staging memory (`batch_put_from`, `batch_get_into`, `batch_is_exist`:
one master round trip per batch, no Python bytes per page). Mooncake reports every failure as a return code,
never an exception: a full store (-200), a missing key (-704), a dead master (-900). Once the master is gone
every call blocks about 4 s before it fails, and Mooncake's own `health_check()` keeps answering "healthy"
while the client is busy (measured), so the store keeps its own view: the first -900 marks it down, and
while down it skips every call (a miss, counted in `stats.failed_ops`), probing the master's port at most
once every `retry_s` seconds and resuming when it answers.
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np

from kvmem._checks import check_int, check_number
from kvmem.storage.base import PageStore

SETUP_RETRIES = "2"  # Mooncake retries a failed setup 20 times, 4.5 s each, unless told otherwise
RPC_FAILED = -900


def _mooncake_store_class():
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # before the import: the client logs every setup otherwise
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", SETUP_RETRIES)
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise RuntimeError(f"the Mooncake store is not installed: pip install 'kvmem[storage]' (on Debian, "
                           f"apt-get install libibverbs1 librdmacm1 first) ({e})") from None
    return MooncakeDistributedStore


class MooncakeStore(PageStore):
    """Pages in a Mooncake store whose master is at `master_addr` ("host:port").

    metadata_server: "P2PHANDSHAKE" (the default) or the master's metadata URL ("http://host:port/metadata").
    local_buffer_mb: the client's transfer buffer. Raises RuntimeError when the library is missing or the master
    cannot be reached.
    """

    def __init__(self, master_addr: str, metadata_server: str = "P2PHANDSHAKE", *, local_buffer_mb: int = 64,
                 batch_size: int = 32, retry_s: float = 1.0) -> None:
        super().__init__(batch_size)
        host, _, port = master_addr.rpartition(":") if isinstance(master_addr, str) else ("", "", "")
        if not host or not port.isdigit():
            raise ValueError(f"master_addr must be 'host:port', got {master_addr!r}")
        local_buffer_mb = check_int("local_buffer_mb", local_buffer_mb, minimum=1)
        self.master_addr = master_addr
        self.retry_s = check_number("retry_s", retry_s, 0)
        self._master = (host, int(port))
        self._down_since: float | None = None
        self._next_probe = 0.0
        try:  # Mooncake's setup retries an absent master for seconds; a closed port says it at once
            socket.create_connection(self._master, timeout=1.0).close()
        except OSError as e:
            raise RuntimeError(f"cannot join the Mooncake store at {master_addr}: no master answers there "
                               f"({e.strerror or e})") from None
        self._store = _mooncake_store_class()()
        rc = self._store.setup("127.0.0.1", metadata_server, 0, local_buffer_mb << 20, "tcp", "", master_addr)
        if rc != 0:
            raise RuntimeError(f"cannot join the Mooncake store at {master_addr} (setup returned {rc})")
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
        if any(c == RPC_FAILED for c in codes):
            self._down_since = time.monotonic()
            self._next_probe = self._down_since + self.retry_s

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
                if got != -704:  # anything but "not found" is the store failing
                    self.stats.failed_ops += 1
                break
            values.append(buf[i * value_bytes:i * value_bytes + got].tobytes())
        return values

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

    def close(self) -> None:
        if self._store is not None:
            if self._down_since is None and self.healthy():
                self._store.close()  # with the master gone, close() waits ~11 s for nothing
            self._store = None
