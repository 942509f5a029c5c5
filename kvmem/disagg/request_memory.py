"""A disaggregated request's memory while it is outside its scheduler: on the decode side from its pre-allocation
until its KV has arrived, on the prefill side from its hand-off until its KV has left.

Such a request is RUNNING (it holds memory) and its row is drawn as `kvmem.radix_cache.CachedRequest` draws it: the
tree's locked prefix, then its own slots, in whole pages. It goes back on the radix cache's one release path,
`release_req`. `held_tokens` is what it holds beyond the tree: what a side adds to its scheduler's
`check_invariants(held_outside=...)`.
"""

from __future__ import annotations

import numpy as np

from kvmem._paging import round_up
from kvmem.allocator import PagedTokenAllocator, TokenAllocator
from kvmem.batch import Req, ReqStatus
from kvmem.radix_cache import RadixCache
from kvmem.req_to_token import ReqToTokenPool


def preallocate(req: Req, req_to_token_pool: ReqToTokenPool, token_allocator: TokenAllocator | PagedTokenAllocator,
                tree_cache: RadixCache, *, reserve_tokens: int = 0) -> int | None:
    """Gives a new request whose prompt's KV will arrive from a prefill side its memory, and returns how many
    leading prompt tokens the tree already holds (whole pages): the KV to ask for starts there.

    Matches the whole prompt in the tree and locks that prefix, takes a req_to_token row and whole pages for the rest
    of the prompt (evicting the shortfall from the tree), and fills the row: after it, req.kv_len == len(input_ids)
    and req.cache_protected_len is the match. `reserve_tokens` stay free or evictable beyond it (room for the running
    requests' next tokens). Returns None, changing nothing, when rows or slots are short.
    """
    match = tree_cache.match_prefix(req.input_ids, req.namespace)
    hit, prompt = match.indices.numel(), len(req.input_ids)
    need = round_up(prompt - hit, token_allocator.page_size)
    tree_cache.lock(match.last_node)  # before evicting: the evictable size must not count the prefix
    room = token_allocator.available_size() + tree_cache.evictable_size()
    if need + reserve_tokens > room or req_to_token_pool.available_size() == 0:
        tree_cache.unlock(match.last_node)
        return None
    short = need - token_allocator.available_size()
    if short > 0:
        tree_cache.evict(short)
    row = req_to_token_pool.alloc(1)[0]
    req_to_token_pool.set_row_slots(row, 0, match.indices)
    if need:
        req_to_token_pool.set_row_slots(row, hit, token_allocator.alloc(need)[:prompt - hit])
    req.req_pool_idx = row
    req.prefix_indices = match.indices
    req.last_node = match.last_node
    req.cache_protected_len = hit
    req.kv_len = req.extend_end = prompt
    req.status = ReqStatus.RUNNING
    return hit


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
