"""The storage tier under the host tier: pages in a file store (the default) or the Mooncake store."""

from __future__ import annotations

import os

from kvmem.storage.base import PageStore, StorageBackend, StorageStats
from kvmem.storage.file_store import FileStore
from kvmem.storage.mooncake_server import MooncakeServer
from kvmem.storage.mooncake_store import MooncakeStore

STORE_SCHEMES = ("file", "mooncake")


def parse_store_spec(spec: str) -> tuple[str, str]:
    """(scheme, where) of a store spec: "file:DIR" (a leading ~ is the home folder) or "mooncake:HOST:PORT" (a
    Mooncake master)."""
    scheme, _, where = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if scheme not in STORE_SCHEMES or not where.strip() or "\0" in where:
        raise ValueError(f"storage must be 'file:DIR' or 'mooncake:HOST:PORT', got {spec!r}")
    return scheme, os.path.expanduser(where) if scheme == "file" else where


def open_store(spec: str, *, metadata_server: str = "P2PHANDSHAKE", capacity_bytes: int | None = None) -> PageStore:
    """The store a spec names: `FileStore(DIR, capacity_bytes)` for "file:DIR", `MooncakeStore(HOST:PORT,
    metadata_server)` for "mooncake:HOST:PORT" (capacity_bytes is the Mooncake segments' business there).
    Raises ValueError for a bad spec or directory, RuntimeError for a store that cannot be reached."""
    scheme, where = parse_store_spec(spec)
    if scheme == "file":
        return FileStore(where, capacity_bytes)
    return MooncakeStore(where, metadata_server)


__all__ = ["FileStore", "MooncakeServer", "MooncakeStore", "PageStore", "StorageBackend", "StorageStats",
           "open_store", "parse_store_spec"]
