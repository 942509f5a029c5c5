"""The storage tier under the host tier: pages in a file store (the default), the Mooncake store, or a simulated
store (keys and capacity without bytes, for replays)."""

from __future__ import annotations

import os

from kvmem.storage.base import PageStore, StorageBackend, StorageStats
from kvmem.storage.file_store import FileStore
from kvmem.storage.mooncake_server import MooncakeServer
from kvmem.storage.mooncake_store import DEFAULT_CONNECT_TIMEOUT_S, MooncakeStore
from kvmem.storage.sim_store import SimStore

STORE_SCHEMES = ("sim", "file", "mooncake")


def parse_store_spec(spec: str) -> tuple[str, str]:
    """(scheme, where) of a store spec: "sim" or "sim:CAPACITY_TOKENS" (a simulated store; where: its capacity,
    "" for none), "file:DIR" (a leading ~ is the home folder) or "mooncake:HOST:PORT" (a Mooncake master)."""
    scheme, _, where = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if scheme == "sim":
        ok = spec == "sim" or (where.isascii() and where.isdigit() and int(where) > 0)
    else:
        ok = scheme in STORE_SCHEMES and bool(where.strip()) and "\0" not in where
    if not ok:
        raise ValueError(f"storage must be 'sim[:CAPACITY_TOKENS]' (a simulated store), 'file:DIR' or "
                         f"'mooncake:HOST:PORT', got {spec!r}")
    return scheme, os.path.expanduser(where) if scheme == "file" else where


def open_store(spec: str, *, metadata_server: str = "P2PHANDSHAKE", capacity_bytes: int | None = None,
               connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> PageStore | SimStore:
    """The store a spec names: `SimStore(CAPACITY_TOKENS)` for "sim[:CAPACITY_TOKENS]", `FileStore(DIR,
    capacity_bytes)` for "file:DIR", `MooncakeStore(HOST:PORT, metadata_server, connect_timeout_s=...)` for
    "mooncake:HOST:PORT" (capacity_bytes is the Mooncake segments' business there, and the spec's for a simulated
    store). Raises ValueError for a bad spec or directory, RuntimeError for a store that cannot be reached."""
    scheme, where = parse_store_spec(spec)
    if scheme == "sim":
        return SimStore(int(where) if where else None)
    if scheme == "file":
        return FileStore(where, capacity_bytes)
    return MooncakeStore(where, metadata_server, connect_timeout_s=connect_timeout_s)


__all__ = ["FileStore", "MooncakeServer", "MooncakeStore", "PageStore", "SimStore", "StorageBackend", "StorageStats",
           "open_store", "parse_store_spec"]
