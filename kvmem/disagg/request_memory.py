"""A disaggregated request's memory while it is outside its scheduler: on the decode side from its pre-allocation
until its KV has arrived, on the prefill side from its hand-off until its KV has left.

Such a request is RUNNING (it holds memory) and its row is drawn as `kvmem.radix_cache.CachedRequest` draws it: the
tree's locked prefix, then its own slots, in whole pages. It goes back on the radix cache's one release path,
`release_req`. `held_tokens` is what it holds beyond the tree (full slots); a side passes such requests to its
scheduler's `check_invariants(held_outside=...)`, which counts that and, for a hybrid tree, their window slots and
state slots.

A hybrid engine's request also holds, beyond its full pages: window slots for its prompt's window tail only (the
last `ceil_page(max(W - 1, page))` tokens, from `window_start`: what its decode reads; the head of its prompt stays
full KV only, as a long request's row does once it has decoded past it), and a state slot (the linear layers' state
after the whole prompt). `RequestKV` says where all of it lives, alike on both sides.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvmem._paging import round_up
from kvmem.allocator import PagedTokenAllocator, TokenAllocator
from kvmem.batch import Req, ReqStatus
from kvmem.hybrid import HybridRadixCache
from kvmem.radix_cache import RadixCache
from kvmem.req_to_token import ReqToTokenPool

_NO_PAGES = np.empty(0, dtype=np.int64)


class RequestKV(NamedTuple):
    """Where the KV a transfer moves for a request lives in one engine's pools: `pages` [n] int64, the full pool's
    pages of its prompt tokens start.. (in order); `window_pages` [m] int64, the window pool's pages of the prompt's
    last m of those (its window tail; empty without window layers); `state_slot`, its linear layers' state (0
    without)."""

    pages: np.ndarray
    window_pages: np.ndarray
    state_slot: int


def window_start(tree_cache: RadixCache, start: int, prompt: int) -> int:
    """The first prompt position whose window KV moves with a request whose KV moves from token `start` on: its
    window tail (`HybridRadixCache.kept_window_start`), not below start; `prompt` (none) without window layers."""
    if not _windowed(tree_cache):
        return prompt
    return max(start, tree_cache.kept_window_start(prompt))


def request_kv(req: Req, req_to_token_pool: ReqToTokenPool, tree_cache: RadixCache, start: int) -> RequestKV:
    """Where the request's prompt KV from token `start` on (a multiple of the page size) lives: its row's pages, the
    window pages paired with those of its window tail (0 where the window KV is gone) and its state slot."""
    ps = tree_cache.page_size
    pages = row_pages(req, req_to_token_pool, start, ps)
    if not isinstance(tree_cache, HybridRadixCache):
        return RequestKV(pages, _NO_PAGES, 0)
    window_pages = _NO_PAGES
    if _windowed(tree_cache):
        tail = pages[(window_start(tree_cache, start, req.kv_len) - start) // ps:]
        window_pages = tree_cache.token_allocator.window_pages_of(tail)
    state = int(tree_cache.req_state_slots([req.req_pool_idx])[0]) if tree_cache.state_pool is not None else 0
    return RequestKV(pages, window_pages, state)


def preallocate(req: Req, req_to_token_pool: ReqToTokenPool, token_allocator: TokenAllocator | PagedTokenAllocator,
                tree_cache: RadixCache, *, reserve_tokens: int = 0) -> int | None:
    """Gives a new request whose prompt's KV will arrive from a prefill side its memory, and returns how many
    leading prompt tokens the tree already holds (whole pages): the KV to ask for starts there.

    Matches the whole prompt in the tree and locks that prefix, takes a req_to_token row and whole pages for the rest
    of the prompt (evicting the shortfall from the tree), and fills the row: after it, req.kv_len == len(input_ids)
    and req.cache_protected_len is the match. A hybrid tree's request also gets window slots for its window tail
    (`window_start`) and a state slot (`HybridRadixCache.start_reqs`: the matched state's copy, until the prompt's
    arrives). `reserve_tokens` stay free or evictable beyond it, in each token pool (room for the running requests'
    next tokens). Returns None, changing nothing, when rows, slots, window slots or state slots are short.
    """
    match = tree_cache.match_prefix(req.input_ids, req.namespace)
    hit, prompt = match.indices.numel(), len(req.input_ids)
    ps = token_allocator.page_size
    need = round_up(prompt - hit, ps)
    window_need = round_up(prompt - window_start(tree_cache, hit, prompt), ps)
    tree_cache.lock(match.last_node)  # before evicting: the evictable size must not count the prefix
    if not _has_room(tree_cache, need + reserve_tokens, window_need + reserve_tokens) or \
            req_to_token_pool.available_size() == 0:
        tree_cache.unlock(match.last_node)
        return None
    _evict_for(tree_cache, need, window_need)
    row = req_to_token_pool.alloc(1)[0]
    req_to_token_pool.set_row_slots(row, 0, match.indices)
    if need:
        slots = token_allocator.alloc_window_tail(need, window_need) if _windowed(tree_cache) else \
            token_allocator.alloc(need)
        req_to_token_pool.set_row_slots(row, hit, slots[:prompt - hit])
    req.req_pool_idx = row
    req.prefix_indices = match.indices
    req.last_node = match.last_node
    req.cache_protected_len = hit
    req.kv_len = req.extend_end = prompt
    req.status = ReqStatus.RUNNING
    tree_cache.start_reqs([req])
    return hit


def _has_room(tree_cache: RadixCache, tokens: int, window_tokens: int) -> bool:
    """Whether `tokens` full slots (and for a hybrid tree `window_tokens` window slots and a state slot) are free or
    evictable."""
    alloc = tree_cache.token_allocator
    if tokens > alloc.available_size() + tree_cache.evictable_size():
        return False
    if not isinstance(tree_cache, HybridRadixCache):
        return True
    if _windowed(tree_cache) and window_tokens > alloc.window_available_size() + tree_cache.window_evictable_size():
        return False
    return tree_cache.state_pool is None or tree_cache.state_available_size() + tree_cache.state_evictable_size() > 0


def _evict_for(tree_cache: RadixCache, tokens: int, window_tokens: int) -> None:
    """Evicts what is short of `tokens` free full slots (and window slots and a state slot), once `_has_room`."""
    alloc = tree_cache.token_allocator
    short = tokens - alloc.available_size()
    if short > 0:
        tree_cache.evict(short)
    if not isinstance(tree_cache, HybridRadixCache):
        return
    short = window_tokens - alloc.window_available_size() if _windowed(tree_cache) else 0
    if short > 0:
        tree_cache.evict_window(short)
    if tree_cache.state_pool is not None and not tree_cache.state_available_size():
        tree_cache.evict_states(1)


def _windowed(tree_cache: RadixCache) -> bool:
    return isinstance(tree_cache, HybridRadixCache) and tree_cache.window is not None


def row_pages(req: Req, req_to_token_pool: ReqToTokenPool, start: int, page_size: int) -> np.ndarray:
    """[pages] int64: the pages of the request's tokens start..kv_len-1 (start a multiple of page_size), in order."""
    return req_to_token_pool.row_slots(req.req_pool_idx, start, req.kv_len)[::page_size] // page_size


def held_tokens(req: Req, page_size: int) -> int:
    """Slots the request holds beyond the tree's prefix (whole pages)."""
    return round_up(req.kv_len, page_size) - req.cache_protected_len


def release(req: Req, tree_cache: RadixCache, *, cache: bool) -> None:
    """Frees the request's memory (`RadixCache.release_req`; `cache`: its whole pages enter the tree first) and
    finishes it."""
    tree_cache.release_req(req, cache=cache)
    req.status = ReqStatus.FINISHED
