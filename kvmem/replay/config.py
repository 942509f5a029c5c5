"""What a trace replay simulates: one frozen dataclass, checked where it is built."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvmem._checks import check_host_bytes, check_int, check_number
from kvmem.eviction import EVICTION_POLICIES as _POLICY_KEYS
from kvmem.replay.cost import (
    DEFAULT_KV_BYTES_PER_TOKEN,
    DEFAULT_MODEL,
    DEFAULT_PCIE_GBPS,
    DEFAULT_STORAGE_GBPS,
    DEFAULT_STORAGE_LATENCY_US,
    GPUS,
    MODEL_COMPUTE,
    kv_copies,
)
from kvmem.sizing import (
    HYBRID_MODEL_CONFIGS,
    WINDOW_FREE_INTERVAL,
    HybridConfig,
    bytes_per_token,
    get_model_config,
    window_pool_tokens,
)
from kvmem.storage import parse_store_spec

# kvmem.tiers.WRITE_POLICIES and kvmem.schedule_policy.SCHEDULE_POLICIES, copied because those import torch and
# the replay's configuration must not (a test checks that they agree).
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
SCHEDULE_POLICIES = ("lpm", "fcfs")

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
    eviction_policy: which unlocked radix-tree leaves go first: a name of `kvmem.eviction.EVICTION_POLICIES`,
        "belady" (the offline optimum, which only a replay can run) included.
    schedule_policy: "lpm" (longest cached prefix first) or "fcfs" (arrival order).
    max_running: cap on requests decoding at once (also the req_to_token rows).
    chunked_prefill_size: new prompt tokens per prefill step (None: a prompt is prefilled whole).
    honour_arrivals: True admits a request only once the simulated clock reaches its arrival_s; False
        queues every request at time 0, in trace order.
    seed: for any tie-break a simulator randomizes.
    host_capacity_tokens: host-tier slots under the device cache (None: no host tier); more than the
        device's capacity (rounded down to pages).
    write_policy: when the host tier copies a device node: "write_through", "write_through_selective" or
        "write_back" (see kvmem.tiers).
    kv_bytes_per_token: KV bytes a token weighs, to price copies between tiers (None: `model`'s, in its own
        dtype; llama-3-8b's without a model).
    h2d_gbps / d2h_gbps: host-to-device and device-to-host copy bandwidth, GB/s (1e9 bytes; None: the `gpu`'s
        host link, 50 GB/s without a gpu; d2h as h2d).
    storage: a storage tier under the host tier: "sim" or "sim:CAPACITY_TOKENS" (a SimStore: the pages' keys,
        capacity and eviction without their bytes, what a plan needs), "file:DIR" (a FileStore) or
        "mooncake:HOST:PORT" (a Mooncake master); None: none. storage_metadata: the Mooncake metadata server
        ("P2PHANDSHAKE" or a URL).
    storage_capacity_tokens: what the file or simulated store may hold (None: unbounded, or sim:CAPACITY_TOKENS's;
        at least one page). storage_gbps / storage_latency_us: the storage tier's bandwidth (GB/s) and a read's
        latency (us), what the clock charges a prefill that reads from it.
    cache_decode_pages: a running request's full output pages count as cached as soon as they are written (as
        vLLM does; see kvmem.SchedulerConfig); False: outputs are cached when the request finishes (as SGLang).
    in_batch_prefix_caching: a request waits a step for a page another request of its prefill batch computes
        (kvmem.SchedulerConfig), as vLLM's schedule-time caching lets it hit that page.
    gpu, model, tp: the simulated clock. gpu None: the fixed StepCost; a kvmem.replay.cost.GPUS name: the
        roofline of `model` (a kvmem.sizing preset; None: llama-3-8b) on `tp` of those GPUs (see
        kvmem.replay.cost). `model` names the preset kv_bytes_per_token was taken from, if any.
    pin_prefix_tokens: pin the first N tokens of each finished request's prompt (`RadixCache.pin`; 0: no
        pins), as a server would pin its system prompts. pin_budget: the share of the capacity pins may hold.
    full_attention_pools: for a hybrid `model` (kvmem.sizing.HYBRID_MODEL_CONFIGS), one pool sized as if every
        layer were full attention (the comparison); False: window-aware pools (kvmem.hybrid), capacity_tokens being
        the full-attention pool's, beside a window pool of window_tokens (None: `sizing.window_pool_tokens` of
        max_running and chunked_prefill_size) and state_slots recurrent states (None: two per running request).
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
    host_capacity_tokens: int | None = None
    write_policy: str = "write_through"
    kv_bytes_per_token: int | None = None
    h2d_gbps: float | None = None
    d2h_gbps: float | None = None
    storage: str | None = None
    storage_metadata: str = "P2PHANDSHAKE"
    storage_capacity_tokens: int | None = None
    storage_gbps: float = DEFAULT_STORAGE_GBPS
    storage_latency_us: float = DEFAULT_STORAGE_LATENCY_US
    cache_decode_pages: bool = True
    in_batch_prefix_caching: bool = False
    gpu: str | None = None
    model: str | None = None
    tp: int = 1
    pin_prefix_tokens: int = 0
    pin_budget: float = 0.2
    full_attention_pools: bool = False
    window_tokens: int | None = None
    state_slots: int | None = None

    def __post_init__(self) -> None:
        if self.model is not None and self.model not in MODEL_COMPUTE:
            raise ValueError(f"model must be one of {', '.join(MODEL_COMPUTE)}, got {self.model!r}")
        if self.gpu is not None and self.gpu not in GPUS:
            raise ValueError(f"gpu must be one of {', '.join(GPUS)}, got {self.gpu!r}")
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
        if self.host_capacity_tokens is not None:
            check_int("host_capacity_tokens", self.host_capacity_tokens, minimum=1)
            if self.host_pages * self.page_size <= self.capacity_tokens // self.page_size * self.page_size:
                raise ValueError(f"host_capacity_tokens {self.host_capacity_tokens} must exceed the device's "
                                 f"{self.capacity_tokens} (a host tier holds a copy of every cached device page)")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        if self.kv_bytes_per_token is not None:
            check_int("kv_bytes_per_token", self.kv_bytes_per_token, minimum=1)
        for name in ("h2d_gbps", "d2h_gbps"):
            if getattr(self, name) is not None:
                check_number(name, getattr(self, name), 0, allow_minimum=False)
        check_number("storage_gbps", self.storage_gbps, 0, allow_minimum=False)
        check_number("storage_latency_us", self.storage_latency_us, 0)
        if self.storage_capacity_tokens is not None:
            check_int("storage_capacity_tokens", self.storage_capacity_tokens, minimum=1)
        if self.storage is not None:
            scheme, where = parse_store_spec(self.storage)
            if self.host_capacity_tokens is None:
                raise ValueError("storage needs a host tier (--host-capacity-tokens or --host-mem-gb): pages reach "
                                 "it through the host")
            if scheme == "sim" and where and self.storage_capacity_tokens is not None:
                raise ValueError(f"storage_capacity_tokens with storage {self.storage!r}: give the simulated store's "
                                 f"capacity once")
        for name in ("cache_decode_pages", "in_batch_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        check_int("tp", self.tp, minimum=1)
        if self.gpu is not None:
            kv_copies(self.model or DEFAULT_MODEL, self.tp)  # a tp that cannot split the model's heads
        check_int("pin_prefix_tokens", self.pin_prefix_tokens, minimum=0)
        if not 0 <= check_number("pin_budget", self.pin_budget, 0) <= 1:
            raise ValueError(f"pin_budget must lie in [0, 1], got {self.pin_budget!r}")
        self._check_hybrid()

    def _check_hybrid(self) -> None:
        if not isinstance(self.full_attention_pools, bool):
            raise ValueError(f"full_attention_pools must be a bool, got {self.full_attention_pools!r}")
        hybrid = self.hybrid
        for name in ("window_tokens", "state_slots"):
            value = getattr(self, name)
            if value is None:
                continue
            if hybrid is None:
                raise ValueError(f"{name} is for the window-aware pools of a hybrid model (model one of "
                                 f"{', '.join(HYBRID_MODEL_CONFIGS)}, full_attention_pools False)")
            check_int(name, value, minimum=2 if name == "state_slots" else 1)
        if hybrid is None:
            return
        if self.host_capacity_tokens is not None:
            raise ValueError("a host tier with a hybrid model's window-aware pools: kvmem.hybrid's components are "
                             "device-only (full_attention_pools=True replays it with one pool)")
        if self.eviction_policy == "belady":
            raise ValueError("belady eviction with a hybrid model's window-aware pools: the oracle ranks the full "
                             "pool alone")
        if hybrid.window_layers:
            need = self.hybrid_window_tokens
            if self.window_tokens is not None and self.window_tokens % self.page_size:
                raise ValueError(f"window_tokens {self.window_tokens} must be a multiple of page_size "
                                 f"{self.page_size}")
            if self.window_tokens is not None and need > self.capacity_tokens // self.page_size * self.page_size:
                raise ValueError(f"window_tokens {need} exceeds capacity_tokens {self.capacity_tokens}")
            ps, window = self.page_size, min(hybrid.sliding_window, self.context_len)
            least = _pages(max(window - 1, ps), ps) + _pages(WINDOW_FREE_INTERVAL, ps) + 3 * ps
            if need < least:
                raise ValueError(f"window_tokens {need} is too small for {self.model}'s window of {window} at page "
                                 f"size {ps}: a request takes up to {least} window slots")
        elif self.window_tokens is not None:
            raise ValueError(f"window_tokens: {self.model} has no sliding-window layer")
        if not hybrid.linear_layers and self.state_slots is not None:
            raise ValueError(f"state_slots: {self.model} has no linear-attention layer")

    def at_capacity(self, capacity_tokens: int, **changes) -> ReplayConfig:
        """This configuration at another capacity (and `changes`, as dataclasses.replace takes them): a window pool
        set by hand shrinks to the new full pool if it was larger (a sweep's smaller points)."""
        window = self.window_tokens
        if window is not None and window > capacity_tokens:
            window = max(capacity_tokens // self.page_size * self.page_size, self.page_size)
        return dataclasses.replace(self, capacity_tokens=capacity_tokens, window_tokens=window, **changes)

    @property
    def hybrid(self) -> HybridConfig | None:
        """The hybrid model whose window-aware pools this replay runs on; None for one pool (a model of one layer
        kind, or full_attention_pools)."""
        if self.full_attention_pools or self.model not in HYBRID_MODEL_CONFIGS:
            return None
        return HYBRID_MODEL_CONFIGS[self.model]

    @property
    def hybrid_window_tokens(self) -> int:
        """The window pool's tokens (0 without window layers): window_tokens, or what `sizing.window_pool_tokens`
        gives the replay's concurrency."""
        hybrid = self.hybrid
        if hybrid is None or not hybrid.window_layers:
            return 0
        if self.window_tokens is not None:
            return self.window_tokens
        pool = window_pool_tokens(hybrid, self.page_size, self.max_running, self.chunked_prefill_size or 8192)
        return min(pool, self.capacity_tokens // self.page_size * self.page_size)  # never more than the full pool

    @property
    def hybrid_state_slots(self) -> int:
        """The state slots (0 without linear layers): state_slots, or two per running request."""
        hybrid = self.hybrid
        if hybrid is None or not hybrid.linear_layers:
            return 0
        return self.state_slots if self.state_slots is not None else 2 * self.max_running

    @property
    def token_kv_bytes(self) -> int:
        """kv_bytes_per_token, or the model's (llama-3-8b's without one). Left None in the field, so that
        dataclasses.replace with another model derives it again."""
        if self.kv_bytes_per_token is not None:
            return self.kv_bytes_per_token
        return DEFAULT_KV_BYTES_PER_TOKEN if self.model is None else bytes_per_token(get_model_config(self.model))

    @property
    def host_links_gbps(self) -> tuple[float, float]:
        """(h2d, d2h) GB/s: as given, else the GPU's host link (50 GB/s without a GPU); d2h as h2d."""
        h2d = self.h2d_gbps if self.h2d_gbps is not None else (
            DEFAULT_PCIE_GBPS if self.gpu is None else GPUS[self.gpu].host_link_gbps)
        return h2d, self.d2h_gbps if self.d2h_gbps is not None else h2d

    @property
    def context_len(self) -> int:
        """The req_to_token row length a replay uses: the longest request, capped at the capacity (whole
        pages), since a request longer than the KV capacity can never run. One absurd request in a trace is
        then rejected, instead of sizing every row after it."""
        return min(self.max_context_len, self.capacity_tokens // self.page_size * self.page_size)

    @property
    def store_capacity_tokens(self) -> int | None:
        """What the storage tier may hold, in tokens: storage_capacity_tokens, or a simulated store's sim:N (None:
        unbounded)."""
        if self.storage is not None and self.storage_capacity_tokens is None:
            scheme, where = parse_store_spec(self.storage)
            if scheme == "sim" and where:
                return int(where)
        return self.storage_capacity_tokens

    @property
    def host_pages(self) -> int:
        return (self.host_capacity_tokens or 0) // self.page_size

    def check_host_memory(self, replicas: int = 1) -> None:
        """Raises ValueError (one line) when the host bookkeeping of `replicas` replays of this configuration (a
        cluster replay runs one per replica) would not fit this machine: the allocators (33 bytes a page), the
        tree's slot bitmap (1 byte a slot) and the req_to_token rows."""
        table = self.max_running * self.context_len * 4
        what = f"a replay at capacity {self.capacity_tokens} tokens"
        check_host_bytes(what if replicas == 1 else f"{replicas} replicas of {what}",
                         replicas * ((self.capacity_tokens // self.page_size + self.host_pages) * 33
                                     + self.capacity_tokens + table))


def _pages(tokens: int, page_size: int) -> int:
    """`tokens` rounded up to whole pages."""
    return -(-tokens // page_size) * page_size
