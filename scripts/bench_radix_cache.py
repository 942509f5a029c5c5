#!/usr/bin/env python3
"""Radix cache micro-benchmarks: kvmem's RadixCache beside SGLang's, on the same calls and the same keys.

Rows (page_size 1, LRU, CPU tensors; median microseconds per call):
  match_prefix  keys of 1k, 32k and 256k tokens, cached as a path of 512-token nodes (the shape that
                multi-turn chats and chunked prefill give the tree); the whole key matches.
  insert        a key of 1k / 32k / 256k tokens whose first half is that cached path and whose second half
                is new (a new leaf per call).
  evict(64)     at 1k, 10k, 40k and 200k evictable leaves under a shared 64-token prefix, with 16-token
                leaves (4 nodes freed a call) and 1-token leaves (64 nodes a call). Evicted leaves are
                replaced, untimed, between calls so that the leaf count stays put.
kvmem is given each key as an int64 `array("q")`, the same object SGLang wraps in its RadixKey; the
`kvmem_list_key_us` column gives kvmem the key as a Python list instead (conversion included).

One command measures both sides: kvmem in this process, then SGLang by running this same file with
`--peer sglang` under SGLang's venv python (`--sglang-python`, default /tmp/sglang-peer/bin/python; that
side skipped with a note when it does not exist). SGLang is timed twice: its classic Python RadixCache
(`sglang_us`) and its UnifiedRadixCache on the Rust tree core (`sglang_rust_us`). SGLang's match returns
a length and a node, kvmem's the slot indices too: `*_with_indices_us` add SGLang's path_device_indices.
The unified cache's insert frees the already-cached part of the value itself, so that side's insert
includes that free (and is given fresh slots there): kvmem leaves that free to its caller, so its like-for-like
figure against the Rust core is `kvmem_insert_and_free_us` (insert, then free the duplicate slots), and the bare
insert row is marked lopsided there. The JSON report is printed on stdout, progress on stderr.

Hybrid rows (issue 36): the same kvmem rows on `kvmem.hybrid.HybridRadixCache` with a sliding window of 128 (gpt-oss)
over a `HybridTokenAllocator` whose window pool is as large as its full pool (every node stays live), beside the
full-attention RadixCache: `hybrid.rows[*].ratio` is hybrid_us / kvmem_us, the goal at most HYBRID_GOAL. Both sides
are timed in HYBRID_ROUNDS rounds, hybrid first in every other one, and the ratio is the median of the rounds' ratios,
so that a drift of a shared machine over the run favours neither.

Before a ratio is reported, both sides must have done the same work on that row: every match returned the
same prefix length, every insert found the same cached prefix, every evict call freed the same number of
tokens (`work` in each side's raw rows). A row where they differ gets no ratio and is listed under
`rows_with_unequal_work`.

    python scripts/bench_radix_cache.py [--sglang-python PATH] [--quick] [--out FILE]
"""

from __future__ import annotations

import gc
import json
import operator
import os
import platform
import statistics
import sys
import time
from array import array

import _peer  # scripts/_peer.py: the script's own folder is on sys.path

CHUNK = 512  # tokens per node on the cached path of the match/insert rows
MATCH_LENGTHS = (1024, 32768, 262144)
EVICT_LEAVES = (1000, 10000, 40000, 200000)
EVICT_LEAF_TOKENS = (16, 1)
SHARED_PREFIX = 64
EVICT_AMOUNT = 64
HYBRID_WINDOW = 128  # gpt-oss's sliding window
HYBRID_GOAL = 1.5  # a hybrid tree operation within this factor of the full-attention one's time
EVICT_BUDGET_S = 3.0  # per evict row and side: SGLang's tree takes ~0.5 s a call at 200k leaves
QUICK_EVICT_BUDGET_S = 0.5
HYBRID_ROUNDS = 3  # full-attention and hybrid rows, timed in alternating order (see _peer.hybrid_rows)


# ---- workloads (side-agnostic: a side provides alloc / insert / match / evict / match_with_indices) ----
def path_key(length: int) -> array:
    """Deterministic tokens (the same in both processes, no RNG involved)."""
    return array("q", ((i * 2654435761 + length) % 50000 + 10 for i in range(length)))


def build_path(side, key: array):
    """Caches `key` as a path of CHUNK-token nodes: one insert, then matches of shorter and shorter
    prefixes, each splitting the first node (growing prefixes would cost SGLang's tree cubic time)."""
    slots = side.alloc(len(key))
    side.insert(key, slots)
    for end in range(len(key) - CHUNK, 0, -CHUNK):
        side.match(key[:end])
    return slots


def timed(fn, reps: int, setup=None, work=None) -> tuple[list[float], list[int]]:
    """Microseconds per call of fn(arg), where arg = setup() is prepared untimed before each call, and the
    work each call did (`work(result)`, taken after the clock stops)."""
    out, done = [], []
    for _ in range(reps):
        arg = setup() if setup else None
        t0 = time.perf_counter_ns()
        result = fn(arg)
        out.append((time.perf_counter_ns() - t0) / 1e3)
        if work is not None:
            done.append(work(result))
    return out, done


def progress(message: str) -> None:
    print(f"[bench_radix_cache] {message}", file=sys.stderr, flush=True)


def summary(measured: tuple[list[float], list[int]], what: str) -> dict:
    """Median and min of the samples, and the work: `what` -> the value every call gave, or its range."""
    samples, done = measured
    work = done[0] if len(set(done)) == 1 else {"min": min(done), "max": max(done)}
    return {"median_us": round(statistics.median(samples), 2), "min_us": round(min(samples), 2),
            "reps": len(samples), "work": {what: work}}


def run_rows(make_side, quick: bool, with_list_key: bool) -> dict:
    rows = {}
    lengths = MATCH_LENGTHS[:2] if quick else MATCH_LENGTHS
    for length in lengths:
        # Enough calls that a row spans tens of milliseconds: a burst of noise on a shared VM then moves
        # the median of one row less.
        reps = 1000 if length <= 1024 else 400 if length <= 32768 else 100
        ins_reps = min(reps, 10) if length > 32768 else reps // 4
        half = length // 2
        side = make_side(length + (2 * ins_reps + 2) * half)
        key = path_key(length)
        slots = build_path(side, key)
        side.match(key)  # warm
        rows[f"match_prefix/{length}"] = summary(timed(lambda _: side.match(key), reps, work=side.match_len),
                                                 "matched_tokens")
        rows[f"match_prefix_with_indices/{length}"] = summary(
            timed(lambda _: side.match_with_indices(key), reps, work=side.indices_len), "matched_tokens")
        if with_list_key:
            as_list = key.tolist()
            rows[f"match_prefix_list_key/{length}"] = summary(
                timed(lambda _: side.match(as_list), reps, work=side.match_len), "matched_tokens")
        fresh = iter(range(10**9, 2 * 10**9, half))

        def new_insert():
            start = next(fresh)
            k = key[:half] + array("q", range(start, start + half))
            return k, side.cat(slots[:half], side.alloc(half))

        rows[f"insert/{length}"] = summary(timed(lambda kv: side.insert(*kv), ins_reps, new_insert, int),
                                           "cached_prefix_tokens")
        if hasattr(side, "insert_and_free"):
            def new_insert_with_duplicates():  # as the Rust side's value: the cached half is fresh slots
                start = next(fresh)
                k = key[:half] + array("q", range(start, start + half))
                return k, side.cat(side.alloc(half), side.alloc(half))

            rows[f"insert_and_free/{length}"] = summary(
                timed(lambda kv: side.insert_and_free(*kv), ins_reps, new_insert_with_duplicates, int),
                "cached_prefix_tokens")
        progress(f"match/insert {length} tokens: done")
        side = None  # free this length's tree before the next one is built
        gc.collect()
    leaves_list = EVICT_LEAVES[:3] if quick else EVICT_LEAVES
    for leaf_tokens in EVICT_LEAF_TOKENS:
        for leaves in leaves_list:
            rows[f"evict/{leaves}/{leaf_tokens}"] = evict_row(make_side, leaves, leaf_tokens,
                                                              QUICK_EVICT_BUDGET_S if quick else EVICT_BUDGET_S)
            progress(f"evict at {leaves} leaves of {leaf_tokens} tokens: done")
            gc.collect()
    return rows


def evict_row(make_side, leaves: int, leaf_tokens: int, budget_s: float) -> dict:
    side = make_side(SHARED_PREFIX + (leaves + 4 * EVICT_AMOUNT) * leaf_tokens + 1024)
    prefix = array("q", range(1, SHARED_PREFIX + 1))
    prefix_slots = side.alloc(SHARED_PREFIX)
    side.insert(prefix, prefix_slots)
    next_leaf = [0]

    def add_leaves(n: int) -> None:
        for _ in range(n):
            first = 100_000 + next_leaf[0] * leaf_tokens
            next_leaf[0] += 1
            side.insert(prefix + array("q", range(first, first + leaf_tokens)),
                        side.cat(prefix_slots, side.alloc(leaf_tokens)))

    t0 = time.perf_counter()
    add_leaves(leaves)
    build_s = time.perf_counter() - t0
    freed = [0]

    def refill():
        add_leaves(freed[0] // leaf_tokens)

    def evict(_):
        freed[0] = side.evict(EVICT_AMOUNT)

    per_call = max(1, EVICT_AMOUNT // leaf_tokens)
    t0 = time.perf_counter()
    evict(None)
    first = time.perf_counter() - t0
    reps = int(max(3, min(200, budget_s / max(first, 1e-6))))
    refill()
    out = summary(timed(evict, reps, refill, lambda _: freed[0]), "evicted_tokens_per_call")
    out.update(build_s=round(build_s, 3), nodes_freed_per_call=per_call)
    return out


# ---- kvmem side ------------------------------------------------------------------------------------
def kvmem_side_factory(window: int | None = None):
    """kvmem's RadixCache, or (window) its HybridRadixCache with that sliding window."""
    import torch

    from kvmem.allocator import TokenAllocator
    from kvmem.hybrid import HybridRadixCache, HybridTokenAllocator
    from kvmem.radix_cache import RadixCache
    from kvmem.req_to_token import ReqToTokenPool

    class KvmemSide:
        def __init__(self, size: int) -> None:
            if window is None:
                self.alloc_ = TokenAllocator(size)
                self.cache = RadixCache(ReqToTokenPool(1, 1), self.alloc_, page_size=1, eviction_policy="lru")
            else:
                self.alloc_ = HybridTokenAllocator(size, size)
                self.cache = HybridRadixCache(ReqToTokenPool(1, window), self.alloc_, eviction_policy="lru",
                                              window=window)

        def alloc(self, n):
            return self.alloc_.alloc(n)

        @staticmethod
        def cat(a, b):
            return torch.cat((a, b))

        def insert(self, key, value):
            return self.cache.insert(key, value)

        def insert_and_free(self, key, value):
            """What SGLang's UnifiedRadixCache.insert does: the value's already-cached part is freed too."""
            n = self.cache.insert(key, value)
            self.alloc_.free(value[:n])
            return n

        def match(self, key):
            return self.cache.match_prefix(key)

        match_with_indices = match  # kvmem's match always returns the indices

        @staticmethod
        def match_len(m):
            return m.indices.numel()

        indices_len = match_len

        def evict(self, n):
            return self.cache.evict(n)

    return KvmemSide


# ---- SGLang side (runs under SGLang's venv; imports nothing from kvmem) ----------------------------
def sglang_side_factory(sg: dict, rust: bool):
    """SGLang's classic Python RadixCache, or (rust=True) its UnifiedRadixCache on the Rust tree core."""
    torch = sg["torch"]
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    class SglangSide:
        tree_core = "rust" if rust else None

        def __init__(self, size: int) -> None:
            rtp = sg["ReqToTokenPool"](size=1, max_context_len=8, device="cpu", enable_memory_saver=False)
            kv = sg["MHATokenToKVPool"](size=size, page_size=1, dtype=torch.float16, head_num=1, head_dim=8,
                                        layer_num=1, device="cpu", enable_memory_saver=False)
            self.alloc_ = sg["TokenToKVPoolAllocator"](size=size, dtype=torch.float16, device="cpu", kvcache=kv,
                                                       need_sort=False)
            common = dict(disable=False, req_to_token_pool=rtp, token_to_kv_pool_allocator=self.alloc_,
                          page_size=1, eviction_policy="lru")
            if rust:
                self.cache = sg["UnifiedRadixCache"](sg["CacheInitParams"](
                    **common, tree_components=(sg["ComponentType"].FULL,), tree_core_backend="rust"))
                core = type(self.cache.tree_core).__name__
                if core != "RustUnifiedTreeCore":
                    raise RuntimeError(f"SGLang fell back to {core} instead of its Rust tree core")
            else:
                self.cache = sg["RadixCache"](sg["CacheInitParams"](**common))

        def alloc(self, n):
            return self.alloc_.alloc(n)

        def cat(self, cached, new):
            # UnifiedRadixCache.insert frees the part of a value that the tree already holds (a finished
            # request's duplicate KV), so that part must be fresh slots: the tree's own would be freed twice.
            return torch.cat((self.alloc(len(cached)) if rust else cached, new))

        def insert(self, key, value):
            return self.cache.insert(InsertParams(key=RadixKey(key), value=value)).prefix_len

        def match(self, key):
            return self.cache.match_prefix(MatchPrefixParams(key=RadixKey(key)))

        def match_with_indices(self, key):
            m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(key)))
            return self.cache.path_device_indices(m.last_device_node)

        @staticmethod
        def match_len(m):
            return int(m.device_prefix_len)

        @staticmethod
        def indices_len(indices):
            return len(indices)

        def evict(self, n):
            return self.cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted

    return SglangSide


def sglang_main(args) -> None:
    sg = _peer.load_driver(args.sglang_driver).import_sglang()
    gc.disable()
    out = {"version": getattr(__import__("sglang"), "__version__", "?")}
    for label, rust in (("radix", False), ("rust", True)):
        progress(f"SGLang {'UnifiedRadixCache/Rust core' if rust else 'RadixCache (Python)'}")
        try:
            out[label] = run_rows(sglang_side_factory(sg, rust), args.quick, with_list_key=False)
        except Exception as exc:  # the Rust core is optional in SGLang builds: report, keep the Python rows
            out[label] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out))


# ---- report --------------------------------------------------------------------------------------
LOPSIDED_INSERT = ("SGLang's UnifiedRadixCache.insert also frees the value's already-cached half (a finished request's "
                   "duplicate slots), which kvmem's insert leaves to its caller: compare kvmem_insert_and_free_us")


def same_work(kv: dict, name: str, theirs: dict, their_name: str | None = None) -> bool:
    """Whether the other side's row did what kvmem's did (see the module docstring)."""
    row = theirs.get(their_name or name)
    return row is not None and row.get("work") == kv[name]["work"]


def like_for_like(row: dict, prefix: str) -> tuple[float, float]:
    """(kvmem us, SGLang us) doing the same thing: kvmem's match always gathers the slot indices, so SGLang's
    figure is its match plus path_device_indices; the unified cache's insert frees the duplicate slots, so
    kvmem's figure is its insert plus that free."""
    theirs = row.get(f"{prefix}_with_indices_us", row[f"{prefix}_us"])
    mine = row["kvmem_insert_and_free_us"] if prefix == "sglang_rust" and row["op"] == "insert" else row["kvmem_us"]
    return mine, theirs


def report(kv: dict, sg: dict) -> dict:
    radix, rust = sg.get("radix", {}), sg.get("rust", {})
    rows, unequal = [], []
    for name, res in kv.items():
        if name.startswith(("match_prefix_with_indices/", "match_prefix_list_key/", "insert_and_free/")):
            continue
        parts = name.split("/")
        row = {"op": parts[0]}
        if parts[0] == "evict":
            row.update(op=f"evict({EVICT_AMOUNT})", leaves=int(parts[1]), leaf_tokens=int(parts[2]),
                       nodes_freed_per_call=res["nodes_freed_per_call"])
        else:
            row["key_tokens"] = int(parts[1])
            if parts[0] == "match_prefix":
                row["path_nodes"] = int(parts[1]) // CHUNK
            else:
                row["new_tokens"] = int(parts[1]) // 2
        row["kvmem_us"] = res["median_us"]
        row["work"] = res["work"]
        if parts[0] == "match_prefix":
            row["kvmem_list_key_us"] = kv[f"match_prefix_list_key/{parts[1]}"]["median_us"]
        if parts[0] == "insert":
            row["kvmem_insert_and_free_us"] = kv[f"insert_and_free/{parts[1]}"]["median_us"]
        for label, theirs, prefix in (("sglang", radix, "sglang"), ("sglang_rust", rust, "sglang_rust")):
            if name not in theirs:
                continue
            row[f"{prefix}_us"] = theirs[name]["median_us"]
            checks = [same_work(kv, name, theirs)]
            if parts[0] == "match_prefix":
                indices = f"match_prefix_with_indices/{parts[1]}"
                row[f"{prefix}_with_indices_us"] = theirs[indices]["median_us"]
                checks.append(same_work(kv, indices, theirs))
            if parts[0] == "insert" and label == "sglang_rust":
                checks.append(same_work(kv, f"insert_and_free/{parts[1]}", theirs, name))
                row["lopsided_vs_sglang_rust"] = LOPSIDED_INSERT
            if not all(checks):
                row[f"unequal_work_vs_{label}"] = {"kvmem": res["work"], label: theirs[name].get("work")}
                unequal.append(f"{name} vs {label}")
                continue
            mine_us, theirs_us = like_for_like(row, prefix)
            row["speedup_vs_" + label] = round(theirs_us / mine_us, 2)
        row["kvmem_min_us"] = res["min_us"]
        row["reps"] = res["reps"]
        rows.append(row)
    out = {"rows": rows, "goals": goals(rows), "raw": {"kvmem": kv, "sglang": sg}}
    out["goals"]["rows_with_unequal_work"] = unequal
    return out


def goals(rows: list[dict]) -> dict:
    evict40 = [r["kvmem_us"] for r in rows if r["op"].startswith("evict") and r["leaves"] == 40000]
    # Rows with a ratio are those where both sides did the same work (see report).
    compared = [r for r in rows if "speedup_vs_sglang" in r]
    compared_rust = [r for r in rows if "speedup_vs_sglang_rust" in r]
    match = {r["key_tokens"]: r["kvmem_us"] for r in rows if r["op"] == "match_prefix"}

    def label(r):
        return f"{r['op']} {r['key_tokens']}" if "key_tokens" in r else f"{r['op']} {r['leaves']}x{r['leaf_tokens']}"

    return {
        "evict_40k_leaves_us": evict40,
        "evict_40k_leaves_under_100us": bool(evict40) and max(evict40) < 100,
        "every_row_faster_than_sglang_python": bool(compared) and all(
            operator.lt(*like_for_like(r, "sglang")) for r in compared),
        "rows_slower_than_sglang_rust": [label(r) for r in compared_rust
                                         if operator.gt(*like_for_like(r, "sglang_rust"))],
        # Not like for like, and not hidden: kvmem's figures against the Rust core's as measured, i.e. its bare
        # match (a length and a node, no indices) against kvmem's match, which always gathers them.
        "rows_slower_than_sglang_rust_bare": [label(r) for r in compared_rust if r["kvmem_us"] > r["sglang_rust_us"]],
        "match_ns_per_token": {n: round(us * 1e3 / n, 2) for n, us in match.items()},
    }


def hybrid_report(rounds: list[tuple[dict, dict]]) -> dict:
    """Each row's hybrid time beside the full-attention one over alternating rounds (`_peer.hybrid_rows`), rated where
    both did the same work in every round."""
    def medians(rows: dict) -> dict:
        return {name: row["median_us"] for name, row in rows.items()}

    def works(name: str) -> list[tuple]:
        return [(kv[name]["work"], hy[name]["work"]) for kv, hy in rounds]

    out = _peer.hybrid_rows([(medians(kv), medians(hy)) for kv, hy in rounds], works, HYBRID_GOAL)
    out["window"] = HYBRID_WINDOW
    return out


def main(argv: list[str] | None = None) -> None:
    ap = _peer.parser(__doc__, "smaller rows only (no 256k keys, no 200k leaves), one hybrid round")
    args = _peer.parse_sides(ap, argv, sglang_main)
    if args is None:
        return
    gc.disable()  # both sides: a collection of a 200k-node tree would land inside some timed call
    kv = run_rows(kvmem_side_factory(), args.quick, with_list_key=True)
    rounds = _peer.hybrid_rounds(lambda: run_rows(kvmem_side_factory(), args.quick, with_list_key=False),
                                 lambda: run_rows(kvmem_side_factory(HYBRID_WINDOW), args.quick, with_list_key=False),
                                 1 if args.quick else HYBRID_ROUNDS, kv)
    gc.enable()
    sg = _peer.run_peer(__file__, args)
    import torch

    out = report(kv, sg)
    out["hybrid"] = hybrid_report(rounds)
    out["meta"] = {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
                   "cpus": os.cpu_count(), "sglang": sg.get("version", sg.get("error")), "page_size": 1,
                   "eviction_policy": "lru", "node_tokens_on_match_path": CHUNK}
    _peer.emit(out, args.out)


if __name__ == "__main__":
    main()
