"""Throughput of moving KV pages between two pools: Mooncake's transfer engine over TCP on 127.0.0.1 (the
MooncakeTransport kvmem.disagg uses, and the engine's own batch call on the same runs) beside torch copies of the same
bytes in one process (the CopyTransport's indexed copies, and one flat memcpy).

The layer set is shaped like Llama-3-8B's KV: 32 layers, 8 KV heads, head dim 128, bfloat16 (128 KiB a token). Pages
go to the receiving pool either in order (runs of pages: one copy per buffer) or shuffled (one copy per page per
buffer). The engine's batch call goes in batches of 1,024 runs, one after another. Each figure is the best of
--repeats runs. Prints one JSON object.

    python scripts/bench_kv_transfer.py [--page-sizes 16,512] [--pool-tokens 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from kvmem import MHAKVPool  # noqa: E402
from kvmem._checks import positive_int_arg  # noqa: E402
from kvmem.disagg import CopyTransport, KVLayout, MooncakeTransport, TransferStatus  # noqa: E402
from kvmem.disagg.transport import page_runs  # noqa: E402
from kvmem.storage import MooncakeServer  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
BATCH_ENTRIES = 1024  # the most one batch_transfer_sync_write took (4096 failed at once)


def best_seconds(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def figures(seconds: float, pages: int, nbytes: int) -> dict:
    return {"seconds": round(seconds, 6), "pages_per_s": round(pages / seconds, 1),
            "gb_per_s": round(nbytes / seconds / 1e9, 3)}


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    """One flat copy of `nbytes` between two fresh tensors: the bound for the same bytes in one process."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    return best_seconds(lambda: dst.copy_(src), repeats)


def bench_page_size(page_size: int, pool_tokens: int, repeats: int, metadata_server: str) -> dict:
    make = lambda: MHAKVPool(pool_tokens, page_size, DTYPE, KV_HEADS, HEAD_DIM, LAYERS)  # noqa: E731
    src, dst = make(), make()
    for buf in src.k_buffer + src.v_buffer:
        buf.normal_()
    layout = KVLayout.of(src)
    pages = pool_tokens // page_size  # usable pages 1..pages
    src_pages = np.arange(1, pages + 1)
    nbytes = pages * layout.bytes_per_page
    orders = {"in_order": src_pages, "shuffled": np.random.default_rng(0).permutation(src_pages)}
    out = {"page_size": page_size, "pages": pages, "bytes_per_page": layout.bytes_per_page, "bytes": nbytes}

    copy = CopyTransport()
    a, b = copy.register(src), copy.register(dst)
    for name, dst_pages in orders.items():
        out[f"copy_transport_{name}"] = figures(
            best_seconds(lambda: copy.write(a, src_pages, b, dst_pages), repeats), pages, nbytes)
    out["memcpy"] = figures(memcpy_seconds(nbytes, repeats), pages, nbytes)

    sender, receiver = MooncakeTransport(metadata_server), MooncakeTransport(metadata_server)
    try:
        a, b = sender.register(src), receiver.register(dst)

        def through_transport(dst_pages):
            transfer = sender.write(a, src_pages, b, dst_pages)
            if transfer.wait(600) is not TransferStatus.DONE:
                raise RuntimeError(f"a Mooncake write failed: {transfer.error or 'still pending after 600 s'}")

        def batch_call(dst_pages):
            srcs, dsts, lengths = _addresses(a, b, src_pages, dst_pages)
            for i in range(0, len(srcs), BATCH_ENTRIES):  # the engine's own batch write, on the transport's engine
                chunk = slice(i, i + BATCH_ENTRIES)
                if sender._engine.batch_transfer_sync_write(b.endpoint, srcs[chunk], dsts[chunk], lengths[chunk]):
                    raise RuntimeError("a Mooncake batch write failed")

        for name, dst_pages in orders.items():
            dst.k_buffer[0].zero_()
            out[f"mooncake_transport_{name}"] = figures(
                best_seconds(lambda: through_transport(dst_pages), repeats), pages, nbytes)
            out[f"mooncake_batch_call_{name}"] = figures(
                best_seconds(lambda: batch_call(dst_pages), repeats), pages, nbytes)
        last = orders["shuffled"]
        check = src.k_buffer[0].view(pages + 1, page_size, KV_HEADS, HEAD_DIM)[src_pages[:4]]
        assert torch.equal(check, dst.k_buffer[0].view(pages + 1, page_size, KV_HEADS, HEAD_DIM)[last[:4]])
    finally:
        sender.close()
        receiver.close()
    for name in orders:
        out[f"mooncake_vs_memcpy_{name}"] = round(out["memcpy"]["seconds"] /
                                                  out[f"mooncake_transport_{name}"]["seconds"], 4)
    return out


def _addresses(src, dst, src_pages, dst_pages):
    """Every (source, destination, length) of a write's runs, as MooncakeTransport computes them."""
    srcs, dsts, lengths = [], [], []
    starts = page_runs(src_pages, np.asarray(dst_pages))
    for src_layer, dst_layer in zip(src.addresses, dst.addresses):
        for s_base, d_base, page_bytes in zip(src_layer, dst_layer, src.page_bytes):
            srcs += (s_base + starts[0] * page_bytes).tolist()
            dsts += (d_base + starts[1] * page_bytes).tolist()
            lengths += (starts[2] * page_bytes).tolist()
    return srcs, dsts, lengths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page-sizes", default="16,512")
    parser.add_argument("--pool-tokens", type=positive_int_arg, default=4096)
    parser.add_argument("--repeats", type=positive_int_arg, default=3)
    args = parser.parse_args(argv)
    page_sizes = [positive_int_arg(p) for p in args.page_sizes.split(",")]
    if any(args.pool_tokens % p for p in page_sizes):
        parser.error(f"--pool-tokens {args.pool_tokens} must be a multiple of every page size in {page_sizes}")
    torch.manual_seed(0)
    # One torch thread: on this shared 2-core VM two OpenMP threads made a 1 MiB copy ~100x slower under load
    # (0.08 against 10.8 GB/s), and the transfer engine's own threads need the cores too.
    torch.set_num_threads(1)
    with MooncakeServer(16, metadata="http") as server:
        results = [bench_page_size(p, args.pool_tokens, args.repeats, server.metadata_server) for p in page_sizes]
    print(json.dumps({"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16",
                      "pool_tokens": args.pool_tokens, "torch_threads": torch.get_num_threads(),
                      "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
