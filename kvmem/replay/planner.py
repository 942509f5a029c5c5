"""`kvmem-replay TRACE --target-hit-fraction F`: the KV capacity that reaches F of the hit rate this server
achieves with unbounded memory, found by replays.

1. The ceilings: the trace's (`kvmem.replay.reuse.reuse_ceiling`: what an unbounded cache would serve, Mooncake
   traces only) and this server's (a replay at `unbounded_capacity`, which never evicts: it also misses what
   arrives while its prefix is still being prefilled, and recomputes each prompt's last token). The target is F x
   the server's, the achievable hit rate.
2. A search between the smallest capacity that rejects no request (the longest request) and the unbounded one:
   each round replays `jobs` capacities spaced evenly on a log scale inside the bracket, at once, and keeps the
   tightest bracket (below the target, at or above it), until its ends are within `tolerance` of each other. The
   answer is the bracket's top: the smallest capacity measured to reach the target.

Every replay is kept: the curve the search measured, hit rate and TTFT by capacity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from kvmem.replay.config import ReplayConfig
from kvmem.replay.reuse import reuse_ceiling, unbounded_capacity

DEFAULT_TOLERANCE = 0.02  # the bracket's ends within 2% of each other
MAX_ROUNDS = 40


class CapacityPlan(NamedTuple):
    """What the search found: the target, the answer, and every replay (`curve`, by capacity)."""

    fraction: float
    trace_ceiling: float | None  # what an unbounded cache would serve (Mooncake traces), else None
    achievable: float            # this server's hit rate with unbounded KV
    unbounded_tokens: int
    target: float                # fraction x achievable
    tokens: int                  # the smallest capacity measured to reach the target
    curve: list                  # ReplayReport by capacity, ascending
    rounds: int


def plan_capacity(trace, config: ReplayConfig, fraction: float, run: Callable[[Sequence[ReplayConfig]], list],
                  jobs: int, tolerance: float = DEFAULT_TOLERANCE) -> CapacityPlan:
    """Searches the capacity at which a replay of `trace` under `config` reaches `fraction` of the hit rate it
    reaches with unbounded KV. `run(configs)` replays configurations (at once where it can) and returns their
    ReplayReports in order; each round asks it for `jobs` capacities."""
    ps = config.page_size
    top = unbounded_capacity(trace, ps)
    bottom = min(-(-config.max_context_len // ps) * ps, top)
    reports = {}

    def measure(capacities: Sequence[int]) -> None:
        new = sorted({c for c in capacities if c not in reports})
        for c, report in zip(new, run([config.at_capacity(c) for c in new])):
            reports[c] = report

    measure([bottom, top])
    achievable = reports[top].hit_rate
    target = fraction * achievable
    rounds = 1
    lo, hi = bottom, top
    if reports[bottom].hit_rate >= target:
        hi = bottom
    while hi > lo and hi - lo > max(ps, tolerance * hi) and rounds < MAX_ROUNDS:
        inner = np.geomspace(lo, hi, max(jobs, 1) + 2)[1:-1]
        measure(sorted({max(lo + ps, min(hi - ps, int(c) // ps * ps)) for c in inner}))
        rounds += 1
        reached = [c for c in sorted(reports) if lo < c <= hi and reports[c].hit_rate >= target]
        hi = reached[0] if reached else hi
        lo = max(c for c in reports if lo <= c < hi and reports[c].hit_rate < target)
    return CapacityPlan(fraction, reuse_ceiling(trace), achievable, top, target, hi,
                        [reports[c] for c in sorted(reports)], rounds)
