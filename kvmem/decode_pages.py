"""The output pages of running requests, cached when a match needs them (`SchedulerConfig.cache_decode_pages`).

A decode step writes a request's output tokens without inserting them, so that a step costs what it costs
without caching; vLLM caches each full page as it is written. A match is the only thing that could see such a
page, so a walk that ends where a running request's cached prefix ends, with the key going on with that
request's next full page of output, first puts the request's full pages into the tree: the walk then finds
what inserting each page as it was written would have given.

Every running request decodes one token per decode step, so the step at which a request's next page is whole
is known when it starts decoding; the pages are indexed as they become whole, and a walk looks its key's next
page up instead of reading every candidate's tokens (at large pages many requests share the node where their
prefixes end, and the waiting queue is ranked at every step).
"""

from __future__ import annotations

import heapq
from bisect import insort
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvmem._paging import TOKEN_BYTES
from kvmem.radix_cache import request_token_ids

if TYPE_CHECKING:
    from kvmem.batch import Req
    from kvmem.radix_tree import TreeNode


class DecodePageTails:
    """Running requests by the node where their cached prefix ends, and their next full pages of output.

    cache(req): puts a request's full pages so far into the tree and moves its lock down to them (the
    scheduler's cache_unfinished_req). decode_steps(): how many decode steps the scheduler has taken, each of
    which adds one token to every running request.
    """

    def __init__(self, page_size: int, cache: Callable[[Req], None], decode_steps: Callable[[], int]) -> None:
        self.page_size = page_size
        self._cache = cache
        self._decode_steps = decode_steps
        self._node_of: dict[Req, TreeNode] = {}
        self._count: dict[TreeNode, int] = {}  # tracked requests per node
        self._order: dict[Req, int] = {}  # when each was tracked: the first one tracked wins a tie
        self._page_of: dict[Req, bytes] = {}  # its next page, once whole
        self._next = 0
        self._due: list[tuple[int, int, Req]] = []  # (decode step its next page is whole, order, req), a heap
        # node -> its tracked requests' whole next pages -> [(order, req)], by order
        self._pages: dict[TreeNode, dict[bytes, list[tuple[int, Req]]]] = {}

    def __contains__(self, node: TreeNode) -> bool:
        return node in self._count

    def __bool__(self) -> bool:
        return bool(self._node_of)

    def track(self, req: Req) -> None:
        """`req` decodes from now on, its cached prefix (whole pages) ending at its last_node."""
        node = req.last_node
        order = self._next
        self._next += 1
        self._node_of[req] = node
        self._order[req] = order
        self._count[node] = self._count.get(node, 0) + 1
        left = req.cache_protected_len + self.page_size - req.kv_len  # tokens until its next page is whole
        # Indexing what is due first keeps the heap to the requests whose pages are still being written.
        self._index_whole_pages()
        heapq.heappush(self._due, (self._decode_steps() + max(left, 0), order, req))

    def untrack(self, req: Req) -> None:
        """`req` stops decoding (it finished or was retracted), or its prefix is about to move."""
        node = self._node_of.pop(req, None)
        if node is None:
            return
        order = self._order.pop(req)
        count = self._count[node] - 1
        if count:
            self._count[node] = count
        else:
            del self._count[node]
        page = self._page_of.pop(req, None)
        if page is not None:
            pages = self._pages[node]
            holders = pages[page]
            holders.remove((order, req))
            if not holders:
                del pages[page]
                if not pages:
                    del self._pages[node]

    def continues(self, node: TreeNode, page: bytes | None) -> bool:
        """Whether a running request whose cached prefix ends at `node` has written `page` (a key's next page, as
        bytes; None: the key has none) as its next full page: what `take` would find. Changes nothing."""
        if page is None or node not in self._count:
            return False
        self._index_whole_pages()
        return page in self._pages.get(node, ())

    def take(self, view: memoryview, node: TreeNode, matched: int) -> bool:
        """When a walk of a key (`view`, its bytes) ends at `node` after `matched` bytes, where a running request's
        cached prefix ends, and the key goes on with that request's next full page of output: caches the
        request's full pages (the walk may go further now) and returns True; else False, changing nothing."""
        if node not in self._count:
            return False
        page_bytes = self.page_size * TOKEN_BYTES
        if len(view) < matched + page_bytes:
            return False
        self._index_whole_pages()
        holders = self._pages.get(node, {}).get(view[matched:matched + page_bytes].tobytes())
        if not holders:
            return False
        req = holders[0][1]
        self.untrack(req)
        self._cache(req)  # its full pages up to kv_len; the rest are not written yet
        self.track(req)
        return True

    def _index_whole_pages(self) -> None:
        """Indexes the next pages that decode steps have made whole since the last look."""
        due, now, ps = self._due, self._decode_steps(), self.page_size
        while due and due[0][0] <= now:
            _, order, req = heapq.heappop(due)
            if self._order.get(req) != order:
                continue  # untracked since (finished, retracted, or tracked again further down)
            start = req.cache_protected_len
            page = self._page_of[req] = memoryview(request_token_ids(req, start + ps, start)).cast("B").tobytes()
            insort(self._pages.setdefault(self._node_of[req], {}).setdefault(page, []), (order, req),
                   key=lambda holder: holder[0])
