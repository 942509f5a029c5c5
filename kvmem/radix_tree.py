"""The radix tree core: token prefixes as a tree of edges, with lock references and an ordered set of
evictable leaves. It knows nothing of allocators or requests; `RadixCache` (and the tiered cache) build on
it and decide what a node's value is and where its slots go when it is evicted.

Design choices, each for a measured reason (the figures: docs/benchmarks.md):

- Keys are `bytes` holding native int64 token ids (8 bytes a token, as SGLang's `array("q")`). A query is
  turned once into a zero-copy byte view (free for an `array("q")`, one C-speed conversion for a list), and
  each edge is compared with `edge_key.startswith(query_view[matched:end])`: a memcmp at an offset, with
  no copy of the query, so a walk costs O(len(key)) bytes compared in total. Slicing the rest of the key at
  every node (what SGLang's tree does) costs O(len(key)) per node instead, which dominates long prompts.
  Bytes also compare and hash fast, and
  `bytes` of the first page (8 * page_size bytes) serves as the child key for every page size.
- Node values are numpy arrays: on the CPU a numpy slice, copy or concatenate costs a fraction of the torch
  op, and those are most of what insert and evict do per node.
- Evictable leaves (unlocked, childless) are held by the eviction policy (`kvmem.eviction`), told where a
  node gains or loses that status or changes a field its order reads; eviction asks it for victims one at a
  time: O(k log n), and nothing ever scans the tree outside `check_invariants`/`reset`. Pinned leaves
  (`pin`) sit in a set of their own, oldest pin first, taken only when the policy has nothing left.
- A match that ends inside an edge splits the node (copying that one node's key and value), so that a
  match's last node covers exactly the matched prefix and a lock protects exactly what was returned.
- Page size > 1: keys are matched in whole pages and edges are split only at page boundaries.
"""

from __future__ import annotations

import itertools
from array import array
from typing import NamedTuple

import numpy as np
from sortedcontainers import SortedList

from kvmem._checks import check_int, fail_invariant
from kvmem._index import key_bytes
from kvmem._paging import TOKEN_BYTES
from kvmem.eviction import EvictionPolicySpec, make_policy
from kvmem.page_hash import DIGEST_BYTES, encode_namespace
from kvmem.pins import PrefixPins


class TreeNode:
    """One edge of the tree: `key` (bytes of int64 token ids), `value` ([num_tokens] int64 numpy slots).

    `children` maps the bytes of a child's first page to the child. `lock_ref` counts the requests using
    the node's prefix; `last_access` and `created` are logical-clock ticks, `hit_count` counts the matches
    that reached it, `priority` is the highest request priority inserted through it, `depth` is the tokens on
    the path above it, and `id` (unique, increasing) breaks ties.
    `entry` is its record in the evictable set, or None when it is not there; `pin` is 0, or the order of its
    newest pin (`RadixTree.pin`).
    `page_digests` (its pages' 32-byte `kvmem.page_hash` digests, concatenated) is kept only by a cache that
    needs page names (events, storage), else None. A root (one per namespace) has parent None and an empty
    key; so has a node removed by eviction or `reset`.
    """

    __slots__ = ("key", "value", "parent", "children", "lock_ref", "last_access", "hit_count", "created",
                 "priority", "id", "entry", "page_digests", "depth", "pin")

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
        self.entry = None
        self.page_digests: bytes | None = None
        self.depth = 0 if parent is None else parent.depth + len(parent.key) // TOKEN_BYTES
        self.pin = 0

    @property
    def num_tokens(self) -> int:
        return len(self.key) // TOKEN_BYTES

    def token_ids(self) -> list[int]:
        """This edge's token ids (for debugging and tests; the tree never needs them as ints)."""
        return array("q", self.key).tolist()

    def __repr__(self) -> str:
        ids = self.token_ids()
        shown = ids[:8] + ["..."] if len(ids) > 8 else ids
        return f"TreeNode(id={self.id}, tokens={shown}, num_tokens={len(ids)}, lock_ref={self.lock_ref})"


class Walk(NamedTuple):
    """Where a key's walk down the tree stopped. `node` is the deepest node matched whole, its path
    covering the first `matched` bytes of the key; `child` is the next node when the match goes
    `into_child` bytes (whole pages, > 0, less than the child's key) into it, else None and 0."""

    node: TreeNode
    matched: int
    child: TreeNode | None
    into_child: int

    @property
    def num_tokens(self) -> int:
        """Tokens of the key that the tree holds: through `node` and into `child`."""
        return (self.matched + self.into_child) // TOKEN_BYTES


class RadixTree(PrefixPins):
    """Nodes, walks, splits, lock references and the evictable set, over values the subclass owns.

    Sizes are in tokens: `total_size() == evictable_size() + protected_size()`. A tiered subclass overrides the
    few steps where a tier changes what happens: `_protect` / `_unprotect` (a node's lock count leaves or
    reaches 0), `_leave_device` (an evicted leaf goes), `_node_device_tokens` (what a node holds, checked).
    """

    node_class: type[TreeNode] = TreeNode

    def __init__(self, page_size: int, eviction_policy: EvictionPolicySpec, pin_budget_tokens: int = 0) -> None:
        self.page_size = check_int("page_size", page_size, minimum=1)
        self._policy = make_policy(eviction_policy)
        self._policy.bind(self)
        self.eviction_policy = self._policy.name
        self._page_bytes = page_size * TOKEN_BYTES
        self._pinned = SortedList()  # pinned evictable leaves: (pin order, id, node)
        self._pin_budget = pin_budget_tokens
        self._ids = itertools.count()
        self._init_root()

    def _init_root(self) -> None:
        self.root_node = self._new_root()
        self._roots: dict[str | None, TreeNode] = {None: self.root_node}
        self._clock = 0
        self._policy.clear()
        self._clear_pins()
        self._evictable_size = 0
        self._protected_size = 0

    def _new_root(self) -> TreeNode:
        return self.node_class(b"", np.empty(0, dtype=np.int64), None, 0, next(self._ids))

    def _root(self, namespace: str | None) -> TreeNode:
        """The root of `namespace`'s tree (None: the default namespace). Namespaces share nothing but the
        evictable sets and the slots: a prefix cached in one is never matched from another."""
        if namespace is None:
            return self.root_node
        root = self._roots.get(namespace) if type(namespace) is str else None
        if root is None:
            encode_namespace("namespace", namespace)  # before the root exists: it names every page below it
            root = self._roots[namespace] = self._new_root()
        return root

    # ---- sizes --------------------------------------------------------------------------------------
    def evictable_size(self) -> int:
        """Tokens in unlocked nodes (freeable by eviction, leaves first)."""
        return self._evictable_size

    def protected_size(self) -> int:
        """Tokens in nodes locked by at least one request."""
        return self._protected_size

    def total_size(self) -> int:
        """All cached tokens."""
        return self._evictable_size + self._protected_size

    # ---- walking and growing ------------------------------------------------------------------------
    def _descend(self, view: memoryview, nbytes: int, root: TreeNode) -> Walk:
        """Walks the first `nbytes` (whole pages) of `view` down from `root` without changing the tree."""
        node, matched, page_bytes = root, 0, self._page_bytes
        while matched < nbytes:
            child = node.children.get(view[matched:matched + page_bytes].tobytes())
            if child is None:
                break
            key = child.key
            end = matched + len(key)
            if end <= nbytes and key.startswith(view[matched:end]):
                node, matched = child, end
                continue
            limit = min(end, nbytes) - matched
            if end > nbytes and key.startswith(view[matched:nbytes]):
                return Walk(node, matched, child, limit)
            return Walk(node, matched, child, _common_prefix_bytes(key, view, matched, limit, page_bytes))
        return Walk(node, matched, None, 0)

    def next_page(self, view: memoryview, walk: Walk) -> bytes | None:
        """Trusted: the bytes of the page of `view` after where `walk` (a `_descend` of it) stopped at a whole
        node: what a later walk would look up there; None when the key ends there, or the walk stopped inside an
        edge."""
        end = walk.matched + self._page_bytes
        return view[walk.matched:end].tobytes() if walk.child is None and end <= len(view) else None

    def walk_is_current(self, walk: Walk, next_page: bytes | None, namespace: str | None) -> bool:
        """Trusted: whether `walk`, an earlier `_descend` of a key whose page after it is `next_page`, is still
        where a walk of that key would stop. A check of one node, not a walk.

        Nodes leave the tree only as leaves (their parent set to None), keys change only by splits (which keep
        a path's tokens), and a walk goes further only through a child with the key's next page: so the walk
        still stops there while the child it went into partway is still its node's child (unsplit, not
        evicted), or while its last node is in the tree and has no child for the next page.
        """
        node = walk.node
        if walk.child is not None:
            return walk.child.parent is node
        if node.parent is None and node is not self._roots.get(namespace):
            return False  # left the tree (or a root from before reset())
        return next_page is None or next_page not in node.children

    def _walk_to_node(self, walk: Walk) -> TreeNode:
        """The node whose path is exactly what `walk` matched, splitting its child if the match ends inside it."""
        return walk.node if walk.child is None else self._split(walk.child, walk.into_child)

    def _split(self, child: TreeNode, into_child: int) -> TreeNode:
        """Cuts `child` after `into_child` bytes (whole pages) into a new parent; returns that parent.

        Both halves copy their values: views would keep the whole original storage alive for as long as
        either half lives.
        """
        k = into_child // TOKEN_BYTES
        parent = child.parent
        head = self.node_class(child.key[:into_child], child.value[:k].copy(), parent, child.created, next(self._ids))
        head.lock_ref = child.lock_ref
        head.last_access = child.last_access
        head.hit_count = child.hit_count
        head.priority = child.priority
        parent.children[child.key[:self._page_bytes]] = head
        child.key = child.key[into_child:]
        child.value = child.value[k:].copy()
        if child.page_digests is not None:  # digests chain per page, so a split only divides them
            cut = k // self.page_size * DIGEST_BYTES
            head.page_digests, child.page_digests = child.page_digests[:cut], child.page_digests[cut:]
        child.parent = head
        child.depth += k
        head.children[child.key[:self._page_bytes]] = child
        self._policy.split(head, child)
        if child.entry is not None:
            self._rekey(child)  # it is shorter now
        return head

    def _add_leaf(self, parent: TreeNode, key: bytes, value: np.ndarray, priority: int) -> TreeNode:
        """Links a new unlocked leaf under `parent` and counts its tokens evictable; its caller then puts it in the
        evictable set (`_add_evictable`), once whatever its policy ranks it by is stamped on it."""
        leaf = self.node_class(key, value, parent, self._clock, next(self._ids))
        leaf.priority = priority
        if parent.entry is not None:
            self._remove_evictable(parent)
        parent.children[key[:self._page_bytes]] = leaf
        self._evictable_size += len(value)
        return leaf

    def _touch(self, last: TreeNode, *, hit: bool, priority: int | None = None) -> None:
        """Advances the clock and stamps the path root..last as accessed now (and matched, or inserted at
        `priority`). Its caller re-keys `last` if it is an evictable leaf (no other node on the path is)."""
        self._clock += 1
        now, node = self._clock, last
        while node.parent is not None:
            node.last_access = now
            if hit:
                node.hit_count += 1
            if priority is not None and node.priority < priority:
                node.priority = priority
            node = node.parent

    @property
    def clock(self) -> int:
        """The logical clock: ticks once per match or insert (what `last_access` and `created` hold)."""
        return self._clock

    def _path_values(self, node: TreeNode) -> list[np.ndarray]:
        """The values of the nodes root..node, in path order."""
        values = []
        while node.parent is not None:
            values.append(node.value)
            node = node.parent
        values.reverse()
        return values

    # ---- what the scheduler is about to need ------------------------------------------------------------
    def request_waiting(self, rid, key, namespace: str | None = None) -> None:
        """The scheduler queued request `rid`, whose match key is `key`: a policy that looks ahead keeps what it
        will match (a read-only walk, as `prefix_len`; nothing at all for the other policies)."""
        if self._looks_ahead():
            view = key_bytes("key", key)
            walk = self._descend(view, len(view) - len(view) % self._page_bytes, self._root(namespace))
            self._note_waiting(rid, walk.node if walk.child is None else walk.child, view)

    def request_admitted(self, rid) -> None:
        """The scheduler admitted request `rid` (matched and locked its prefix)."""
        self._policy.admitted(rid)

    def _looks_ahead(self) -> bool:
        return self._policy.looks_ahead

    def _note_waiting(self, rid, node: TreeNode, key: memoryview) -> None:
        self._policy.waiting(rid, node, key)

    # ---- locks --------------------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protects the prefix root..node from eviction (one more request uses it). The root is a no-op.

        Raises, changing nothing, if `node` is not a node of this tree (evicted, from before reset(), or
        another tree's)."""
        self._check_node(node)
        self.lock(node)

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Releases one `inc_lock_ref(node)`; nodes nobody uses become evictable. The root is a no-op.

        Raises ValueError, changing nothing, if `node` is not locked or not a node of this tree.
        """
        root = self._check_node(node)
        if node is root:
            return
        if node.lock_ref <= 0:
            raise ValueError(f"dec_lock_ref on node {node.id}, which is not locked (lock_ref {node.lock_ref})")
        self.unlock(node)

    def lock(self, node: TreeNode) -> None:
        """inc_lock_ref's trusted body, for a node the caller knows is in this tree (one a match just returned)."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self._protect(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """dec_lock_ref's trusted body, for a node of this tree that the caller locked."""
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._unprotect(node)
            node = node.parent

    def move_lock(self, locked: TreeNode, node: TreeNode) -> None:
        """Trusted: lock(node) then unlock(locked), for a `node` below the `locked` one on its path (a request's
        lock moving down its own prefix as more of it is cached); only the nodes between them change."""
        while node is not locked:
            if node.lock_ref == 0:
                self._protect(node)
            node.lock_ref += 1
            node = node.parent

    def _protect(self, node: TreeNode) -> None:
        """A node's first lock: its tokens move from evictable to protected, and it leaves the evictable set."""
        n = len(node.value)
        self._evictable_size -= n
        self._protected_size += n
        if node.entry is not None:
            self._remove_evictable(node)

    def _unprotect(self, node: TreeNode) -> None:
        """A node's last lock is gone: its tokens are evictable again, and a leaf joins the evictable set."""
        n = len(node.value)
        self._protected_size -= n
        self._evictable_size += n
        if not node.children:
            self._add_evictable(node)

    def _check_node(self, node: TreeNode) -> TreeNode:
        """Returns the root `node` hangs from, if it is one of this tree's roots; raises otherwise. A walk up
        the path (a lock walks it anyway), so a node of another tree is refused before either tree changes."""
        if not isinstance(node, TreeNode):
            raise TypeError(f"node must be a TreeNode, got {type(node).__name__}")
        walker = node
        while walker.parent is not None:
            walker = walker.parent
        if any(root is walker for root in self._roots.values()):
            return walker
        if walker is node:
            raise ValueError(f"node {node.id} is no longer in the tree (evicted, or from before reset())")
        raise ValueError(f"node {node.id} is not in this tree: it belongs to another tree")

    # ---- the evictable set --------------------------------------------------------------------------
    def _add_evictable(self, node: TreeNode) -> None:
        if node.pin:
            node.entry = (node.pin, node.id, node)
            self._pinned.add(node.entry)
        else:
            node.entry = self._policy.add(node)

    def _remove_evictable(self, node: TreeNode) -> None:
        if node.pin:
            self._pinned.remove(node.entry)
        else:
            self._policy.remove(node, node.entry)
        node.entry = None

    def _rekey(self, node: TreeNode) -> None:
        if not node.pin:  # a pinned leaf keeps its pin's order
            node.entry = self._policy.update(node, node.entry)

    def _next_victim(self) -> TreeNode | None:
        """The policy's next victim; a pinned leaf (oldest pin first) only when the policy has none left, so a
        pin never keeps memory from a request that needs it."""
        node = self._policy.pop()
        if node is None and self._pinned:
            node = self._pinned.pop(0)[2]
            self._drop_pins_of(node)
        if node is not None:
            self._policy.evicted(node)
        return node

    def _evict_leaves(self, num_tokens: int, removed: list[TreeNode] | None = None) -> tuple[int, list[np.ndarray]]:
        """Evicts unlocked leaves in policy order until `num_tokens` tokens are out (or none is left); returns
        (tokens evicted, their values), and appends the evicted nodes to `removed` if given. Each leaves
        through `_leave_device`, which may make its parent the next evictable leaf, so a chain empties leaf
        by leaf."""
        freed = 0
        values = []
        while freed < num_tokens:
            node = self._next_victim()
            if node is None:
                break
            node.entry = None
            values.append(node.value)
            freed += len(node.value)
            self._leave_device(node)
            if removed is not None:
                removed.append(node)
        self._evictable_size -= freed
        return freed, values

    def _leave_device(self, node: TreeNode) -> None:
        """An evicted leaf leaves the tree; a parent left childless and unlocked becomes evictable."""
        parent = node.parent
        del parent.children[node.key[:self._page_bytes]]
        node.parent = None
        self._forget(node)
        if not parent.children and parent.lock_ref == 0 and parent.parent is not None:
            self._add_evictable(parent)

    def _forget(self, node: TreeNode) -> None:
        """`node` has left the tree: a hook for what a subclass keeps per node outside it."""

    def _all_nodes(self) -> list[TreeNode]:
        """Every node but the roots."""
        nodes, stack = [], list(self._roots.values())
        while stack:
            node = stack.pop()
            nodes.extend(node.children.values())
            stack.extend(node.children.values())
        return nodes

    def _detach_all(self) -> list[TreeNode]:
        """Unlinks every node (each left with parent None) and returns them; the roots stay."""
        nodes = self._all_nodes()
        for node in nodes:
            node.parent = None
        return nodes

    # ---- checks -------------------------------------------------------------------------------------
    def _check_tree(self) -> list[TreeNode]:
        """Raises AssertionError naming the first broken structural invariant (links and child keys, node
        sizes in whole pages, lock refs, size counters, the evictable set); returns every node but the root."""
        page_bytes, ps = self._page_bytes, self.page_size
        for root in self._roots.values():
            if root.key or root.parent is not None or root.lock_ref or root.entry is not None:
                fail_invariant("a root must have an empty key, no parent, no lock and no evictable entry")
        evictable = protected = leaves = 0
        nodes = []
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                n = child.num_tokens
                if child.parent is not node:
                    fail_invariant(f"node {child.id}: parent is not node {node.id}, which lists it as a child")
                if first != child.key[:page_bytes]:
                    fail_invariant(f"node {child.id} is filed under a child key that is not its first page")
                if n == 0 or n % ps or len(child.key) % TOKEN_BYTES:
                    fail_invariant(f"node {child.id}: {len(child.key)} key bytes (must be {n} > 0 tokens in whole "
                                   f"pages of {ps})")
                if child.depth != node.depth + node.num_tokens:
                    fail_invariant(f"node {child.id}: depth {child.depth}, but its parent's path ends at "
                                   f"{node.depth + node.num_tokens} tokens")
                if child.lock_ref < 0 or (node.parent is not None and child.lock_ref > node.lock_ref):
                    fail_invariant(f"node {child.id}: lock_ref {child.lock_ref} (parent {node.lock_ref}) must be "
                                   f">= 0 and at most its parent's")
                device = self._node_device_tokens(child)
                if child.lock_ref:
                    protected += device
                else:
                    evictable += device
                self._check_evictable_entry(child)
                leaves += child.entry is not None
                nodes.append(child)
                stack.append(child)
        if evictable != self._evictable_size or protected != self._protected_size:
            fail_invariant(f"counters say evictable {self._evictable_size}, protected {self._protected_size}; "
                           f"the nodes hold {evictable} and {protected}")
        held = len(self._policy) + len(self._pinned)
        if leaves != held:
            fail_invariant(f"the evictable sets hold {held} entries for {leaves} unlocked leaves")
        self._check_pins()
        return nodes

    def _node_device_tokens(self, node: TreeNode) -> int:
        """The tokens `node` holds in the (device) tier the sizes count; checks its value against its key."""
        if len(node.value) != node.num_tokens:
            fail_invariant(f"node {node.id}: {node.num_tokens} tokens and {len(node.value)} slots (must be equal)")
        return len(node.value)

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        return node.lock_ref == 0 and not node.children

    def _check_evictable_entry(self, node: TreeNode) -> None:
        should = self._is_evictable_leaf(node)
        if should != (node.entry is not None):
            fail_invariant(f"node {node.id} (lock_ref {node.lock_ref}, {len(node.children)} children) is "
                           f"{'' if node.entry is not None else 'not '}in the evictable set")
        if not should:
            return
        if node.pin:
            current = node.entry == (node.pin, node.id, node) and node.entry in self._pinned
        else:
            current = self._policy.is_current(node, node.entry)
        if not current:
            fail_invariant(f"node {node.id}: its evictable entry is stale or missing from its {self.eviction_policy} "
                           "set")


def _common_prefix_bytes(key: bytes, view: memoryview, start: int, limit: int, page_bytes: int) -> int:
    """Bytes (whole pages) that key[:limit] shares with view[start:start+limit], knowing that the first page
    matches and the whole `limit` does not: bisection whose compares touch only the undecided window, so
    the cost is O(limit) bytes compared, with no copies."""
    lo, hi = 1, limit // page_bytes  # pages: the first lo match, the first hi do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if key.startswith(view[start + lo * page_bytes:start + mid * page_bytes], lo * page_bytes):
            lo = mid
        else:
            hi = mid
    return lo * page_bytes
