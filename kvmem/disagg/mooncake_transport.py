"""Pages moved by Mooncake's transfer engine (`pip install 'kvmem[storage]'`), over TCP on 127.0.0.1.

Each side runs a `TransferEngine` named "127.0.0.1:PORT" in the metadata server (the HTTP one that the Mooncake
master starts with `--enable_http_metadata_server`, as `kvmem.storage.MooncakeServer(metadata="http")` does), and
registers its pool's buffers there; the sending side writes straight into the receiving side's registered memory,
which takes no step of the receiver's. The non-CUDA build moves host memory only, so pools must be on the CPU.

A write submits one transfer per run of pages per buffer (each its own Mooncake batch, so that it can be polled
without blocking: the Python binding's batch status call spins until the whole batch ends, and its batch write
refused 16k entries), `max_in_flight` at a time, the next ones as earlier ones end (when polled). A Transfer is FAILED
once every submitted part has ended, so that no byte lands after the failure is reported; the one exception is a
write still moving after `timeout_s`, which is reported FAILED then, since Mooncake cannot recall it.
"""

from __future__ import annotations

import os
import socket
import time
from urllib.parse import urlparse

import numpy as np

from kvmem._checks import check_int, check_number
from kvmem.disagg.layout import Pool, layer_buffers, num_layers, num_pages, page_bytes
from kvmem.disagg.transport import KVBuffers, KVTransport, Transfer, TransferStatus

_FAILED_IDS = (0, 2**64 - 1)  # what a submit returns when it could not start (no such peer, no segment)
# Parts of a write in flight at once: with all 16k parts of a shuffled 512 MiB write submitted together, some failed
# and others never ended (mooncake-transfer-engine-non-cuda 0.3.13); a window of 64 or 1024 lost none, as fast.
MAX_IN_FLIGHT = 256
TIMEOUT_S = 60.0


def _transfer_engine_class():
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # before the import: it logs every connection otherwise
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise RuntimeError(f"the Mooncake transfer engine is not installed: pip install 'kvmem[storage]' (on Debian, "
                           f"apt-get install libibverbs1 librdmacm1 first) ({e})") from None
    return TransferEngine


class MooncakeTransport(KVTransport):
    """A transfer engine on 127.0.0.1 whose metadata lives at `metadata_server` ("http://host:port/metadata").

    Raises RuntimeError (one line) when the library is missing, the metadata server does not answer, or the engine
    cannot start. max_in_flight: parts of a write submitted at once; timeout_s: when a write still moving is given
    up (see the module docstring). `close()` ends the engine and its registrations.
    """

    def __init__(self, metadata_server: str, *, max_in_flight: int = MAX_IN_FLIGHT,
                 timeout_s: float = TIMEOUT_S) -> None:
        self.max_in_flight = check_int("max_in_flight", max_in_flight, minimum=1)
        self.timeout_s = check_number("timeout_s", timeout_s, 0, allow_minimum=False)
        url = urlparse(metadata_server) if isinstance(metadata_server, str) else None
        if url is None or url.scheme != "http" or not url.hostname or not url.port:
            raise ValueError(f"metadata_server must be an http://host:port/... URL (the Mooncake master's HTTP "
                             f"metadata server), got {metadata_server!r}")
        try:
            socket.create_connection((url.hostname, url.port), timeout=1.0).close()
        except OSError as e:
            raise RuntimeError(f"no Mooncake metadata server answers at {metadata_server} "
                               f"({e.strerror or e})") from None
        self._engine = _transfer_engine_class()()
        # The name is the engine's key in the metadata server, and must be unique there; the port in it is not
        # listened on (the engine picks its own RPC port), so a free one only makes the name unique.
        self.endpoint = f"127.0.0.1:{_free_port()}"
        if self._engine.initialize(self.endpoint, metadata_server, "tcp", "") != 0:
            raise RuntimeError(f"the Mooncake transfer engine could not start with metadata at {metadata_server}")
        # By the pool's first buffer address: the pool and its buffers' addresses (a hybrid engine registers up to
        # three pools).
        self._registrations: dict[int, tuple[Pool, list[int]]] = {}

    def register(self, pool: Pool) -> KVBuffers:
        if pool.device.type != "cpu":
            raise ValueError(f"pool is on {pool.device}: the non-CUDA Mooncake transfer engine moves host memory only")
        buffers = [layer_buffers(pool, layer) for layer in range(num_layers(pool))]
        addresses = [b.data_ptr() for layer in buffers for b in layer]
        if addresses[0] in self._registrations:
            raise ValueError("pool is registered with this transport already")
        sizes = [b.numel() * b.element_size() for layer in buffers for b in layer]
        if self._engine.batch_register_memory(addresses, sizes) != 0:
            raise RuntimeError(f"the Mooncake transfer engine could not register {sum(sizes)} bytes of KV pool")
        self._registrations[addresses[0]] = (pool, addresses)  # the pool must outlive the registration
        return KVBuffers(self.endpoint, tuple(tuple(b.data_ptr() for b in layer) for layer in buffers),
                         page_bytes(pool), num_pages(pool))

    def unregister(self, buffers: KVBuffers) -> None:
        registration = self._registrations.pop(_first_address(buffers), None) \
            if buffers.endpoint == self.endpoint else None
        if registration is not None:
            self._engine.batch_unregister_memory(registration[1])

    def check_peer(self, buffers: KVBuffers) -> None:
        code = self._engine.send_probe(buffers.endpoint)
        if code != 0:
            raise RuntimeError(f"the KV peer {buffers.endpoint} is not listening (Mooncake probe returned {code})")

    def _write(self, src: KVBuffers, dst: KVBuffers, layers: list[int], src_starts: np.ndarray,
               dst_starts: np.ndarray, lengths: np.ndarray) -> Transfer:
        if src.endpoint != self.endpoint or _first_address(src) not in self._registrations:
            raise ValueError(f"src {src.endpoint} is not registered with this transport")
        parts = []  # (source address, destination address, bytes) of every run in every buffer
        for layer in layers:
            for src_base, dst_base, size in zip(src.addresses[layer], dst.addresses[layer], src.page_bytes):
                parts += zip((src_base + src_starts * size).tolist(), (dst_base + dst_starts * size).tolist(),
                             (lengths * size).tolist())
        transfer = _MooncakeTransfer(self._engine, dst.endpoint, parts, self.max_in_flight, self.timeout_s)
        transfer.poll()  # submits the first window
        return transfer

    def close(self) -> None:
        if self._engine is not None:
            for _, addresses in self._registrations.values():
                self._engine.batch_unregister_memory(addresses)
            self._registrations.clear()
            self._engine = None  # its destructor removes it from the metadata server


class _MooncakeTransfer(Transfer):
    """The parts of one write, submitted as single-run Mooncake batches at most `max_in_flight` at a time and polled
    one by one. FAILED once a part failed (or could not be submitted, or `timeout_s` passed) and no submitted part
    is still in flight, or once `timeout_s` passed: then a part may still be moving, which Mooncake cannot recall."""

    def __init__(self, engine, peer: str, parts: list[tuple[int, int, int]], max_in_flight: int,
                 timeout_s: float) -> None:
        self._engine = engine
        self._peer = peer
        self._parts = parts
        self._next = 0  # the first part not submitted yet
        self._in_flight: list[int] = []
        self._max_in_flight = max_in_flight
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s

    def poll(self) -> TransferStatus:
        if self._engine is None:
            return TransferStatus.FAILED if self.error else TransferStatus.DONE
        still = []
        for batch in self._in_flight:
            code = self._engine.transfer_check_status(batch)  # 1 done, 0 in flight, -1 failed, -2 timed out
            if code == 0:
                still.append(batch)
            elif code < 0:
                self._fail(f"a Mooncake write to {self._peer} {'timed out' if code == -2 else 'failed'}")
        self._in_flight = still
        engine = self._engine
        while not self.error and self._next < len(self._parts) and len(self._in_flight) < self._max_in_flight:
            batch = engine.transfer_submit_write(self._peer, *self._parts[self._next])
            if batch in _FAILED_IDS:
                self._fail(f"the KV peer {self._peer} is not listening (Mooncake could not start a write)")
            else:
                self._in_flight.append(batch)
                self._next += 1
        if self._in_flight and time.monotonic() > self._deadline:
            self._fail(f"a Mooncake write to {self._peer} did not end within {self._timeout_s} s")
            self._in_flight = []  # abandoned: Mooncake has no call that stops a write
        if self._in_flight or (not self.error and self._next < len(self._parts)):
            return TransferStatus.PENDING
        self._engine = None  # ended: it no longer keeps the transfer engine alive
        return TransferStatus.FAILED if self.error else TransferStatus.DONE

    def _fail(self, error: str) -> None:
        self.error = self.error or error


def _first_address(buffers: KVBuffers) -> int | None:
    return buffers.addresses[0][0] if buffers.addresses and buffers.addresses[0] else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
