"""The transport interface: write these pages of these layers from my pool into these pages of the peer's pool.

A transport registers a pool (`register` -> `KVBuffers`, which a peer needs to address it) and writes pages from a
pool it registered into a peer's registered pool (`write` -> `Transfer`). A write returns at once; its Transfer is
polled (`poll`) or waited for with a bound (`wait`), and reports failure (`error`, one line) instead of raising.
FAILED and DONE are final: no byte of that transfer lands after either is reported, so the receiving side may reuse
the pages then and not before. Pages are whole pages (see `kvmem.disagg.layout`); runs of pages that follow each
other on both sides go as one copy per buffer.
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvmem._checks import check_number
from kvmem.disagg.layout import Pool, engine_pools


class TransferStatus(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class Transfer(ABC):
    """One write in flight. `error`: why it failed (one line), "" otherwise."""

    error: str = ""

    @abstractmethod
    def poll(self) -> TransferStatus:
        """Where the transfer is, without waiting."""

    def wait(self, timeout_s: float) -> TransferStatus:
        """Polls until the transfer ends or `timeout_s` seconds pass, then returns its status (PENDING at the bound:
        its bytes may still land, so its pages stay reserved until a later poll says it ended)."""
        deadline = time.monotonic() + check_number("timeout_s", timeout_s, 0)
        pause = 5e-5
        while (status := self.poll()) is TransferStatus.PENDING and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
        return status


class Finished(Transfer):
    """A transfer that ended when it was submitted: DONE, or FAILED with `error`."""

    def __init__(self, error: str = "") -> None:
        self.error = error

    def poll(self) -> TransferStatus:
        return TransferStatus.FAILED if self.error else TransferStatus.DONE


class AllOf(Transfer):
    """Several writes as one (a hybrid request's full pages, window pages and state): PENDING while any is, then
    FAILED with the first error, or DONE. So it fails only once none of its writes moves."""

    def __init__(self, transfers: Sequence[Transfer]) -> None:
        self._transfers = list(transfers)

    def poll(self) -> TransferStatus:
        statuses = [t.poll() for t in self._transfers]
        if TransferStatus.PENDING in statuses:
            return TransferStatus.PENDING
        self.error = next((t.error for t in self._transfers if t.error), "")
        return TransferStatus.FAILED if TransferStatus.FAILED in statuses else TransferStatus.DONE


@dataclass(frozen=True)
class KVBuffers:
    """Where a registered pool keeps its pages, as a peer addresses them: `endpoint` names the transport's end that
    holds them, `addresses[l][b]` is the start of buffer b of layer l (a memory address), `page_bytes[b]` a page's
    bytes in buffer b of any layer, `num_pages` the pool's pages (page 0 is padding, never written)."""

    endpoint: str
    addresses: tuple[tuple[int, ...], ...]
    page_bytes: tuple[int, ...]
    num_pages: int

    def to_dict(self) -> dict:
        return {"endpoint": self.endpoint, "addresses": [list(a) for a in self.addresses],
                "page_bytes": list(self.page_bytes), "num_pages": self.num_pages}

    @classmethod
    def from_dict(cls, fields: dict) -> KVBuffers:
        try:
            return cls(str(fields["endpoint"]), tuple(tuple(int(x) for x in a) for a in fields["addresses"]),
                       tuple(int(x) for x in fields["page_bytes"]), int(fields["num_pages"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed KV buffers from the peer: {e!r}") from None


class KVTransport(ABC):
    """Moves pages from pools registered here into pools a peer registered (see the module docstring)."""

    @abstractmethod
    def register(self, pool: Pool) -> KVBuffers:
        """Makes `pool`'s buffers writable by peers and readable by `write`; the pool must outlive its registration."""

    @abstractmethod
    def unregister(self, buffers: KVBuffers) -> None:
        """Ends a registration: later writes into or out of it fail."""

    @abstractmethod
    def check_peer(self, buffers: KVBuffers) -> None:
        """Raises RuntimeError (one line) when the end holding `buffers` does not answer."""

    def write(self, src: KVBuffers, src_pages, dst: KVBuffers, dst_pages, layers: Sequence[int] | None = None
              ) -> Transfer:
        """Copies pages src_pages[i] of `src` (registered here) into pages dst_pages[i] of `dst`, in every buffer of
        `layers` (layer ids; None: every layer). Pages: 1-D integer sequences of equal length, in [1, num_pages) of
        their pool, destinations distinct. Raises ValueError for bad pages or layers, or buffers of different page
        sizes, before anything moves."""
        src_pages = _pages("src_pages", src_pages, src.num_pages)
        dst_pages = _pages("dst_pages", dst_pages, dst.num_pages)
        if len(src_pages) != len(dst_pages):
            raise ValueError(f"src_pages has {len(src_pages)} pages, dst_pages {len(dst_pages)}")
        if len(np.unique(dst_pages)) != len(dst_pages):
            raise ValueError("dst_pages lists a page more than once")
        if src.page_bytes != dst.page_bytes or len(src.addresses) != len(dst.addresses):
            raise ValueError(f"the pools store pages differently: {len(src.addresses)} layers of {src.page_bytes} "
                             f"bytes here, {len(dst.addresses)} of {dst.page_bytes} at {dst.endpoint}")
        layer_num = len(src.addresses)
        if layers is None:
            layers = range(layer_num)
        elif isinstance(layers, (str, bytes)) or len(set(layers)) != len(layers) or \
                not all(isinstance(x, int) and 0 <= x < layer_num for x in layers):
            raise ValueError(f"layers must be distinct layer ids in [0, {layer_num}), got {layers!r}")
        if not len(src_pages):
            return Finished()
        return self._write(src, dst, list(layers), *page_runs(src_pages, dst_pages))

    @abstractmethod
    def _write(self, src: KVBuffers, dst: KVBuffers, layers: list[int], src_starts: np.ndarray,
               dst_starts: np.ndarray, lengths: np.ndarray) -> Transfer:
        """write's body: in each layer of `layers`, runs of `lengths[i]` pages from page src_starts[i] to page
        dst_starts[i]."""

    def close(self) -> None:
        """Releases the transport's resources; registrations end."""


def page_runs(src_pages: np.ndarray, dst_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src_starts, dst_starts, lengths) [runs] int64: the pairs of page lists cut where either stops counting up by
    one, so that each run is one contiguous copy on both sides."""
    breaks = np.flatnonzero((np.diff(src_pages) != 1) | (np.diff(dst_pages) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(src_pages)])))
    return src_pages[starts], dst_pages[starts], lengths


def _pages(name: str, pages, num_pages: int) -> np.ndarray:
    array = np.asarray(pages)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be a 1-D sequence of page ids, got {array.dtype} of shape {array.shape}")
    array = array.astype(np.int64)
    if array.size and (array.min() < 1 or array.max() >= num_pages):
        bad = array.min() if array.min() < 1 else array.max()
        raise ValueError(f"{name} holds page {bad}, outside [1, {num_pages})")
    return array


class EngineBuffers(NamedTuple):
    """An engine's registered pools, as a peer addresses them: `kv`, the (full-attention layers') KV pages; `window`
    and `state`, a hybrid engine's window KV pages and state slots (None where it has none)."""

    kv: KVBuffers
    window: KVBuffers | None
    state: KVBuffers | None

    @classmethod
    def register(cls, transport: KVTransport, engine) -> EngineBuffers:
        """Registers every pool of a `kvmem.engine.Engine` (none stays registered when one fails)."""
        done: list[KVBuffers] = []
        try:
            for pool in engine_pools(engine):
                done.append(None if pool is None else transport.register(pool))
        except BaseException:
            for b in done:
                if b is not None:
                    transport.unregister(b)
            raise
        return cls(*done)

    def unregister(self, transport: KVTransport) -> None:
        for b in self:
            if b is not None:
                transport.unregister(b)

    def to_dicts(self) -> tuple[dict, dict | None, dict | None]:
        return tuple(None if b is None else b.to_dict() for b in self)
