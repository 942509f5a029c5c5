"""The linear-attention component of the hybrid cache: recurrent states at node ends.

A state summarises exactly the prefix it was computed over, so it sits on the node that ends there, and a match is
usable only where a node holds one (the root: the zero state). States are kept only at positions on the grid
`lcm(64, page_size)` (a chunked gated-delta kernel reproduces a prefill bitwise when cut at multiples of 64, and a
node ends on a page): a prefill chunk that ends there copies the request's state into the tree, a request that
finishes there hands its state over. A request admitted over a cached state gets a slot of its own, copied from it
(copy on write: the tree's slot is never written), or zeroed at the root.

A request's lock holds the state of the node it locks (`state_lock`): from its match until its lock moves on (the
end of its first prefill chunk), which covers the copy at admission. A split leaves the state with the tail, the
node that still ends at its position. State eviction frees the least recently used unlocked state (matched, or
computed again by a request that cached its prefix): a node nobody locks and with no child goes whole, any other
stays without a state.

`StateComponent` is a part of `HybridRadixCache` (a mixin over its tree and a `StatePool` / `StateSlotPool`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from sortedcontainers import SortedList

from kvmem._checks import check_int, fail_invariant
from kvmem.allocator import HELD

if TYPE_CHECKING:
    from kvmem.hybrid.tree_node import HybridTreeNode
    from kvmem.radix_cache import CachedRequest


class StateComponent:
    """The state part of `HybridRadixCache` (see the module docstring). Sizes are state slots: the tree's, evictable
    when no request locks their node, else protected; a running request holds one slot of its own."""

    def _state_clear(self) -> None:
        self._state_lru = SortedList()  # (state_tick, id, node) of nodes holding a state nobody locks
        self._state_evictable = 0
        self._state_protected = 0

    def _state_setup(self, state_pool) -> None:
        self.state_pool = state_pool
        self._state_slots = state_pool.allocator
        self._req_state = np.zeros(self.req_to_token_pool.size, dtype=np.int64)  # per row: its own state slot
        self.state_copies = 0  # states copied: into an admitted request's slot, or into the tree at a chunk end
        self.state_evicted = 0  # states state eviction freed

    # ---- sizes --------------------------------------------------------------------------------------
    def state_evictable_size(self) -> int:
        """The tree's states on nodes no request locks: what `evict_states` can free."""
        return self._state_evictable

    def state_protected_size(self) -> int:
        """The tree's states on nodes a request locks."""
        return self._state_protected

    def state_available_size(self) -> int:
        """Free state slots."""
        return self._state_slots.available_size()

    def req_state_slots(self, rows) -> np.ndarray:
        """The state slot of each request row in `rows` (its req_pool_idx): [n] int64, 0 for a row without one. What
        a model's linear layers read and write for those requests."""
        return self._req_state[np.asarray(rows, dtype=np.int64)]

    # ---- the tree's states --------------------------------------------------------------------------
    def _attach_state(self, node: HybridTreeNode, slot: int) -> None:
        node.state = slot
        node.state_tick = self._clock
        self._state_slots.mark_cached(np.array([slot], dtype=np.int64))
        if node.state_lock:
            self._state_protected += 1
        else:
            self._state_evictable += 1
            self._state_add(node)

    def _state_add(self, node: HybridTreeNode) -> None:
        node.state_entry = (node.state_tick, node.id, node)
        self._state_lru.add(node.state_entry)

    def _state_remove(self, node: HybridTreeNode) -> None:
        self._state_lru.remove(node.state_entry)
        node.state_entry = None

    def _drop_state(self, node: HybridTreeNode) -> None:
        """Frees the state of a node nobody locks (its entry already out of the LRU)."""
        self._state_slots.free_owned(np.array([node.state], dtype=np.int64))
        node.state = 0
        self._state_evictable -= 1

    def _state_forget(self, node: HybridTreeNode) -> None:
        """`node`, holding a state, left the tree; nobody locked it."""
        self._state_remove(node)
        self._drop_state(node)

    def _refresh_state(self, node: HybridTreeNode) -> None:
        node.state_tick = self._clock
        if node.state_entry is not None:
            self._state_remove(node)
            self._state_add(node)

    def _lock_state(self, node: HybridTreeNode) -> None:
        if node.state_lock == 0 and node.state:
            self._state_evictable -= 1
            self._state_protected += 1
            self._state_remove(node)
        node.state_lock += 1

    def _unlock_state(self, node: HybridTreeNode) -> None:
        node.state_lock -= 1
        if node.state_lock == 0 and node.state:
            self._state_protected -= 1
            self._state_evictable += 1
            self._state_add(node)

    # ---- eviction -----------------------------------------------------------------------------------
    def evict_states(self, num_states: int) -> int:
        """Frees at least `num_states` of the tree's states, least recently used first, from nodes no request
        locks (or all there are if fewer); returns how many. A node nobody locks and with no child goes whole (its
        KV too); any other stays without a state."""
        return self._evict_states(check_int("num_states", num_states, minimum=0))[0]

    def _evict_states(self, num_states: int) -> tuple[int, int]:
        """evict_states' body: returns (states freed, full tokens freed with the nodes that went whole)."""
        freed = full = 0
        values: list[np.ndarray] = []
        lru = self._state_lru
        while freed < num_states and lru:
            node = lru.pop(0)[2]
            node.state_entry = None
            self._drop_state(node)
            freed += 1
            if node.lock_ref == 0 and not node.children:
                full += self._delete_leaf(node, values)
        full += self._take_dropped(values)
        if values:
            self._release(values)
        self.state_evicted += freed
        return freed, full

    # ---- requests -----------------------------------------------------------------------------------
    def _start_states(self, reqs: list[CachedRequest]) -> None:
        """Gives each request a state slot (free ones: the caller made the room), copied from the state of the node
        its lock holds, or zeroed at the root."""
        slots = self._state_slots.alloc(len(reqs)).numpy()
        sources = np.fromiter((self._source_state(r) for r in reqs), dtype=np.int64, count=len(reqs))
        copied = sources != 0
        n = int(np.count_nonzero(copied))
        if n:
            self.state_pool.copy_slots(sources[copied], slots[copied])
            self.state_copies += n
        if n != len(reqs):
            self.state_pool.zero_slots(slots[~copied])
        rows = np.fromiter((r.req_pool_idx for r in reqs), dtype=np.int64, count=len(reqs))
        self._req_state[rows] = slots

    @staticmethod
    def _source_state(req: CachedRequest) -> int:
        node = req.last_node
        if node is None or node.parent is None:
            return 0
        if not node.state:
            raise RuntimeError(f"request {req.rid!r} was admitted over node {node.id}, which holds no state: its "
                               "match must end at one")
        return node.state

    def _cache_state(self, node: HybridTreeNode, row: int, finished: bool) -> None:
        """The request in `row` has computed exactly the prefix ending at `node` (on the grid): the node keeps its
        state, handed over by a finished request, copied from a running one (into a free slot, or one state
        eviction makes; none: the node stays without). A state the node holds already stays, used now."""
        if node.parent is None:
            return
        if node.state:  # its prefix was asked for again, past where the request's match could resume
            self._refresh_state(node)
            return
        slot = int(self._req_state[row])
        if not slot:
            return
        if finished:
            self._req_state[row] = 0
        else:
            if not self._state_slots.available_size():
                self._evict_states(1)
            fresh = self._state_slots.alloc(1) if self._state_slots.available_size() else None
            if fresh is None:
                return
            self.state_pool.copy_slots(np.array([slot], dtype=np.int64), fresh.numpy())
            self.state_copies += 1
            slot = int(fresh[0])
        self._attach_state(node, slot)

    def _release_state(self, row: int) -> None:
        slot = self._req_state[row]
        if slot:
            self._state_slots.free_owned(np.array([slot], dtype=np.int64))
            self._req_state[row] = 0

    # ---- checks -------------------------------------------------------------------------------------
    def _check_states(self, nodes: list[HybridTreeNode]) -> None:
        slots, evictable, protected, entries = [], 0, 0, 0
        grid = self.chunk_grid
        for node in nodes:
            if node.state_lock < 0 or node.state_lock > node.lock_ref:
                fail_invariant(f"node {node.id}: state_lock {node.state_lock} (lock_ref {node.lock_ref}) must lie in "
                               "[0, lock_ref]")
            if node.state:
                if (node.depth + len(node.value)) % grid:
                    fail_invariant(f"node {node.id} holds a state at position {node.depth + len(node.value)}, off "
                                   f"the grid of {grid}")
                slots.append(node.state)
                if node.state_lock:
                    protected += 1
                else:
                    evictable += 1
            should = bool(node.state) and node.state_lock == 0
            if should != (node.state_entry is not None):
                fail_invariant(f"node {node.id} (state {node.state}, state_lock {node.state_lock}) is "
                               f"{'' if node.state_entry is not None else 'not '}in the state LRU")
            if should:
                entries += 1
                if node.state_entry != (node.state_tick, node.id, node) or node.state_entry not in self._state_lru:
                    fail_invariant(f"node {node.id}: its state LRU entry is stale or missing")
        if entries != len(self._state_lru):
            fail_invariant(f"the state LRU holds {len(self._state_lru)} entries for {entries} nodes")
        if evictable != self._state_evictable or protected != self._state_protected:
            fail_invariant(f"state counters say evictable {self._state_evictable}, protected {self._state_protected}; "
                           f"the nodes hold {evictable} and {protected}")
        held = np.array(slots, dtype=np.int64)
        if len(np.unique(held)) != len(held) or np.count_nonzero(self._state_slots.cached_mask(held)) != len(held) \
                or self._state_slots.cached_size() != len(held):
            fail_invariant(f"the tree holds {len(held)} states; the state allocator marks "
                           f"{self._state_slots.cached_size()} cached (each must be one of them, once)")
        own = self._req_state[self._req_state != 0]
        if len(np.unique(own)) != len(own) or np.count_nonzero(self._state_slots._pages.states(own) != HELD):
            fail_invariant("a request's state slot is shared, free or the tree's")
        for row in np.flatnonzero(self._req_state).tolist():
            if self.req_to_token_pool.is_free(row):
                fail_invariant(f"free row {row} keeps a state slot")

    def _check_held_states(self, reqs: list[CachedRequest]) -> None:
        held = 0
        for req in reqs:
            if not self._req_state[req.req_pool_idx]:
                raise AssertionError(f"running request {req.rid!r} has no state slot")
            held += 1
        free, total = self._state_slots.available_size(), self._state_slots.size
        if free + self._state_evictable + self._state_protected + held != total:
            raise AssertionError(f"state slots: free {free} + evictable {self._state_evictable} + protected "
                                 f"{self._state_protected} + held by requests {held} != total {total}")

