"""Wall time per phase of the scheduler loop, for benchmarks and the replay's cost breakdown.

A `Scheduler` built with `timer=PhaseTimer()` adds the seconds of each phase it runs (`with
timer.phase("match"): ...`); without one it uses `NO_TIMER`, whose phases are one shared object that does
nothing.
"""

from __future__ import annotations

from collections import defaultdict
from time import perf_counter

# The phases a Scheduler times one after another; "alloc", "evict" and "cache" are timed inside them, so only
# these add up to the loop's time.
LOOP_PHASES = ("rank", "match", "prepare_extend", "prepare_decode", "process", "decode_run")


class _Phase:
    """One timed phase: adds its seconds to the timer when the block exits."""

    __slots__ = ("timer", "name", "start")

    def __init__(self, timer: PhaseTimer, name: str) -> None:
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        self.start = perf_counter()

    def __exit__(self, *exc) -> None:
        self.timer.add(self.name, perf_counter() - self.start)


class PhaseTimer:
    """Accumulated seconds and call counts per phase name ("match", "prepare_extend", ...)."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: defaultdict[str, int] = defaultdict(int)

    def phase(self, name: str) -> _Phase:
        """A context manager that times its block as `name`."""
        return _Phase(self, name)

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds
        self.calls[phase] += 1

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def to_json(self) -> dict[str, float]:
        """Seconds per phase, rounded to microseconds."""
        return {phase: round(s, 6) for phase, s in sorted(self.seconds.items())}


class _NoPhase:
    __slots__ = ()

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc) -> None:
        pass


class NullTimer:
    """A timer that times nothing, at the cost of a method call and an empty `with` block per phase."""

    _phase = _NoPhase()

    def phase(self, name: str) -> _NoPhase:
        return self._phase

    def add(self, phase: str, seconds: float) -> None:
        pass


NO_TIMER = NullTimer()
