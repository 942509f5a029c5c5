"""Multi-level cascade attention metadata built from the radix tree: each shared prefix is read once per batch.

Flat paged attention reads every request's whole KV, so a system prompt shared by 200 decoding requests is
read 200 times per layer. Cascade attention (FlashInfer's `MultiLevelCascadeAttentionWrapper`) splits each
request's KV into levels, attends each level separately and merges the results with the log-sum-exp merge
(`kvmem.attention.merge`): a level entry whose KV is a shared prefix serves all the requests under it, so
that prefix is read once per level entry instead of once per request.

The radix tree already knows every shared prefix: a running request's `last_node` path (root..node,
`cache_protected_len` tokens, the leading slots of its req_to_token row) is its cached prefix, and a node on
the paths of two or more requests of the batch holds KV they share. Along one request's path the number of
batch requests through a node never grows, so the shared nodes are a prefix of the path, and a run of nodes
with the same count is a *segment* shared by exactly the same requests. Segments nest: each lies under its
parent segment and is shared by a strict subset of its requests.

Levels, FlashInfer's layout (https://docs.flashinfer.ai/tutorials/kv_layout.html, "Multi-level Cascade
Inference Data Layout"): every level is a `PagedKVMetadata` over the same paged K/V buffers and the same
queries, in one *cascade order* of the requests where those sharing a segment are contiguous, so that one
level entry (one qo range) covers them all.

- Shared levels 0 .. num_levels-2: level l holds the l-th kept segment of each request's path. An entry is
  one segment with the query rows of all its requests; runs of requests with no segment at that level get
  one entry with no pages (FlashInfer returns zeros and lse -inf for it, which the merge ignores). Segment
  pages are whole pages of the tree, so entries end on page boundaries (kv_last_page_len = page_size).
- The last level: each request's own suffix, from the end of its last kept segment to seq_lens (its
  uncached part, the current token, and any shared part not kept), one entry per request, causal. The
  shared levels lie wholly before every query (the tree holds only a request's prefix), so they are
  attended without a mask, as FlashInfer's wrapper plans them.

A segment is kept only if it (together with any shorter segments above it that were not kept) holds at
least `min_shared_tokens` tokens, and at most `max_levels - 1` segments per request are kept; the rest of
the path falls to the next kept segment or to the request's own suffix. With nothing kept the result is a
single flat level, equal to `build_decode_metadata` / `build_extend_metadata` in batch order.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from kvmem._checks import check_int
from kvmem._torch import torch
from kvmem.attention.metadata import PagedKVMetadata
from kvmem.batch import ScheduleBatch
from kvmem.kernels.kv_indices import _create_kv_indices, _create_kv_indptr, _kv_last_page_len
from kvmem.radix_tree import RadixTree

if TYPE_CHECKING:
    from kvmem.radix_tree import TreeNode

DEFAULT_MAX_LEVELS = 3


@dataclass(frozen=True)
class CascadeMetadata:
    """One batch's cascade levels (see the module docstring), all on req_to_token's device.

    levels: the per-level FlashInfer arrays, shared prefixes first, each request's own suffix last; every
        level's qo_indptr ends at total_q and indexes queries in cascade order.
    request_order: [bs] int64, cascade position -> the request's index in the batch.
    qo_order: [total_q] int64, cascade query row -> the batch's query row (equal to request_order in a
        decode batch). Attention runs on `permute_queries(q)`; `unpermute_outputs` puts the rows back.
    """

    levels: tuple[PagedKVMetadata, ...]
    request_order: torch.Tensor
    qo_order: torch.Tensor

    @property
    def num_levels(self) -> int:
        return len(self.levels)

    @property
    def page_size(self) -> int:
        return self.levels[0].page_size

    def permute_queries(self, q: torch.Tensor) -> torch.Tensor:
        """q [total_q, ...] in batch order -> the same rows in cascade order."""
        return q.index_select(0, self.qo_order)

    def unpermute_outputs(self, out: torch.Tensor) -> torch.Tensor:
        """out [total_q, ...] in cascade order -> the same rows in batch order (inverse of permute_queries)."""
        return torch.empty_like(out).index_copy_(0, self.qo_order, out)


def build_cascade_metadata(batch: ScheduleBatch, tree: RadixTree, *, min_shared_tokens: int = 256,
                           max_levels: int = DEFAULT_MAX_LEVELS) -> CascadeMetadata:
    """Cascade levels for a prepared decode or extend batch, from the prefixes its requests hold in `tree`.

    Args:
        batch: a ScheduleBatch after `prepare_for_decode()` or `prepare_for_extend()`: its requests'
            `last_node` / `cache_protected_len`, req_to_token rows, `seq_lens` and `extend_lens` (the query
            tokens: 1 per request in a decode) are read, nothing is changed.
        tree: the radix cache the batch's requests locked their prefixes in (`batch.tree_cache`).
        min_shared_tokens: the fewest tokens a shared level entry may hold (>= 0); shorter shared segments
            are read with what follows them instead.
        max_levels: at most this many levels (>= 1), the own-suffix level included; 1 gives flat attention.

    Raises ValueError (changing nothing) for an empty batch, a page size other than the tree's, or a
    request whose last_node is not in `tree` or does not cover its cache_protected_len tokens, TypeError
    naming `batch` or `tree` when it is not a ScheduleBatch or a radix tree, and RuntimeError before the batch
    is prepared.
    """
    if not isinstance(batch, ScheduleBatch):
        raise TypeError(f"batch must be a ScheduleBatch, got {type(batch).__name__}")
    if not isinstance(tree, RadixTree):
        raise TypeError(f"tree must be the batch's radix cache (a RadixTree), got {type(tree).__name__}")
    min_shared_tokens = check_int("min_shared_tokens", min_shared_tokens, minimum=0)
    max_levels = check_int("max_levels", max_levels, minimum=1)
    if batch.forward_mode is None:
        raise RuntimeError("build_cascade_metadata needs prepare_for_extend() or prepare_for_decode() first")
    if not batch.reqs:
        raise ValueError("the batch is empty: there is nothing to attend")
    if tree.page_size != batch.page_size:
        raise ValueError(f"tree.page_size {tree.page_size} != the batch's page_size {batch.page_size}")
    qo_lens = batch.extend_lens.numpy()
    prefix_lens = batch.seq_lens.numpy() - qo_lens
    paths = [_cached_path(req, tree, int(p)) for req, p in zip(batch.reqs, prefix_lens.tolist())]
    table = batch.req_to_token_pool.req_to_token
    return cascade_metadata(table, batch.req_pool_indices.numpy(), batch.seq_lens.numpy(), qo_lens, paths,
                            tree.page_size, min_shared_tokens, max_levels)


def cascade_metadata(req_to_token: torch.Tensor, req_pool_indices: np.ndarray, seq_lens: np.ndarray,
                     qo_lens: np.ndarray, paths: list[list[TreeNode]], page_size: int, min_shared_tokens: int,
                     max_levels: int) -> CascadeMetadata:
    """build_cascade_metadata without its checks, over host arrays ([bs] int64) and each request's cached
    path (root excluded, root-first)."""
    keys, starts, pages = _assign_levels(paths, page_size, min_shared_tokens, max_levels)
    bs = len(paths)
    # Sorting the key tuples makes every prefix of keys (a segment at some level) a contiguous run; the
    # sort is stable, so the batch order survives wherever nothing is shared.
    node_ids = {kept: tuple(node.id for node in kept) for kept in set(keys)}
    order = np.array(sorted(range(bs), key=lambda i: node_ids[keys[i]]), dtype=np.int64)
    device = req_to_token.device
    qo_sorted = qo_lens[order]
    qo_indptr = np.zeros(bs + 1, dtype=np.int64)
    np.cumsum(qo_sorted, out=qo_indptr[1:])
    num_shared = max(map(len, keys))
    levels = [_shared_level([keys[i][lvl] if lvl < len(keys[i]) else None for i in order.tolist()], pages,
                            qo_indptr, page_size, device) for lvl in range(num_shared)]
    levels.append(_own_level(req_to_token, req_pool_indices[order], seq_lens[order], starts[order], qo_indptr,
                             page_size))
    return CascadeMetadata(tuple(levels), torch.from_numpy(order).to(device),
                           torch.from_numpy(_query_order(order, qo_lens)).to(device))


def _cached_path(req, tree: RadixTree, prefix_len: int) -> list[TreeNode]:
    """The nodes root..req.last_node (its namespace's root excluded, root first), checked against the
    request's row."""
    nodes, num_tokens = [], 0
    node = req.last_node
    root = None
    if node is not None:
        try:
            root = tree._check_node(node)
        except ValueError:
            raise ValueError(f"request {req.rid!r}: its last_node {node.id} is not in this tree (evicted, reset, "
                             "or another tree's)") from None
    while node is not root:
        nodes.append(node)
        num_tokens += len(node.value)
        node = node.parent
    if num_tokens != req.cache_protected_len or num_tokens > prefix_len:
        raise ValueError(f"request {req.rid!r}: its cached path holds {num_tokens} tokens; need exactly "
                         f"cache_protected_len ({req.cache_protected_len}) and at most the {prefix_len} tokens "
                         "before its queries")
    nodes.reverse()
    return nodes


def _assign_levels(paths: list[list[TreeNode]], page_size: int, min_shared_tokens: int, max_levels: int):
    """Per request: its kept segments (a tuple, each segment named by its last node) and where its own
    suffix starts; and each kept segment's page ids ([n] int64 numpy).

    A kept segment's entry spans from the end of the previous kept one: a shorter shared segment above it
    that was not kept is read with it. Every request through a segment shares all of the path above it, so
    all of them make the same choices there and the span is the same for each: the choices are made once
    per deepest shared node, for every request whose shared part ends there.
    """
    count = Counter(chain.from_iterable(paths))  # requests of the batch through each node
    keys: list[tuple[TreeNode, ...]] = []
    starts = np.zeros(len(paths), dtype=np.int64)
    pages: dict[TreeNode, np.ndarray] = {}
    decided: dict[TreeNode, tuple[tuple[TreeNode, ...], int]] = {}
    for i, path in enumerate(paths):
        shared = len(path)
        while shared and count[path[shared - 1]] == 1:  # a request's own nodes end its path
            shared -= 1
        if not shared:
            keys.append(())
            continue
        choice = decided.get(path[shared - 1])
        if choice is None:
            choice = decided[path[shared - 1]] = _keep_segments(path, shared, count, pages, page_size,
                                                                min_shared_tokens, max_levels - 1)
        keys.append(choice[0])
        starts[i] = choice[1]
    return keys, starts, pages


def _keep_segments(path: list[TreeNode], shared: int, count: Counter, pages: dict, page_size: int,
                   min_shared_tokens: int, max_kept: int) -> tuple[tuple[TreeNode, ...], int]:
    """The segments kept along path[:shared] and the token where the rest starts; adds the pages of each
    newly kept segment to `pages`."""
    kept: list[TreeNode] = []
    start = pos = 0  # tokens: where the pending span starts, where the walk is
    first = k = 0    # path indices of the same two points
    while k < shared and len(kept) < max_kept:
        sharers = count[path[k]]
        while k < shared and count[path[k]] == sharers:  # one segment: the same requests throughout
            pos += len(path[k].value)
            k += 1
        if pos - start >= min_shared_tokens:
            last = path[k - 1]
            if last not in pages:
                slots = np.concatenate([node.value for node in path[first:k]])
                pages[last] = slots[::page_size] // page_size
            kept.append(last)
            start, first = pos, k
    return tuple(kept), start


def _shared_level(entry_keys: list, pages: dict, qo_indptr: np.ndarray, page_size: int,
                  device: torch.device) -> PagedKVMetadata:
    """One shared level: a run of requests (cascade order) with the same segment is one entry over its pages;
    a run with none is one entry with no pages."""
    bounds = [0] + [j for j in range(1, len(entry_keys)) if entry_keys[j] is not entry_keys[j - 1]]
    runs = [entry_keys[j] for j in bounds]
    run_pages = [pages[key] if key is not None else np.empty(0, dtype=np.int64) for key in runs]
    kv_indptr = np.zeros(len(runs) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in run_pages], out=kv_indptr[1:])
    last_page_len = np.array([page_size if key is not None else 0 for key in runs], dtype=np.int32)
    run_qo = qo_indptr[bounds + [len(entry_keys)]]
    return PagedKVMetadata(_int32(run_qo, device), _int32(kv_indptr, device),
                           _int32(np.concatenate(run_pages), device), _int32(last_page_len, device), page_size)


def _own_level(req_to_token: torch.Tensor, rows: np.ndarray, seq_lens: np.ndarray, starts: np.ndarray,
               qo_indptr: np.ndarray, page_size: int) -> PagedKVMetadata:
    """The last level: each request's tokens starts..seq_lens of its row, one entry per request."""
    device = req_to_token.device
    kv_lens = torch.from_numpy(seq_lens - starts).to(device)
    kv_indptr = _create_kv_indptr(kv_lens, page_size)
    kv_indices = _create_kv_indices(req_to_token, torch.from_numpy(rows).to(device), kv_lens, kv_indptr,
                                    kv_start_idx=torch.from_numpy(starts).to(device), page_size=page_size)
    return PagedKVMetadata(_int32(qo_indptr, device), kv_indptr, kv_indices, _kv_last_page_len(kv_lens, page_size),
                           page_size)


def _query_order(order: np.ndarray, qo_lens: np.ndarray) -> np.ndarray:
    """[total_q] int64: the batch query rows of the requests in `order`, each request's rows in order."""
    if (qo_lens == 1).all():
        return order
    qo_start = np.cumsum(qo_lens) - qo_lens
    lens = qo_lens[order]
    shift = qo_start[order] - (np.cumsum(lens) - lens)  # batch row - cascade row, per request
    return np.repeat(shift, lens) + np.arange(int(lens.sum()), dtype=np.int64)


def _int32(values: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int32)).to(device)
