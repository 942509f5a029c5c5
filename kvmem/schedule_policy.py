"""The order of the waiting queue: "lpm" (longest cached prefix first) or "fcfs" (arrival order).

"lpm" ranks the first `lpm_window` waiting requests by how many tokens of their match key the tree holds,
with walks that change nothing (no split, no access-time or hit-count update, no index gather): at
saturation the window is ranked every step while few are admitted, and a full match for each would dominate
the loop. For the same reason each request's walk is kept and taken again only when the tree changed where
it stopped (`RadixCache.walk_is_current`).
"""

from __future__ import annotations

from collections import deque
from itertools import islice
from typing import TYPE_CHECKING, NamedTuple

from kvmem.radix_tree import Walk, key_bytes

if TYPE_CHECKING:
    from kvmem.batch import Req
    from kvmem.decode_pages import DecodePageTails
    from kvmem.radix_cache import RadixCache

SCHEDULE_POLICIES = ("lpm", "fcfs")


class KeptWalk(NamedTuple):
    """A waiting request's last ranking walk: its key's bytes, the walk, the key's page after where it stopped
    (`RadixCache.next_page`) and its rank (minus the prefix length: the sort key)."""

    view: memoryview
    walk: Walk
    next_page: bytes | None
    rank: int


class PrefixRanker:
    """Sorts the head of a waiting queue by cached prefix, longest first, arrival order among equals. Walks that
    end where a running request's output pages could continue them have those pages cached first (`tails`)."""

    def __init__(self, tree_cache: RadixCache, tails: DecodePageTails, window: int) -> None:
        self.tree_cache = tree_cache
        self.tails = tails
        self.window = window
        self._walks: dict[Req, KeptWalk] = {}

    def sort(self, waiting: deque[Req], take_decode_pages: bool = True) -> bool:
        """Puts the first `window` requests of `waiting` in rank order. Without `take_decode_pages`, returns False,
        reordering nothing, when a walk ends where a running request's output pages could continue it (only a
        match tells what it would then find); else True."""
        walks, tails = self._walks, self.tails
        n = min(self.window, len(waiting))
        ranks = []
        for req in islice(waiting, n):
            # The common case, inlined (the window is ranked at every step): a kept walk that is still current
            # (RadixCache.walk_is_current, for a walk that matched something) and that no running request's
            # output pages continue.
            kept = walks.get(req)
            if kept is not None:
                walk = kept.walk
                child, node = walk.child, walk.node
                if child is None:
                    page = kept.next_page
                    if node.parent is not None and (page is None or page not in node.children) and (
                            node not in tails or not tails.continues(node, page)):
                        ranks.append(kept.rank)
                        continue
                elif child.parent is node:
                    ranks.append(kept.rank)
                    continue
            rank = self._rank(req, take_decode_pages)
            if rank is None:
                return False
            ranks.append(rank)
        if ranks != sorted(ranks):
            order = sorted(range(n), key=ranks.__getitem__)
            window = [waiting.popleft() for _ in range(n)]
            waiting.extendleft([window[i] for i in reversed(order)])
        return True

    def walk_of(self, req: Req) -> KeptWalk | None:
        """`req`'s last ranking walk (None if it was never ranked); it may be one a split made stale, which still
        counts the same tokens."""
        return self._walks.get(req)

    def forget(self, req: Req) -> None:
        """`req` left the queue."""
        self._walks.pop(req, None)

    def _rank(self, req: Req, take_decode_pages: bool) -> int | None:
        tree, ns = self.tree_cache, req.namespace
        kept = self._walks.get(req)
        if kept is None or not tree.walk_is_current(kept.walk, kept.next_page, ns):
            view = key_bytes("key", req.match_key()) if kept is None else kept.view  # fixed while it waits
            kept = self._keep(req, view, tree.prefix_walk(view, ns))
        walk = kept.walk
        if walk.child is None and walk.node in self.tails:  # a running request's output may continue it
            if not take_decode_pages:
                return None
            view = kept.view
            while walk.child is None and self.tails.take(view, walk.node, walk.matched):
                walk = tree.prefix_walk(view, ns)
            kept = self._keep(req, view, walk)
        return kept.rank

    def _keep(self, req: Req, view: memoryview, walk: Walk) -> KeptWalk:
        kept = self._walks[req] = KeptWalk(view, walk, self.tree_cache.next_page(view, walk), -walk.num_tokens)
        return kept
