"""Per-request latency in a replay: time to first token (TTFT), time between tokens (TBT) and goodput under SLOs.

A request's TTFT runs from its arrival to the moment its first token can reach the user: the end of the step that
prefilled its prompt on a colocated replica; the landing of its KV on the decode side in a disaggregated one (the
decode side streams the first token then, as SGLang's does). Its TBT is the mean gap between its later tokens: the
time from its first token to its last over the tokens after the first (DistServe's TPOT), so every decode step it
waited through, and every prefill that stalled its batch on a colocated replica, counts. Goodput is the requests
per second that met both SLOs, over the replay's span (the first arrival to the last token); a request that could
never run meets neither.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvmem._checks import check_number


class SLO(NamedTuple):
    """Service-level objectives, seconds: a request meets them when its TTFT and its TBT are at most these."""

    ttft_s: float
    tbt_s: float

    @classmethod
    def checked(cls, ttft_s: float, tbt_s: float) -> SLO:
        """ValueError naming the argument unless both are positive."""
        return cls(check_number("slo_ttft_s", ttft_s, 0, allow_minimum=False),
                   check_number("slo_tbt_s", tbt_s, 0, allow_minimum=False))


class RequestTimes:
    """When each request arrived, got its first token and its last, and how many tokens it got.

    >>> times = RequestTimes()
    >>> times.arrived(0, 1.0); times.first_token(0, 1.5); times.finished(0, 2.5, 11)
    >>> times.arrived(1, 1.2)     # never ran
    >>> out = times.to_json(SLO(1.0, 0.2))
    >>> out["ttft_p50_s"], out["tbt_p50_s"], out["slo_met"], out["goodput_rps"]
    (0.5, 0.1, 1, 0.666667)
    """

    def __init__(self) -> None:
        self.arrival: dict = {}
        self.first: dict = {}
        self.last: dict = {}
        self.tokens: dict = {}

    def arrived(self, rid, t: float) -> None:
        self.arrival[rid] = t

    def first_token(self, rid, t: float) -> None:
        """The first time only: a request retracted and prefilled again had its first token already."""
        self.first.setdefault(rid, t)

    def finished(self, rid, t: float, output_tokens: int) -> None:
        self.last[rid] = t
        self.tokens[rid] = output_tokens

    def ttft(self) -> np.ndarray:
        """[requests with a first token] float64 seconds."""
        return np.array([t - self.arrival[rid] for rid, t in self.first.items()], dtype=np.float64)

    def tbt(self) -> dict:
        """rid -> mean seconds between tokens, for the finished requests with two tokens or more."""
        first, tokens = self.first, self.tokens
        return {rid: (t - first[rid]) / (tokens[rid] - 1) for rid, t in self.last.items() if tokens[rid] > 1}

    def span_s(self) -> float:
        """From the first arrival to the last token (0.0 before any)."""
        if not self.arrival or not self.last:
            return 0.0
        return max(self.last.values()) - min(self.arrival.values())

    def slo_met(self, slo: SLO) -> int:
        """Finished requests whose TTFT and TBT (none with a single token) are within `slo`."""
        tbt = self.tbt()
        return sum(1 for rid in self.last
                   if self.first[rid] - self.arrival[rid] <= slo.ttft_s and tbt.get(rid, 0.0) <= slo.tbt_s)

    def goodput_rps(self, slo: SLO) -> float:
        span = self.span_s()
        return self.slo_met(slo) / span if span > 0 else 0.0

    def to_json(self, slo: SLO | None = None) -> dict:
        """TTFT and TBT p50 / p90 / p99 (seconds), and with `slo` the SLOs, the requests meeting them and goodput."""
        out = {}
        for name, values in (("ttft", self.ttft()), ("tbt", np.fromiter(self.tbt().values(), dtype=np.float64))):
            if values.size:
                out.update((f"{name}_{p}_s", round(float(v), 6))
                           for p, v in zip(("p50", "p90", "p99"), np.percentile(values, [50, 90, 99])))
        if slo is not None:
            met = self.slo_met(slo)
            out.update({"slo_ttft_s": slo.ttft_s, "slo_tbt_s": slo.tbt_s, "slo_met": met,
                        "slo_met_fraction": round(met / len(self.arrival), 6) if self.arrival else 0.0,
                        "goodput_rps": round(self.goodput_rps(slo), 6)})
        return out
