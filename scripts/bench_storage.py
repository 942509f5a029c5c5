#!/usr/bin/env python3
"""Storage-tier throughput: batch_set, batch_exists and batch_get of real KV pages, per backend.

Pages come from a `HostKVPool` in a model's storage format (random KV, so that nothing compresses), named by
the chained page digests a cache would give them. Each backend writes the pages, checks their presence, then
reads them back into other host slots and compares them bit for bit (a row is reported only when the pages
read equal the pages written):

  file       `FileStore` in a fresh temporary directory (the embedded default)
  mooncake   `MooncakeStore` over a local `MooncakeServer` (a master and a storage process on 127.0.0.1)

Rows per backend and page shape: pages/s and GB/s (1e9 bytes of payload, the KV alone) of each call, as the
median of --repeats runs, each over --pages pages in batches of the store's batch size. A read is timed after
a write of the same pages by the same process: the file store reads from the page cache, as a warm node would.

    python scripts/bench_storage.py [--pages 256] [--repeats 3] [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from kvmem import HostKVPool, MHAKVPool
from kvmem._checks import check_host_bytes, output_file_arg, positive_int_arg
from kvmem.page_hash import page_digests, storage_key
from kvmem.storage import FileStore

# (name, layers, kv heads, head dim, page size): Llama-3-8B's KV at bf16 (2 MiB pages of 16 tokens), one layer
# of it (64 KiB pages: the per-call overhead shows), and a 1-token page of one layer (4 KiB).
SHAPES = [("llama-3-8b page 16", 32, 8, 128, 16), ("one layer page 16", 1, 8, 128, 16),
          ("one layer page 1", 1, 8, 128, 1)]


def host_pages(layers: int, heads: int, head_dim: int, page_size: int, pages: int):
    """A host pool holding `pages` pages of random KV twice over (a source and a destination), and their keys."""
    tokens = pages * page_size
    device = MHAKVPool(page_size, page_size, torch.bfloat16, heads, head_dim, layers)
    host = HostKVPool(device, size=3 * tokens)
    src = host.allocator.alloc(tokens).numpy()
    rng = np.random.default_rng(0)
    host.write_pages(src, [rng.bytes(host.page_payload_bytes()) for _ in range(pages)])
    keys = [storage_key(d) for d in page_digests(rng.integers(0, 128_256, tokens).tolist(), page_size)]
    return host, src, keys


def time_backend(store, host, src, keys, repeats: int) -> dict:
    dst = host.allocator.alloc(len(src)).numpy()
    payload = host.page_payload_bytes() * len(keys)
    rows: dict[str, list[float]] = {"batch_set": [], "batch_exists": [], "batch_get": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        stored = store.batch_set(keys, host, src)
        rows["batch_set"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        present = store.batch_exists(keys)
        rows["batch_exists"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got = store.batch_get(keys, host, dst)
        rows["batch_get"].append(time.perf_counter() - t0)
        if (stored, present, got) != (len(keys),) * 3:
            raise RuntimeError(f"{type(store).__name__}: stored {stored}, found {present}, read {got} of "
                               f"{len(keys)} pages")
        if host.read_pages(src) != host.read_pages(dst):
            raise RuntimeError(f"{type(store).__name__}: the pages read differ from the pages written")
        _clear(store, keys)
    out = {}
    for name, seconds in rows.items():
        s = statistics.median(seconds)
        out[name] = {"pages_per_s": round(len(keys) / s, 1), "us_per_page": round(s / len(keys) * 1e6, 2)}
        if name != "batch_exists":
            out[name]["gbps"] = round(payload / s / 1e9, 3)
    return out


def _clear(store, keys) -> None:
    """Drops the pages, so that the next repeat writes them again instead of finding them present."""
    for key in keys:
        store._discard(key)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=positive_int_arg, default=256, help="pages per call (default 256)")
    ap.add_argument("--repeats", type=positive_int_arg, default=3)
    ap.add_argument("--quick", action="store_true", help="32 pages, one repeat, the small shapes only")
    ap.add_argument("--out", type=output_file_arg, help="also write the JSON report here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # page gathers are small copies: a thread pool only waits on a shared machine
    pages, repeats, shapes = (32, 1, SHAPES[1:]) if args.quick else (args.pages, args.repeats, SHAPES)
    # The largest host pool (its Mooncake segment is 2/3 of it), checked before the Mooncake master starts: more
    # pages than this machine holds abort Mooncake's storage process, or fail the pool, only once it runs.
    try:
        check_host_bytes(f"a host pool of {3 * pages} pages", 3 * pages * _biggest_page(shapes))
    except ValueError as e:
        ap.error(f"argument --pages: {e}")

    report = {"machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads", "pages": pages,
              "repeats": repeats, "rows": []}
    # SIGTERM as Ctrl-C: the finally below stops the Mooncake master and storage process it started.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _run(args, report, pages, repeats, shapes)
    except KeyboardInterrupt:
        print("bench_storage: interrupted", file=sys.stderr)
        return 130


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _run(args: argparse.Namespace, report: dict, pages: int, repeats: int, shapes) -> int:
    mooncake = _mooncake_server(pages, shapes)
    try:
        for name, layers, heads, head_dim, ps in shapes:
            host, src, keys = host_pages(layers, heads, head_dim, ps, pages)
            row = {"shape": name, "page_payload_bytes": host.page_payload_bytes()}
            with tempfile.TemporaryDirectory(prefix="kvmem-bench-storage-") as tmp:
                row["file"] = time_backend(FileStore(tmp), host, src, keys, repeats)
            if isinstance(mooncake, str):
                row["mooncake"] = {"error": mooncake}
            else:
                from kvmem.storage import MooncakeStore

                store = MooncakeStore(mooncake.master_addr, mooncake.metadata_server,
                                      local_buffer_mb=max(64, 2 * host.page_payload_bytes() * 32 >> 20))
                row["mooncake"] = time_backend(store, host, src, keys, repeats)
                store.close()
            report["rows"].append(row)
    finally:
        if not isinstance(mooncake, str):
            mooncake.stop()
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


def _mooncake_server(pages: int, shapes):
    """A local Mooncake store big enough for the largest shape's pages, or why there is none."""
    try:
        from kvmem.storage import MooncakeServer
        from kvmem.storage.mooncake_store import _mooncake_store_class

        _mooncake_store_class()
    except RuntimeError as e:
        return str(e)
    return MooncakeServer(segment_mb=max(256, 2 * pages * _biggest_page(shapes) >> 20)).start()


def _biggest_page(shapes) -> int:
    """Bytes of the largest shape's page: K and V at bfloat16."""
    return max(layers * heads * head_dim * 2 * 2 * ps for _, layers, heads, head_dim, ps in shapes)


if __name__ == "__main__":
    sys.exit(main())
