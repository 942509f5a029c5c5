#!/usr/bin/env python3
"""Replays a fixed set of configurations and checks that their reports stay identical (timings aside).

    python scripts/replay_identity.py --out DIR                   # write each configuration's report
    python scripts/replay_identity.py --out NEW --compare OLD     # ... and compare with an earlier run
    python scripts/replay_identity.py --list
    python scripts/replay_identity.py --out DIR --only tiers,cluster --engine python

A change that must not move any replay decision (a refactoring, a faster engine) is checked by running this
before and after it (or with two `--engine`s) and comparing. Each configuration runs `kvmem-replay ... --json-only
--no-progress` in its own process on the Mooncake traces of ../shared/traces; the wall-clock fields of a report
(`TIMING_KEYS`) are dropped, every other field must be equal. Prints one JSON object: per configuration its hit
rate, retractions and wall seconds, kvmem-replay's line saying the Python engine replayed what the asked-for native
engine does not cover (`fallback`), and with `--compare` whether it is identical (and the first differences).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces" / "mooncake"
CONV, SYN = "{traces}/conversation_trace.jsonl", "{traces}/synthetic_trace.jsonl"  # filled in by --traces
# Wall-clock fields: they measure this machine, not the replay's decisions.
TIMING_KEYS = {"cache_op_seconds", "replay_seconds", "cache_op_breakdown_s", "routing_seconds"}

CONFIGS: dict[str, list[str]] = {
    "conversation_3m": [CONV, "--capacity-tokens", "3000000"],
    "page4": [SYN, "--limit", "3000", "--page-size", "4", "--capacity-tokens", "1000000"],
    "page16": [SYN, "--limit", "3000", "--page-size", "16", "--capacity-tokens", "1000000"],
    "page512": [CONV, "--limit", "1500", "--page-size", "512", "--capacity-tokens", "1000000"],
    "tiers": [CONV, "--limit", "3000", "--capacity-tokens", "500000", "--host-capacity-tokens", "2000000"],
    "tiers_write_back_lfu": [SYN, "--limit", "2000", "--capacity-tokens", "300000", "--host-capacity-tokens",
                             "1000000", "--write-policy", "write_back", "--eviction-policy", "lfu", "--page-size",
                             "16"],
    "cluster": [CONV, "--limit", "3000", "--capacity-tokens", "500000", "--replicas", "4", "--router",
                "kv-overlap", "--page-size", "16"],
    "cluster_round_robin": [SYN, "--limit", "2000", "--capacity-tokens", "300000", "--replicas", "3", "--router",
                            "round-robin"],
    "belady": [CONV, "--limit", "2000", "--capacity-tokens", "500000", "--eviction-policy", "belady"],
    "pins": [SYN, "--limit", "2000", "--capacity-tokens", "500000", "--pin-prefix-tokens", "512"],
    "chunked_prefill": [CONV, "--limit", "2000", "--capacity-tokens", "1000000", "--chunked-prefill-size", "2048"],
    "retraction_heavy": [CONV, "--limit", "2000", "--capacity-tokens", "150000", "--max-running", "512",
                         "--arrivals", "all-at-once"],
    "fcfs": [CONV, "--limit", "3000", "--capacity-tokens", "1000000", "--schedule-policy", "fcfs"],
    "in_batch_prefix_caching": [SYN, "--limit", "3000", "--capacity-tokens", "1000000", "--in-batch-prefix-caching"],
    "roofline_tp8": [CONV, "--limit", "3000", "--gpu", "H100", "--tp", "8", "--capacity-tokens", "1000000"],
    # Hybrid models on full-attention pools: the roofline prices sliding windows, chunks and linear states.
    "roofline_sliding": [CONV, "--limit", "1500", "--model", "gpt-oss-120b", "--gpu", "H100", "--tp", "8",
                         "--full-attention-pools"],
    "roofline_chunked": [CONV, "--limit", "1500", "--model", "llama-4-scout", "--gpu", "H100", "--tp", "8",
                         "--full-attention-pools", "--chunked-prefill-size", "4096"],
    "roofline_linear": [CONV, "--limit", "1500", "--model", "qwen3-next-80b", "--gpu", "H100", "--tp", "8",
                        "--full-attention-pools", "--page-size", "16"],
    "no_decode_pages_chat": ["--format", "synthetic-chat", "--limit", "2000", "--capacity-tokens", "200000",
                             "--no-cache-decode-pages"],
    "policies_fifo_priority": [SYN, "--limit", "2000", "--capacity-tokens", "300000", "--eviction-policy", "fifo"],
}


def strip_timings(report):
    if isinstance(report, dict):
        return {k: strip_timings(v) for k, v in report.items() if k not in TIMING_KEYS}
    if isinstance(report, list):
        return [strip_timings(v) for v in report]
    return report


def run(name: str, traces: str, extra: list[str]) -> tuple[dict, float, str | None]:
    argv = [a.format(traces=traces) for a in CONFIGS[name]] + ["--json-only", "--no-progress"] + extra
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", "import sys; from kvmem.replay.cli import main; sys.exit(main())",
                           *argv], capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{name}: kvmem-replay {' '.join(argv)} exited {done.returncode}: {done.stderr[-2000:]}")
    fallback = [line for line in done.stderr.splitlines() if "the Python engine replays" in line]
    return strip_timings(json.loads(done.stdout)), wall, fallback[0] if fallback else None


def differences(old, new, path="") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            out += differences(old.get(key), new.get(key), f"{path}.{key}" if path else key)
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in differences(a, b, f"{path}[{i}]")]
    return [] if old == new else [f"{path}: {old!r} -> {new!r}"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="folder for the reports (NAME.json each)")
    ap.add_argument("--compare", help="a folder of earlier reports to compare with")
    ap.add_argument("--only", help="comma-separated configuration names (default: all)")
    ap.add_argument("--engine", help="passed to kvmem-replay as --engine (where it has one)")
    ap.add_argument("--jobs", type=int, default=1, help="configurations run at once (default 1)")
    ap.add_argument("--traces", default=str(TRACES), help=f"the Mooncake traces' folder (default {TRACES})")
    ap.add_argument("--list", action="store_true", help="print the configurations and exit")
    args = ap.parse_args()
    if args.list:
        print(json.dumps(CONFIGS, indent=2))
        return 0
    if not args.out:
        ap.error("--out is required")
    names = list(CONFIGS) if not args.only else [n.strip() for n in args.only.split(",")]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configurations: {', '.join(unknown)} (see --list)")
    if not Path(CONV.format(traces=args.traces)).exists():
        ap.error(f"the traces are missing: {CONV.format(traces=args.traces)} (see --traces)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = ["--engine", args.engine] if args.engine else []
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = dict(zip(names, pool.map(lambda n: run(n, args.traces, extra), names)))
    summary = {}
    for name, (report, wall, fallback) in results.items():
        (out / f"{name}.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
        body = report.get("sweep", [report])[0] if "sweep" in report else report
        row = {"hit_rate": body.get("hit_rate"), "retractions": body.get("retractions"), "wall_s": round(wall, 2)}
        if fallback:  # kvmem-replay's line on stderr: the native engine asked for does not cover it
            row["fallback"] = fallback
        if args.compare:
            old_path = Path(args.compare) / f"{name}.json"
            if old_path.exists():
                diffs = differences(json.loads(old_path.read_text()), report)
                row["identical"] = not diffs
                if diffs:
                    row["differences"] = diffs[:10]
            else:
                row["identical"] = None
        summary[name] = row
    all_same = all(r.get("identical") for r in summary.values()) if args.compare else None
    print(json.dumps({"configurations": summary, "all_identical": all_same}, indent=2))
    return 0 if all_same in (None, True) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
