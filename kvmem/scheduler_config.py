"""How the Scheduler admits work (SchedulerConfig) and what it counts (SchedulerStats)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmem._checks import check_int, check_number
from kvmem.schedule_policy import SCHEDULE_POLICIES

__all__ = ["SchedulerConfig", "SchedulerStats"]


@dataclass(frozen=True)
class SchedulerConfig:
    """How the loop admits work.

    schedule_policy: "lpm" (longest cached prefix first) or "fcfs" (arrival order).
    max_running_requests: cap on requests in the running batch (None: the req_to_token rows).
    chunked_prefill_size: new tokens per extend step (None: no cap, no chunking); a request longer
        than what is left of the step is prefilled in chunks.
    lpm_window: how many waiting requests "lpm" matches against the tree per step (bounds its cost).
    load_back_threshold: with a tiered cache, a prefix part held only by the host is loaded back when it has
        at least this many tokens, and recomputed when shorter (a copy costs more than a few tokens' prefill).
    init_new_token_ratio / min_new_token_ratio / new_token_ratio_decay: the share of running requests'
        remaining output tokens that admission keeps free.
    cache_decode_pages: a running request's full pages of output count as cached as soon as they are written
        (as vLLM caches them), so a request that continues them, or the request itself after a retraction,
        reuses them; False caches output only when the request finishes (as SGLang does). The pages enter
        the tree when a match reaches them or the request is retracted, so a decode step costs nothing more.
    in_batch_prefix_caching: a waiting request whose next uncached page is one that a request admitted in the
        same prefill batch computes waits for the next batch (with those behind it) and finds it cached there
        (SGLang's in-batch prefix caching; vLLM gets the same hits by caching pages when they are scheduled).
        Off: it computes the page again, beside the other.
    """

    schedule_policy: str = "lpm"
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = 8192
    lpm_window: int = 128
    load_back_threshold: int = 16
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001
    cache_decode_pages: bool = True
    in_batch_prefix_caching: bool = False

    def __post_init__(self) -> None:
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        for name in ("max_running_requests", "chunked_prefill_size"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum=1)
        check_int("lpm_window", self.lpm_window, minimum=1)
        check_int("load_back_threshold", self.load_back_threshold, minimum=1)
        for name in ("init_new_token_ratio", "min_new_token_ratio", "new_token_ratio_decay"):
            check_number(name, getattr(self, name), 0)
        if not 0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1:
            raise ValueError("need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1, got "
                             f"{self.min_new_token_ratio} and {self.init_new_token_ratio}")
        for name in ("cache_decode_pages", "in_batch_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")


@dataclass
class SchedulerStats:
    retractions: int = 0
    evicted_tokens: int = 0
    prefill_batches: int = 0
    decode_batches: int = 0
    rejected: int = 0
