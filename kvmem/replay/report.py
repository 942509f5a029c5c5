"""What a replay measured: counters, per-step samples, a JSON-ready summary and plots."""

from __future__ import annotations

import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ReplayReport:
    """Metrics of one replay, filled in by the simulator as it runs.

    Hit rate is token-weighted: `hit_rate = cached_tokens / prompt_tokens`, where, over every request
    admitted at least once, `prompt_tokens` sums the prompt lengths and `cached_tokens` sums the cached
    prefix tokens that `match_prefix` found when the request was first admitted (`record_admission`).
    A request retracted and admitted again counts once, with its first match; a prompt prefilled in
    chunks counts the match made before its first chunk. Output tokens never count.

    Memory samples, one per scheduler step (`record_step`): `tokens_used` is the KV slots not free
    (running requests' tokens plus everything cached, capacity - available), `evictable_tokens` the
    cached slots no running request holds (freed on demand), so `tokens_used - evictable_tokens` are the
    slots pinned by running requests. `time_s` is the simulator's clock in seconds.

    evicted_tokens: tokens the radix cache evicted; retractions: decode-time retractions; rejected:
    requests that could never run (longer than max_context_len or the KV capacity), skipped;
    cache_op_seconds: wall time spent inside cache and allocator calls; replay_seconds: wall time of
    the whole replay.
    """

    capacity_tokens: int
    host_capacity_tokens: int | None = None
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    evicted_tokens: int = 0
    retractions: int = 0
    rejected: int = 0
    cache_op_seconds: float = 0.0
    replay_seconds: float = 0.0
    time_s: array = field(default_factory=lambda: array("d"), repr=False)
    tokens_used: array = field(default_factory=lambda: array("q"), repr=False)
    evictable_tokens: array = field(default_factory=lambda: array("q"), repr=False)
    running: array = field(default_factory=lambda: array("q"), repr=False)
    cumulative_hit_rate: array = field(default_factory=lambda: array("d"), repr=False)
    host_cached_tokens: int = 0
    storage_cached_tokens: int = 0
    storage: str | None = None
    prefetched_tokens: int = 0
    stored_tokens: int = 0
    storage_misses_corrupt: int = 0
    storage_failed_ops: int = 0
    loaded_tokens: int = 0
    backed_up_tokens: int = 0
    host_evicted_tokens: int = 0
    transfer_seconds: float = 0.0

    def record_admission(self, prompt_len: int, cached_len: int, host_len: int = 0, storage_len: int = 0) -> None:
        """Counts a request's first admission: its prompt length and its cached prefix length, of which
        `host_len` tokens were loaded from the host tier (`storage_len` of them read from storage for it)."""
        if not 0 <= storage_len <= host_len <= cached_len <= prompt_len:
            raise ValueError(f"need 0 <= storage_len <= host_len <= cached_len <= prompt_len, got storage_len="
                             f"{storage_len}, host_len={host_len}, cached_len={cached_len}, prompt_len={prompt_len}")
        self.requests += 1
        self.prompt_tokens += prompt_len
        self.cached_tokens += cached_len
        self.host_cached_tokens += host_len - storage_len
        self.storage_cached_tokens += storage_len

    def record_tiers(self, tree, config) -> None:
        """Takes a tiered cache's copy counts and prices them: transfer_seconds = KV bytes moved / bandwidth
        (host to device, device to host, and the storage tier's reads and writes)."""
        stats, link = tree.stats, tree.storage_link
        self.loaded_tokens = stats.loaded_tokens
        self.backed_up_tokens = stats.backed_up_tokens
        self.host_evicted_tokens = stats.host_evicted_tokens
        moved = stats.loaded_tokens / (config.h2d_gbps * 1e9) + stats.backed_up_tokens / (config.d2h_gbps * 1e9)
        if link is not None:
            self.storage = config.storage
            self.prefetched_tokens = link.stats.prefetched_tokens
            self.stored_tokens = link.stats.stored_tokens
            self.storage_misses_corrupt = link.storage.stats.corrupt
            self.storage_failed_ops = link.storage.stats.failed_ops
            moved += (link.stats.prefetched_tokens + link.stats.stored_tokens) / (config.storage_gbps * 1e9)
        self.transfer_seconds = config.kv_bytes_per_token * moved

    def record_step(self, time_s: float, tokens_used: int, evictable_tokens: int, running: int) -> None:
        """Samples memory after a scheduler step; the cumulative hit rate is taken from the counters."""
        self.time_s.append(time_s)
        self.tokens_used.append(tokens_used)
        self.evictable_tokens.append(evictable_tokens)
        self.running.append(running)
        self.cumulative_hit_rate.append(self.hit_rate)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def host_hit_rate(self) -> float:
        """The share of prompt tokens loaded back from the host tier that it held already (part of hit_rate)."""
        return self.host_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def storage_hit_rate(self) -> float:
        """The share of prompt tokens read from the storage tier for the request (part of hit_rate)."""
        return self.storage_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def device_hit_rate(self) -> float:
        """The share of prompt tokens found on the device (hit_rate - host_hit_rate - storage_hit_rate)."""
        below = self.host_cached_tokens + self.storage_cached_tokens
        return (self.cached_tokens - below) / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def peak_tokens_used(self) -> int:
        return max(self.tokens_used, default=0)

    @property
    def mean_tokens_used(self) -> float:
        """Mean over steps (not over simulated time)."""
        return sum(self.tokens_used) / len(self.tokens_used) if self.tokens_used else 0.0

    @property
    def peak_pinned_tokens(self) -> int:
        return max((u - e for u, e in zip(self.tokens_used, self.evictable_tokens)), default=0)

    def to_json(self) -> dict:
        """The summary as a JSON-ready dict (token counts are ints, seconds and rates floats)."""
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": round(self.hit_rate, 6),
            "evicted_tokens": self.evicted_tokens,
            "retractions": self.retractions,
            "rejected": self.rejected,
            "peak_tokens_used": self.peak_tokens_used,
            "mean_tokens_used": round(self.mean_tokens_used, 1),
            "peak_pinned_tokens": self.peak_pinned_tokens,
            "capacity_tokens": self.capacity_tokens,
            "steps": len(self.time_s),
            "cache_op_seconds": round(self.cache_op_seconds, 6),
            "replay_seconds": round(self.replay_seconds, 6),
            **self._tier_json(),
        }

    def _tier_json(self) -> dict:
        """The host tier's fields; none without a host tier, so that a device-only report is as it was."""
        if self.host_capacity_tokens is None:
            return {}
        return {
            "host_capacity_tokens": self.host_capacity_tokens,
            "device_hit_rate": round(self.device_hit_rate, 6),
            "host_hit_rate": round(self.host_hit_rate, 6),
            "loaded_tokens": self.loaded_tokens,
            "backed_up_tokens": self.backed_up_tokens,
            "host_evicted_tokens": self.host_evicted_tokens,
            "transfer_seconds": round(self.transfer_seconds, 6),
            **self._storage_json(),
        }

    def _storage_json(self) -> dict:
        if self.storage is None:
            return {}
        return {
            "storage": self.storage,
            "storage_hit_rate": round(self.storage_hit_rate, 6),
            "prefetched_tokens": self.prefetched_tokens,
            "stored_tokens": self.stored_tokens,
            "storage_misses_corrupt": self.storage_misses_corrupt,
            "storage_failed_ops": self.storage_failed_ops,
        }

    def write_plots(self, directory: str | os.PathLike) -> list[Path]:
        """Writes memory_use.png and hit_rate.png (against simulated time) into `directory`, creating it.
        Raises RuntimeError when matplotlib is missing."""
        figure_cls = require_matplotlib()
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        t = self.time_s
        pinned = [u - e for u, e in zip(self.tokens_used, self.evictable_tokens)]

        fig = figure_cls(figsize=(8, 4.5))
        ax = fig.subplots()
        ax.plot(t, self.tokens_used, label="used (requests + cache)")
        ax.plot(t, pinned, label="pinned by running requests")
        ax.axhline(self.capacity_tokens, color="grey", linestyle="--", label="capacity")
        ax.set(xlabel="simulated time (s)", ylabel="KV tokens", title="KV-cache memory use")
        ax.legend(loc="lower right")
        memory = out / "memory_use.png"
        fig.savefig(memory, dpi=120, bbox_inches="tight")

        fig = figure_cls(figsize=(8, 4.5))
        ax = fig.subplots()
        ax.plot(t, self.cumulative_hit_rate)
        ax.set(xlabel="simulated time (s)", ylabel="cumulative hit rate", ylim=(0, 1),
               title=f"Prefix-cache hit rate (final {self.hit_rate:.3f})")
        hit = out / "hit_rate.png"
        fig.savefig(hit, dpi=120, bbox_inches="tight")
        return [memory, hit]


def write_sweep_plot(reports: Sequence[ReplayReport], directory: str | os.PathLike) -> Path:
    """Writes hit_rate_vs_capacity.png (one point per report; with a host tier, one curve per tier and their
    total) into `directory`; needs matplotlib."""
    figure_cls = require_matplotlib()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    ordered = sorted(reports, key=lambda r: r.capacity_tokens)
    fig = figure_cls(figsize=(8, 4.5))
    ax = fig.subplots()
    x = [r.capacity_tokens for r in ordered]
    tiered = ordered[0].host_capacity_tokens is not None
    ax.plot(x, [r.hit_rate for r in ordered], marker="o", label="any tier" if tiered else None)
    if tiered:
        ax.plot(x, [r.device_hit_rate for r in ordered], marker=".", label="device")
        ax.plot(x, [r.host_hit_rate for r in ordered], marker=".", label=f"host ({ordered[0].host_capacity_tokens:,})")
        ax.legend(loc="upper left")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="device KV capacity (tokens)", ylabel="hit rate", ylim=(0, 1), title="Hit rate vs KV capacity")
    ax.grid(True, alpha=0.3)
    path = out / "hit_rate_vs_capacity.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def require_matplotlib():
    """matplotlib's Figure class (no pyplot: no global backend state); RuntimeError if not installed."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install matplotlib") from None
    return Figure
