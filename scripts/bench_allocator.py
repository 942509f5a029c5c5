#!/usr/bin/env python3
"""Slot allocator micro-benchmarks: kvmem's allocators beside SGLang's, on the same calls and the same inputs.

Rows (CPU tensors in, CPU tensors out; median microseconds per call over repeats):
  token/n={1,64,4096}/{alloc,free,alloc+free}
      TokenAllocator vs TokenToKVPoolAllocator over a 1M-slot pool. `alloc+free` is a tight loop of
      `free(alloc(n))`; `alloc` and `free` are k allocs in a row, then their k frees.
  paged/extend_{1..2048,128}/{alloc,free,alloc+free}
      PagedTokenAllocator vs PagedTokenToKVPoolAllocator (page_size 16, 1M-slot pool): alloc_extend for
      256 requests whose prefixes (0..4096 tokens, half of them page-aligned) end in a partial page
      allocated beforehand, with extend lengths uniform in 1..2048 or all 128. The free returns the new
      pages (the extend slots past each request's partial page), as a finished request's tail would be.
  paged/decode/{alloc,free,alloc+free}
      alloc_decode for 256 requests, 16 of which cross into a new page; the free returns those 16 pages.
Every pool is first partly used and fragmented (chunks allocated, a random subset freed in random order),
so no row measures the trivial fresh pool. SGLang gets the arguments its scheduler passes (device and CPU
copies of prefix/seq lens, extend_num_tokens); kvmem gets the same tensors. SGLang is measured with
need_sort=False (`sglang_us`) and need_sort=True (`sglang_sorted_us`, what its scheduler uses for paged
pools; the merge-and-sort runs inside an alloc only when the free list runs short, so a short loop sees
little of it). On a CPU platform SGLang runs its torch fallbacks (alloc_extend_naive, alloc_decode_naive),
as its scheduler would there. `ratio` is sglang_us / kvmem_us: above 1 means kvmem is faster.

A ratio is reported only where both sides did the same work (`checks` in each side's raw results): every alloc
returned the slots asked for, the row ended with the same free slots on both sides (the same fragmentation,
everything it allocated freed), and on a fresh pool the paged calls handed out the very same slots (their
contract: pages in order, each request's partial page first). A row where they differ gets no ratio and is
listed in `rows_with_unequal_work`. Only alloc+free is like for like: kvmem flags the pages an alloc pops as
allocated lazily, at the next read of the flags (the check in its free), so part of its alloc's cost is paid
in its free row; the alloc and free rows are marked `lopsided`, and their slower rows are listed apart.

Hybrid rows (issue 36): the same kvmem rows on `kvmem.hybrid.HybridTokenAllocator` (a window slot paired with every
full slot; window pool as large as the full one, so the fragmentation is the same), beside the full-attention
allocators: `hybrid.rows[*].ratio` is hybrid_us / kvmem_us, the goal at most HYBRID_GOAL. Both sides are timed in
HYBRID_ROUNDS rounds, hybrid first in every other one, and the ratio is the median of the rounds' ratios, so that a
drift of a shared machine over the run favours neither.

One command measures both sides: kvmem in this process, then SGLang by running this same file with
`--peer sglang` under SGLang's venv python (`--sglang-python`, default /tmp/sglang-peer/bin/python; that
side is skipped with a note when it does not exist). The JSON report is printed on stdout.

    python scripts/bench_allocator.py [--sglang-python PATH] [--quick] [--seed 0] [--out FILE]
                                      [--allocator-module PATH]
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import platform
import statistics
import time

import numpy as np

import _peer  # scripts/_peer.py: the script's own folder is on sys.path

POOL_TOKENS = 1 << 20
PAGE_SIZE = 16
BATCH = 256
TOKEN_SIZES = (1, 64, 4096)
MAX_PREFIX = 4096
EXTEND_ROWS = {"extend_1..2048": None, "extend_128": 128}  # None: uniform in 1..MAX_EXTEND
MAX_EXTEND = 2048
DECODE_CROSSINGS = BATCH // PAGE_SIZE
MAX_K = {1: 5000, 64: 2000, 4096: 32, "extend_1..2048": 20, "extend_128": 50, "decode": 500}  # calls per repeat
BUDGET_S, REPS = 1.0, 7  # per row and side
QUICK_BUDGET_S, QUICK_REPS = 0.25, 5
HYBRID_GOAL = 1.5  # a hybrid allocation within this factor of the full-attention one's time
HYBRID_ROUNDS = 3  # full-attention and hybrid rows, timed in alternating order (see _peer.hybrid_rows)


# ---- workloads (numpy only: the same arrays in both processes for one seed) ------------------------------
def fragment_plan(seed: int, units: int, max_chunk: int) -> tuple[list[int], list[int]]:
    """Chunk sizes to allocate (about half the pool) and which chunks to free, in order (about half)."""
    rng = np.random.default_rng(seed)
    sizes = []
    while sum(sizes) < units // 2:
        sizes.append(int(rng.integers(1, max_chunk + 1)))
    order = rng.permutation(len(sizes))[: len(sizes) // 2]
    return sizes, [int(i) for i in order]


def extend_case(seed: int, extend_len: int | None) -> dict:
    """256 extends. Request i's partial last page is page i+1 (taken first from the fresh pool)."""
    rng = np.random.default_rng(seed + 1)
    prefix = rng.integers(0, MAX_PREFIX + 1, BATCH)
    aligned = rng.random(BATCH) < 0.5
    prefix[aligned] -= prefix[aligned] % PAGE_SIZE
    extend = rng.integers(1, MAX_EXTEND + 1, BATCH) if extend_len is None else np.full(BATCH, extend_len)
    seq = prefix + extend
    page = np.arange(1, BATCH + 1)
    off = prefix % PAGE_SIZE
    # The slot of token prefix-1; for an aligned prefix its page is a cached one no allocator reads.
    last = np.where(off > 0, page * PAGE_SIZE + off - 1, np.where(prefix > 0, page * PAGE_SIZE + PAGE_SIZE - 1, -1))
    in_partial = np.minimum(extend, np.where(off > 0, PAGE_SIZE - off, 0))
    starts = np.cumsum(extend) - extend
    keep = np.concatenate([np.arange(s + p, s + e) for s, p, e in zip(starts, in_partial, extend)])
    return {"prefix": prefix, "seq": seq, "last": last, "keep": keep, "extend_num_tokens": int(extend.sum())}


def decode_case(seed: int) -> dict:
    """256 decodes; DECODE_CROSSINGS of them start a new page. Request i's last page is page i+1."""
    rng = np.random.default_rng(seed + 2)
    seq = rng.integers(PAGE_SIZE + 1, MAX_PREFIX + 1, BATCH)
    cross = np.zeros(BATCH, dtype=bool)
    cross[rng.permutation(BATCH)[:DECODE_CROSSINGS]] = True
    # Crossing: token seq-1 sits at offset 0 of a new page; otherwise at offsets 1..15 of page i+1.
    seq = np.where(cross, seq - (seq - 1) % PAGE_SIZE, np.where((seq - 1) % PAGE_SIZE == 0, seq + 1, seq))
    page = np.arange(1, BATCH + 1)
    last = page * PAGE_SIZE + (seq - 2) % PAGE_SIZE
    return {"seq": seq, "last": last, "keep": np.flatnonzero(cross)}


# ---- timing ------------------------------------------------------------------------------------------------
def measure(repeat, budget_s: float, reps: int, max_k: int) -> dict:
    """repeat(k) -> (alloc_us, free_us, pair_us) per call over k calls. A warm-up repeat of one call sizes k
    so that `reps` repeats fill about `budget_s` (at least one call each: SGLang's extend takes ~0.1 s)."""
    t0 = time.perf_counter()
    repeat(1)
    first = time.perf_counter() - t0
    k = int(max(1, min(max_k, budget_s / reps / max(first, 1e-6))))
    repeat(k)
    samples = [repeat(k) for _ in range(reps)]
    out = {}
    for i, op in enumerate(("alloc", "free", "alloc+free")):
        col = [s[i] for s in samples]
        out[op] = {"median_us": round(statistics.median(col), 2), "min_us": round(min(col), 2)}
    out.update(reps=reps, calls_per_rep=k)
    return out


def token_repeat(a, n: int):
    pc = time.perf_counter
    alloc, free = a.alloc, a.free

    def repeat(k: int):
        t0 = pc()
        for _ in range(k):
            free(alloc(n))
        t1 = pc()
        outs = [alloc(n) for _ in range(k)]
        t2 = pc()
        for o in outs:
            free(o)
        t3 = pc()
        return (t2 - t1) * 1e6 / k, (t3 - t2) * 1e6 / k, (t1 - t0) * 1e6 / k

    return repeat


def paged_repeat(call, free, keep):
    """Timers sit around each call: the gather of the slots to free (out[keep]) stays untimed."""
    pc = time.perf_counter

    def repeat(k: int):
        ta = tf = 0.0
        for _ in range(k):
            t0 = pc()
            out = call()
            t1 = pc()
            back = out[keep]
            t2 = pc()
            free(back)
            tf += pc() - t2
            ta += t1 - t0
        return ta * 1e6 / k, tf * 1e6 / k, (ta + tf) * 1e6 / k

    return repeat


def digest(t) -> str:
    return hashlib.blake2b(t.numpy().astype(np.int64).tobytes(), digest_size=6).hexdigest()


def fragment(a, seed: int, unit: int, max_chunk: int) -> None:
    """Allocates the chunks of fragment_plan (in units of `unit` slots) and frees the planned half of them."""
    sizes, order = fragment_plan(seed, a.size // unit, max_chunk)
    held = [a.alloc(s * unit) for s in sizes]
    for i in order:
        a.free(held[i])


def run_rows(side, torch, seed: int, quick: bool) -> dict:
    """side: make_token(size), make_paged(size, ps), extend_call(a, case), decode_call(a, case)."""
    budget, reps = (QUICK_BUDGET_S, QUICK_REPS) if quick else (BUDGET_S, REPS)
    rows, checks = {}, {}
    for n in TOKEN_SIZES:
        t0 = time.perf_counter()
        a = side.make_token(POOL_TOKENS)
        fragment(a, seed, 1, 4096)
        assert a.available_size() > MAX_K[n] * n
        free_before = a.available_size()
        rows[f"token/n={n}"] = measure(token_repeat(a, n), budget, reps, MAX_K[n])
        rows[f"token/n={n}"]["row_s"] = round(time.perf_counter() - t0, 2)
        out = a.alloc(n)
        checks[f"token/n={n}"] = {"slots_per_alloc": len(out), "free_before_row": free_before,
                                  "free_after_row": a.available_size() + len(out)}
        a.free(out)
        del a
        gc.collect()
    cases = {name: extend_case(seed, ext) for name, ext in EXTEND_ROWS.items()}
    cases["decode"] = decode_case(seed)
    for name, case in cases.items():
        t0 = time.perf_counter()
        a = side.make_paged(POOL_TOKENS, PAGE_SIZE)
        a.alloc(BATCH * PAGE_SIZE)  # pages 1..256: each request's partial last page
        t = {key: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for key, v in case.items()}
        call = side.decode_call(a, t) if name == "decode" else side.extend_call(a, t)
        out = call()  # on the fresh pool both sides must hand out the very same slots
        check = {"first_call_digest": digest(out), "out_len": len(out)}
        a.free(out[t["keep"]])
        fragment(a, seed, PAGE_SIZE, 64)
        check["free_before_row"] = a.available_size()
        rows[f"paged/{name}"] = measure(paged_repeat(call, a.free, t["keep"]), budget, reps, MAX_K[name])
        rows[f"paged/{name}"]["row_s"] = round(time.perf_counter() - t0, 2)
        check["free_after_row"] = a.available_size()
        checks[f"paged/{name}"] = check
        del a, call
        gc.collect()
    return {"rows": rows, "checks": checks}


# ---- kvmem side --------------------------------------------------------------------------------------------
class KvmemSide:
    def __init__(self, module_path: str | None) -> None:
        if module_path is None:
            import kvmem.allocator as module
        else:  # a private copy of kvmem/allocator.py, to measure a proposed change with the same rows
            import importlib.util

            spec = importlib.util.spec_from_file_location("allocator_under_test", module_path)
            if spec is None:
                raise ImportError(f"{module_path} is not a Python file")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        self.make_token = module.TokenAllocator
        self.make_paged = module.PagedTokenAllocator

    @staticmethod
    def extend_call(a, t):
        prefix, seq, last = t["prefix"], t["seq"], t["last"]
        return lambda: a.alloc_extend(prefix, seq, last)

    @staticmethod
    def decode_call(a, t):
        seq, last = t["seq"], t["last"]
        return lambda: a.alloc_decode(seq, last)


class HybridSide(KvmemSide):
    """kvmem's paired allocator at page size 1 and PAGE_SIZE, its window pool as large as its full pool."""

    def __init__(self) -> None:
        from kvmem.hybrid import HybridTokenAllocator

        self.make_token = lambda size: HybridTokenAllocator(size, size, 1)
        self.make_paged = lambda size, ps: HybridTokenAllocator(size, size, ps)


def hybrid_report(rounds: list[tuple[dict, dict]]) -> dict:
    """Each row's hybrid time beside the full-attention one over alternating rounds (`_peer.hybrid_rows`), rated where
    both did the same work in every round (the same checks: slots per alloc, free slots before and after, the first
    paged call's slots)."""
    def medians(res: dict) -> dict:
        return {f"{name}/{op}": row[op]["median_us"] for name, row in res["rows"].items()
                for op in ("alloc", "free", "alloc+free")}

    def works(row: str) -> list[tuple]:
        name = row.rsplit("/", 1)[0]
        return [(kv["checks"][name], hy["checks"][name]) for kv, hy in rounds]

    return _peer.hybrid_rows([(medians(kv), medians(hy)) for kv, hy in rounds], works, HYBRID_GOAL)


# ---- SGLang side (runs under SGLang's venv; imports nothing from kvmem) -------------------------------------
class SglangSide:
    def __init__(self, sg: dict, need_sort: bool) -> None:
        self.sg, self.need_sort, self.torch = sg, need_sort, sg["torch"]

    def _kv(self, size: int, ps: int):
        # Built as the peer driver builds it; the allocator only stores it.
        return self.sg["MHATokenToKVPool"](size=size, page_size=ps, dtype=self.torch.float16, head_num=1,
                                           head_dim=8, layer_num=1, device="cpu", enable_memory_saver=False)

    def make_token(self, size: int):
        return self.sg["TokenToKVPoolAllocator"](size=size, dtype=self.torch.float16, device="cpu",
                                                 kvcache=self._kv(size, 1), need_sort=self.need_sort)

    def make_paged(self, size: int, ps: int):
        return self.sg["PagedTokenToKVPoolAllocator"](size=size, page_size=ps, dtype=self.torch.float16,
                                                      device="cpu", kvcache=self._kv(size, ps),
                                                      need_sort=self.need_sort)

    @staticmethod
    def extend_call(a, t):
        # On a CPU device the scheduler's "device" and "_cpu" copies are two CPU tensors.
        prefix, prefix_cpu, seq, seq_cpu = t["prefix"], t["prefix"].clone(), t["seq"], t["seq"].clone()
        last, n = t["last"], t["extend_num_tokens"]
        return lambda: a.alloc_extend(prefix, prefix_cpu, seq, seq_cpu, last, n)

    @staticmethod
    def decode_call(a, t):
        seq, seq_cpu, last = t["seq"], t["seq"].clone(), t["last"]
        return lambda: a.alloc_decode(seq, seq_cpu, last)


def sglang_main(args) -> None:
    sg = _peer.load_driver(args.sglang_driver).import_sglang()
    import sglang

    gc.disable()
    out = {"version": getattr(sglang, "__version__", "?"), "import_s": round(sg["import_s"], 1),
           "triton_kernels": SglangSide(sg, False).make_paged(1024, PAGE_SIZE).use_triton_kernels}
    for label, need_sort in (("sglang", False), ("sglang_sorted", True)):
        out[label] = run_rows(SglangSide(sg, need_sort), sg["torch"], args.seed, args.quick)
    print(json.dumps(out))


# ---- report ------------------------------------------------------------------------------------------------
LOPSIDED = ("kvmem flags popped pages as allocated lazily, at its free's check, so part of its alloc's cost is in "
            "its free row: only alloc+free compares like for like")


def report(kv: dict, sg: dict) -> dict:
    rows, slower, slower_lopsided, unequal = [], [], [], []
    for name, res in kv["rows"].items():
        same = {label: sg.get(label, {}).get("checks", {}).get(name) == kv["checks"][name]
                for label in ("sglang", "sglang_sorted")}
        for op in ("alloc", "free", "alloc+free"):
            row = {"row": f"{name}/{op}", "kvmem_us": res[op]["median_us"]}
            if op != "alloc+free":
                row["lopsided"] = LOPSIDED
            for label in ("sglang", "sglang_sorted"):
                theirs = sg.get(label, {}).get("rows", {}).get(name)
                if not theirs:
                    continue
                row[f"{label}_us"] = theirs[op]["median_us"]
                if not same[label]:
                    row[f"unequal_work_vs_{label}"] = {"kvmem": kv["checks"][name],
                                                       label: sg[label].get("checks", {}).get(name)}
                    continue
                row[f"ratio{label[6:]}"] = round(theirs[op]["median_us"] / res[op]["median_us"], 2)
            if any(row[f"{k}_us"] < row["kvmem_us"] for k in ("sglang", "sglang_sorted") if f"ratio{k[6:]}" in row):
                (slower_lopsided if "lopsided" in row else slower).append(row["row"])
            rows.append(row)
        unequal += [f"{name} vs {label}" for label, ok in same.items() if not ok and label in sg]
    compared = any("ratio" in r for r in rows)
    return {"rows": rows,
            "goal": {"kvmem_at_least_as_fast_on_every_like_for_like_row": compared and not slower,
                     "kvmem_slower_rows": slower, "kvmem_slower_lopsided_rows": slower_lopsided,
                     "rows_with_unequal_work": unequal},
            "raw": {"kvmem": kv, "sglang": sg}}


def main(argv: list[str] | None = None) -> None:
    ap = _peer.parser(__doc__, "a short run (fewer repeats per row, one hybrid round)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--allocator-module", metavar="PATH",
                    help="time this copy of kvmem/allocator.py instead of the installed one (to try a change)")
    args = _peer.parse_sides(ap, argv, sglang_main)
    if args is None:
        return
    try:  # loaded before any row: a path that is no module with the allocators is a usage error, not a traceback
        side = KvmemSide(args.allocator_module)
    except (OSError, ImportError, SyntaxError, AttributeError) as e:
        ap.error(f"argument --allocator-module: {type(e).__name__}: {e}")
    import torch

    t0 = time.perf_counter()
    gc.disable()  # a collection would land inside some timed call
    kv = run_rows(side, torch, args.seed, args.quick)
    rounds = _peer.hybrid_rounds(lambda: run_rows(side, torch, args.seed, args.quick),
                                 lambda: run_rows(HybridSide(), torch, args.seed, args.quick),
                                 1 if args.quick else HYBRID_ROUNDS, kv)
    gc.enable()
    sg = _peer.run_peer(__file__, args, "--seed", str(args.seed))
    out = report(kv, sg)
    out["hybrid"] = hybrid_report(rounds)
    out["meta"] = {"cpus": os.cpu_count(), "torch": torch.__version__, "numpy": np.__version__,
                   "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
                   "machine": platform.machine(), "sglang": sg.get("version", sg.get("error")),
                   "sglang_triton_kernels": sg.get("triton_kernels"),
                   "pool_tokens": POOL_TOKENS, "page_size": PAGE_SIZE, "batch": BATCH, "seed": args.seed,
                   "quick": args.quick, "kvmem_allocator": args.allocator_module or "kvmem.allocator",
                   "wall_s": round(time.perf_counter() - t0, 1)}
    _peer.emit(out, args.out)


if __name__ == "__main__":
    main()
