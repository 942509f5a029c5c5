"""The eviction-policy interface, and the policies that are a key function of a node.

A tier of the radix tree (the device tier of any cache, the host tier of a HiRadixCache) hands its policy
each node the moment the node becomes an evictable leaf (unlocked, with no child in that tier) and takes it
back when it stops being one; `evict` asks the policy for victims one at a time. So a policy only ever sees
leaves, and the tree never scans: every call below is O(log n) or better in the leaves it holds.

    add(node) -> entry        the node became an evictable leaf; the tier keeps the entry on the node
    remove(node, entry)       it stopped being one (locked, gained a child, reset)
    update(node, entry)       its fields changed while it is one (a match or insert reached it, or a split
                              shortened it): -> its new entry
    pop() -> node | None      the next victim, taken out of the set (None when the set is empty)
    split(head, child)        a split cut `head` off the front of `child` (state to copy; head is internal)
    waiting(rid, node, key)   the scheduler queued request `rid`, whose match key is `key` and whose prefix
                              ends at `node` in this tier (a root: nothing cached); only if `looks_ahead`
    admitted(rid)             it was admitted (its lock protects its prefix now)
    evicted(node)             the tier lets `node` go (the policy's victim, or a pinned leaf); a device tier
                              over a host tier may keep it there as host-only
    request_turn(node, rest, matched, prompt_len) -> turn
                              a request that matched `matched` tokens down to `node` (its device prefix),
                              its prompt going on with `rest`, inserts its first new tokens: its conversation
                              turn, which the cache stamps on the nodes it inserts in its `turns` table
                              (`kvmem.eviction.turns`, set by the cache); only if `tracks_turns`

Node fields a policy may read: `last_access` and `created` (ticks of the tree's logical clock, which advances
once per match_prefix / insert: deterministic, unlike wall time), `hit_count` (how many match_prefix calls
reached the node), `priority` (the highest priority of the requests that inserted through it), `depth`
(tokens on the path above it) and `num_tokens`; a policy that `tracks_turns` reads a node's conversation turn
from its `turns` table. The tree updates them along the whole path of an access, but
re-ranks only the path's last node when it is an evictable leaf (no other node on the path is one), so a
policy must not rank a leaf by what changes on its ancestors.

A policy object serves one tier of one cache (`bind` refuses a second): most keep per-node state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from sortedcontainers import SortedList

from kvmem._paging import TOKEN_BYTES

if TYPE_CHECKING:
    from kvmem.eviction.turns import TurnTable
    from kvmem.radix_tree import RadixTree, TreeNode

EvictionKey = Callable[["TreeNode"], Any]


class EvictionPolicy(ABC):
    """One tier's evictable leaves and the order in which they go (see the module docstring)."""

    name = "policy"
    looks_ahead = False  # True: the tree walks each queued request's key to tell `waiting` where it ends
    tracks_turns = False  # True: the cache asks `request_turn` for each request and stamps it on its nodes
    turns: TurnTable | None = None  # where: the cache's table, set by the cache when `tracks_turns`

    def __init__(self) -> None:
        self._tree: RadixTree | None = None
        self._page_bytes = 0

    def bind(self, tree: RadixTree) -> None:
        """Called once by the tier the policy serves."""
        if self._tree is not None:
            raise ValueError(f"this {self.name!r} policy already orders another tier's leaves: give each tier "
                             "of each cache a policy object of its own")
        self._tree = tree
        self._page_bytes = tree.page_size * TOKEN_BYTES  # a page of token ids, as node keys hold them

    @abstractmethod
    def add(self, node: TreeNode) -> Any:
        """`node` became an evictable leaf: returns its entry (not None), which the tier keeps."""

    @abstractmethod
    def remove(self, node: TreeNode, entry: Any) -> None:
        """`node` (holding `entry`) is no longer an evictable leaf."""

    def update(self, node: TreeNode, entry: Any) -> Any:
        """`node`'s fields changed while it is an evictable leaf: returns its new entry."""
        self.remove(node, entry)
        return self.add(node)

    @abstractmethod
    def pop(self) -> TreeNode | None:
        """Takes the next victim out of the set and returns it (None when the set is empty); the tier then
        evicts it. A policy may reorder its own entries first (second chances), never drop one silently."""

    def split(self, head: TreeNode, child: TreeNode) -> None:
        """A split made `head` (internal, new) the front part of `child`; `update` follows if child is a leaf."""

    def waiting(self, rid: Any, node: TreeNode, key: memoryview) -> None:
        """Request `rid` joined the scheduler's waiting queue; its match key is `key` (int64 token ids as bytes)
        and the tier holds its prefix down to `node` (a root when nothing is cached; a node the key goes only
        partly into when the match ends inside an edge). Called only when `looks_ahead`."""

    def admitted(self, rid: Any) -> None:
        """Request `rid` was admitted: its prefix is locked now."""

    def evicted(self, node: TreeNode) -> None:
        """The tier lets `node` go: the victim `pop` returned, or a pinned leaf once `pop` had none (a host
        tier's policy that tracks turns also hears of device leaves that leave with no host copy)."""

    def request_turn(self, node: TreeNode, rest: Sequence[int], matched: int, prompt_len: int) -> int:
        """The conversation turn of a request (0: a first prompt) whose admission matched `matched` of its
        `prompt_len` prompt tokens down to `node` (a root when nothing; with a host tier, the device part of the
        match), and whose tokens go on with `rest` (int64 token ids, a memoryview or array: at least a page,
        and the rest of its prompt). Called only when `tracks_turns`."""
        return 0

    @abstractmethod
    def clear(self) -> None:
        """Forgets every entry and all state (the tier was reset)."""

    @abstractmethod
    def __len__(self) -> int:
        """Entries held: the tier's evictable leaves."""

    @abstractmethod
    def is_current(self, node: TreeNode, entry: Any) -> bool:
        """Whether `entry` is `node`'s entry as the policy ranks it now (for check_invariants)."""

    def _page_key(self, node: TreeNode) -> int:
        """A name for `node`'s place in the tree that outlives it (its parent and first page), for ghost lists:
        a prefix evicted and recomputed comes back under the same parent with the same first page."""
        return place_key(node.parent, node.key[:self._page_bytes])


def place_key(parent: TreeNode, first_page: bytes) -> int:
    """The name `_page_key` gives a node under `parent` whose first page is `first_page` (int64 token ids as
    bytes): what a request looks up for the place where its match stops."""
    return hash((parent.id, first_page))


class KeyedPolicy(EvictionPolicy):
    """Evicts the leaf with the smallest `key(node)` first (ties: the older node). The key is read when the
    node becomes an evictable leaf and whenever the tree changes a field it may read."""

    def __init__(self, key: EvictionKey, name: str | None = None) -> None:
        if not callable(key):
            raise TypeError(f"key must be a function of a TreeNode, got {type(key).__name__}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str or None, got {type(name).__name__}")
        super().__init__()
        self.key = key
        self.name = name or getattr(key, "__name__", type(key).__name__)
        self._leaves = SortedList()

    def add(self, node: TreeNode) -> tuple:
        entry = (self.key(node), node.id, node)
        self._leaves.add(entry)
        return entry

    def remove(self, node: TreeNode, entry: tuple) -> None:
        self._leaves.remove(entry)

    def update(self, node: TreeNode, entry: tuple) -> tuple:
        leaves = self._leaves
        leaves.remove(entry)
        entry = (self.key(node), node.id, node)
        leaves.add(entry)
        return entry

    def pop(self) -> TreeNode | None:
        return self._leaves.pop(0)[2] if self._leaves else None

    def clear(self) -> None:
        self._leaves.clear()

    def __len__(self) -> int:
        return len(self._leaves)

    def is_current(self, node: TreeNode, entry: tuple) -> bool:
        return entry == (self.key(node), node.id, node) and entry in self._leaves


def lru(node: TreeNode):
    """Least recently used first."""
    return node.last_access


def lfu(node: TreeNode):
    """Fewest hits first, then least recently used."""
    return node.hit_count, node.last_access


def fifo(node: TreeNode):
    """Oldest insert first (a split keeps its age)."""
    return node.created


def priority(node: TreeNode):
    """Lowest request priority first, then least recently used."""
    return node.priority, node.last_access
