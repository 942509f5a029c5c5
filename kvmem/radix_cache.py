"""The radix prefix cache: which token prefixes have KV in the pool, shared between requests.

Each edge of the tree holds a run of tokens (`TreeNode.key`) and the KV slots of those tokens
(`TreeNode.value`, [n] int64); the slots of a prefix are the values along its path from the root. Requests
lock the path of the prefix they use (`inc_lock_ref`), and `evict` frees unlocked leaves back to the
allocator. The tree itself (walks, splits, locks, the evictable set) is `kvmem.radix_tree`; this module adds
what makes it a cache over a slot allocator: slot ownership, indices on the allocator's device, and the
seam through which requests enter it (`cache_finished_req`, `cache_unfinished_req`).

The tree is host bookkeeping, like the allocator's: tensors exist only at the edges (`MatchResult.indices`
on the allocator's device, slots handed to the allocator). The tree marks the slots it takes in the allocator
(`mark_cached`), so that insert rejects a slot that the tree already holds for another prefix: otherwise the
mistake surfaces later as a double free deep inside `evict`. Page size > 1: `insert` takes whole pages only and
raises otherwise, because a partial page is owned by its request, not the tree (`cache_*_req` cut it off
themselves).

Two surfaces: the SGLang-named public methods (`match_prefix`, `insert`, `inc_lock_ref`, `dec_lock_ref`,
`cache_finished_req`, `cache_unfinished_req`, `evict`) check their arguments, then call the trusted one that a
scheduler, which checked its requests where they entered, calls directly: `lock` / `unlock` / `move_lock` (a
node a match returned), `cache_req` (a request whose row, slots and locked prefix the scheduler keeps), and the
read-only walks that rank a waiting queue (`prefix_walk`, `walk_is_current`, `next_page`). A request's memory
goes back on one path, `release_req`, whether it finishes, is retracted or aborted, or its admission is undone.
Both surfaces keep the same bookkeeping, exactly: the allocator's page states are right after every call.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import numpy as np

from kvmem._checks import check_int, check_number, fail_invariant
from kvmem._index import as_index_array
from kvmem._torch import torch
from kvmem.allocator import PagedTokenAllocator, TokenAllocator
from kvmem.events.schema import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvmem.eviction import EvictionPolicy, EvictionPolicySpec
from kvmem.eviction.turns import TurnTable
from kvmem.page_hash import DIGEST_BYTES, chain_page_digests, event_hash, event_hashes, namespace_prefix
from kvmem.pool_room import PoolRoom
from kvmem.radix_tree import TOKEN_BYTES, RadixTree, TreeNode, Walk, key_bytes
from kvmem.req_to_token import ReqToTokenPool


class MatchResult(NamedTuple):
    """`indices`: [prefix_len] int64 slots of the longest cached prefix on the device (page-aligned),
    read-only: it may share memory with the tree. `last_node`: the node whose path from the root is exactly
    that prefix (the root when nothing matched); lock it with `inc_lock_ref` to keep the prefix cached.

    A tiered cache (`kvmem.HiRadixCache`) also reports `host_hit_length`, the tokens after that prefix that
    only its host tier holds, down to `last_host_node`; a plain RadixCache reports 0 and None, so a caller
    has one code path for both."""

    indices: torch.Tensor
    last_node: TreeNode
    host_hit_length: int = 0
    last_host_node: TreeNode | None = None


class CachedRequest(Protocol):
    """What the cache reads and writes of a request (`kvmem.Req` is one).

    Its req_to_token row by owner, once the cache has it (aligned = kv_len rounded down to whole pages;
    cached = leading tokens the tree already held when the request was inserted):

        [0, cache_protected_len)              the tree's: the matched prefix, locked through last_node
        [cache_protected_len, cached)         duplicates of what another request cached meanwhile: freed
        [cached, aligned)                     newly inserted: the tree's from then on
        [aligned, kv_len)                     the partial tail page: the request's, freed when it finishes
    """

    rid: Any
    req_pool_idx: int | None
    kv_len: int
    cache_protected_len: int
    last_node: TreeNode | None
    prefix_indices: torch.Tensor
    priority: int
    input_ids: array
    output_ids: list[int]
    namespace: str | None


class RadixCache(PoolRoom, RadixTree):
    """A radix tree of cached token prefixes over a slot allocator.

    Args:
        req_to_token_pool: the requests' slot table (read and written by `cache_finished_req` /
            `cache_unfinished_req`).
        token_allocator: where evicted slots go back; its page_size must equal `page_size`. It serves this cache
            alone: the cache marks the slots it holds there (`mark_cached`).
        page_size: tokens per page; keys are matched and inserted in whole pages.
        eviction_policy: a name of `kvmem.eviction.EVICTION_POLICIES` ("lru", "lfu", "fifo", "priority",
            "s3fifo", "arc", "2q", "gdsf", "lookahead", "multiturn"), a key function of a node, or an `EvictionPolicy`.
        pin_budget: the share of the capacity that `pin` may hold (0 to 1); older pins past it degrade.
        event_sink: called with each KV event (`kvmem.events`): a `BlockStored` (medium "GPU") for the pages
            of every node that enters the tree, a `BlockRemoved` for the pages each `evict` call takes out,
            an `AllBlocksCleared` on `reset`. Block hashes are `kvmem.page_hash` page hashes, kept on the
            nodes only when a sink is set. `kvmem.events.EventCollector` batches them per scheduler step.

    Sizes are in tokens: `total_size() == evictable_size() + protected_size()`, and every slot the tree
    holds is allocated in `token_allocator`, so with no request memory
    `available_size() + total_size() == token_allocator.size`.

    >>> from kvmem import RadixCache, ReqToTokenPool, TokenAllocator
    >>> alloc = TokenAllocator(16)
    >>> cache = RadixCache(ReqToTokenPool(2, 8), alloc)
    >>> cache.insert([5, 6, 7], alloc.alloc(3))     # no leading token was cached yet
    0
    >>> m = cache.match_prefix([5, 6, 9])           # shares [5, 6]
    >>> m.indices.tolist()
    [1, 2]
    >>> cache.inc_lock_ref(m.last_node)             # a request uses [5, 6]: evict cannot take it
    >>> cache.evict(16)                             # only the unlocked [7] goes
    1
    >>> cache.dec_lock_ref(m.last_node); cache.evict(16), alloc.available_size()
    (2, 16)
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool, token_allocator: TokenAllocator | PagedTokenAllocator,
                 page_size: int = 1, eviction_policy: EvictionPolicySpec = "lru",
                 event_sink: Callable[[KVCacheEvent], None] | None = None, pin_budget: float = 0.2) -> None:
        if not isinstance(req_to_token_pool, ReqToTokenPool):
            raise TypeError(f"req_to_token_pool must be a ReqToTokenPool, got {type(req_to_token_pool).__name__}")
        if not isinstance(token_allocator, (TokenAllocator, PagedTokenAllocator)):
            raise TypeError(f"token_allocator must be a TokenAllocator or PagedTokenAllocator, got "
                            f"{type(token_allocator).__name__}")
        pin_budget = check_number("pin_budget", pin_budget, 0)
        if pin_budget > 1:
            raise ValueError(f"pin_budget must lie in [0, 1] (a share of the capacity), got {pin_budget!r}")
        super().__init__(page_size, eviction_policy, int(pin_budget * token_allocator.size))
        if token_allocator.page_size != page_size:
            raise ValueError(f"page_size {page_size} != token_allocator.page_size {token_allocator.page_size}")
        if event_sink is not None and not callable(event_sink):
            raise TypeError(f"event_sink must be callable (or None), got {type(event_sink).__name__}")
        self._event_sink = event_sink
        self._names = event_sink is not None  # keep page digests on nodes (events and storage name pages)
        self.req_to_token_pool = req_to_token_pool
        self.token_allocator = token_allocator
        self.device = token_allocator.device
        self._on_cpu = self.device.type == "cpu"
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self._turns: TurnTable | None = None
        self._turn_policy: EvictionPolicy | None = None
        self._track_turns([self._policy])

    def _track_turns(self, policies: list[EvictionPolicy]) -> None:
        """Gives the policies that rank by conversation turns one table (`kvmem.eviction.turns`) to read; the
        first of them infers each request's turn."""
        tracking = [p for p in policies if p.tracks_turns]
        if tracking:
            self._turns = self._turns or TurnTable()
            self._turn_policy = self._turn_policy or tracking[0]
            for policy in tracking:
                policy.turns = self._turns

    # ---- match and insert ---------------------------------------------------------------------------
    def match_prefix(self, key, namespace: str | None = None) -> MatchResult:
        """The longest cached prefix of `key` (a sequence of int token ids, an int64 `array("q")` being the
        cheapest), truncated down to whole pages, among the prefixes cached in `namespace` (None: the
        default namespace; namespaces never share a prefix).

        An empty key, or one shorter than a page, matches nothing (empty indices, the root). A match ending
        inside an edge splits that node so that `last_node` covers exactly the prefix. Updates access time
        and hit count along the path.
        """
        view = key_bytes("key", key)
        node = self._walk_to_node(self.prefix_walk(view, namespace))
        if node.parent is None:
            return MatchResult(self._empty, node)
        self._touch(node, hit=True)
        return self._matched(node)

    def _matched(self, node: TreeNode) -> MatchResult:
        """match_prefix's result for the node its walk ended at (touched): a hook for a tiered cache."""
        if node.entry is not None:
            self._rekey(node)
        return MatchResult(self._path_indices(node), node)

    def prefix_len(self, key, namespace: str | None = None) -> int:
        """How many leading tokens of `key` `match_prefix` would return (whole pages, in any tier), without
        changing the tree: no split, no access-time or hit-count update, no index gather. A scheduler ranks
        its waiting queue with this and matches for real only the requests it admits."""
        return self.prefix_walk(key_bytes("key", key), namespace).num_tokens

    def prefix_walk(self, view: memoryview, namespace: str | None) -> Walk:
        """Trusted: prefix_len's walk of a key's bytes (`key_bytes`), which changes nothing; keep it to check
        later whether it still stops there (`walk_is_current`) instead of walking again."""
        return self._descend(view, len(view) - len(view) % self._page_bytes, self._root(namespace))

    def insert(self, key, value: torch.Tensor, priority: int = 0, namespace: str | None = None) -> int:
        """Caches slots `value` ([len(key)] integer tensor, any device; a numpy array works too) for tokens
        `key` (a non-empty sequence of int token ids, whole pages) in `namespace`. Returns how many leading tokens were
        already cached: the tree keeps its own slots there and the caller still owns (and should free)
        value[:returned]; the tree takes ownership of (a copy of) value[returned:].

        Raises, changing nothing, on an empty or misaligned key, a length mismatch, a non-integer value,
        or new slots that are 0, not allocated, not whole pages, or already in the tree.
        """
        view = key_bytes("key", key)
        value, priority = self._check_insert(view, value, priority)
        walk = self._descend(view, len(view), self._root(namespace))
        on_device = walk.num_tokens - self._device_gap(walk)
        if on_device * TOKEN_BYTES < len(view):
            self._check_new_slots(value[on_device:])
        return self._grow(view, value, priority, namespace, walk)[0]  # nothing in it raises: all checked

    def _insert(self, view: memoryview, value: np.ndarray, priority: int, namespace: str | None,
                below: TreeNode, turn: int = 0) -> tuple[int, TreeNode]:
        """insert's trusted body for a key (`view`: its whole pages' bytes) that continues the path of `below` (a
        request's locked prefix, or a root): `value` are host int64 slots the caller took from the allocator.
        Returns (tokens of the key already on device, the node whose path ends with the key)."""
        return self._grow(view, value, priority, namespace, self._descend(view, len(view), below), turn)

    def _grow(self, view: memoryview, value: np.ndarray, priority: int, namespace: str | None, walk: Walk,
              turn: int = 0) -> tuple[int, TreeNode]:
        """Caches the key whose walk is `walk`: the tree takes value's slots for the tokens beyond what it holds
        on device (a new leaf, and `_revive_path` for the tokens a lower tier holds), stamps the path as inserted
        at `priority` (and `turn`, for a policy that tracks turns), and names the new pages."""
        matched = walk.num_tokens
        on_device = matched - self._device_gap(walk)
        grows = matched * TOKEN_BYTES < len(view)
        last = self._walk_to_node(walk)
        if on_device < matched:
            self._revive_path(last, value[on_device:matched])
        self._touch(last, hit=False, priority=priority)
        turns = self._turns
        if turns is not None:
            turns.stamp_path(last, turn)
        if grows:
            new_slots = value[matched:]
            last = self._add_leaf(last, view[matched * TOKEN_BYTES:].tobytes(), new_slots.copy(), priority)
            if turns is not None:
                turns.stamp(last, turn)
            self._add_evictable(last)
            self._own(new_slots)
            if self._names:
                self._name_pages(last, namespace)
        elif last.entry is not None:
            self._rekey(last)
        if grows or on_device < matched:
            self._inserted(last)
        return on_device, last

    def _device_gap(self, walk: Walk) -> int:
        """Tokens of a walk's path that the device does not hold (a lower tier does): none in a one-tier cache."""
        return 0

    def _revive_path(self, last: TreeNode, slots: np.ndarray) -> None:
        """Puts the path's tokens that only a lower tier held (`_device_gap`) on device, in `slots`."""

    def _inserted(self, last: TreeNode) -> None:
        """An insert put new device slots on the path root..last: a hook for a tier below the device."""

    def _check_insert(self, view: memoryview, value, priority) -> tuple[np.ndarray, int]:
        """insert's argument checks: returns value as host int64 slots and priority as an int."""
        nbytes = len(view)
        if nbytes == 0:
            raise ValueError("key is empty: there is nothing to insert")
        if nbytes % self._page_bytes:
            raise ValueError(f"key has {nbytes // TOKEN_BYTES} tokens, not a multiple of page_size "
                             f"{self.page_size}: insert whole pages (the partial tail belongs to the request)")
        return self._check_value(value, nbytes // TOKEN_BYTES), check_int("priority", priority)

    def prefetch(self, key, namespace: str | None = None):
        """Starts reading a prompt's pages from a storage tier (a tiered cache's; see HiRadixCache). A cache
        with no tier below the device has none: None."""
        return None

    def finish_prefetch(self, prefetch) -> int:
        """Takes what a `prefetch` read (tokens); a cache with no tier below the device has none: 0."""
        return 0

    def writing_check(self) -> int:
        """Completes copies to lower tiers that have finished (a tiered cache's; the Scheduler calls it every
        step). A single-tier cache has none: 0."""
        return 0

    def _path_indices(self, node: TreeNode) -> torch.Tensor:
        values = self._path_values(node)
        if not values:
            return self._empty
        return self._to_device(values[0] if len(values) == 1 else np.concatenate(values))

    def _to_device(self, slots: np.ndarray) -> torch.Tensor:
        out = torch.from_numpy(slots)
        return out if self._on_cpu else out.to(self.device)

    @staticmethod
    def _check_value(value, num_tokens: int) -> np.ndarray:
        """`value` as [num_tokens] int64 slots on the host (a view when it already is)."""
        if not isinstance(value, (torch.Tensor, np.ndarray)):
            raise TypeError(f"value must be a torch.Tensor of slots, got {type(value).__name__}")
        slots = as_index_array("value", value)
        if len(slots) != num_tokens:
            raise ValueError(f"value must have shape [len(key)] = [{num_tokens}], got {tuple(value.shape)}")
        return slots

    def _check_new_slots(self, s: np.ndarray) -> None:
        """Raises unless the slots the tree is about to own are valid: allocated (so never slot 0), whole
        pages, and not already cached under another prefix."""
        held = self.token_allocator.allocated_mask(s)
        # count_nonzero: a third of the cost of .all()/.any() on a few hundred bools
        if np.count_nonzero(held) != len(s):
            bad = s[~held][0]
            raise ValueError(f"value holds slot {bad}, " + ("the padding slot" if bad == 0 else
                                                            "which token_allocator has not handed out"))
        cached = self.token_allocator.cached_mask(s)
        if np.count_nonzero(cached):
            raise ValueError(f"value holds slot {s[cached][0]}, which the tree already caches for another prefix")
        ps = self.page_size
        if ps > 1:
            pages = s.reshape(-1, ps)
            if (pages[:, 0] % ps).any() or (pages != pages[:, :1] + np.arange(ps)).any():
                raise ValueError(f"value must hold whole pages (page_size {ps}, each page's slots in order "
                                 f"from its first), got {s[:2 * ps].tolist()}...")
        # A slot twice in one value would be freed twice by eviction; the allocator's scratch array finds a
        # repeat in two vector passes, with no sort.
        if self.token_allocator.has_repeated_pages(s):
            values, counts = np.unique(s, return_counts=True)
            raise ValueError(f"value holds slot {values[counts > 1][0]} more than once")

    # ---- eviction -----------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Frees at least `num_tokens` tokens (whole nodes) from unlocked leaves in policy order, or all
        that is evictable if that is less; returns the number freed. O(k log n) for k nodes freed."""
        removed = None if self._event_sink is None else []
        freed, values = self._evict_leaves(check_int("num_tokens", num_tokens, minimum=0), removed)
        if values:
            self._release(values)
        if removed:
            self._report_removed(removed)
        return freed

    def _release(self, values: list[np.ndarray]) -> None:
        """Gives the slots of removed nodes back to the allocator in one call."""
        self.token_allocator.free_owned(values[0] if len(values) == 1 else np.concatenate(values))

    def _own(self, slots: np.ndarray) -> None:
        """Marks `slots` the tree's in the allocator (what insert checks a value against)."""
        self.token_allocator.mark_cached(slots)

    def _split(self, child: TreeNode, into_child: int) -> TreeNode:
        head = super()._split(child, into_child)
        if self._turns is not None:
            self._turns.split(head, child)
        return head

    def _forget(self, node: TreeNode) -> None:
        if self._turns is not None:
            self._turns.forget(node)

    # ---- page names and events ---------------------------------------------------------------------
    def _name_pages(self, node: TreeNode, namespace: str | None) -> None:
        """Gives a new node its pages' digests (chained from its parent's last page) and reports them stored."""
        parent = node.parent
        parent_digest = None if parent.parent is None else parent.page_digests[-DIGEST_BYTES:]
        node.page_digests = chain_page_digests(namespace_prefix(namespace), parent_digest, node.key,
                                               self._page_bytes)
        self._report_stored(node)

    def _report_stored(self, node: TreeNode, medium: str = MEDIUM_GPU) -> None:
        """Reports `node`'s pages stored in `medium` (its digests named them when it entered the tree)."""
        if self._event_sink is None:
            return
        parent = node.parent
        parent_hash = None if parent.parent is None else event_hash(parent.page_digests[-DIGEST_BYTES:])
        self._event_sink(BlockStored(event_hashes(node.page_digests), parent_hash, array("q", node.key).tolist(),
                                     self.page_size, medium=medium))

    def _report_removed(self, nodes: list[TreeNode], medium: str = MEDIUM_GPU) -> None:
        """Reports the pages of `nodes` removed from `medium`, in one event."""
        if self._event_sink is not None:
            self._event_sink(BlockRemoved(event_hashes(b"".join(n.page_digests for n in nodes)), medium))

    # ---- requests -----------------------------------------------------------------------------------
    def cache_finished_req(self, req: CachedRequest) -> None:
        """Caches a finished request's whole pages, frees the rest of its memory and unlocks its prefix.

        Inserts tokens (input_ids + output_ids)[:aligned] with their slots from the request's row, frees (in
        one allocator call) its duplicates and its partial tail (see `CachedRequest`), then frees the row,
        unlocks `req.last_node` and sets `req.req_pool_idx` to None. Raises, changing nothing, for a request
        whose row, lengths, locked prefix or own slots are not as `CachedRequest` draws them.
        """
        self._check_request(req)
        self.cache_req(req, finished=True)

    def cache_unfinished_req(self, req: CachedRequest) -> None:
        """Caches a running request's whole pages so far (after a prefill chunk) and moves its lock there.

        Its row then points at the tree's slots for tokens [0, aligned) (its own duplicates are freed),
        `last_node` / `prefix_indices` / `cache_protected_len` describe that prefix, and the partial tail
        [aligned, kv_len) stays the request's. Raises, changing nothing, as cache_finished_req does.
        """
        self._check_request(req)
        self.cache_req(req, finished=False)

    def cache_req(self, req: CachedRequest, finished: bool) -> None:
        """Trusted body of cache_finished_req (`finished`) / cache_unfinished_req, for a scheduler's request: its
        row holds slots its batches took from the allocator, and `last_node` (locked, or None for nothing) is the
        path of its first cache_protected_len tokens, so the insert starts there."""
        row, kv_len, protected = req.req_pool_idx, req.kv_len, req.cache_protected_len
        aligned = kv_len - kv_len % self.page_size
        if not finished and aligned <= protected:
            return
        pool, locked = self.req_to_token_pool, req.last_node
        if locked is None:
            locked = self._root(req.namespace)
        # The row from `start` on: a finished request needs nothing before its prefix, an unfinished one's row
        # becomes its prefix_indices.
        start = protected if finished else 0
        slots = pool.row_slots(row, start, kv_len if finished else aligned)
        cached, node = protected, locked
        if aligned > protected:
            turn = 0 if self._turns is None else self._request_turn(req, aligned)
            new, node = self._insert(memoryview(request_token_ids(req, aligned, protected)).cast("B"),
                                     slots[protected - start:aligned - start], req.priority, req.namespace,
                                     locked, turn)
            cached = protected + new
        if finished:
            self.token_allocator.free_owned(np.concatenate((slots[:cached - start], slots[aligned - start:])))
            pool.free_row(row)
            self.unlock(locked)
            req.req_pool_idx = None
            if self._turns is not None:
                self._turns.forget_request(req)
            return
        if cached > protected:
            # Another request cached these tokens meanwhile: the row takes the tree's slots, its own go back.
            self.token_allocator.free_owned(slots[protected:cached])
            indices = self._path_indices(node)
            pool.set_row_slots(row, protected, indices[protected:cached])
        else:
            indices = self._to_device(slots)  # the row's slots are the path's: no gather from the tree
        self.move_lock(locked, node)  # the insert went on from the locked node: node is below it
        req.last_node = node
        req.prefix_indices = indices
        req.cache_protected_len = aligned

    def release_req(self, req: CachedRequest, *, cache: bool) -> None:
        """Trusted: frees a scheduler's request's memory, the one path for a finish, a retraction and an abort.
        `cache`: its whole pages enter the tree first (`cache_req(req, finished=True)`); else its own slots go
        back unread (a retraction). A request that was matched but never given a row (an admission undone) only
        drops its lock."""
        if req.req_pool_idx is None:
            if req.last_node is not None:
                self.unlock(req.last_node)
            return
        if cache:
            self.cache_req(req, finished=True)
            return
        row = req.req_pool_idx
        self.token_allocator.free_owned(self.req_to_token_pool.row_slots(row, req.cache_protected_len, req.kv_len))
        self.req_to_token_pool.free_row(row)
        if req.last_node is not None:
            self.unlock(req.last_node)
        req.req_pool_idx = None

    def _request_turn(self, req: CachedRequest, aligned: int) -> int:
        """The conversation turn of `req`, as the policy that tracks turns infers it from the prefix the request
        matched: taken at its first insert, while last_node and cache_protected_len still describe its
        admission's match (at least a page follows it, up to `aligned`), then kept in the turn table for its
        later inserts. Requests admitted in one batch that continue the same prefix read it one after another,
        so they count as consecutive turns."""
        turn = self._turns.request(req)
        if turn is None:
            node = req.last_node if req.last_node is not None else self._root(req.namespace)
            matched = req.cache_protected_len
            rest = request_token_ids(req, max(aligned, len(req.input_ids)), matched)  # not just the first chunk
            turn = self._turn_policy.request_turn(node, rest, matched, len(req.input_ids))
            self._turns.set_request(req, turn)
        return turn

    def _check_request(self, req: CachedRequest) -> None:
        """Raises unless `req` is as `CachedRequest` draws it: an allocated row, 0 <= cache_protected_len <=
        kv_len <= its tokens, a last_node of this tree whose path is exactly its first cache_protected_len
        tokens, and, after them, slots of its own (allocated, distinct, none the tree's)."""
        rid = getattr(req, "rid", req)
        row = req.req_pool_idx
        pool = self.req_to_token_pool
        if row is None:
            raise ValueError(f"request {rid!r} has no req_to_token row (req_pool_idx is None)")
        if not isinstance(row, (int, np.integer)) or isinstance(row, bool) or not 0 <= row < pool.size \
                or pool.is_free(row):
            raise ValueError(f"request {rid!r}: req_pool_idx {row!r} is not an allocated row of req_to_token_pool")
        kv_len, protected = req.kv_len, req.cache_protected_len
        tokens = len(req.input_ids) + len(req.output_ids)
        if not 0 <= protected <= kv_len <= min(tokens, pool.max_context_len):
            raise ValueError(f"request {rid!r}: need 0 <= cache_protected_len ({protected}) <= kv_len ({kv_len}) "
                             f"<= its {tokens} tokens")
        node = req.last_node
        if node is None:
            if protected:
                raise ValueError(f"request {rid!r}: cache_protected_len {protected} with no last_node locking it")
        else:
            self._check_node(node)
            view = memoryview(request_token_ids(req, protected)).cast("B")
            walk = self._descend(view, len(view), self._root(req.namespace))
            if walk.node is not node or walk.child is not None or walk.num_tokens != protected:
                raise ValueError(f"request {rid!r}: last_node is not the path of its first {protected} tokens "
                                 f"(cache_protected_len)")
            if node.parent is not None and node.lock_ref <= 0:
                raise ValueError(f"request {rid!r}: last_node {node.id} is not locked")
        own = pool.row_slots(row, protected, kv_len)  # the request's own slots: allocated, not the tree's
        if len(own):
            held = self.token_allocator.allocated_mask(own)
            if np.count_nonzero(held) != len(own):
                raise ValueError(f"request {rid!r}: its row holds slot {own[~held][0]}, which token_allocator has "
                                 f"not handed out")
            cached = self.token_allocator.cached_mask(own)
            if np.count_nonzero(cached):
                raise ValueError(f"request {rid!r}: its row holds slot {own[cached][0]} after cache_protected_len, "
                                 f"which the tree caches")
            if len(np.unique(own)) != len(own):
                raise ValueError(f"request {rid!r}: its row lists a slot more than once")

    # ---- whole tree ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """Frees every cached slot back to the allocator and empties the tree.

        Raises RuntimeError (changing nothing) while any request holds a lock: its prefix would be freed
        under it. Nodes from before the reset are dead: locking them raises.
        """
        if self._protected_size:
            raise RuntimeError(f"reset() while requests lock {self._protected_size} cached tokens; "
                               "release them (dec_lock_ref) first")
        values = [node.value for node in self._detach_all()]
        if values:
            self._release(values)
        self._init_root()
        if self._turns is not None:
            self._turns.clear_nodes()
        if self._event_sink is not None:
            self._event_sink(AllBlocksCleared())

    def check_invariants(self) -> None:
        """Raises AssertionError naming the first broken invariant: tree links and child keys, node sizes
        (whole pages), lock refs (non-negative, a child never above its parent), the size counters, the
        evictable set (exactly the unlocked leaves, each under its current policy key), and the slots
        (distinct, never slot 0, and exactly the slots the allocator has marked cached)."""
        values = [node.value for node in self._check_tree()]
        slots = np.concatenate(values) if values else np.empty(0, dtype=np.int64)
        if len(slots) and slots.min() <= 0:
            fail_invariant(f"the tree holds slot {slots.min()} (slot 0 is padding)")
        if len(np.unique(slots)) != len(slots):
            fail_invariant("the tree holds a slot more than once")
        if len(slots) and not self.token_allocator.cached_mask(slots).all():
            fail_invariant("the tree holds a slot that token_allocator has not marked cached (or considers free)")
        if self.token_allocator.cached_size() != len(slots):
            fail_invariant(f"token_allocator marks {self.token_allocator.cached_size()} slots cached; the tree holds "
                           f"{len(slots)}")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(page_size={self.page_size}, eviction_policy={self.eviction_policy!r}, "
                f"total={self.total_size()}, evictable={self._evictable_size}, "
                f"protected={self._protected_size}, evictable_leaves={len(self._policy) + len(self._pinned)})")


def request_token_ids(req: CachedRequest, end: int, start: int = 0) -> array | memoryview:
    """Tokens start..end-1 of `req.input_ids + req.output_ids`, int64: a view of input_ids when they lie in the
    prompt, else an array built by C-speed copies."""
    ids = req.input_ids
    n = len(ids)
    if end <= n:
        return memoryview(ids)[start:end]
    out = array("q", memoryview(ids)[start:]) if start < n else array("q")
    out.extend(req.output_ids[max(start - n, 0):end - n])
    return out
