"""Lookahead: the prefixes that requests already waiting in the scheduler's queue will match go last.

Source: Bin Gao et al., "Cost-Efficient Large Language Model Serving for Multi-turn Conversations with
CachedAttention", USENIX ATC 2024: the scheduler knows its queue, so the KV a queued request is about to
reuse is worth keeping whatever its recency says (CachedAttention prefetches it into the fast tier and keeps
it from being evicted). The tree walks each queued request's key once, when it is queued (the cost of one
`prefix_len`), and tells the policy the deepest node it will match; that node leaves the base policy's order
for a set of its own, taken only when the base policy has nothing left, until the request is admitted (its
lock protects the path from then on). Marking only that node protects its whole path: its ancestors are not
leaves while it is there.

The tree grows while requests wait (the previous turn of a conversation finishes, a chunk is prefilled), so a
mark follows it: a request whose key goes on past its marked node waits under that node's next page, and a
new leaf there takes the mark over (one dict lookup per leaf, and the pages of the keys it moves along).

It wraps a base policy (LRU by default; any `EvictionPolicy`) that orders everything else, so lookahead
composes with the others. O(log n) per operation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sortedcontainers import SortedList

from kvmem._paging import TOKEN_BYTES
from kvmem.eviction.base import EvictionPolicy, KeyedPolicy, lru

if TYPE_CHECKING:
    from kvmem.radix_tree import RadixTree, TreeNode


class Lookahead(EvictionPolicy):
    """Marked leaves (a waiting request will match down to them) last, least recently used first among them;
    the rest in `base`'s order (an EvictionPolicy that does not look ahead itself and serves no tier yet;
    None: LRU). An entry is `[marked, base entry or marked-set record]`, a list that keeps its identity while the
    node moves between the two."""

    looks_ahead = True

    def __init__(self, base: EvictionPolicy | None = None) -> None:
        if base is not None:
            if not isinstance(base, EvictionPolicy):
                raise TypeError(f"base must be an EvictionPolicy or None, got {type(base).__name__}")
            if base.looks_ahead:  # only this policy hears of waiting requests: a base's own marks would go stale
                raise ValueError(f"base must not look ahead itself, got {base.name!r}")
            if base._tree is not None:
                raise ValueError(f"base: this {base.name!r} policy already orders another tier's leaves")
        super().__init__()
        self.base = KeyedPolicy(lru, "lru") if base is None else base
        self.name = "lookahead" if base is None else f"lookahead+{self.base.name}"
        self._marked = SortedList()  # (last_access, id, node) of marked evictable leaves
        self._entries: dict[TreeNode, list] = {}
        self._expected: dict[TreeNode, int] = {}  # node -> waiting requests that will match down to it
        self._target: dict[Any, TreeNode] = {}    # rid -> the node it marked
        self._keys: dict[Any, memoryview] = {}    # rid -> its match key, while it waits
        self._follow: dict[TreeNode, dict[bytes, set]] = {}  # node -> next page -> rids whose key goes on there
        self._follow_at: dict[Any, tuple[TreeNode, bytes]] = {}

    def bind(self, tree: RadixTree) -> None:
        super().bind(tree)
        self.base.bind(tree)

    @property
    def tracks_turns(self) -> bool:  # type: ignore[override]  # the base policy's (lookahead+multiturn)
        return self.base.tracks_turns

    @property
    def turns(self):
        return self.base.turns

    @turns.setter
    def turns(self, table) -> None:  # the table the cache stamps turns in is the base policy's
        self.base.turns = table

    def request_turn(self, node: TreeNode, rest: Sequence[int], matched: int, prompt_len: int) -> int:
        return self.base.request_turn(node, rest, matched, prompt_len)

    def evicted(self, node: TreeNode) -> None:
        self.base.evicted(node)

    def _place(self, node: TreeNode, entry: list) -> list:
        if node in self._expected:
            entry[0], entry[1] = True, (node.last_access, node.id, node)
            self._marked.add(entry[1])
        else:
            entry[0], entry[1] = False, self.base.add(node)
        return entry

    def _take(self, node: TreeNode, entry: list) -> None:
        if entry[0]:
            self._marked.remove(entry[1])
        else:
            self.base.remove(node, entry[1])

    def add(self, node: TreeNode) -> list:
        if node.parent in self._follow:
            self._grow(node)
        entry = self._entries[node] = self._place(node, [False, None])
        return entry

    def _grow(self, node: TreeNode) -> None:
        """`node` appeared where waiting requests' keys go on from its parent: their marks move down to it."""
        waiting = self._follow[node.parent]
        rids = waiting.pop(node.key[:self._page_bytes], ())
        if not waiting:
            del self._follow[node.parent]
        for rid in rids:
            del self._follow_at[rid]
            self._unmark(rid)
            self._target[rid] = node
            self._expected[node] = self._expected.get(node, 0) + 1  # not in a set yet: add() places it
            self._follow_from(rid, node)

    def _follow_from(self, rid: Any, node: TreeNode) -> None:
        """If rid's key covers `node`'s whole path and goes on by a page, waits for the tree to grow there."""
        key, page = self._keys[rid], self._page_bytes
        start, end = node.depth * TOKEN_BYTES, (node.depth + node.num_tokens) * TOKEN_BYTES
        # startswith, not !=: bytes against a memoryview slice compares by memcmp, while a memoryview's own
        # comparison unpacks item by item. The slice has the edge's length.
        if len(key) < end + page or (node.parent is not None and not node.key.startswith(key[start:end])):
            return
        nxt = key[end:end + page].tobytes()
        self._follow.setdefault(node, {}).setdefault(nxt, set()).add(rid)
        self._follow_at[rid] = (node, nxt)

    def remove(self, node: TreeNode, entry: list) -> None:
        self._take(node, entry)
        del self._entries[node]

    def update(self, node: TreeNode, entry: list) -> list:
        if entry[0] == (node in self._expected) and not entry[0]:
            entry[1] = self.base.update(node, entry[1])
            return entry
        self._take(node, entry)
        return self._place(node, entry)

    def pop(self) -> TreeNode | None:
        node = self.base.pop()
        if node is None:
            if not self._marked:
                return None
            node = self._marked.pop(0)[2]
            del self._expected[node]
        del self._entries[node]
        for rids in self._follow.pop(node, {}).values():
            for rid in rids:
                del self._follow_at[rid]
        return node

    def split(self, head: TreeNode, child: TreeNode) -> None:
        self.base.split(head, child)

    def waiting(self, rid: Any, node: TreeNode, key: memoryview) -> None:
        if rid in self._keys:  # queued again while it waits: its old mark goes
            self.admitted(rid)
        self._keys[rid] = key
        if node.parent is not None:
            self._target[rid] = node
            count = self._expected.get(node, 0)
            self._expected[node] = count + 1
            if count == 0:
                self._rerank(node)
        self._follow_from(rid, node)

    def admitted(self, rid: Any) -> None:
        self.base.admitted(rid)
        self._keys.pop(rid, None)
        at = self._follow_at.pop(rid, None)
        if at is not None:
            waiting = self._follow[at[0]]
            waiting[at[1]].discard(rid)
            if not waiting[at[1]]:
                del waiting[at[1]]
                if not waiting:
                    del self._follow[at[0]]
        self._unmark(rid)

    def _unmark(self, rid: Any) -> None:
        node = self._target.pop(rid, None)
        count = self._expected.get(node)  # None: no mark, or its node was evicted meanwhile
        if count == 1:
            del self._expected[node]
            self._rerank(node)
        elif count is not None:
            self._expected[node] = count - 1

    def _rerank(self, node: TreeNode) -> None:
        entry = self._entries.get(node)
        if entry is not None:
            self.update(node, entry)

    def clear(self) -> None:
        self.base.clear()
        self._marked.clear()
        self._entries.clear()
        self._expected.clear()
        self._target.clear()
        self._keys.clear()
        self._follow.clear()
        self._follow_at.clear()

    def __len__(self) -> int:
        return len(self.base) + len(self._marked)

    def is_current(self, node: TreeNode, entry: list) -> bool:
        if self._entries.get(node) is not entry or entry[0] != (node in self._expected):
            return False
        if entry[0]:
            return entry[1] == (node.last_access, node.id, node) and entry[1] in self._marked
        return self.base.is_current(node, entry[1])
