"""What a trace replay simulates: one frozen dataclass, checked where it is built."""

from __future__ import annotations

from dataclasses import dataclass

from kvmem._checks import check_host_bytes, check_int
from kvmem.eviction import EVICTION_POLICIES as _POLICY_KEYS
from kvmem.scheduler import SCHEDULE_POLICIES

# The names the radix cache accepts, in its order; the replay offers exactly those.
EVICTION_POLICIES = tuple(_POLICY_KEYS)


@dataclass(frozen=True)
class ReplayConfig:
    """The simulated server.

    capacity_tokens: KV-cache slots (tokens) in the pool, page_size included (rounded down to pages by
        the simulator).
    max_context_len: the longest prompt + output a request may have (the req_to_token row length);
        derive it from the trace (`Trace.max_context_len`).
    page_size: tokens per KV page (1: token-granular radix cache).
    eviction_policy: which unlocked radix-tree leaves go first: "lru", "lfu", "fifo" or "priority".
    schedule_policy: "lpm" (longest cached prefix first) or "fcfs" (arrival order).
    max_running: cap on requests decoding at once (also the req_to_token rows).
    chunked_prefill_size: new prompt tokens per prefill step (None: a prompt is prefilled whole).
    honour_arrivals: True admits a request only once the simulated clock reaches its arrival_s; False
        queues every request at time 0, in trace order.
    seed: for any tie-break a simulator randomizes.
    """

    capacity_tokens: int
    max_context_len: int
    page_size: int = 1
    eviction_policy: str = "lru"
    schedule_policy: str = "lpm"
    max_running: int = 256
    chunked_prefill_size: int | None = 8192
    honour_arrivals: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("capacity_tokens", "max_context_len", "page_size", "max_running"):
            check_int(name, getattr(self, name), minimum=1)
        if self.chunked_prefill_size is not None:
            check_int("chunked_prefill_size", self.chunked_prefill_size, minimum=1)
        if self.capacity_tokens < self.page_size:
            raise ValueError(f"capacity_tokens {self.capacity_tokens} is less than one page "
                             f"(page_size {self.page_size})")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {EVICTION_POLICIES}, got {self.eviction_policy!r}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        if not isinstance(self.honour_arrivals, bool):
            raise ValueError(f"honour_arrivals must be a bool, got {self.honour_arrivals!r}")
        check_int("seed", self.seed)

    @property
    def context_len(self) -> int:
        """The req_to_token row length a replay uses: the longest request, capped at the capacity (whole
        pages), since a request longer than the KV capacity can never run. One absurd request in a trace is
        then rejected, instead of sizing every row after it."""
        return min(self.max_context_len, self.capacity_tokens // self.page_size * self.page_size)

    def check_host_memory(self) -> None:
        """Raises ValueError (one line) when the replay's host bookkeeping would not fit this machine: the
        allocator (33 bytes a page), the tree's slot bitmap (1 byte a slot) and the req_to_token rows."""
        table = self.max_running * self.context_len * 4
        check_host_bytes(f"a replay at capacity {self.capacity_tokens} tokens",
                         self.capacity_tokens // self.page_size * 33 + self.capacity_tokens + table)
