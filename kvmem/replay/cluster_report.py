"""What a cluster replay measured: each replica's `ReplayReport`, the routing, the events, and plots."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvmem.events import AllBlocksCleared, BlockStored, EventBatch
from kvmem.replay.report import ReplayReport, format_seconds, format_tokens, require_matplotlib, summary_rows

# The counters of a ReplayReport that add up over replicas (a cluster's capacity is its replicas' sum).
_SUMMED = ("capacity_tokens", "requests", "prompt_tokens", "cached_tokens", "evicted_tokens", "retractions",
           "rejected", "cache_op_seconds", "host_cached_tokens", "storage_cached_tokens", "prefetched_tokens",
           "stored_tokens", "storage_misses_corrupt", "storage_failed_ops", "loaded_tokens", "backed_up_tokens",
           "host_evicted_tokens", "transfer_seconds", "output_tokens", "prefill_seconds_saved")
# Per-step samples of one replica: in the per-replica entries, not summed.
_PER_REPLICA_ONLY = ("peak_tokens_used", "mean_tokens_used", "peak_pinned_tokens", "mean_evictable_tokens",
                     "mean_running")
# What each per-replica entry takes from the replica's own report.
_REPLICA_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "hit_rate", "steps", "evicted_tokens",
                   "retractions", "rejected")
_TIER_HIT_RATES = ("device_hit_rate", "host_hit_rate", "storage_hit_rate")


@dataclass
class EventCounts:
    """The KV events the router applied: batches, and blocks stored and removed (any medium), clears."""

    batches: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0

    def count(self, batch: EventBatch) -> None:
        self.batches += 1
        for event in batch.events:
            if type(event) is BlockStored:
                self.stored_blocks += len(event.block_hashes)
            elif type(event) is AllBlocksCleared:
                self.cleared += 1
            else:
                self.removed_blocks += len(event.block_hashes)


@dataclass
class ClusterReport:
    """Metrics of one cluster replay.

    policy: the routing policy; reports: each replica's `ReplayReport` (its requests are those admitted there);
    routed: requests routed to each replica; busy_seconds: the simulated seconds each replica spent in steps
    (it has work), of which prefill_seconds prefilling (its share of the prompt compute);
    makespan_seconds: the latest replica clock at the end; events: what the router's index was fed;
    index_cached_tokens: the prompt tokens the index showed cached on the chosen replica when each request was
    routed (None for policies that do not read it); routing_seconds: wall time spent routing (prompt hashing
    included); replay_seconds: wall time of the whole replay; latency: TTFT and TBT percentiles and goodput under
    SLOs (`kvmem.replay.latency.RequestTimes.to_json`), None where not measured.
    """

    policy: str
    reports: list[ReplayReport]
    routed: list[int]
    busy_seconds: list[float]
    prefill_seconds: list[float]
    makespan_seconds: float = 0.0
    events: EventCounts = field(default_factory=EventCounts)
    index_cached_tokens: int | None = None
    routing_seconds: float = 0.0
    replay_seconds: float = 0.0
    latency: dict | None = None

    @property
    def num_replicas(self) -> int:
        return len(self.reports)

    def total(self) -> ReplayReport:
        """The replicas' counters summed into one report, with every request's time to first token (no per-step
        samples: `simulated_seconds` is the cluster's in to_json)."""
        first = self.reports[0]
        total = ReplayReport(capacity_tokens=0, host_capacity_tokens=None if first.host_capacity_tokens is None
                             else first.host_capacity_tokens * self.num_replicas, storage=first.storage,
                             cost_model=first.cost_model, num_gpus=first.num_gpus)  # each replica's GPUs
        for name in _SUMMED:
            setattr(total, name, sum(getattr(r, name) for r in self.reports))
        for r in self.reports:
            total.ttft_s.extend(r.ttft_s)
            total.first_token_s.extend(r.first_token_s)
        total.cache_phases = {k: sum(r.cache_phases.get(k, 0.0) for r in self.reports) for k in first.cache_phases}
        total.replay_seconds = self.replay_seconds
        return total

    @property
    def simulated_seconds(self) -> float:
        """From the first arrival at any replica to the latest replica's last step."""
        ran = [r for r in self.reports if r.time_s]
        return max(r.time_s[-1] for r in ran) - min(r.start_s or 0.0 for r in ran) if ran else 0.0

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens over prompt tokens, over every replica (token-weighted, as a single replay's)."""
        return self.total().hit_rate

    @property
    def load_imbalance(self) -> float:
        """The most requests a replica admitted over the mean (1.0: even; also 1.0 with no requests)."""
        counts = [r.requests for r in self.reports]
        mean = sum(counts) / len(counts)
        return max(counts) / mean if mean else 1.0

    def to_json(self) -> dict:
        """The cluster's totals (a single replay's fields, summed; `capacity_tokens` is the cluster's), then
        `replicas`, `router`, `load_imbalance`, `makespan_seconds`, `routing_seconds`, `events`,
        `index_hit_rate` (index-reading policies only) and `per_replica`."""
        total, sim_s = self.total(), self.simulated_seconds
        out = {k: v for k, v in total.to_json().items() if k not in _PER_REPLICA_ONLY}
        out["steps"] = sum(len(r.time_s) for r in self.reports)
        out.update({"simulated_seconds": round(sim_s, 6),  # the cluster's throughput: over its time
                    "output_tokens_per_s": round(total.output_tokens / sim_s, 3) if sim_s else 0.0,
                    "requests_per_s": round(total.requests / sim_s, 6) if sim_s else 0.0})
        out.update({
            "replicas": self.num_replicas,
            "router": self.policy,
            "load_imbalance": round(self.load_imbalance, 6),
            "makespan_seconds": round(self.makespan_seconds, 6),
            "routing_seconds": round(self.routing_seconds, 6),
            "events": vars(self.events).copy(),
        })
        if self.index_cached_tokens is not None:
            out["index_hit_rate"] = round(self.index_cached_tokens / total.prompt_tokens if total.prompt_tokens
                                          else 0.0, 6)
        if self.latency is not None:
            out.update(self.latency)
        out["per_replica"] = [self._replica_json(r) for r in range(self.num_replicas)]
        return out

    def _replica_json(self, rank: int) -> dict:
        """The replica's own report (its counters, hit rates per tier and per-step samples, rounded as a single
        replay's JSON) beside what only the cluster knows of it."""
        report = self.reports[rank].to_json()
        entry = {"replica": rank, "routed": self.routed[rank], "busy_seconds": round(self.busy_seconds[rank], 6),
                 "prefill_seconds": round(self.prefill_seconds[rank], 6)}
        entry.update((k, report[k]) for k in _REPLICA_FIELDS + _PER_REPLICA_ONLY + _TIER_HIT_RATES if k in report)
        return entry

    def write_plots(self, directory: str | os.PathLike) -> list[Path]:
        """Writes replicas.png (requests and hit rate per replica) into `directory`; needs matplotlib."""
        figure_cls = require_matplotlib()
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        ranks = range(self.num_replicas)
        fig = figure_cls(figsize=(8, 6))
        top, bottom = fig.subplots(2, 1, sharex=True)
        top.bar(ranks, [r.requests for r in self.reports])
        top.set_xticks(ranks)
        top.set(ylabel="requests", title=f"{self.policy} over {self.num_replicas} replicas: load imbalance "
                f"{self.load_imbalance:.2f}, hit rate {self.hit_rate:.3f}")
        bottom.bar(ranks, [r.hit_rate for r in self.reports], color="tab:orange")
        bottom.set(xlabel="replica", ylabel="hit rate", ylim=(0, 1))
        path = out / "replicas.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        return [path]


def format_cluster_summary(reports: Sequence[ClusterReport], title: str) -> str:
    """What a person reads after a cluster replay: a single replay's summary over the whole cluster, then the
    router's load imbalance and a row per replica; or, for several cluster replays, a row each. A warning when
    arrivals outran the cluster."""
    lines = [title, f"clock: {reports[0].reports[0].cost_model} (each replica)"]
    if len(reports) == 1:
        lines += _cluster_lines(reports[0])
    else:
        lines += _table([_run_row(r) for r in reports])
    for r in reports:
        overload = r.total().overload()
        if overload is not None:
            where = "" if len(reports) == 1 else f"{r.num_replicas} replicas, {r.policy}: "
            lines.append(f"warning: {where}{overload.message()}")
    if len(reports) == 1:
        behind = {rank: o for rank, o in enumerate(r.overload() for r in reports[0].reports) if o is not None}
        if behind:  # the cluster may keep up while the router overloads some replicas
            keeps_up = ", though the cluster keeps up" if reports[0].total().overload() is None else ""
            lines.append(f"warning: arrivals outrun replica{'s' if len(behind) > 1 else ''} "
                         f"{', '.join(map(str, behind))} of {reports[0].num_replicas} (outrun) from t="
                         f"{format_seconds(min(o.from_s for o in behind.values()))} at the earliest: their TTFT "
                         f"reflects queueing{keeps_up}")
    return "\n".join(lines)


def _cluster_lines(cluster: ClusterReport) -> list[str]:
    total, sim_s = cluster.total(), cluster.simulated_seconds
    rows = [(name, value) for name, value in summary_rows(total) if name != "KV memory"]
    throughput = f"{total.output_tokens / sim_s if sim_s else 0:,.0f} output tokens/s over {format_seconds(sim_s)} " \
                 f"simulated"
    rows = [(name, throughput if name == "throughput" else value) for name, value in rows]
    index = "" if cluster.index_cached_tokens is None else \
        f"; the index showed {cluster.index_cached_tokens / max(total.prompt_tokens, 1):.3f} of prompt tokens cached"
    rows.append(("router", f"{cluster.policy} over {cluster.num_replicas} replicas: load imbalance "
                           f"{cluster.load_imbalance:.2f} (the busiest replica's requests over the mean){index}"))
    lines = [f"  {name:<24}{value}" for name, value in rows]
    return lines + _table([_replica_row(cluster, rank) for rank in range(cluster.num_replicas)])


def _replica_row(cluster: ClusterReport, rank: int) -> list[tuple[str, str]]:
    r = cluster.reports[rank]
    ttft = r.ttft_percentiles()
    return [("replica", str(rank)), ("routed", f"{cluster.routed[rank]:,}"), ("hit rate", f"{r.hit_rate:.3f}"),
            ("TTFT p50", format_seconds(ttft.get("p50"))), ("p90", format_seconds(ttft.get("p90"))),
            ("busy", format_seconds(cluster.busy_seconds[rank])),
            ("prefill", format_seconds(cluster.prefill_seconds[rank])),
            ("peak memory", f"{format_tokens(r.peak_tokens_used)} of {format_tokens(r.capacity_tokens)}"),
            ("evicted", format_tokens(r.evicted_tokens)), ("+outrun", _outrun(r))]


def _outrun(r: ReplayReport) -> str:
    overload = r.overload()
    return "" if overload is None else f"from {format_seconds(overload.from_s)}"


def _run_row(cluster: ClusterReport) -> list[tuple[str, str]]:
    ttft = cluster.total().ttft_percentiles()
    return [("replicas", str(cluster.num_replicas)), ("router", cluster.policy),
            ("hit rate", f"{cluster.hit_rate:.3f}"), ("TTFT p50", format_seconds(ttft.get("p50"))),
            ("p90", format_seconds(ttft.get("p90"))), ("p99", format_seconds(ttft.get("p99"))),
            ("load imbalance", f"{cluster.load_imbalance:.2f}"),
            ("makespan", format_seconds(cluster.makespan_seconds))]


def _table(rows: list[list[tuple[str, str]]]) -> list[str]:
    """Rows of (column, cell) as a right-aligned table; a column whose name starts with "+" only where some row
    fills it."""
    keep = [i for i, (name, _) in enumerate(rows[0]) if not name.startswith("+") or any(row[i][1] for row in rows)]
    rows = [[row[i] for i in keep] for row in rows]
    cells = [[name.lstrip("+") for name, _ in rows[0]]] + [[value for _, value in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return ["  " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in cells]


def write_cluster_sweep_plots(reports: Sequence[ClusterReport], directory: str | os.PathLike) -> list[Path]:
    """Writes hit_rate_vs_replicas.png and load_imbalance_vs_replicas.png (one curve per policy) into
    `directory`; needs matplotlib."""
    figure_cls = require_matplotlib()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    policies = list(dict.fromkeys(r.policy for r in reports))
    paths = []
    for name, label, value in (("hit_rate_vs_replicas", "hit rate", lambda r: r.hit_rate),
                               ("load_imbalance_vs_replicas", "load imbalance (max / mean requests)",
                                lambda r: r.load_imbalance)):
        fig = figure_cls(figsize=(8, 4.5))
        ax = fig.subplots()
        for policy in policies:
            points = sorted((r.num_replicas, value(r)) for r in reports if r.policy == policy)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=policy)
        ax.set(xlabel="replicas", ylabel=label, title=f"{label[0].upper()}{label[1:]} per routing policy")
        if name == "hit_rate_vs_replicas":
            ax.set_ylim(0, 1)
        ax.set_xscale("log", base=2)
        counts = sorted({r.num_replicas for r in reports})
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best")
        path = out / f"{name}.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        paths.append(path)
    return paths
