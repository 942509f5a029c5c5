#!/usr/bin/env python3
"""Routing policies against a shared storage tier: cluster replays of one trace, one JSON table.

Each point is a `kvmem-replay TRACE --replicas N --router POLICY` run (the same cluster simulator), run one after
the other in this process: every replica has --capacity-tokens of device cache and --page-size pages;

- a policy in --routers replays with local caches only;
- a policy in --tiered adds a host tier of --host-capacity-tokens per replica (no storage);
- a policy in --shared-storage adds that host tier and a storage tier that every replica shares (a simulated
  store, `--storage sim`: the pages a file store would hold, with no file written): Mooncake's global pool.

Each row: the point's options, hit rate (and per tier), its ratio to the first row's, load imbalance (max / mean
requests), the index's hit rate (what the router saw), requests per replica, and the replay's wall time.

    python scripts/replay_cluster.py TRACE --replicas 10 --capacity-tokens 3000000 --page-size 512 \\
        --routers round-robin,least-load,cache-aware,kv-overlap --shared-storage round-robin \\
        --host-capacity-tokens 12000000
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import _peer  # scripts/_peer.py: the script's own folder is on sys.path

FIELDS = ("hit_rate", "device_hit_rate", "host_hit_rate", "storage_hit_rate", "load_imbalance", "index_hit_rate",
          "requests", "prompt_tokens", "evicted_tokens", "retractions", "makespan_seconds", "routing_seconds")


def run_point(requests, trace: str, argv: list[str]) -> dict:
    """One cluster replay of `requests` with the command-line options `argv` (the CLI's own defaults apply)."""
    from kvmem.replay.cli import _replay_config, build_parser
    from kvmem.replay.cluster import replay_cluster

    args = build_parser().parse_args([trace, *argv])
    config = _replay_config(args, requests)
    t0 = time.perf_counter()
    report = replay_cluster(requests, config, args.replicas[0], args.router[0]).to_json()
    row = {"options": " ".join(argv)}
    row.update({k: report[k] for k in FIELDS if k in report})
    row["requests_per_replica"] = [r["requests"] for r in report["per_replica"]]
    row["wall_s"] = round(time.perf_counter() - t0, 2)
    return row


def _names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--replicas", type=int, default=10)
    ap.add_argument("--capacity-tokens", type=int, default=3_000_000, help="device cache per replica")
    ap.add_argument("--page-size", type=int, default=512)
    ap.add_argument("--routers", type=_names, default=["round-robin", "least-load", "cache-aware", "kv-overlap"],
                    help="policies replayed with local caches only")
    ap.add_argument("--tiered", type=_names, default=[], help="policies replayed with a host tier per replica")
    ap.add_argument("--shared-storage", type=_names, default=["round-robin"],
                    help="policies replayed with a host tier per replica and a shared storage tier")
    ap.add_argument("--host-capacity-tokens", type=int, default=12_000_000, help="host tier per replica")
    ap.add_argument("--limit", type=int, help="replay only the first N requests")
    ap.add_argument("--out", help="also write the JSON table here")
    args = ap.parse_args(argv)

    from kvmem.replay.traces import read_trace

    base = ["--replicas", str(args.replicas), "--capacity-tokens", str(args.capacity_tokens),
            "--page-size", str(args.page_size), "--no-progress"]
    host = ["--host-capacity-tokens", str(args.host_capacity_tokens)]
    points = [[*base, "--router", p] for p in args.routers]
    points += [[*base, "--router", p, *host] for p in args.tiered]
    points += [[*base, "--router", p, *host, "--storage", "sim"] for p in args.shared_storage]
    try:
        requests = read_trace(args.trace, limit=args.limit)
        _peer.check_points(requests, args.trace, points, args.out, cluster=True)
    except _peer.usage_errors() as e:
        print(f"replay_cluster.py: error: {e}", file=sys.stderr)
        return 2
    rows = []
    for point in points:
        rows.append(run_point(requests, args.trace, point))
        rows[-1]["vs_first"] = round(rows[-1]["hit_rate"] / rows[0]["hit_rate"], 3) if rows[0]["hit_rate"] else None
        print(json.dumps(rows[-1]), file=sys.stderr)
    _peer.emit({"trace": args.trace, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
