"""The sliding-window component of the hybrid cache: which cached tokens still have their window KV.

With a window of W (transformers' `sliding_window`: a query at position p reads keys p-W+1..p), a token needs the
window KV of its `keep = W - 1` predecessors, so a cached prefix of length L is usable only if its last `keep`
tokens have theirs (or the whole path has, for a short prefix). A node is *live* (every token has its window KV) or
a *tombstone* (full KV only: still a path to deeper nodes, and a prefix for the full layers); a match returns the
deepest usable end. A request locks only the window tail [page_floor(L - keep), L) of what it matched: older window
KV may go while it runs (window eviction makes nodes tombstones, LRU first). Before locking, the node straddling the
tail's start is split there, so that a node starts exactly at it: a later split copies lock counts to both halves,
and both then lie on the same side of that start, so releasing walks exactly the nodes the lock counted.

`WindowComponent` is a part of `HybridRadixCache` (a mixin over its tree and its `HybridTokenAllocator`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from sortedcontainers import SortedList

from kvmem._checks import check_int, fail_invariant
from kvmem._paging import TOKEN_BYTES

if TYPE_CHECKING:
    from kvmem.hybrid.allocator import HybridTokenAllocator
    from kvmem.hybrid.tree_node import HybridTreeNode
    from kvmem.radix_cache import CachedRequest


class WindowComponent:
    """The window part of `HybridRadixCache` (see the module docstring). Sizes are window tokens: live nodes'
    tokens, evictable when no request's window tail covers them, else protected."""

    token_allocator: HybridTokenAllocator
    window: int | None  # W; None: the cache has no window component

    def _window_clear(self) -> None:
        self._window_lru = SortedList()  # _window_entry of live nodes no window tail covers, and stale ones
        self._window_stale = 0  # entries no longer their node's (see _window_remove)
        self._window_evictable = 0
        self._window_protected = 0

    def _window_setup(self, window: int, free_interval: int) -> None:
        ps = self.page_size
        self.window = window
        self._keep = window - 1
        # A request keeps the window KV of its last ceil_page(max(keep, page)) tokens: a key cut at a page boundary
        # then still finds a whole window before it, and the last page a request inserts is never a tombstone.
        self._tail = -(-max(self._keep, ps) // ps) * ps
        self._free_interval = -(-free_interval // ps) * ps
        self._window_start = np.zeros(self.req_to_token_pool.size, dtype=np.int64)  # per row: window freed below
        self.window_slots_freed = 0   # window tokens requests freed as they left their window while decoding
        self.window_evicted_tokens = 0  # window tokens window eviction freed

    # ---- sizes --------------------------------------------------------------------------------------
    def window_evictable_size(self) -> int:
        """Window tokens of live nodes no request's window tail covers: what `evict_window` can free."""
        return self._window_evictable

    def window_protected_size(self) -> int:
        """Window tokens of live nodes inside some request's window tail."""
        return self._window_protected

    def window_total_size(self) -> int:
        return self._window_evictable + self._window_protected

    def kept_window_start(self, kv_len: int) -> int:
        """Trusted: the first position whose window KV a request holding kv_len tokens keeps (page-aligned, >= 0):
        what its next tokens read, and what a tree node it leaves must keep to stay matchable."""
        start = kv_len - self._tail
        return max(start - start % self.page_size, 0)

    # ---- liveness -----------------------------------------------------------------------------------
    def _pages(self, slots: np.ndarray) -> np.ndarray:
        """The full pages of slots listed whole (a node's value, a request's run of whole pages)."""
        return slots if self.page_size == 1 else slots[::self.page_size] // self.page_size

    def _dead_prefix(self, slots: np.ndarray) -> int:
        """Leading tokens of `slots` (whole pages) that have no window slot: a request frees its window from the
        start of its row up, so those are a prefix."""
        first = slots[0] // self.page_size
        window_page = self.token_allocator.window_pages_of
        if window_page(first):
            return 0
        peers = window_page(self._pages(slots))
        paired = np.flatnonzero(peers)
        return (int(paired[0]) if len(paired) else len(peers)) * self.page_size

    def _make_live(self, node: HybridTreeNode) -> None:
        """`node`'s tokens have their window KV now (a new node, or a tombstone revived)."""
        node.window_live = True
        node.window_tail = False
        n = len(node.value)
        if node.window_lock:
            self._window_protected += n
        else:
            self._window_evictable += n
            node.window_tick = self._clock
            self._window_add(node)

    def _tombstone(self, node: HybridTreeNode) -> int:
        """Frees the window KV of a live node that no window tail covers (its full KV stays); returns the tokens."""
        n = len(node.value)
        self.token_allocator.free_window_pages(self._pages(node.value))
        node.window_live = False
        self._window_evictable -= n
        return n

    def _window_entry(self, node: HybridTreeNode) -> tuple:
        """Its window LRU record: the tails window eviction kept live rank after every other node, so that eviction
        takes the older parts of paths before the tails that matches end on."""
        return node.window_tail, node.window_tick, node.id, node

    def _window_add(self, node: HybridTreeNode) -> None:
        if self._window_stale > 64 and 2 * self._window_stale > len(self._window_lru):
            self._window_lru = SortedList(e for e in self._window_lru if _is_current(e))
            self._window_stale = 0
        node.window_entry = self._window_entry(node)
        self._window_lru.add(node.window_entry)

    def _window_remove(self, node: HybridTreeNode) -> None:
        # The entry stays in the list, stale (no longer its node's, or its node left the tree): a removal by value
        # would search for it on every full eviction and every match; window eviction skips stale entries, and the
        # next add rebuilds the list once they are more than half.
        node.window_entry = None
        self._window_stale += 1

    def _window_split(self, head: HybridTreeNode, child: HybridTreeNode) -> None:
        head.window_live = child.window_live
        head.window_lock = child.window_lock
        head.window_tick = child.window_tick
        head.window_tail = child.window_tail
        if child.window_entry is not None:
            self._window_add(head)


    def _refresh_window(self, node: HybridTreeNode) -> None:
        """A match ended at `node`: the nodes of its window tail (and a page) rank as used now, so that window
        eviction takes the older parts of paths first and keeps their tails matchable."""
        covered, limit, now = 0, self._keep + self.page_size, self._clock
        while node.parent is not None and covered < limit:
            node.window_tick = now
            if node.window_entry is not None:
                self._window_remove(node)
                self._window_add(node)
            covered += len(node.value)
            node = node.parent

    # ---- matches ------------------------------------------------------------------------------------
    def _window_valid(self, node: HybridTreeNode) -> HybridTreeNode | None:
        """None if a match may end at `node` (its last `keep` tokens are live, or its whole path); else the
        deepest node above that might: the parent of the tombstone that cut the run short."""
        run, keep, x = 0, self._keep, node
        while x.parent is not None and x.window_live and run < keep:
            run += len(x.value)
            x = x.parent
        if run >= keep or x.parent is None:
            return None
        return x.parent

    # ---- locks: the window tail of the path ----------------------------------------------------------
    def _tail_start(self, node: HybridTreeNode) -> int:
        end = node.depth + len(node.value)
        start = end - self._keep
        return max(start - start % self.page_size, 0)

    def _lock_window(self, node: HybridTreeNode) -> None:
        if node.parent is None:
            return
        start = self._tail_start(node)
        x = node
        while x.depth > start:
            x = x.parent
        if x.depth < start < x.depth + len(x.value):  # x straddles the tail's start: cut it there
            self._split(x, (start - x.depth) * TOKEN_BYTES)
        while node.parent is not None and node.depth >= start:
            if node.window_lock == 0 and node.window_live:
                n = len(node.value)
                self._window_evictable -= n
                self._window_protected += n
                self._window_remove(node)
            node.window_lock += 1
            node = node.parent

    def _unlock_window(self, node: HybridTreeNode) -> None:
        if node.parent is None:
            return
        start = self._tail_start(node)
        while node.parent is not None and node.depth >= start:
            node.window_lock -= 1
            if node.window_lock == 0 and node.window_live:
                n = len(node.value)
                self._window_protected -= n
                self._window_evictable += n
                self._window_add(node)
            node = node.parent

    # ---- inserts over tombstones --------------------------------------------------------------------
    def _revive(self, node: HybridTreeNode, slots: np.ndarray) -> None:
        """An insert brings `slots` (a request's full slots for `node`'s tokens) over the tombstone `node`: where the
        request still has their window KV (a suffix of the node, whole pages), the node takes it (its full slots
        stay; the request's full duplicates are freed by the caller, their pairing moved to the node's)."""
        alloc = self.token_allocator
        pages = self._pages(slots)
        peers = alloc.window_pages_of(pages)
        if peers[-1] == 0:
            return
        first = int(np.flatnonzero(peers)[0])
        if np.count_nonzero(peers[first:]) != len(peers) - first or \
                np.count_nonzero(alloc.pages_cached(pages[first:])):
            return  # not a request's own window run (a caller's odd value): leave the node a tombstone
        if first:
            self._split(node, first * self.page_size * TOKEN_BYTES)  # the head stays a tombstone
            pages = pages[first:]
        node_pages = self._pages(node.value)
        alloc.move_window_pages(pages, node_pages)  # cached with the node's full pages
        self._make_live(node)

    # ---- eviction -----------------------------------------------------------------------------------
    def evict_window(self, num_tokens: int) -> int:
        """Frees at least `num_tokens` window tokens, LRU first, from live nodes no request's window tail covers, or
        all there are if that is less; returns the window tokens freed. A node longer than a window tail
        (ceil_page(max(W - 1, page)) tokens) is cut before its last tail: the head becomes a tombstone, the tail
        stays live and ranks after every node that is not such a tail. A shorter node goes whole (full KV too) when
        nobody locks it and it has no child; else it becomes a tombstone (its full KV stays)."""
        return self._evict_window(check_int("num_tokens", num_tokens, minimum=0))[0]

    def _evict_window(self, num_tokens: int) -> tuple[int, int]:
        """evict_window's body: returns (window tokens freed, full tokens freed with the nodes that went whole)."""
        freed = full = 0
        values: list[np.ndarray] = []
        while freed < num_tokens and self._window_lru:
            entry = self._window_lru.pop(0)
            node = entry[-1]
            if not _is_current(entry):
                self._window_stale -= 1
                continue
            node.window_entry = None
            n = len(node.value)
            if n > self._tail:
                freed += self._trim(node)
            elif node.lock_ref == 0 and not node.children:
                self._window_evictable -= n
                node.window_live = False  # counted out here: _forget must not count it again
                full += self._delete_leaf(node, values)
                freed += n
            else:
                freed += self._tombstone(node)
        full += self._take_dropped(values)
        if values:
            self._release(values)
        self.window_evicted_tokens += freed
        return freed, full

    def _trim(self, node: HybridTreeNode) -> int:
        """Cuts a live node longer than a window tail, out of the LRU, before its last tail: the head becomes a
        tombstone, the tail stays live (a match may still end there: a conversation's next turn resumes at it) and
        ranks with the tails. Returns the window tokens freed."""
        freed = self._tombstone(self._split(node, (len(node.value) - self._tail) * TOKEN_BYTES))
        node.window_tail = True
        self._window_add(node)
        return freed

    # ---- requests -----------------------------------------------------------------------------------
    def _free_window_tails(self, reqs: list[CachedRequest], kv_lens: np.ndarray) -> None:
        """Frees the window slots of each request's own tokens that no later token reads: positions below
        page_floor(q - ceil_page(max(keep, page))) for the token at q = kv_len about to be computed, never below
        cache_protected_len (what the tree holds goes by eviction), in runs of at least the free interval."""
        n = len(reqs)
        rows = np.fromiter((r.req_pool_idx for r in reqs), dtype=np.int64, count=n)
        protected = np.fromiter((r.cache_protected_len for r in reqs), dtype=np.int64, count=n)
        start = np.maximum(self._window_start[rows], protected)
        ps = self.page_size
        end = kv_lens - self._tail
        end -= end % ps
        due = np.flatnonzero(end - start >= self._free_interval)
        if len(due) == 0:
            return
        rows, start, end = rows[due], start[due], end[due]
        pages = (end - start) // ps
        total = int(pages.sum())
        first = np.cumsum(pages) - pages
        owner = np.repeat(np.arange(len(due)), pages)
        positions = start[owner] + (np.arange(total, dtype=np.int64) - first[owner]) * ps
        slots = self.req_to_token_pool.slots_at(rows[owner], positions)
        self.window_slots_freed += self.token_allocator.free_window_pages(slots // ps)
        self._window_start[rows] = end

    def _window_held(self, req: CachedRequest) -> int:
        """Window tokens `req` holds of its own (its row after cache_protected_len, whole pages)."""
        ps, protected = self.page_size, req.cache_protected_len
        end = -(-req.kv_len // ps) * ps
        if end <= protected:
            return 0
        slots = self.req_to_token_pool.row_slots(req.req_pool_idx, protected, end)
        return int(np.count_nonzero(self.token_allocator.window_pages_of(self._pages(slots)))) * ps

    # ---- checks -------------------------------------------------------------------------------------
    def _check_window(self, nodes: list[HybridTreeNode]) -> None:
        alloc = self.token_allocator
        evictable = protected = 0
        entries = 0
        live_pages = []
        for node in nodes:
            n = len(node.value)
            if node.window_lock < 0 or node.window_lock > node.lock_ref:
                fail_invariant(f"node {node.id}: window_lock {node.window_lock} (lock_ref {node.lock_ref}) must lie in "
                               "[0, lock_ref]")
            peers = alloc.window_pages_of(self._pages(node.value))
            if node.window_live:
                if np.count_nonzero(peers) != len(peers):
                    fail_invariant(f"live node {node.id} has a token without a window slot")
                live_pages.append(peers)
                if node.window_lock:
                    protected += n
                else:
                    evictable += n
            elif np.count_nonzero(peers):
                fail_invariant(f"tombstone node {node.id} keeps a window slot")
            should = node.window_live and node.window_lock == 0
            if should != (node.window_entry is not None):
                fail_invariant(f"node {node.id} (live {node.window_live}, window_lock {node.window_lock}) is "
                               f"{'' if node.window_entry is not None else 'not '}in the window LRU")
            if should:
                entries += 1
                if node.window_entry != self._window_entry(node) or node.window_entry not in self._window_lru:
                    fail_invariant(f"node {node.id}: its window LRU entry is stale or missing")
        current = sum(1 for e in self._window_lru if _is_current(e))
        if entries != current or len(self._window_lru) - current != self._window_stale:
            fail_invariant(f"the window LRU holds {current} current entries (and {self._window_stale} counted stale of "
                           f"{len(self._window_lru)}) for {entries} nodes")
        if evictable != self._window_evictable or protected != self._window_protected:
            fail_invariant(f"window counters say evictable {self._window_evictable}, protected "
                           f"{self._window_protected}; the nodes hold {evictable} and {protected}")
        pages = np.concatenate(live_pages) if live_pages else np.empty(0, dtype=np.int64)
        if alloc.window_cached_size() != len(pages) * self.page_size:
            fail_invariant(f"the window allocator marks {alloc.window_cached_size()} slots cached; the live nodes "
                           f"hold {len(pages) * self.page_size}")
        alloc.check_pairing()


def _is_current(entry: tuple) -> bool:
    """Whether a window LRU entry is still its node's, and the node still in the tree."""
    node = entry[-1]
    return node.window_entry is entry and node.parent is not None
