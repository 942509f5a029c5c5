"""`kvmem-replay --replicas N --router POLICY`: the cluster replay's options, checks and run (see cli.py).

- `--replicas 10 --router cache-aware`: one cluster replay; the report adds `per_replica`, `load_imbalance`.
- `--replicas 1,2,4,8 --router round-robin,cache-aware` (or `--router all`): every pair, reported as `sweep`.
- `--replicas 10 --sweep`: replica counts 1, 2, 4, ... up to 10 (and 10), by every policy named in --router
  (all four without it).
"""

from __future__ import annotations

import argparse
import sys

from kvmem.replay.config import ReplayConfig
from kvmem.router import POLICIES

DEFAULT_POLICY = "cache-aware"  # SGLang router's default


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=_replica_counts, metavar="N",
                   help="simulate N engines behind a router fed by their KV events (a comma-separated list "
                        "sweeps replica counts); each replica has the capacity and tiers given above")
    p.add_argument("--router", type=_policies, metavar="POLICY",
                   help=f"routing policy with --replicas: {', '.join(POLICIES)} (comma-separated, or 'all', "
                        f"to sweep policies; default {DEFAULT_POLICY})")


def cluster_runs(args: argparse.Namespace, config: ReplayConfig) -> list[tuple[int, str]] | None:
    """The (replicas, policy) pairs to replay, or None without --replicas; ValueError for options that do
    not go together, or replicas that would not fit this machine's memory."""
    if args.replicas is None:
        if args.router is not None:
            raise ValueError("--router needs --replicas N (the router picks among replicas)")
        return None
    if args.compare_policies:
        raise ValueError("--compare-policies replays one engine under each policy; drop --replicas")
    if config.eviction_policy == "belady":
        raise ValueError("--eviction-policy belady is the single replay's oracle (it reads the whole trace's "
                         "future in arrival order); drop --replicas")
    if args.sweep:  # a list of capacities
        raise ValueError("--sweep CAPACITIES sweeps a single replay's capacity; with --replicas, sweep replica "
                         "counts (--replicas 1,2,4) and policies (--router a,b or --sweep alone)")
    counts = args.replicas
    if args.sweep is not None:
        largest = max(counts)
        counts = sorted({1 << k for k in range(largest.bit_length()) if 1 << k < largest} | set(counts))
    policies = args.router or (list(POLICIES) if args.sweep is not None else [DEFAULT_POLICY])
    runs = [(n, policy) for n in counts for policy in policies]
    if len(runs) > 1 and config.storage is not None:
        raise ValueError("--storage with several cluster runs: each run would find the pages the runs before it "
                         "stored; replay each configuration against its own --storage")
    config.check_host_memory(max(counts))
    return runs


def run_cluster(args: argparse.Namespace, trace, config: ReplayConfig, runs: list[tuple[int, str]],
                out: dict, title: str, engine: str = "native", slo=None) -> dict:
    """Replays `runs` on `engine` (see kvmem.replay.engine), prints their summary under `title` on stderr (unless
    --json-only) and adds their reports (and plots, with --plot) to `out`, with goodput under `slo` (a
    kvmem.replay.latency.SLO; the Python engine's) when given; RuntimeError (one line) when the plots cannot be
    written."""
    from kvmem.replay.cluster_report import format_cluster_summary, write_cluster_sweep_plots
    from kvmem.replay.engine import replay_cluster  # the Python engine imports torch: only once the arguments are good

    progress = not args.no_progress
    reports = []
    for replicas, policy in runs:
        if len(runs) > 1 and progress:
            print(f"kvmem-replay: {replicas} replicas, {policy}", file=sys.stderr)
        reports.append(replay_cluster(trace, config, replicas, policy, progress, engine, slo))
    if len(runs) == 1:
        out.update(reports[0].to_json())
    else:
        out["sweep"] = [r.to_json() for r in reports]
    if not args.json_only:
        print(format_cluster_summary(reports, title), file=sys.stderr)
    if args.plot:
        try:
            plots = reports[0].write_plots(args.plot) if len(runs) == 1 else write_cluster_sweep_plots(reports,
                                                                                                     args.plot)
        except OSError as e:
            raise RuntimeError(f"cannot write plots to {args.plot}: {e.strerror or e}") from None
        out["plots"] = [str(p) for p in plots]
    return out


def _replica_counts(text: str) -> list[int]:
    counts = []
    for part in text.split(","):
        try:
            value = int(part)
        except ValueError:
            value = 0
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive replica count (or a comma-separated list), got "
                                             f"{text!r}")
        counts.append(value)
    return sorted(set(counts))


def _policies(text: str) -> list[str]:
    if text == "all":
        return list(POLICIES)
    names = text.split(",")
    for name in names:
        if name not in POLICIES:
            raise argparse.ArgumentTypeError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)} "
                                             "(comma-separated) or 'all'")
    return list(dict.fromkeys(names))
