"""`kvmem-replay --compare-policies`: one trace replayed under several eviction policies, side by side.

Each (policy, capacity) pair is one replay, with the same scheduler, capacities and page size for every
policy; with `jobs` > 1 they run in `jobs` worker processes, started with "spawn" (forking a process that runs
torch's threads can deadlock the child), each of which loads the trace once with the picklable `load_trace`.
`belady` (the offline optimum) is the ceiling and `lru` the baseline, so both always run; each policy's
`gap_closed` is (hit rate - lru's) / (belady's - lru's), the share of what LRU leaves on the table that the
policy gets back. `engine` replays each policy it covers (kvmem.replay.engine), the Python engine the others.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from kvmem.replay.config import ReplayConfig
from kvmem.replay.engine import fallback_note
from kvmem.replay.report import format_seconds, require_matplotlib
from kvmem.replay.workers import init_worker, kill_workers, sigint_blocked

BASELINE, CEILING = "lru", "belady"
# Below this gap between belady's and lru's hit rates, a share of it is noise (a few requests' hits): n/a.
GAP_NOISE = 0.005
DEFAULT_POLICIES = ("lru", "lfu", "fifo", "s3fifo", "arc", "2q", "gdsf", "lookahead", "multiturn", "belady")

_trace = None  # the trace a worker replays, loaded once by its initializer


def _load_worker_trace(load_trace: Callable) -> None:
    global _trace
    init_worker()
    _trace = load_trace()


def _replay_one(config: ReplayConfig, trace=None, engine: str = "python") -> dict:
    from kvmem.replay.engine import replay

    return replay(_trace if trace is None else trace, config, engine=engine).to_json()


def compare_policies(trace, config: ReplayConfig, policies: Sequence[str], capacities: Sequence[int],
                     jobs: int = 1, load_trace: Callable | None = None, engine: str = "python") -> dict:
    """Replays `trace` under each policy (plus lru and belady) at each capacity, in this process or (jobs > 1) in
    worker processes that build the trace with `load_trace()` (a picklable callable; required then). Returns the
    JSON-ready result: `policies`, `capacities`, `hit_rate[policy]` and `gap_closed[policy]` (one value per
    capacity; gap_closed is None where belady leads lru by less than GAP_NOISE), and every replay's report in
    `runs`."""
    policies = list(dict.fromkeys([BASELINE, *policies, CEILING]))
    configs = [config.at_capacity(c, eviction_policy=p) for p in policies for c in capacities]
    reports: dict[tuple[str, int], dict] = {}

    def done(c: ReplayConfig, report: dict) -> None:
        reports[c.eviction_policy, c.capacity_tokens] = report
        print(f"kvmem-replay: {c.eviction_policy} at {c.capacity_tokens:,} tokens: hit rate {report['hit_rate']:.4f}",
              file=sys.stderr)

    note = fallback_note(engine, configs)
    if note is not None:
        print(f"kvmem-replay: {note}", file=sys.stderr)
    if jobs <= 1 or len(configs) == 1:
        for c in configs:
            done(c, _replay_one(c, trace, engine))
    else:
        if load_trace is None:
            raise ValueError("jobs > 1 needs load_trace: each worker process builds the trace itself")
        with ProcessPoolExecutor(max_workers=min(jobs, len(configs)), mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_load_worker_trace, initargs=(load_trace,)) as pool:
            try:
                with sigint_blocked():  # Ctrl-C is this process's alone (kvmem.replay.workers)
                    futures = {pool.submit(_replay_one, c, None, engine): c for c in configs}
                for future in as_completed(futures):
                    done(futures[future], future.result())
            except BaseException:
                kill_workers()  # before the pool waits for them
                raise
    hit = {p: [reports[p, c]["hit_rate"] for c in capacities] for p in policies}
    gap = {p: [_gap_closed(h, lo, hi) for h, lo, hi in zip(hit[p], hit[BASELINE], hit[CEILING])] for p in policies}
    return {"policies": policies, "capacities": list(capacities), "hit_rate": hit, "gap_closed": gap,
            "runs": [{"eviction_policy": p, **reports[p, c]} for p in policies for c in capacities]}


def _gap_closed(hit: float, lru: float, belady: float) -> float | None:
    return round((hit - lru) / (belady - lru), 4) if belady - lru >= GAP_NOISE else None


def format_table(result: dict) -> str:
    """The comparison as a text table: a row per policy, a column per capacity, hit rate (gap closed); then, from
    lru's runs, how much of the memory was evictable on average and the median time to first token. A policy
    only chooses among evictable pages, and a saturated server (TTFT of seconds and more) holds most of its
    memory in running requests: there belady's lead comes partly from the queueing its hits save."""
    caps = result["capacities"]
    labels = [*result["policies"], *_CONTEXT_ROWS]
    width = max(len("policy"), *map(len, labels)) + 2
    head = f"{'policy':<{width}}" + "".join(f"{c:>24,}" for c in caps)
    lines = [head, "-" * len(head)]
    for p in result["policies"]:
        cells = []
        for h, g in zip(result["hit_rate"][p], result["gap_closed"][p]):
            gap = "" if p in (BASELINE, CEILING) else " (n/a)" if g is None else f" ({g:+.0%} of gap)"
            cells.append(f"{h:.4f}{gap}")
        lines.append(f"{p:<{width}}" + "".join(f"{cell:>24}" for cell in cells))
    lines.append("-" * len(head))
    # A report's capacity_tokens is the one asked for rounded down to whole pages: match them in sorted order.
    runs = sorted((r for r in result["runs"] if r["eviction_policy"] == BASELINE), key=lambda r: r["capacity_tokens"])
    baseline = dict(zip(sorted(caps), runs))
    for label, cell in _CONTEXT_ROWS.items():
        lines.append(f"{label:<{width}}" + "".join(f"{cell(baseline[c]):>24}" for c in caps))
    return "\n".join(lines)


_CONTEXT_ROWS: dict[str, Callable[[dict], str]] = {
    f"{BASELINE}: evictable": lambda r: f"{r['mean_evictable_tokens'] / r['capacity_tokens']:.0%}",
    f"{BASELINE}: TTFT p50": lambda r: format_seconds(r.get("ttft_p50_s")),
}


def write_policy_plot(result: dict, directory: str | os.PathLike) -> Path:
    """Writes hit_rate_by_policy.png into `directory`: hit rate against capacity, a curve per policy, belady
    dashed (the ceiling) and lru bold (the baseline). Needs matplotlib."""
    figure_cls = require_matplotlib()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    fig = figure_cls(figsize=(8, 4.5))
    ax = fig.subplots()
    caps = result["capacities"]
    for p in result["policies"]:
        style = {CEILING: dict(linestyle="--", color="black", linewidth=1.5),
                 BASELINE: dict(color="tab:blue", linewidth=2.5)}.get(p, dict(linewidth=1))
        ax.plot(caps, result["hit_rate"][p], marker="o", markersize=3, label=p, **style)
    if len(caps) > 1:
        ax.set_xscale("log", base=2)
    ax.set(xlabel="KV capacity (tokens)", ylabel="hit rate", title="Hit rate by eviction policy (belady: the "
           "offline optimum)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    path = out / "hit_rate_by_policy.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path
