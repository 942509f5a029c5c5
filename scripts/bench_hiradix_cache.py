#!/usr/bin/env python3
"""What the host tier costs the radix cache: HiRadixCache against RadixCache on the same calls and keys.

The rows are bench_radix_cache.py's (match_prefix and insert of 1k/32k/256k-token keys on a path of 512-token
nodes; evict(64) at 1k to 200k leaves of 16 and 1 tokens), run on three caches over the same device allocator:

  radix            RadixCache (no host tier)
  hi_write_back    HiRadixCache, write_back: nothing is copied until eviction. On match and insert rows this is
                   a device-only workload on a tiered cache, the overhead the issue bounds at 10%.
  hi_write_through HiRadixCache, write_through: every insert also starts a backup to the host (the host pool is a
                   HostSlotPool: slots without bytes, so the rows time the bookkeeping, not the copy).

On a tiered cache, evict(64) is device eviction that keeps backed-up leaves as host-only nodes (write_back backs
each up first): tier work the plain cache does not do. `evict_host` rows time HiRadixCache.evict_host(64) at the
same leaf counts, once every leaf is host-only (each call frees 64 tokens of host-only leaves, refilled
untimed). Both tiers' evictions pop from ordered sets: the cost must stay flat as the leaf count grows.

SGLang 0.5.23 (the peer venv) has no HiRadixCache class any more: its hierarchical cache is UnifiedRadixCache
with a HybridCacheController that needs server arguments and CUDA copy engines, so it cannot be built on this
CPU; bench_radix_cache.py times its unified tree's device eviction (the same LRU-list bookkeeping).

    python scripts/bench_hiradix_cache.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from array import array
from pathlib import Path

from bench_radix_cache import EVICT_AMOUNT, EVICT_LEAVES, SHARED_PREFIX, kvmem_side_factory, run_rows, summary, timed

from kvmem._checks import output_file_arg


def side_factory(tiered: str | None):
    """bench_radix_cache's kvmem side over RadixCache (tiered None) or HiRadixCache with that write policy."""
    from kvmem import HiRadixCache, ReqToTokenPool
    from kvmem.tiers import HostSlotPool

    class Side(kvmem_side_factory()):
        def __init__(self, size: int) -> None:
            super().__init__(size)
            if tiered is not None:
                self.cache = HiRadixCache(ReqToTokenPool(1, 1), self.alloc_, HostSlotPool(4 * size),
                                          write_policy=tiered)

    return Side


def evict_host_row(leaves: int, leaf_tokens: int) -> dict:
    """HiRadixCache.evict_host(64) with `leaves` host-only leaves under a shared prefix."""
    Side = side_factory("write_through")
    side = Side(SHARED_PREFIX + (leaves + 4 * EVICT_AMOUNT) * leaf_tokens + 1024)
    cache = side.cache
    prefix = array("q", range(1, SHARED_PREFIX + 1))
    prefix_slots = side.alloc(SHARED_PREFIX)
    cache.insert(prefix, prefix_slots)
    cache.inc_lock_ref(cache.match_prefix(prefix).last_node)  # the prefix stays on device: leaves hang below it
    next_leaf = [0]

    def add_host_leaves(n: int) -> None:
        for _ in range(n):
            first = 100_000 + next_leaf[0] * leaf_tokens
            next_leaf[0] += 1
            cache.insert(prefix + array("q", range(first, first + leaf_tokens)),
                         side.cat(prefix_slots, side.alloc(leaf_tokens)))
        cache.evict(n * leaf_tokens)  # backed up on insert: each leaf stays as host-only

    t0 = time.perf_counter()
    add_host_leaves(leaves)
    build_s = time.perf_counter() - t0
    assert cache.host_evictable_size() == leaves * leaf_tokens, "every leaf must be host-only"
    freed = [0]

    def evict(_):
        freed[0] = cache.evict_host(EVICT_AMOUNT)
        return freed[0]

    reps = 200
    out = summary(timed(evict, reps, lambda: add_host_leaves(freed[0] // leaf_tokens), work=int), "host_tokens_freed")
    out.update(build_s=round(build_s, 3))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller rows only (no 256k keys, no 200k leaves)")
    ap.add_argument("--out", type=output_file_arg, help="also write the JSON report here")
    args = ap.parse_args(argv)
    gc.disable()  # a collection of a 200k-node tree would land inside some timed call
    sides = {}
    for name, tiered in (("radix", None), ("hi_write_back", "write_back"), ("hi_write_through", "write_through")):
        print(f"[bench_hiradix_cache] {name}", file=sys.stderr, flush=True)
        sides[name] = run_rows(side_factory(tiered), args.quick, with_list_key=False)
        gc.collect()
    leaves_list = EVICT_LEAVES[:3] if args.quick else EVICT_LEAVES
    evict_host = {f"evict_host/{n}/{t}": evict_host_row(n, t) for t in (16, 1) for n in leaves_list}
    gc.enable()

    rows = []
    for name, base in sides["radix"].items():
        if name.startswith("match_prefix_with_indices/"):
            continue
        row = {"row": name, "radix_us": base["median_us"]}
        for tier in ("hi_write_back", "hi_write_through"):
            row[f"{tier}_us"] = sides[tier][name]["median_us"]
            row[f"{tier}_ratio"] = round(sides[tier][name]["median_us"] / base["median_us"], 3)
        rows.append(row)
    for name, res in evict_host.items():
        rows.append({"row": name, "hi_write_through_us": res["median_us"], "build_s": res["build_s"]})
    device_only = [r["hi_write_back_ratio"] for r in rows if r["row"].startswith(("match_prefix/", "insert/"))]
    report = {
        "rows": rows,
        "goals": {
            "device_only_worst_ratio_write_back": max(device_only),
            "device_only_within_10_percent": max(device_only) <= 1.10,
            "evict_host_40k_leaves_us": [r["hi_write_through_us"] for r in rows
                                         if r["row"].startswith("evict_host/40000/")],
        },
        "meta": {"python": platform.python_version(), "machine": platform.machine(), "page_size": 1,
                 "eviction_policy": "lru", "evict_amount": EVICT_AMOUNT},
        "raw": {**sides, "evict_host": evict_host},
    }
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
