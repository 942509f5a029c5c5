#!/usr/bin/env python3
"""What each tier buys: replays of one trace over a grid of device capacities, host tiers, write policies and
storage tiers, with the hit rate of each tier, TTFT and the KV moved between them, as one JSON table
(`kvmem-replay TRACE --sweep-host SIZES` sets host sizes beside none in one run, with a summary).

Each point is a `kvmem-replay` run (the same simulator, scheduler and cache), one process per point
(--jobs at a time). A storage spec may hold `{point}`, replaced by the point's index, so that every point
gets a fresh directory: `--storage 'file:/tmp/kv-{point}'`.

    python scripts/replay_tiers.py TRACE --device 3000000 --host 0,12000000,47000000 \\
        --write-policy write_through,write_through_selective,write_back --device-only 50000000
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import os
import sys
import time

from kvmem._checks import positive_int_arg

import _peer  # scripts/_peer.py: the script's own folder is on sys.path

FIELDS = ("hit_rate", "device_hit_rate", "host_hit_rate", "storage_hit_rate", "loaded_tokens", "backed_up_tokens",
          "host_evicted_tokens", "prefetched_tokens", "stored_tokens", "storage_misses_corrupt", "storage_failed_ops",
          "transfer_seconds", "evicted_tokens", "requests", "prompt_tokens", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
          "overload")


def run_point(trace: str, argv: list[str]) -> dict:
    """One kvmem-replay run of `trace` with the command-line options `argv` (the CLI's own defaults apply)."""
    from kvmem.replay.cli import _replay_config, build_parser
    from kvmem.replay.simulator import replay
    from kvmem.replay.traces import read_trace

    requests = read_trace(trace)
    config = _replay_config(build_parser().parse_args([trace, *argv]), requests)
    t0 = time.perf_counter()
    report = replay(requests, config).to_json()
    row = {"options": " ".join(argv)}
    row.update({k: report[k] for k in FIELDS if k in report})
    row["wall_s"] = round(time.perf_counter() - t0, 2)
    return row


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--device", type=_ints, required=True, help="device capacities (tokens), comma-separated")
    ap.add_argument("--host", type=_ints, default=[0], help="host tiers (tokens; 0: none), comma-separated")
    ap.add_argument("--write-policy", default="write_through", help="write policies, comma-separated")
    ap.add_argument("--storage", help="a storage spec for every tiered point ({point}: the point's index)")
    ap.add_argument("--storage-metadata", default="P2PHANDSHAKE")
    ap.add_argument("--device-only", type=_ints, default=[], help="extra device-only capacities to compare with")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--jobs", type=positive_int_arg, default=os.cpu_count() or 1)
    ap.add_argument("--out", help="also write the JSON table here")
    args = ap.parse_args(argv)

    points = []
    policies = args.write_policy.split(",")
    for device, host, policy in itertools.product(args.device, args.host, policies):
        argv = ["--capacity-tokens", str(device), "--page-size", str(args.page_size)]
        if host == 0:
            if policy != policies[0]:
                continue  # without a host tier the write policy means nothing
        else:
            argv += ["--host-capacity-tokens", str(host), "--write-policy", policy]
            if args.storage:
                argv += ["--storage", args.storage.replace("{point}", str(len(points))),
                         "--storage-metadata", args.storage_metadata]
        points.append(argv)
    points += [["--capacity-tokens", str(c), "--page-size", str(args.page_size)] for c in args.device_only]
    from kvmem.replay.traces import read_trace

    try:  # every point checked here, before the workers start: a bad one would cost a BrokenProcessPool later
        _peer.check_points(read_trace(args.trace), args.trace, [[o.replace("{point}", "0") for o in p]
                                                                for p in points], args.out)
    except _peer.usage_errors() as e:
        print(f"replay_tiers.py: error: {e}", file=sys.stderr)
        return 2
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(run_point, [args.trace] * len(points), points))
    _peer.emit({"trace": args.trace, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
