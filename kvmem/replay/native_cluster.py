"""The cluster replay on the native engine (`kvmem.replay._native.Cluster`): `kvmem.replay.cluster.replay_cluster`'s
report, field for field (timings aside), for a configuration the native engine covers (`native_replay.unsupported`).

The router reads the replicas' KV events alone, as the Python cluster's does: their device pages named by the token
prefixes they hold (kvmem/replay/native/view.h) instead of 64-bit page hashes, so that a 10-replica replay at page 1
keeps no hash per cached token. Torch-free, as `native_replay` is.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import numpy as np

from kvmem._checks import check_int
from kvmem.replay import native_replay
from kvmem.replay.cluster_report import ClusterReport, EventCounts
from kvmem.replay.cost import RooflineCost, StepCost, cost_model
from kvmem.replay.traces import TraceRequest
from kvmem.router import POLICIES

ROUTES_PER_CALL = 256  # arrivals routed between returns to Python: progress, and Ctrl-C


def replay_cluster(requests: Sequence[TraceRequest], config, replicas: int, policy: str, *, progress: bool = False,
                   cost: StepCost | RooflineCost | None = None) -> ClusterReport:
    """Replays `requests` on `replicas` engines configured by `config` behind a `policy` router (kvmem.router's
    defaults) and returns what it measured. ValueError for a replica count below 1, an unknown policy or a
    configuration the native engine does not cover; RuntimeError when it is not built."""
    t_start = time.perf_counter()
    replicas = check_int("replicas", replicas, minimum=1)
    if policy not in POLICIES:
        raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(POLICIES)}")
    native = native_replay.load_native()
    if isinstance(native, ImportError):
        raise RuntimeError(f"the native replay engine is not built ({native})")
    why = native_replay.unsupported(config, cost)
    if why is not None:
        raise ValueError(f"the native replay engine does not cover {why}")
    cost = cost_model(config) if cost is None else cost
    trace = native_replay.native_trace(native, requests)
    order, arrivals = native_replay._arrival_order(requests, config.honour_arrivals)
    run = native.Cluster(native_replay._engine_config(config, cost), trace, replicas, policy,
                         order.astype(np.int32), arrivals)
    bar = native_replay._progress_bar(len(order), progress)
    notes = _Notes(config, requests, replicas)
    done = False
    while not done:
        done = run.advance(ROUTES_PER_CALL)
        notes.take(run)
        if bar is not None:
            bar.update(run.finished + notes.count - bar.n)
    if bar is not None:
        bar.close()
    notes.close()
    summary = run.summary()
    entries = summary["replicas"]
    reports = [native_replay._report(r, r["start_s"], cost, config) for r in entries]
    return ClusterReport(
        policy=policy, reports=reports, routed=[r["routed"] for r in entries],
        busy_seconds=[r["busy_s"] for r in entries], prefill_seconds=[r["prefill_s"] for r in entries],
        makespan_seconds=max(r["clock"] for r in entries), events=EventCounts(**summary["events"]),
        index_cached_tokens=summary["index_cached_tokens"] if policy in ("cache-aware", "kv-overlap") else None,
        routing_seconds=summary["routing_seconds"], replay_seconds=time.perf_counter() - t_start)


class _Notes:
    """The notes a cluster's replicas print on stderr for the requests they reject (ReplicaSim's, per replica: the
    first MAX_SKIP_NOTES named, the rest counted at the end)."""

    def __init__(self, config, requests, replicas: int) -> None:
        self.config, self.requests = config, requests
        self.count = 0
        self.per_replica = [0] * replicas

    def take(self, run) -> None:
        for rank, rid, why in run.rejections(self.count):
            self.count += 1
            self.per_replica[rank] += 1
            if self.per_replica[rank] <= native_replay.MAX_SKIP_NOTES:
                native_replay._note_rejection(f"replica {rank}: ", rid, why, self.config, self.requests)

    def close(self) -> None:
        for rank, n in enumerate(self.per_replica):
            if n > native_replay.MAX_SKIP_NOTES:
                print(f"{native_replay._NOTE}replica {rank}: skipped {n - native_replay.MAX_SKIP_NOTES} more requests "
                      f"that can never run here", file=sys.stderr)
