#!/usr/bin/env python3
"""kvmem's scheduler and cache beside vLLM's and SGLang's, on the peers' own workloads, in one run.

Workloads: `sglang_driver.py --gen-synthetic` files of 2,000 and 10,000 requests (a few shared system prompts,
a quarter follow-up turns that quote an earlier prompt and its output). Each is replayed at page sizes 1 and 16
by ../shared/peers' drivers (vllm_driver.py through vLLM's KVCacheManager, sglang_driver.py through SGLang's
RadixCache / UnifiedRadixCache) and by kvmem's Scheduler, driven the way the drivers drive theirs: every request
arrives at once in file order, FCFS admission into at most --max-running requests reserving room for all of
their outputs (new_token_ratio 1.0), no chunked prefill, one prefill batch or one decode step per iteration,
--token-budget KV slots. The sampled tokens are the workload's outputs (the drivers' hash-of-prompt draws).

What is timed, as the drivers time it: kvmem's `Scheduler.step()` and `process_batch_result()` (admission and
match, allocation and eviction, req_to_token writes and batch tensors, inserts and frees, token appends), and
`add_request`; vLLM's get_computed_blocks + allocate_slots + free (`cache_ops_wall_s`) and, apart, the block
hashing of its Request objects (`hash_s`: vLLM hashes on creation and on every appended token, kvmem when a
request enters the tree); SGLang's match + lock, slot allocation, release and LPM policy calls. Timings are
the minimum over --repeats runs for every side. kvmem runs with decode pages cached as written and in-batch
prefix caching (the mode `kvmem_vllm` in the report: vLLM's hit semantics), and its hit rate is also given
with SGLang's semantics (neither: `kvmem_sglang`) and each alone.

`ratios`: peer seconds / kvmem seconds (above 1: kvmem is faster). `hit_rate_minus_vllm`: kvmem's hit rate in
vLLM mode less vLLM's.

    python scripts/bench_replay.py [--sizes 2000,10000] [--page-sizes 1,16] [--repeats 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvmem._checks import output_file_arg, positive_int_arg

import _peer  # scripts/_peer.py: the script's own folder is on sys.path

PEERS = Path(__file__).resolve().parents[2] / "shared" / "peers"
MODES = {"vllm": (True, True), "decode_pages": (True, False), "in_batch": (False, True), "sglang": (False, False)}
# sglang_driver.py --impl's choices but "all", whose runs it reports in another form
SGLANG_IMPLS = ("radix", "unified-python", "unified-rust")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=_peer.list_arg(positive_int_arg), default="2000,10000",
                    help="requests per workload, comma-separated")
    ap.add_argument("--page-sizes", type=_peer.list_arg(positive_int_arg), default="1,16",
                    help="page (block) sizes, comma-separated")
    ap.add_argument("--token-budget", type=positive_int_arg, default=65536, help="KV slots (tokens) for every side")
    ap.add_argument("--max-running", type=positive_int_arg, default=16)
    ap.add_argument("--repeats", type=positive_int_arg, default=1, help="runs per side; timings are the minimum")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-python", default="/tmp/vllm-peer/bin/python")
    ap.add_argument("--sglang-python", default="/tmp/sglang-peer/bin/python")
    ap.add_argument("--sglang-impls", type=_peer.list_arg(_peer.choice_arg(SGLANG_IMPLS)), default="radix,unified-rust",
                    help="sglang_driver.py --impl values, comma-separated")
    ap.add_argument("--peers", default=str(PEERS), help="the folder with vllm_driver.py and sglang_driver.py")
    ap.add_argument("--out", type=output_file_arg, help="also write the JSON report here")
    args = ap.parse_args(argv)
    # A peer's python that does not exist skips that side (the report says so); the drivers it would run must be
    # there, and sglang_driver.py always: it writes and reads the workloads.
    _peer.check_python(ap, "--vllm-python", args.vllm_python)
    _peer.check_python(ap, "--sglang-python", args.sglang_python)
    drivers = ["sglang_driver.py"] + (["vllm_driver.py"] if os.path.exists(args.vllm_python) else [])
    for driver in drivers:
        if not (Path(args.peers) / driver).is_file():
            ap.error(f"argument --peers: {args.peers} has no {driver}")
    return ap, args


def check_budget(ap: argparse.ArgumentParser, args: argparse.Namespace, workloads: list) -> None:
    """Every request of every workload must fit the token budget at every page size, as the drivers check it (2
    pages spare): a usage error before any side runs, rather than a traceback or a failed side after some rows."""
    for workload in workloads:
        longest = max(len(ids) + len(outs) for ids, outs in workload)
        for ps in args.page_sizes:
            size = args.token_budget // ps * ps
            if longest + 2 * ps > size:
                ap.error(f"argument --token-budget: {args.token_budget} tokens (in pages of {ps}) hold fewer than the "
                         f"{longest + 2 * ps} the longest request of the {len(workload)}-request workload needs "
                         f"(2 pages spare, as the drivers count)")


def generate(peers: Path, n: int, seed: int, folder: str) -> Path:
    """The driver's own --gen-synthetic file (the generator needs only the standard library)."""
    path = Path(folder) / f"w{n}_s{seed}.jsonl"
    subprocess.run([sys.executable, str(peers / "sglang_driver.py"), "--gen-synthetic", str(path), "--n", str(n),
                    "--seed", str(seed)], check=True, capture_output=True)
    return path


def load(peers: Path, path: Path) -> list:
    """(prompt ids, output ids) per request, read by the driver's own loader."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sglang_driver", peers / "sglang_driver.py")
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)  # module level: standard library only
    return [(ids, outs) for ids, outs, _ in driver.load_workload(path)]


# ---- kvmem -----------------------------------------------------------------------------------------------------
def kvmem_run(workload: list, page_size: int, mode: str, budget: int, max_running: int) -> dict:
    from kvmem import (
        ForwardMode,
        PagedTokenAllocator,
        PhaseTimer,
        RadixCache,
        Req,
        ReqToTokenPool,
        Scheduler,
        SchedulerConfig,
        TokenAllocator,
    )

    decode_pages, in_batch = MODES[mode]
    size = budget // page_size * page_size
    max_context = max(len(i) + len(o) for i, o in workload) + 2 * page_size
    pool = ReqToTokenPool(max_running + 4, max_context)
    alloc = TokenAllocator(size) if page_size == 1 else PagedTokenAllocator(size, page_size)
    timer = PhaseTimer()
    sched = Scheduler(pool, alloc, RadixCache(pool, alloc, page_size=page_size), SchedulerConfig(
        schedule_policy="fcfs", max_running_requests=max_running, chunked_prefill_size=None,
        init_new_token_ratio=1.0, min_new_token_ratio=1.0, new_token_ratio_decay=0.0,
        cache_decode_pages=decode_pages, in_batch_prefix_caching=in_batch), timer=timer)
    reqs = [Req(i, ids, len(outs)) for i, (ids, outs) in enumerate(workload)]
    outputs = [outs for _, outs in workload]
    pc = time.perf_counter
    t0 = pc()
    for req in reqs:
        sched.add_request(req)
    seconds = pc() - t0
    admitted, prompt_tokens, cached_tokens, steps = set(), 0, 0, 0
    wall = pc()
    while not sched.is_idle():
        t0 = pc()
        batch = sched.step()
        seconds += pc() - t0
        if batch.forward_mode is ForwardMode.EXTEND:
            for req in batch.reqs:
                if req.rid not in admitted:
                    admitted.add(req.rid)
                    prompt_tokens += len(req.input_ids)
                    cached_tokens += len(req.prefix_indices)
        tokens = [outputs[r.rid][len(r.output_ids)] for r in batch.reqs]
        t0 = pc()
        sched.process_batch_result(batch, tokens)
        seconds += pc() - t0
        steps += 1
    sched.check_invariants()
    phases = timer.seconds
    inside = {"alloc": phases.get("alloc", 0.0), "evict": phases.get("evict", 0.0),
              "insert_release": phases.get("cache", 0.0), "match": phases.get("match", 0.0) + phases.get("rank", 0.0)}
    return {"hit_rate": round(cached_tokens / prompt_tokens, 6), "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens, "evicted_tokens": sched.stats.evicted_tokens,
            "retractions": sched.stats.retractions, "steps": steps, "cache_s": round(seconds, 6),
            "breakdown_s": {**{k: round(v, 6) for k, v in inside.items()},
                            "batch_and_bookkeeping": round(seconds - sum(inside.values()), 6)},
            "loop_wall_s": round(pc() - wall, 6)}


# ---- peers ----------------------------------------------------------------------------------------------------
def peer_run(python: str, script: Path, *argv: str) -> dict:
    if not os.path.exists(python):
        return {"error": f"{python} not found: side skipped"}
    proc = subprocess.run([python, str(script), *argv], capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": f"{script.name} failed (exit {proc.returncode}): {proc.stderr[-2000:]}"}
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def best_of(runs: list[dict], key: str) -> dict:
    """The run with the smallest `key` (errors pass through)."""
    good = [r for r in runs if "error" not in r]
    return min(good, key=lambda r: r[key]) if good else runs[0]


def vllm_side(args, path: Path, ps: int) -> dict:
    runs = [peer_run(args.vllm_python, Path(args.peers) / "vllm_driver.py", str(path), "--block-size", str(ps),
                     "--token-budget", str(args.token_budget), "--max-running", str(args.max_running))
            for _ in range(args.repeats)]
    r = best_of(runs, "cache_ops_plus_hash_wall_s")
    if "error" in r:
        return r
    return {"hit_rate": r["hit_rate"], "cache_ops_s": r["cache_ops_wall_s"],
            "hash_s": r["cache_ops_breakdown_s"].get("hash_s", 0.0),
            "cache_ops_plus_hash_s": r["cache_ops_plus_hash_wall_s"],
            "breakdown_s": r["cache_ops_breakdown_s"], "evicted_tokens": r["evicted_tokens"],
            "preemptions": r["preemptions"], "version": r.get("vllm_version")}


def sglang_side(args, path: Path, ps: int, impl: str) -> dict:
    runs = [peer_run(args.sglang_python, Path(args.peers) / "sglang_driver.py", str(path), "--impl", impl,
                     "--page-size", str(ps), "--token-budget", str(args.token_budget), "--max-running",
                     str(args.max_running), "--policy", "fcfs") for _ in range(args.repeats)]
    r = best_of(runs, "cache_ops_wall_s")
    if "error" in r:
        return r
    return {"hit_rate": r["hit_rate"], "cache_ops_s": r["cache_ops_wall_s"], "breakdown_s": r["cache_ops_breakdown_s"],
            "evicted_tokens": r["evicted_tokens"], "retractions": r["retractions"], "version": r.get("sglang_version")}


# ---- report ---------------------------------------------------------------------------------------------------
def ratio(peer: dict, key: str, mine: float) -> float | None:
    return round(peer[key] / mine, 3) if key in peer and mine else None


def row(args, workload: list, path: Path, ps: int) -> dict:
    kvmem = {mode: min((kvmem_run(workload, ps, mode, args.token_budget, args.max_running)
                        for _ in range(args.repeats)), key=lambda r: r["cache_s"]) for mode in MODES}
    vllm = vllm_side(args, path, ps)
    sglang = {impl: sglang_side(args, path, ps, impl) for impl in args.sglang_impls}
    mine = kvmem["vllm"]["cache_s"]
    ratios = {"vllm_cache_ops_plus_hash": ratio(vllm, "cache_ops_plus_hash_s", mine),
              "vllm_cache_ops": ratio(vllm, "cache_ops_s", mine),
              **{f"sglang_{impl}": ratio(s, "cache_ops_s", mine) for impl, s in sglang.items()}}
    hits = {f"kvmem_{mode}": r["hit_rate"] for mode, r in kvmem.items()}
    hits.update({"vllm": vllm.get("hit_rate"), **{f"sglang_{impl}": s.get("hit_rate") for impl, s in sglang.items()}})
    return {"requests": len(workload), "page_size": ps, "prompt_tokens": kvmem["vllm"]["prompt_tokens"],
            "ratios": ratios, "hit_rates": hits,
            "hit_rate_minus_vllm": round(hits["kvmem_vllm"] - hits["vllm"], 6) if hits["vllm"] is not None else None,
            "kvmem": kvmem, "vllm": vllm, "sglang": sglang}


def main(argv: list[str] | None = None) -> None:
    ap, args = parse_args(argv)
    import torch

    torch.set_num_threads(1)  # as the peers' drivers run: the cache's tensors are small
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        paths = [generate(Path(args.peers), n, args.seed, folder) for n in args.sizes]
        workloads = [load(Path(args.peers), path) for path in paths]
        check_budget(ap, args, workloads)
        for path, workload in zip(paths, workloads):
            for ps in args.page_sizes:
                rows.append(row(args, workload, path, ps))
                print(json.dumps({k: rows[-1][k] for k in ("requests", "page_size", "ratios", "hit_rates")}),
                      file=sys.stderr)
    faster = [r["ratios"]["vllm_cache_ops_plus_hash"] for r in rows]
    report = {"rows": rows,
              "kvmem_faster_than_vllm_cache_ops_plus_hash": all(x is not None and x > 1 for x in faster),
              "meta": {"cpus": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2),
                       "python": platform.python_version(), "torch": torch.__version__, "repeats": args.repeats,
                       "token_budget": args.token_budget, "max_running": args.max_running, "seed": args.seed,
                       "wall_s": round(time.perf_counter() - t0, 1)}}
    _peer.emit(report, args.out)


if __name__ == "__main__":
    main()
