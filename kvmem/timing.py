"""Wall time per phase of the scheduler loop, for benchmarks and the replay's cost breakdown.

A `Scheduler` built with `timer=PhaseTimer()` adds the seconds of each phase it runs; without one it times
nothing (one `is None` test per phase).
"""

from __future__ import annotations

from collections import defaultdict

# The phases a Scheduler times one after another; "alloc", "evict" and "cache" are timed inside them, so only
# these add up to the loop's time.
LOOP_PHASES = ("rank", "match", "prepare_extend", "prepare_decode", "process", "decode_run")


class PhaseTimer:
    """Accumulated seconds and call counts per phase name ("match", "prepare_extend", ...)."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: defaultdict[str, int] = defaultdict(int)

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds
        self.calls[phase] += 1

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def to_json(self) -> dict[str, float]:
        """Seconds per phase, rounded to microseconds."""
        return {phase: round(s, 6) for phase, s in sorted(self.seconds.items())}
