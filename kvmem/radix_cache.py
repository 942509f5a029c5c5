"""The radix prefix cache: which token prefixes have KV in the pool, shared between requests.

Each edge of the tree holds a run of tokens (`TreeNode.key`) and the KV slots of those tokens
(`TreeNode.value`, [n] int64); the slots of a prefix are the values along its path from the root. Requests
lock the path of the prefix they use (`inc_lock_ref`), and `evict` frees unlocked leaves.

The tree is host bookkeeping, like the allocator's: node values are numpy arrays, and tensors exist only at
the edges (`MatchResult.indices` on the allocator's device, slots handed to the allocator). On this CPU a
numpy slice, copy or concatenate costs a fraction of the torch op (slice 0.15 us against 1 us, and
`len()` 0.05 us against 0.35 us), which is most of what insert and evict do per node.

Design choices, each for a measured reason:

- Keys are `bytes` holding native int64 token ids (8 bytes a token, as SGLang's `array("q")`). A query is
  turned once into a zero-copy byte view (free for an `array("q")`, one C-speed conversion for a list), and
  each edge is compared with `edge_key.startswith(query_view[off:end])`: a memcmp at an offset, with no copy
  of the query, so a walk costs O(len(key)) bytes compared in total. Slicing the rest of the key at every
  node (what SGLang's tree does) costs O(len(key)) per node instead: 1.6 ms per copy of a 256k-token key
  here, against 44 us for the startswith of the same length. Bytes also compare and hash fast, and
  `bytes` of the first page (8 * page_size bytes) serves as the child key for every page size.
- Evictable leaves (unlocked, childless) sit in a `SortedList` of `(policy key, node id, node)`, updated
  where a node gains or loses that status or changes a field its key reads. `evict(k)` pops from the
  front: O(k log n), and nothing ever scans the tree outside `check_invariants`/`reset`.
- A match that ends inside an edge splits the node (copying that one node's key and value), so that
  `MatchResult.last_node` covers exactly the matched prefix and a lock protects exactly what was returned.
- Page size > 1: keys are matched in whole pages (a query is truncated down to whole pages) and edges are
  split only at page boundaries; `insert` takes whole pages only and raises otherwise, because a partial
  page is owned by its request, not the tree (`cache_*_req` cut it off themselves).
- A host bitmap of the slots the tree owns rejects, at insert, a slot that the tree already holds for
  another prefix: otherwise the mistake surfaces later as a double free deep inside `evict`. A slot
  repeated inside one value is not checked at insert (it would cost a third of an insert);
  `check_invariants` finds it.
"""

from __future__ import annotations

import itertools
from array import array
from typing import NamedTuple

import numpy as np
import torch
from sortedcontainers import SortedList

from kvmem._checks import as_index_array, check_positive_int
from kvmem.allocator import PagedTokenAllocator, TokenAllocator
from kvmem.eviction import EvictionPolicy, get_eviction_policy
from kvmem.req_to_token import ReqToTokenPool

_TOKEN_BYTES = 8  # keys hold int64 token ids


class TreeNode:
    """One edge of the tree: `key` (bytes of int64 token ids), `value` ([num_tokens] int64 numpy slots).

    `children` maps the bytes of a child's first page to the child. `lock_ref` counts the requests using
    the node's prefix; `last_access` and `created` are logical-clock ticks, `hit_count` counts the matches
    that reached it, `priority` is the highest request priority inserted through it, and `id` (unique,
    increasing) breaks ties. `entry` is its record in the evictable set, or None when it is not there.
    A node removed by `evict` or `reset` has `parent` None.
    """

    __slots__ = ("key", "value", "parent", "children", "lock_ref", "last_access", "hit_count", "created",
                 "priority", "id", "entry")

    def __init__(self, key: bytes, value: np.ndarray, parent: TreeNode | None, created: int, id: int) -> None:
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[bytes, TreeNode] = {}
        self.lock_ref = 0
        self.last_access = created
        self.hit_count = 0
        self.created = created
        self.priority = 0
        self.id = id
        self.entry: tuple | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.key) // _TOKEN_BYTES

    def token_ids(self) -> list[int]:
        """This edge's token ids (for debugging and tests; the tree never needs them as ints)."""
        return array("q", self.key).tolist()

    def __repr__(self) -> str:
        ids = self.token_ids()
        shown = ids[:8] + ["..."] if len(ids) > 8 else ids
        return f"TreeNode(id={self.id}, tokens={shown}, num_tokens={len(ids)}, lock_ref={self.lock_ref})"


class MatchResult(NamedTuple):
    """`indices`: [prefix_len] int64 slots of the longest cached prefix (page-aligned), read-only: it may
    share memory with the tree. `last_node`: the node whose path from the root is exactly that prefix
    (the root when nothing matched); lock it with `inc_lock_ref` to keep the prefix cached."""

    indices: torch.Tensor
    last_node: TreeNode


class RadixCache:
    """A radix tree of cached token prefixes over a slot allocator.

    Args:
        req_to_token_pool: the requests' slot table (read and written by `cache_finished_req` /
            `cache_unfinished_req`).
        token_allocator: where evicted slots go back; its page_size must equal `page_size`.
        page_size: tokens per page; keys are matched and inserted in whole pages.
        eviction_policy: "lru", "lfu", "fifo", "priority" (see kvmem.eviction) or an EvictionPolicy.

    Sizes are in tokens: `total_size() == evictable_size() + protected_size()`, and every slot the tree
    holds is allocated in `token_allocator`, so with no request memory
    `available_size() + total_size() == token_allocator.size`.
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool, token_allocator: TokenAllocator | PagedTokenAllocator,
                 page_size: int = 1, eviction_policy: str | EvictionPolicy = "lru") -> None:
        check_positive_int("page_size", page_size)
        if token_allocator.page_size != page_size:
            raise ValueError(f"page_size {page_size} != token_allocator.page_size {token_allocator.page_size}")
        self.req_to_token_pool = req_to_token_pool
        self.token_allocator = token_allocator
        self.page_size = page_size
        self.eviction_policy = get_eviction_policy(eviction_policy)
        self.device = token_allocator.device
        self._page_bytes = page_size * _TOKEN_BYTES
        num_slots = token_allocator.size + page_size
        self._in_tree = np.zeros(num_slots, dtype=np.bool_)  # slots some node's value holds
        self._on_cpu = self.device.type == "cpu"
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self._evictable = SortedList()
        self._ids = itertools.count()
        self._init_root()

    def _init_root(self) -> None:
        self.root_node = TreeNode(b"", np.empty(0, dtype=np.int64), None, 0, next(self._ids))
        self._clock = 0
        self._evictable.clear()
        self._evictable_size = 0
        self._protected_size = 0

    # ---- sizes --------------------------------------------------------------------------------------
    def evictable_size(self) -> int:
        """Tokens in unlocked nodes (freeable by `evict`, leaves first)."""
        return self._evictable_size

    def protected_size(self) -> int:
        """Tokens in nodes locked by at least one request."""
        return self._protected_size

    def total_size(self) -> int:
        """All cached tokens."""
        return self._evictable_size + self._protected_size

    # ---- match and insert ---------------------------------------------------------------------------
    def match_prefix(self, key) -> MatchResult:
        """The longest cached prefix of `key` (a sequence of int token ids, an int64 `array("q")` being the
        cheapest), truncated down to whole pages.

        An empty key, or one shorter than a page, matches nothing (empty indices, the root). A match ending
        inside an edge splits that node so that `last_node` covers exactly the prefix. Updates access time
        and hit count along the path.
        """
        view = _key_bytes("key", key)
        nbytes = len(view) - len(view) % self._page_bytes
        node, _, child, part = self._descend(view, nbytes)
        if child is not None:
            node = self._split(child, part)
        if node is self.root_node:
            return MatchResult(self._empty, node)
        self._clock += 1
        now, root, last = self._clock, self.root_node, node
        while node is not root:
            node.last_access = now
            node.hit_count += 1
            node = node.parent
        if last.entry is not None:
            self._rekey(last)
        return MatchResult(self._path_indices(last), last)

    def prefix_len(self, key) -> int:
        """How many leading tokens of `key` `match_prefix` would return (whole pages), without changing the
        tree: no split, no access-time or hit-count update, no index gather. A scheduler ranks its waiting
        queue with this and matches for real only the requests it admits."""
        view = _key_bytes("key", key)
        _, off, _, part = self._descend(view, len(view) - len(view) % self._page_bytes)
        return (off + part) // _TOKEN_BYTES

    def insert(self, key, value: torch.Tensor, priority: int = 0) -> int:
        """Caches slots `value` ([len(key)] integer tensor, any device; a numpy array works too) for tokens
        `key` (a non-empty sequence of int token ids, whole pages). Returns how many leading tokens were
        already cached: the tree keeps its own slots there and the caller still owns (and should free)
        value[:returned]; the tree takes ownership of (a copy of) value[returned:].

        Raises, changing nothing, on an empty or misaligned key, a length mismatch, a non-integer value,
        or new slots that are 0, not allocated, not whole pages, or already in the tree.
        """
        return self._insert(key, value, priority)[0]

    def _insert(self, key, value, priority: int) -> tuple[int, TreeNode]:
        view = _key_bytes("key", key)
        nbytes = len(view)
        if nbytes == 0:
            raise ValueError("key is empty: there is nothing to insert")
        if nbytes % self._page_bytes:
            raise ValueError(f"key has {nbytes // _TOKEN_BYTES} tokens, not a multiple of page_size "
                             f"{self.page_size}: insert whole pages (the partial tail belongs to the request)")
        slots = self._check_value(value, nbytes // _TOKEN_BYTES)
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
            raise TypeError(f"priority must be an int, got {priority!r}")
        priority = int(priority)
        node, off, child, part = self._descend(view, nbytes)
        matched = (off + part) // _TOKEN_BYTES
        grows = off + part < nbytes
        if grows:
            new_slots = slots[matched:]
            self._check_new_slots(new_slots)
        # Nothing below raises: the tree changes only once the whole call is known to be valid.
        if child is not None:
            node = self._split(child, part)
        self._clock += 1
        now, root, last = self._clock, self.root_node, node
        while node is not root:
            node.last_access = now
            if node.priority < priority:
                node.priority = priority
            node = node.parent
        if grows:
            last = self._add_leaf(last, view[off + part:].tobytes(), new_slots.copy(), priority)
        elif last.entry is not None:
            self._rekey(last)
        return matched, last

    def _descend(self, view: memoryview, nbytes: int) -> tuple[TreeNode, int, TreeNode | None, int]:
        """Walks the first `nbytes` (whole pages) of `view` down the tree without changing it.

        Returns (node, off, child, part): `node` is the deepest node matched whole, its path covering
        view[:off]; `child` is the next node when the match goes `part` bytes (whole pages, > 0, less than
        the child's key) into it, else None and 0.
        """
        node, off, pb = self.root_node, 0, self._page_bytes
        while off < nbytes:
            child = node.children.get(view[off:off + pb].tobytes())
            if child is None:
                break
            key = child.key
            end = off + len(key)
            if end <= nbytes and key.startswith(view[off:end]):
                node, off = child, end
                continue
            limit = min(end, nbytes) - off
            if end > nbytes and key.startswith(view[off:nbytes]):
                return node, off, child, limit
            return node, off, child, _common_prefix_bytes(key, view, off, limit, pb)
        return node, off, None, 0

    def _split(self, child: TreeNode, part: int) -> TreeNode:
        """Cuts `child` after `part` bytes (whole pages) into a new parent; returns that parent.

        Both halves copy their values: views would keep the whole original storage alive for as long as
        either half lives.
        """
        k = part // _TOKEN_BYTES
        parent = child.parent
        head = TreeNode(child.key[:part], child.value[:k].copy(), parent, child.created, next(self._ids))
        head.lock_ref = child.lock_ref
        head.last_access = child.last_access
        head.hit_count = child.hit_count
        head.priority = child.priority
        parent.children[child.key[:self._page_bytes]] = head
        child.key = child.key[part:]
        child.value = child.value[k:].copy()
        child.parent = head
        head.children[child.key[:self._page_bytes]] = child
        return head

    def _add_leaf(self, parent: TreeNode, key: bytes, value: np.ndarray, priority: int) -> TreeNode:
        leaf = TreeNode(key, value, parent, self._clock, next(self._ids))
        leaf.priority = priority
        if parent.entry is not None:
            self._remove_evictable(parent)
        parent.children[key[:self._page_bytes]] = leaf
        self._in_tree[value] = True
        self._evictable_size += len(value)
        self._add_evictable(leaf)
        return leaf

    def _path_indices(self, node: TreeNode) -> torch.Tensor:
        values = []
        root = self.root_node
        while node is not root:
            values.append(node.value)
            node = node.parent
        if not values:
            return self._empty
        if len(values) == 1:
            return self._to_device(values[0])
        values.reverse()
        return self._to_device(np.concatenate(values))

    def _to_device(self, slots: np.ndarray) -> torch.Tensor:
        out = torch.from_numpy(slots)
        return out if self._on_cpu else out.to(self.device)

    # ---- validation ---------------------------------------------------------------------------------
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
        held = self.token_allocator.is_allocated(torch.from_numpy(s)).numpy()
        # count_nonzero: a third of the cost of .all()/.any() on a few hundred bools
        if np.count_nonzero(held) != len(s):
            bad = s[~held][0]
            raise ValueError(f"value holds slot {bad}, " + ("the padding slot" if bad == 0 else
                                                            "which token_allocator has not handed out"))
        cached = self._in_tree.take(s)
        if np.count_nonzero(cached):
            raise ValueError(f"value holds slot {s[cached][0]}, which the tree already caches for another prefix")
        ps = self.page_size
        if ps > 1:
            pages = s.reshape(-1, ps)
            if (pages[:, 0] % ps).any() or (pages != pages[:, :1] + np.arange(ps)).any():
                raise ValueError(f"value must hold whole pages (page_size {ps}, each page's slots in order "
                                 f"from its first), got {s[:2 * ps].tolist()}...")

    # ---- locks --------------------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protects the prefix root..node from eviction (one more request uses it). The root is a no-op."""
        root = self.root_node
        if node.parent is None and node is not root:
            raise ValueError(f"node {node.id} is no longer in the tree (evicted, or from before reset())")
        while node is not root:
            if node.lock_ref == 0:
                n = len(node.value)
                self._evictable_size -= n
                self._protected_size += n
                if node.entry is not None:
                    self._remove_evictable(node)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Releases one `inc_lock_ref(node)`; nodes nobody uses become evictable. The root is a no-op.

        Raises ValueError, changing nothing, if `node` is not locked or no longer in the tree.
        """
        root = self.root_node
        if node is root:
            return
        if node.parent is None:
            raise ValueError(f"node {node.id} is no longer in the tree (evicted, or from before reset())")
        if node.lock_ref <= 0:
            raise ValueError(f"dec_lock_ref on node {node.id}, which is not locked (lock_ref {node.lock_ref})")
        while node is not root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                n = len(node.value)
                self._protected_size -= n
                self._evictable_size += n
                if not node.children:
                    self._add_evictable(node)
            node = node.parent

    # ---- eviction -----------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Frees at least `num_tokens` tokens (whole nodes) from unlocked leaves in policy order, or all
        that is evictable if that is less; returns the number freed. O(k log n) for k nodes freed:
        a parent left childless and unlocked joins the evictable set as its last child goes."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        evictable, root, pb = self._evictable, self.root_node, self._page_bytes
        freed = 0
        values = []
        while freed < num_tokens and evictable:
            node = evictable.pop(0)[2]
            node.entry = None
            parent = node.parent
            del parent.children[node.key[:pb]]
            node.parent = None
            values.append(node.value)
            freed += len(node.value)
            if not parent.children and parent.lock_ref == 0 and parent is not root:
                self._add_evictable(parent)
        if values:
            self._evictable_size -= freed
            self._release(values)
        return freed

    def _release(self, values: list[np.ndarray]) -> None:
        """Gives the slots of removed nodes back to the allocator in one call."""
        slots = values[0] if len(values) == 1 else np.concatenate(values)
        self._in_tree[slots] = False
        self.token_allocator.free(torch.from_numpy(slots))

    def _add_evictable(self, node: TreeNode) -> None:
        node.entry = (self.eviction_policy.sort_key(node), node.id, node)
        self._evictable.add(node.entry)

    def _remove_evictable(self, node: TreeNode) -> None:
        self._evictable.remove(node.entry)
        node.entry = None

    def _rekey(self, node: TreeNode) -> None:
        self._evictable.remove(node.entry)
        self._add_evictable(node)

    # ---- requests -----------------------------------------------------------------------------------
    def cache_finished_req(self, req) -> None:
        """Caches a finished request's whole pages, frees the rest of its memory and unlocks its prefix.

        Inserts tokens (input_ids + output_ids)[:aligned] with their slots from the request's row
        (aligned = kv_len rounded down to whole pages), then in one allocator call frees the request's
        slots that duplicate what the tree already held and its partial tail page; frees the row, unlocks
        `req.last_node` and sets `req.req_pool_idx` to None.
        """
        row = _check_row(req)
        kv_len, protected = req.kv_len, req.cache_protected_len
        slots = as_index_array("req_to_token", self.req_to_token_pool.req_to_token[row, :kv_len])
        aligned = kv_len - kv_len % self.page_size
        cached = protected
        if aligned > protected:
            cached = self._insert(request_token_ids(req, aligned), slots[:aligned], req.priority)[0]
        spare = np.concatenate((slots[protected:cached], slots[aligned:]))
        if len(spare):
            self.token_allocator.free(torch.from_numpy(spare))
        self.req_to_token_pool.free(row)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.req_pool_idx = None

    def cache_unfinished_req(self, req) -> None:
        """Caches a running request's whole pages so far (after a prefill chunk) and moves its lock there.

        Its row then points at the tree's slots for tokens [0, aligned) (its own duplicates are freed),
        `last_node` / `prefix_indices` / `cache_protected_len` describe that prefix, and the partial tail
        [aligned, kv_len) stays the request's.
        """
        row = _check_row(req)
        kv_len, protected = req.kv_len, req.cache_protected_len
        aligned = kv_len - kv_len % self.page_size
        if aligned <= protected:
            return
        table = self.req_to_token_pool.req_to_token
        slots = as_index_array("req_to_token", table[row, :aligned])
        cached, node = self._insert(request_token_ids(req, aligned), slots, req.priority)
        if cached > protected:
            self.token_allocator.free(torch.from_numpy(slots[protected:cached]))
        indices = self._path_indices(node)
        table[row, protected:aligned] = indices[protected:aligned].to(table.dtype)
        # Lock the new node before unlocking the old one, so a shared path never turns evictable in between.
        self.inc_lock_ref(node)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.last_node = node
        req.prefix_indices = indices
        req.cache_protected_len = aligned

    # ---- whole tree ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """Frees every cached slot back to the allocator and empties the tree.

        Raises RuntimeError (changing nothing) while any request holds a lock: its prefix would be freed
        under it. Nodes from before the reset are dead: locking them raises.
        """
        if self._protected_size:
            raise RuntimeError(f"reset() while requests lock {self._protected_size} cached tokens; "
                               "release them (dec_lock_ref) first")
        values = []
        stack = [self.root_node]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                values.append(child.value)
                stack.append(child)
            node.parent = None
        if values:
            self._release(values)
        self._init_root()

    def check_invariants(self) -> None:
        """Raises AssertionError naming the first broken invariant: tree links and child keys, node sizes
        (whole pages), lock refs (non-negative, a child never above its parent), the size counters, the
        evictable set (exactly the unlocked leaves, each under its current policy key), and the slots
        (distinct, never slot 0, allocated in the allocator, matching the tree's ownership bitmap)."""
        root, pb, ps, policy = self.root_node, self._page_bytes, self.page_size, self.eviction_policy
        if root.key or root.parent is not None or root.lock_ref or root.entry is not None:
            _fail("the root must have an empty key, no parent, no lock and no evictable entry")
        evictable = protected = leaves = 0
        values = []
        stack = [root]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                n = len(child.value)
                if child.parent is not node:
                    _fail(f"node {child.id}: parent is not node {node.id}, which lists it as a child")
                if first != child.key[:pb]:
                    _fail(f"node {child.id} is filed under a child key that is not its first page")
                if n == 0 or n % ps or len(child.key) != n * _TOKEN_BYTES:
                    _fail(f"node {child.id}: {len(child.key) // _TOKEN_BYTES} tokens and {n} slots "
                          f"(must be equal, positive, whole pages of {ps})")
                if child.lock_ref < 0 or (node is not root and child.lock_ref > node.lock_ref):
                    _fail(f"node {child.id}: lock_ref {child.lock_ref} (parent {node.lock_ref}) must be "
                          f">= 0 and at most its parent's")
                if child.lock_ref:
                    protected += n
                else:
                    evictable += n
                self._check_evictable_entry(child, policy)
                leaves += child.entry is not None
                values.append(child.value)
                stack.append(child)
        if evictable != self._evictable_size or protected != self._protected_size:
            _fail(f"counters say evictable {self._evictable_size}, protected {self._protected_size}; "
                  f"the nodes hold {evictable} and {protected}")
        if leaves != len(self._evictable):
            _fail(f"the evictable set has {len(self._evictable)} entries for {leaves} unlocked leaves")
        self._check_slots(values)

    def _check_evictable_entry(self, node: TreeNode, policy: EvictionPolicy) -> None:
        should = node.lock_ref == 0 and not node.children
        if should != (node.entry is not None):
            _fail(f"node {node.id} (lock_ref {node.lock_ref}, {len(node.children)} children) is "
                  f"{'' if node.entry is not None else 'not '}in the evictable set")
        if should and (node.entry != (policy.sort_key(node), node.id, node) or node.entry not in self._evictable):
            _fail(f"node {node.id}: evictable entry {node.entry[:2]} is stale or missing from the sorted set")

    def _check_slots(self, values: list[np.ndarray]) -> None:
        slots = np.concatenate(values) if values else np.empty(0, dtype=np.int64)
        if len(slots) and slots.min() <= 0:
            _fail(f"the tree holds slot {slots.min()} (slot 0 is padding)")
        if len(np.unique(slots)) != len(slots):
            _fail("the tree holds a slot more than once")
        if len(slots) and not self.token_allocator.is_allocated(torch.from_numpy(slots)).all():
            _fail("the tree holds a slot that token_allocator considers free")
        if np.count_nonzero(self._in_tree) != len(slots) or not self._in_tree[slots].all():
            _fail("the ownership bitmap does not match the slots in the tree")

    def __repr__(self) -> str:
        return (f"RadixCache(page_size={self.page_size}, eviction_policy={self.eviction_policy.name!r}, "
                f"total={self.total_size()}, evictable={self._evictable_size}, "
                f"protected={self._protected_size}, evictable_leaves={len(self._evictable)})")


def request_token_ids(req, num_tokens: int) -> array:
    """The first `num_tokens` of `req.input_ids + req.output_ids` as an int64 array, by C-speed copies."""
    ids = req.input_ids
    if num_tokens <= len(ids):
        return array("q", ids[:num_tokens])
    out = array("q", ids)
    out.extend(req.output_ids[:num_tokens - len(ids)])
    return out


def _key_bytes(name: str, key) -> memoryview:
    """A byte view of `key` as native int64 token ids: zero-copy for an `array("q")` or a memoryview of one,
    one C-speed conversion
    for a list or tuple, a cast for an integer tensor or numpy array."""
    if isinstance(key, array) and key.typecode == "q":
        buf = key
    elif isinstance(key, memoryview) and key.format == "q" and key.ndim == 1:
        buf = key  # a slice of an int64 array: zero-copy, unlike slicing the array itself
    elif isinstance(key, (torch.Tensor, np.ndarray)):
        buf = np.ascontiguousarray(as_index_array(name, key))
    else:
        try:
            buf = array("q", key)
        except TypeError as e:
            raise TypeError(f"{name} must be a sequence of int token ids, got {type(key).__name__} ({e})") from None
        except OverflowError:
            raise ValueError(f"{name} holds a token id outside int64") from None
    return memoryview(buf).cast("B")


def _common_prefix_bytes(key: bytes, view: memoryview, off: int, limit: int, pb: int) -> int:
    """Bytes (whole pages) that key[:limit] shares with view[off:off+limit], knowing that the first page
    matches and the whole `limit` does not: bisection whose compares touch only the undecided window, so
    the cost is O(limit) bytes compared, with no copies."""
    lo, hi = 1, limit // pb  # pages: the first lo match, the first hi do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if key.startswith(view[off + lo * pb:off + mid * pb], lo * pb):
            lo = mid
        else:
            hi = mid
    return lo * pb


def _check_row(req) -> int:
    if req.req_pool_idx is None:
        raise ValueError(f"request {getattr(req, 'rid', req)!r} has no req_to_token row (req_pool_idx is None)")
    if not 0 <= req.cache_protected_len <= req.kv_len:
        raise ValueError(f"request {getattr(req, 'rid', req)!r}: need 0 <= cache_protected_len "
                         f"({req.cache_protected_len}) <= kv_len ({req.kv_len})")
    return req.req_pool_idx


def _fail(message: str) -> None:
    raise AssertionError(f"RadixCache invariant broken: {message}")
