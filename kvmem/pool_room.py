"""What a radix cache tells the scheduler about the pools' room: one token pool for `RadixCache`, each answer
extended by a hybrid cache (`kvmem.hybrid`) with its window and state components. A mixin over the tree (it reads
`token_allocator`, `_evictable_size` and `evict`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvmem.radix_cache import CachedRequest


class PoolRoom:
    """The pools' room as the Scheduler, the batch and the admission ask for it (see the module docstring)."""

    chunk_grid = 1  # a prefill chunk that stops short of its prompt's end ends on a multiple of this
    match_is_walk = True  # match_prefix returns what prefix_walk walks (a hybrid cache's may end higher)

    def admission_budget(self, reserved: int, new_token_ratio: float):
        """Trusted: what one extend step's admission charges beyond the token pool (None: nothing); see
        `kvmem.prefill_adder`."""
        return None

    def fits(self, num_tokens: int, num_reqs: int = 0) -> bool:
        """Trusted: whether `num_tokens` new slots (whole pages), for `num_reqs` requests given rows now, are free."""
        return num_tokens <= self.token_allocator.available_size()

    def can_fit(self, num_tokens: int) -> bool:
        """Trusted: whether `num_tokens` new slots (whole pages) fit in what is free and evictable."""
        return num_tokens <= self.token_allocator.available_size() + self._evictable_size

    def evict_for(self, num_tokens: int, num_reqs: int = 0) -> int:
        """Trusted: evicts what `fits(num_tokens, num_reqs)` is short of; returns the tokens evicted."""
        short = num_tokens - self.token_allocator.available_size()
        return self.evict(short) if short > 0 else 0

    def start_reqs(self, reqs: list[CachedRequest]) -> None:
        """Trusted: requests were just given rows (after `fits(..., len(reqs))`): a hook for what a component
        holds per request."""

    def decode_step(self, reqs: list[CachedRequest], kv_lens: np.ndarray) -> None:
        """Trusted: running requests `reqs`, holding kv_lens[i] tokens each, are about to decode one more: a hook
        for memory a component frees as requests advance."""

    def check_held(self, reqs: list[CachedRequest]) -> None:
        """Raises AssertionError unless what requests `reqs` (all that hold memory) hold adds up, per component
        beyond the token pool (the Scheduler checks the token pool itself)."""
