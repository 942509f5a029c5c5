"""The hybrid radix cache: one tree of token prefixes whose nodes carry each layer kind's memory.

Full-attention KV is every node's `value` (full slots), as in `RadixCache`; a sliding-window component
(`kvmem.hybrid.window`) tracks which nodes still have their window KV, and a linear-attention component
(`kvmem.hybrid.states`) which node ends hold a recurrent state. A match ends at the deepest node every component
can resume from; each component has its own locks, sizes, LRU order and eviction (`evict` for full KV,
`evict_window`, `evict_states`), and `free + evictable + protected + held by requests == total` holds for each.

Device only: a hybrid cache has no host or storage tier (HiRadixCache is not combined with it), and no KV events.
"""

from __future__ import annotations

import math
import weakref

import numpy as np

from kvmem._checks import check_int, fail_invariant
from kvmem._paging import TOKEN_BYTES, pages_for
from kvmem.eviction import EvictionPolicySpec
from kvmem.hybrid.allocator import HybridTokenAllocator
from kvmem.hybrid.state_pool import StatePool, StateSlotPool
from kvmem.hybrid.states import StateComponent
from kvmem.hybrid.tree_node import HybridTreeNode
from kvmem.hybrid.window import WindowComponent
from kvmem.radix_cache import CachedRequest, MatchResult, RadixCache, request_token_ids
from kvmem.radix_tree import Walk
from kvmem.req_to_token import ReqToTokenPool
from kvmem.sizing import STATE_GRID, WINDOW_FREE_INTERVAL

__all__ = ["HybridAdmission", "HybridRadixCache"]


class HybridRadixCache(WindowComponent, StateComponent, RadixCache):
    """A radix cache for models with sliding-window and/or linear-attention layers (see the module docstring).

    Args:
        req_to_token_pool, page_size, eviction_policy, pin_budget: as for RadixCache (eviction_policy orders the full
            KV's leaves; the window and state components evict least recently used first).
        token_allocator: a `HybridTokenAllocator` with a window, else a `TokenAllocator` / `PagedTokenAllocator`.
        window: the sliding window W (transformers' `sliding_window`; a chunked-attention model's chunk), at most the
            context (req_to_token_pool.max_context_len); None: no window layers.
        state_pool: a `StatePool` (or `StateSlotPool`) with at least 2 slots (a request's own and the cached state it
            matched); None: no linear-attention layers.
        window_free_interval: a decoding request frees the window slots its window left in runs of at least this many
            tokens (whole pages): fewer, larger frees, for at most that many more window slots per request.

    >>> from kvmem import ReqToTokenPool
    >>> from kvmem.hybrid import HybridRadixCache, HybridTokenAllocator
    >>> alloc = HybridTokenAllocator(size=64, window_size=32)
    >>> cache = HybridRadixCache(ReqToTokenPool(2, 64), alloc, window=4, window_free_interval=1)
    >>> slots = alloc.alloc(12)
    >>> cache.insert(list(range(12)), slots)
    0
    >>> cache.evict_window(4), cache.window_evictable_size()    # all but its last window tail (W - 1 tokens)
    (9, 3)
    >>> cache.match_prefix(list(range(12))).indices.numel()     # a match still ends there
    12
    """

    node_class = HybridTreeNode
    match_is_walk = False  # a match ends where every component can resume, which a walk does not check

    def __init__(self, req_to_token_pool: ReqToTokenPool, token_allocator, page_size: int = 1,
                 eviction_policy: EvictionPolicySpec = "lru", *, window: int | None = None,
                 state_pool: StatePool | StateSlotPool | None = None,
                 window_free_interval: int = WINDOW_FREE_INTERVAL, pin_budget: float = 0.2) -> None:
        if window is None and state_pool is None:
            raise ValueError("give window, state_pool or both (a model with neither needs a RadixCache)")
        if window is not None:
            window = check_int("window", window, minimum=1)
            if isinstance(req_to_token_pool, ReqToTokenPool) and window > req_to_token_pool.max_context_len:
                raise ValueError(f"window {window} is larger than the context (req_to_token_pool.max_context_len "
                                 f"{req_to_token_pool.max_context_len})")
            if not isinstance(token_allocator, HybridTokenAllocator):
                raise TypeError(f"token_allocator must be a HybridTokenAllocator for a window, got "
                                f"{type(token_allocator).__name__}")
        elif isinstance(token_allocator, HybridTokenAllocator):
            raise ValueError("token_allocator pairs window slots, but window is None")
        if state_pool is not None:
            if not isinstance(state_pool, (StatePool, StateSlotPool)):
                raise TypeError(f"state_pool must be a StatePool or StateSlotPool, got {type(state_pool).__name__}")
            if state_pool.size < 2:
                raise ValueError(f"state_pool has {state_pool.size} slot: too small for one request, which needs its "
                                 "own state and the cached one it matched (2 slots at least)")
            owner = getattr(state_pool, "_cache", None)
            if owner is not None and owner() is not None:
                raise ValueError("state_pool already serves another HybridRadixCache; give each cache its own")
        window_free_interval = check_int("window_free_interval", window_free_interval, minimum=1)
        super().__init__(req_to_token_pool, token_allocator, page_size, eviction_policy, None, pin_budget)
        ps = self.page_size
        self.window = self._keep = None
        self.state_pool = None
        if window is not None:
            self._window_setup(window, window_free_interval)
            need = self._tail + self._free_interval + 3 * ps
            if token_allocator.window_size < need:
                raise ValueError(f"token_allocator.window_size {token_allocator.window_size} is too small for window "
                                 f"{window} at page size {ps}: a request takes up to {need} window slots")
        if state_pool is not None:
            self._state_setup(state_pool)
            self.chunk_grid = math.lcm(STATE_GRID, ps)
            state_pool._cache = weakref.ref(self)
        self._dropped: list[np.ndarray] = []  # values of tombstone leaves a deletion took with it

    def _init_root(self) -> None:
        super()._init_root()
        self._window_clear()
        self._state_clear()

    # ---- nodes --------------------------------------------------------------------------------------
    def _add_leaf(self, parent: HybridTreeNode, key: bytes, value: np.ndarray, priority: int) -> HybridTreeNode:
        """A new leaf; with a window, its leading tokens whose window KV its request freed already go in a tombstone
        node of their own above it (a leaf all without window KV stays a tombstone leaf: full eviction takes it)."""
        if self._keep is None:
            return super()._add_leaf(parent, key, value, priority)
        dead = self._dead_prefix(value)
        if dead == len(value):
            leaf = super()._add_leaf(parent, key, value, priority)
            leaf.window_live = False
            return leaf
        if dead:
            cut = dead * TOKEN_BYTES
            parent = super()._add_leaf(parent, key[:cut], value[:dead].copy(), priority)
            parent.window_live = False
            key, value = key[cut:], value[dead:].copy()
        leaf = super()._add_leaf(parent, key, value, priority)
        self._make_live(leaf)
        return leaf

    def _split(self, child: HybridTreeNode, into_child: int) -> HybridTreeNode:
        head = super()._split(child, into_child)
        if self._keep is not None:
            self._window_split(head, child)
        return head  # a state stays with child, which still ends where it did

    def _forget(self, node: HybridTreeNode) -> None:
        super()._forget(node)
        if node.window_entry is not None:  # its full slots, and so their window peers, are being freed
            self._window_evictable -= len(node.value)
            self._window_stale += 1  # an entry whose node left the tree is stale (see WindowComponent._window_remove)
        if node.state:
            self._state_forget(node)

    def _leave_device(self, node: HybridTreeNode) -> None:
        """A leaf leaves the tree; a tombstone parent it leaves an unlocked leaf goes too (it can end no usable
        match), and so on up."""
        # RadixTree._leave_device's steps, written out: every evicted leaf comes here, so the super() call this
        # saves shows in every eviction (docs/hybrid.md, Benchmarks).
        parent = node.parent
        del parent.children[node.key[:self._page_bytes]]
        node.parent = None
        self._forget(node)
        if parent.children or parent.lock_ref or parent.parent is None:
            return
        self._add_evictable(parent)
        while not parent.window_live and parent.entry is not None and parent.parent is not None:
            node, parent = parent, parent.parent
            self._unlist_leaf(node)
            self._dropped.append(node.value)
            super()._leave_device(node)

    def _unlist_leaf(self, node: HybridTreeNode) -> None:
        """Takes an evictable leaf out of the evictable set (and its pins) before it leaves the tree."""
        self._remove_evictable(node)
        if node.pin:
            self._drop_pins_of(node)
        self._policy.evicted(node)
        self._evictable_size -= len(node.value)

    def _delete_leaf(self, node: HybridTreeNode, values: list[np.ndarray]) -> int:
        """Removes an evictable leaf that a component's eviction chose (its slots appended to `values`); returns
        its full tokens."""
        self._unlist_leaf(node)
        values.append(node.value)
        self._leave_device(node)
        return len(node.value)

    def _take_dropped(self, values: list[np.ndarray]) -> int:
        """Moves the values of the tombstone leaves deletions took with them into `values`; returns their tokens."""
        if not self._dropped:
            return 0
        dropped, self._dropped = self._dropped, []
        values.extend(dropped)
        return sum(len(v) for v in dropped)

    # ---- match and insert ---------------------------------------------------------------------------
    def _matched(self, node: HybridTreeNode) -> MatchResult:
        """The deepest node on root..node every component can resume from: a state there (or the root), and the
        window KV of its last keep tokens (or of its whole path)."""
        if node.entry is not None:
            self._rekey(node)
        best, keep, states = node, self._keep, self.state_pool is not None
        while best.parent is not None:
            if states and not best.state:
                best = best.parent
                continue
            above = None if keep is None else self._window_valid(best)
            if above is None:
                break
            best = above
        if best.parent is None:
            return MatchResult(self._empty, best)
        if keep is not None:
            self._refresh_window(best)
        if states:
            self._refresh_state(best)
        return MatchResult(self._path_indices(best), best)

    def _grow(self, view: memoryview, value: np.ndarray, priority: int, namespace: str | None, walk: Walk,
              turn: int = 0) -> tuple[int, HybridTreeNode]:
        if self._keep is not None and walk.num_tokens:
            walk = self._revive_walk(walk, value)
        return super()._grow(view, value, priority, namespace, walk, turn)

    def _revive_walk(self, walk: Walk, value: np.ndarray) -> Walk:
        """Revives the tombstones on an insert's walk where `value` (the inserted slots, from where the walk
        started) still has their window KV; returns the walk, ended at a whole node if it ended in a tombstone."""
        node, matched = walk.node, walk.matched
        if walk.child is not None and not walk.child.window_live:
            node = self._split(walk.child, walk.into_child)
            matched += walk.into_child
            walk = Walk(node, matched, None, 0)
        offset = matched // TOKEN_BYTES
        while offset > 0:
            n = len(node.value)
            offset -= n
            parent = node.parent
            if not node.window_live:
                self._revive(node, value[offset:offset + n])
            node = parent
        return walk

    # ---- locks --------------------------------------------------------------------------------------
    def lock(self, node: HybridTreeNode) -> None:
        """The full path root..node, the window tail of the path, and the state at `node`."""
        super().lock(node)
        if self._keep is not None:
            self._lock_window(node)
        if self.state_pool is not None and node.parent is not None:
            self._lock_state(node)

    def unlock(self, node: HybridTreeNode) -> None:
        if self._keep is not None:
            self._unlock_window(node)
        if self.state_pool is not None and node.parent is not None:
            self._unlock_state(node)
        super().unlock(node)

    def move_lock(self, locked: HybridTreeNode, node: HybridTreeNode) -> None:
        super().move_lock(locked, node)
        if self._keep is not None:
            self._lock_window(node)
            self._unlock_window(locked)
        if self.state_pool is not None:
            if node.parent is not None:
                self._lock_state(node)
            if locked.parent is not None:
                self._unlock_state(locked)

    # ---- eviction -----------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Frees at least `num_tokens` full tokens (whole nodes) from unlocked leaves in policy order, their window
        KV and states with them, and the tombstone leaves they leave; returns the full tokens freed."""
        freed, values = self._evict_leaves(check_int("num_tokens", num_tokens, minimum=0))
        freed += self._take_dropped(values)
        if values:
            self._release(values)
        return freed

    # ---- requests -----------------------------------------------------------------------------------
    def cache_req(self, req: CachedRequest, finished: bool) -> None:
        """RadixCache.cache_req, then: a request that computed exactly a prefix on the state grid leaves its state on
        the node ending there (copied, or handed over when finished), and a finished one's row lets go of its window
        cursor and state slot."""
        row, kv_len = req.req_pool_idx, req.kv_len
        locked, protected = req.last_node, req.cache_protected_len
        super().cache_req(req, finished)
        if self.state_pool is not None and kv_len and kv_len % self.chunk_grid == 0:
            node = self._node_at(req, locked, protected, kv_len) if finished else req.last_node
            self._cache_state(node, row, finished)
        if finished:
            self._release_row(row)

    def _check_request(self, req: CachedRequest) -> None:
        """RadixCache's check, and with linear layers a state slot of the request's own (its linear layers' state)."""
        super()._check_request(req)
        if self.state_pool is not None and not self._req_state[req.req_pool_idx]:
            raise ValueError(f"request {getattr(req, 'rid', req)!r} has no state slot: its linear layers' state "
                             "must be in one of its own (HybridRadixCache.start_reqs gives one)")

    def _node_at(self, req: CachedRequest, locked: HybridTreeNode | None, protected: int,
                 kv_len: int) -> HybridTreeNode:
        """The node whose path is the request's first kv_len tokens, which its insert (from `locked`, the node of
        its first `protected`) just made."""
        below = locked if locked is not None else self._root(req.namespace)
        if kv_len == protected:
            return below
        view = memoryview(request_token_ids(req, kv_len, protected)).cast("B")
        return self._descend(view, len(view), below).node

    def release_req(self, req: CachedRequest, *, cache: bool) -> None:
        row = req.req_pool_idx
        super().release_req(req, cache=cache)  # with cache, cache_req(finished=True) released the row
        if row is not None and not cache:
            self._release_row(row)

    def _release_row(self, row: int) -> None:
        if self._keep is not None:
            self._window_start[row] = 0
        if self.state_pool is not None:
            self._release_state(row)

    # ---- the pools' room, as a scheduler asks for it ------------------------------------------------------
    def admission_budget(self, reserved: int, new_token_ratio: float) -> HybridAdmission:
        return HybridAdmission(self, reserved, new_token_ratio)

    def fits(self, num_tokens: int, num_reqs: int = 0) -> bool:
        alloc = self.token_allocator
        if num_tokens > alloc.available_size():
            return False
        if self._keep is not None and num_tokens > alloc.window_available_size():
            return False
        return self.state_pool is None or num_reqs <= self._state_slots.available_size()

    def can_fit(self, num_tokens: int) -> bool:
        alloc = self.token_allocator
        if num_tokens > alloc.available_size() + self._evictable_size:
            return False
        return self._keep is None or num_tokens <= alloc.window_available_size() + self._window_evictable

    def evict_for(self, num_tokens: int, num_reqs: int = 0) -> int:
        """Evicts each component's shortfall (full KV first, whose leaves take their window KV and states along);
        returns the full tokens evicted."""
        alloc = self.token_allocator
        evicted = 0
        short = num_tokens - alloc.available_size()
        if short > 0:
            evicted += self.evict(short)
        if self._keep is not None:
            short = num_tokens - alloc.window_available_size()
            if short > 0:
                evicted += self._evict_window(short)[1]
        if self.state_pool is not None:
            short = num_reqs - self._state_slots.available_size()
            if short > 0:
                evicted += self._evict_states(short)[1]
        return evicted

    def start_reqs(self, reqs: list[CachedRequest]) -> None:
        if self.state_pool is not None:
            self._start_states(reqs)

    def decode_step(self, reqs: list[CachedRequest], kv_lens: np.ndarray) -> None:
        if self._keep is not None and reqs:
            self._free_window_tails(reqs, kv_lens)

    def check_held(self, reqs: list[CachedRequest]) -> None:
        if self._keep is not None:
            alloc = self.token_allocator
            held = sum(self._window_held(r) for r in reqs)
            free, total = alloc.window_available_size(), alloc.window_size
            if free + self._window_evictable + self._window_protected + held != total:
                raise AssertionError(f"window slots: free {free} + evictable {self._window_evictable} + protected "
                                     f"{self._window_protected} + held by requests {held} != total {total}")
        if self.state_pool is not None:
            self._check_held_states(reqs)

    # ---- whole tree ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """Frees every cached slot, window slot and state, and empties the tree (see RadixCache.reset)."""
        states = [] if self.state_pool is None else [n.state for n in self._all_nodes() if n.state]
        super().reset()
        if states:
            self._state_slots.free_owned(np.array(states, dtype=np.int64))

    def check_invariants(self) -> None:
        """RadixCache.check_invariants, then each component's: window liveness against the allocator's pairing
        (live nodes paired and their window pages marked cached, tombstones unpaired), window locks within full
        locks, window sizes and LRU; states on the grid, distinct and marked cached, state sizes and LRU, and the
        requests' own state slots."""
        super().check_invariants()
        nodes = self._all_nodes()
        if self._keep is not None:
            self._check_window(nodes)
        if self.state_pool is not None:
            self._check_states(nodes)
        if self._dropped:
            fail_invariant("tombstone leaves were dropped but their slots not freed")

    def __repr__(self) -> str:
        parts = [f"page_size={self.page_size}", f"total={self.total_size()}", f"evictable={self._evictable_size}"]
        if self._keep is not None:
            parts.append(f"window={self.window}, window_evictable={self._window_evictable}, "
                         f"window_protected={self._window_protected}")
        if self.state_pool is not None:
            parts.append(f"state_evictable={self._state_evictable}, state_protected={self._state_protected}")
        return f"HybridRadixCache({', '.join(parts)})"


class HybridAdmission:
    """One extend step's admission budget for a hybrid cache's window and state components, beside the token pool's
    (`kvmem.prefill_adder.PrefillAdder` asks it).

    Window: a request is charged the window slots of this step's tokens (whole pages) and, for its outputs, up to what a
    decoding request holds (its window tail, the free interval and two pages), against free + evictable window slots
    less what the running requests may still take; a step prefills at most what an otherwise idle window pool holds
    (`max_extend`). States: a new request takes a slot, against free + evictable state slots.
    """

    def __init__(self, cache: HybridRadixCache, reserved: int, new_token_ratio: float) -> None:
        self.cache = cache
        self.new_token_ratio = new_token_ratio
        self.max_extend = math.inf
        self.window_charged = self.window_reserved = self.states_charged = 0
        if cache.window is not None:
            ps = cache.page_size
            self.headroom = cache._tail + cache._free_interval + 2 * ps
            pool = cache.req_to_token_pool
            self.window_reserved = min(reserved, (pool.size - pool.available_size()) * self.headroom)
            step = max(cache.chunk_grid, ps)
            self.max_extend = max((cache.token_allocator.window_size - self.headroom) // step * step, step)

    def fits(self, req: CachedRequest, start: int, end: int) -> bool:
        cache = self.cache
        if cache.window is not None:
            room = (cache.token_allocator.window_available_size() + cache._window_evictable - self.window_reserved
                    - self.window_charged)
            if self._window_charge(req, start, end) > room:
                return False
        if cache.state_pool is not None and req.req_pool_idx is None:
            return cache._state_slots.available_size() + cache._state_evictable - self.states_charged >= 1
        return True

    def add(self, req: CachedRequest, start: int, end: int) -> None:
        if self.cache.window is not None:
            self.window_charged += self._window_charge(req, start, end)
        if req.req_pool_idx is None:
            self.states_charged += 1

    def _window_charge(self, req: CachedRequest, start: int, end: int) -> int:
        ps = self.cache.page_size
        left = req.max_new_tokens - len(req.output_ids)
        outputs = pages_for(int(left * self.new_token_ratio), ps) * ps
        return (pages_for(end, ps) - pages_for(start, ps)) * ps + min(outputs, self.headroom)

