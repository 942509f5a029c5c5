#!/usr/bin/env python3
"""The cost of each eviction policy per cache operation, against LRU's, on one workload.

A tree of `leaves` cached prompts (shared 256-token system prefixes, each prompt 64 tokens more) serves a
stream of requests, each one cycle of what the Scheduler does for a request:
  queue        request_waiting(rid, key)   (a lookahead policy walks the key here; the others do nothing)
  match+lock   match_prefix(key), inc_lock_ref, request_admitted(rid)
  insert       insert(key + 16 new tokens): a new leaf
  unlock       dec_lock_ref (the prefix becomes evictable again)
  evict        evict(16): the policy's next victim (the cache stays the same size)
Half the keys are cached prompts, half new ones; every policy gets the same keys. Policies run in rounds
(each round times every policy once, in turn) and each figure is the median over rounds, so a noisy machine
shifts all of them alike. `cycle_us` is the CPU time of this process per request (time.process_time over the
whole stream: time spent descheduled by other processes does not count), the figure `cycle_vs_lru` compares;
the per-op columns are wall-clock means per call (perf_counter), for where the time goes. belady is left out:
it is a replay-only oracle.

    python scripts/bench_eviction.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from array import array
from pathlib import Path

import numpy as np

OPS = ("queue", "match+lock", "insert", "unlock", "evict")
PREFIXES, PREFIX_TOKENS, PROMPT_TOKENS, NEW_TOKENS = 16, 256, 64, 16


def workload(leaves: int, requests: int, seed: int = 0) -> tuple[list, list]:
    """The prompts to cache first, and each request's key (half of them cached prompts, half new)."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 1 << 30, PREFIX_TOKENS) for _ in range(PREFIXES)]

    def prompt():
        return np.concatenate([prefixes[rng.integers(PREFIXES)], rng.integers(0, 1 << 30, PROMPT_TOKENS)])

    cached = [prompt() for _ in range(leaves)]
    keys = [cached[rng.integers(leaves)] if rng.random() < 0.5 else prompt() for _ in range(requests)]
    # int64 arrays, as the Scheduler's keys are (a Req's fill_ids): a list would cost a conversion per call
    # that the Scheduler never pays
    return [array("q", k.tolist()) for k in cached], [array("q", k.tolist()) for k in keys]


def run(policy: str, cached: list, keys: list, leaves: int) -> dict[str, float]:
    """Mean us per call of each op over the request stream, under `policy`."""
    from kvmem import RadixCache, ReqToTokenPool, TokenAllocator

    size = (leaves + len(keys)) * (PREFIX_TOKENS + PROMPT_TOKENS + NEW_TOKENS)
    alloc = TokenAllocator(size)
    cache = RadixCache(ReqToTokenPool(1, 8), alloc, eviction_policy=policy)
    for key in cached:
        slots = alloc.alloc(len(key))
        n = cache.insert(key, slots)
        if n:
            alloc.free(slots[:n])  # the tree already held those tokens
    spent = dict.fromkeys(OPS, 0.0)
    clock = time.perf_counter
    cpu = time.process_time()
    for rid, key in enumerate(keys):
        t0 = clock()
        cache.request_waiting(rid, key)
        t1 = clock()
        m = cache.match_prefix(key)
        cache.inc_lock_ref(m.last_node)
        cache.request_admitted(rid)
        t2 = clock()
        full = key + array("q", range(rid + (1 << 31), rid + (1 << 31) + NEW_TOKENS))
        slots = alloc.alloc(len(full) - len(m.indices))  # the request computes what was not cached
        t3 = clock()
        cache.insert(full, np.concatenate((m.indices.numpy(), slots.numpy())))
        t4 = clock()
        cache.dec_lock_ref(m.last_node)
        t5 = clock()
        cache.evict(NEW_TOKENS)
        t6 = clock()
        for op, dt in zip(OPS, (t1 - t0, t2 - t1, t4 - t3, t5 - t4, t6 - t5)):
            spent[op] += dt
    cpu = time.process_time() - cpu
    cache.check_invariants()
    return {"cycle": cpu / len(keys) * 1e6, **{op: spent[op] / len(keys) * 1e6 for op in OPS}}


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kvmem, before any import of it
    from kvmem._checks import output_file_arg

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a small tree and few rounds (a smoke test)")
    ap.add_argument("--out", type=output_file_arg, help="also write the JSON report here")
    args = ap.parse_args(argv)
    from kvmem.eviction import ONLINE_POLICIES

    leaves, requests, rounds = (500, 300, 2) if args.quick else (20000, 4000, 7)
    cached, keys = workload(leaves, requests)
    samples: dict[str, list[dict]] = {p: [] for p in ONLINE_POLICIES}
    gc.disable()
    for r in range(rounds):
        for policy in ONLINE_POLICIES:
            samples[policy].append(run(policy, cached, keys, leaves))
            gc.collect()
        print(f"[bench_eviction] round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    gc.enable()
    rows = []
    for policy in ONLINE_POLICIES:
        row = {"policy": policy}
        for op in ("cycle", *OPS):
            row[f"{op}_us"] = round(statistics.median(s[op] for s in samples[policy]), 3)
        rows.append(row)
    lru = rows[0]
    for row in rows:
        row["cycle_vs_lru"] = round(row["cycle_us"] / lru["cycle_us"], 3)
    report = {"rows": rows, "goal_cycle_within_1.5x_lru": all(r["cycle_vs_lru"] <= 1.5 for r in rows),
              "meta": {"leaves": leaves, "requests": requests, "rounds": rounds, "cpus": os.cpu_count(),
                       "load_avg": os.getloadavg()}}
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
