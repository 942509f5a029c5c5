"""The output pages of running requests, cached when a match needs them (`SchedulerConfig.cache_decode_pages`).

A decode step writes a request's output tokens without inserting them, so that a step costs what it costs
without caching; vLLM caches each full page as it is written. A match is the only thing that could see such a
page, so a walk that ends where a running request's cached prefix ends, with the key going on with that
request's next full page of output, first puts the request's full pages into the tree: the walk then finds
what inserting each page as it was written would have given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvmem._paging import TOKEN_BYTES
from kvmem.radix_cache import request_token_ids

if TYPE_CHECKING:
    from kvmem.batch import Req
    from kvmem.radix_tree import TreeNode


class DecodePageTails:
    """Running requests by the node where their cached prefix ends. `cache(req)` puts a request's full pages so
    far into the tree and moves its lock down to them (the scheduler's cache_unfinished_req)."""

    def __init__(self, page_size: int, cache: Callable[[Req], None]) -> None:
        self.page_size = page_size
        self._cache = cache
        self._by_node: dict[TreeNode, list[Req]] = {}
        self._node_of: dict[Req, TreeNode] = {}

    def __contains__(self, node: TreeNode) -> bool:
        return node in self._by_node

    def __bool__(self) -> bool:
        return bool(self._node_of)

    def track(self, req: Req) -> None:
        """`req` decodes from now on, its cached prefix ending at its last_node."""
        node = req.last_node
        self._node_of[req] = node
        self._by_node.setdefault(node, []).append(req)

    def untrack(self, req: Req) -> None:
        """`req` stops decoding (it finished or was retracted), or its prefix is about to move."""
        node = self._node_of.pop(req, None)
        if node is not None:
            reqs = self._by_node[node]
            reqs.remove(req)
            if not reqs:
                del self._by_node[node]

    def take(self, view: memoryview, node: TreeNode, matched: int) -> bool:
        """When a walk of a key (`view`, its bytes) ends at `node` after `matched` bytes, where a running request's
        cached prefix ends, and the key goes on with that request's next full page of output: caches the
        request's full pages (the walk may go further now) and returns True; else False, changing nothing."""
        candidates = self._by_node.get(node)
        if not candidates:
            return False
        ps = self.page_size
        page_bytes = ps * TOKEN_BYTES
        if len(view) < matched + page_bytes:
            return False
        page = view[matched:matched + page_bytes]
        start = matched // TOKEN_BYTES
        for req in candidates:
            if req.kv_len - req.kv_len % ps - req.cache_protected_len >= ps and \
                    memoryview(request_token_ids(req, start + ps, start)).cast("B") == page:
                self.untrack(req)
                self._cache(req)  # its full pages up to kv_len; the rest are not written yet
                self.track(req)
                return True
        return False
