"""Belady's offline optimum for a trace replay: evict the leaf whose next use is farthest in the future.

Source: L. A. Belady, "A study of replacement algorithms for a virtual-storage computer", IBM Systems Journal
5(2), 1966 (MIN: with the future known, evicting what is needed last minimizes misses). MIN is optimal for pages
of one size, each hit worth one page; here a leaf holds any number of pages and a hit is a matched prefix, so
the rule is a near-optimal reference, not a proven bound: on the Mooncake traces no online policy comes near
it, but on tiny hand-made traces (a few requests, one running) an online policy can beat it, and gap_closed
is then negative or None. No cache can run it, since it needs the future; a replay has the whole trace, so it
gives the reference that every practical policy is measured against. Hence
`kvmem.RadixCache(eviction_policy="belady")` refuses, and only the replay builds a `BeladyPolicy`, over a
`FutureIndex` of its trace.

A node's next use is the first request, in arrival order, that has not been admitted yet (a queued request
counts: it is future use, and so does a retracted one queued again) and whose match key covers the node's
first page. Evicting a node frees all of it,
and its first page is the part the soonest request needs. Leaves with no future use go first, least recently
used first; ties break by node id, so the order is deterministic for a given trace.

How next uses are found, without holding the trace's tokens: `FutureIndex` is a compacted trie of every
request's match key (the prompt minus its last token, as the Scheduler matches it) whose edges point into the
trace (request, start, end), so a Mooncake trace's tokens are regenerated from its block ids on demand. Trie
nodes number the requests below them in DFS order, so "the requests whose key passes here" is a contiguous
slice, and its first unadmitted arrival is one numpy min. Each cache node's place in the trie (the end of its
path) is computed once, from its parent's, and dropped when the node is evicted.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
from sortedcontainers import SortedList

from kvmem.eviction import EvictionPolicy
from kvmem.radix_tree import TreeNode

if TYPE_CHECKING:
    from kvmem.replay.config import ReplayConfig

NEVER = 1 << 62  # the next use of what no future request needs


class _TrieNode:
    __slots__ = ("ref", "start", "end", "children", "requests", "lo", "hi")

    def __init__(self, ref: int, start: int, end: int) -> None:
        self.ref, self.start, self.end = ref, start, end  # edge tokens: key(ref)[start:end]
        self.children: dict[int, _TrieNode] = {}
        self.requests: list[int] = []  # requests whose key ends here
        self.lo = self.hi = 0  # DFS slots of the requests below


Position = tuple[_TrieNode, int]  # a trie node and how many of its edge tokens the path has covered


class FutureIndex:
    """Which requests of a trace will match which prefixes, and which of them are still to come.

    `requests[i].input_ids` are request i's prompt tokens; `order` lists the request indices in arrival order
    (the replay's): a permutation of range(len(requests)), else ValueError. A request is future use until
    `admit(i)`.
    """

    def __init__(self, requests: Sequence, order: Sequence[int]) -> None:
        self._requests = requests
        self.rank = _ranks("order", order, len(requests))
        self._key = lru_cache(maxsize=256)(self._load_key)
        self.root = _TrieNode(-1, 0, 0)
        for i in range(len(requests)):
            self._insert(i)
        self._slot = np.empty(len(requests), dtype=np.int64)
        self._next = np.empty(len(requests), dtype=np.int64)  # per DFS slot: its request's rank, or NEVER
        self._number()

    def _load_key(self, i: int) -> np.ndarray:
        return np.asarray(self._requests[i].input_ids)[:-1]

    def _edge(self, node: _TrieNode) -> np.ndarray:
        return self._key(node.ref)[node.start:node.end]

    def _insert(self, i: int) -> None:
        key = self._key(i)
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(int(key[pos]))
            if child is None:
                node.children[int(key[pos])] = node = _TrieNode(i, pos, len(key))
                break
            edge = self._edge(child)
            n = min(len(edge), len(key) - pos)
            differ = np.flatnonzero(edge[:n] != key[pos:pos + n])
            common = int(differ[0]) if len(differ) else n
            if common < len(edge):  # split the edge where the key leaves it (or ends)
                head = _TrieNode(child.ref, child.start, child.start + common)
                head.children[int(edge[common])] = child
                child.start += common
                node.children[int(key[pos])] = head
                child = head
            node, pos = child, pos + common
        node.requests.append(i)

    def _number(self) -> None:
        slot = 0
        stack: list[tuple[_TrieNode, bool]] = [(self.root, False)]
        while stack:
            node, done = stack.pop()
            if done:
                node.hi = slot
                continue
            node.lo = slot
            for i in node.requests:
                self._slot[i] = slot
                self._next[slot] = self.rank[i]
                slot += 1
            stack.append((node, True))
            stack.extend((child, False) for child in node.children.values())

    def admit(self, i: int) -> int:
        """Request i is no longer future use; returns its arrival rank. IndexError for an i not in the trace."""
        i = self._check_request(i)
        self._next[self._slot[i]] = NEVER
        return int(self.rank[i])

    def readmit(self, i: int) -> bool:
        """Request i is future use again (retracted, queued again); False if it already was. IndexError for an
        i not in the trace."""
        slot = self._slot[self._check_request(i)]
        if self._next[slot] != NEVER:
            return False
        self._next[slot] = self.rank[i]
        return True

    def _check_request(self, i) -> int:
        # numpy would read request -1 as the trace's last one
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"request id must be a trace index (an int), got {type(i).__name__} {i!r}")
        if not 0 <= i < len(self.rank):
            raise IndexError(f"request id {i} is not a trace index (the trace has {len(self.rank)} requests)")
        return int(i)

    def advance(self, pos: Position | None, tokens: np.ndarray) -> Position | None:
        """The place `tokens` further down from `pos` (None: no request's key goes there)."""
        if pos is None:
            return None
        node, covered = pos
        i, n = 0, len(tokens)
        while i < n:
            if covered == node.end - node.start:
                node = node.children.get(int(tokens[i]))
                if node is None:
                    return None
                covered = 0
            edge = self._edge(node)[covered:]
            m = min(len(edge), n - i)
            if not np.array_equal(edge[:m], tokens[i:i + m]):
                return None
            covered += m
            i += m
        return node, covered

    def next_use(self, pos: Position | None) -> int:
        """The arrival rank of the first request still to come whose key passes `pos` (NEVER if none)."""
        if pos is None:
            return NEVER
        node = pos[0]
        return int(self._next[node.lo:node.hi].min()) if node.hi > node.lo else NEVER


class BeladyPolicy(EvictionPolicy):
    """Belady's MIN over one tier of a replay's cache (see the module docstring). Request ids must be the
    trace indices that `index` was built with (the replay's are)."""

    name = "belady"
    looks_ahead = True  # to hear of a retracted request queued again, and of the node its prefix ends at

    def __init__(self, index: FutureIndex) -> None:
        if not isinstance(index, FutureIndex):
            raise TypeError(f"index must be the trace's FutureIndex, got {type(index).__name__}")
        super().__init__()
        self._index = index
        self._leaves = SortedList()  # entries [-next use, last_access, id, node]: lists, re-ranked in place
        self._entries: dict[TreeNode, list] = {}
        self._by_use: dict[int, set[TreeNode]] = {}
        self._ends: dict[TreeNode, Position | None] = {}

    def _end(self, node: TreeNode) -> Position | None:
        """Where the path root..node ends in the trie, from the nearest ancestor whose end is known."""
        path = []
        while node.parent is not None and node not in self._ends:
            path.append(node)
            node = node.parent
        pos = self._ends[node] if node.parent is not None else (self._index.root, 0)
        for node in reversed(path):
            pos = self._ends[node] = self._index.advance(pos, np.frombuffer(node.key, dtype=np.int64))
        return pos

    def _next_use(self, node: TreeNode) -> int:
        first_page = np.frombuffer(node.key[:self._page_bytes], dtype=np.int64)
        return self._index.next_use(self._index.advance(self._end(node.parent), first_page))

    def _place(self, node: TreeNode, entry: list) -> list:
        use = self._next_use(node)
        entry[0], entry[1] = -use, node.last_access
        self._leaves.add(entry)
        self._by_use.setdefault(use, set()).add(node)
        return entry

    def add(self, node: TreeNode) -> list:
        entry = self._entries[node] = self._place(node, [0, 0, node.id, node])
        return entry

    def remove(self, node: TreeNode, entry: list) -> None:
        self._leaves.remove(entry)
        del self._entries[node]
        self._forget_use(-entry[0], node)

    def update(self, node: TreeNode, entry: list) -> list:
        self._leaves.remove(entry)
        self._forget_use(-entry[0], node)
        return self._place(node, entry)

    def _forget_use(self, use: int, node: TreeNode) -> None:
        nodes = self._by_use[use]
        nodes.discard(node)
        if not nodes:
            del self._by_use[use]

    def pop(self) -> TreeNode | None:
        if not self._leaves:
            return None
        entry = self._leaves.pop(0)
        node = entry[3]
        del self._entries[node]
        self._forget_use(-entry[0], node)
        self._ends.pop(node, None)
        return node

    def admitted(self, rid: Any) -> None:
        for node in self._by_use.pop(self._index.admit(rid), ()):
            entry = self._entries[node]
            self._leaves.remove(entry)
            self._place(node, entry)

    def waiting(self, rid: Any, node: TreeNode, key: memoryview) -> None:
        # A new request is future use already; a retracted one is again, and needs its prefix soon.
        if self._index.readmit(rid) and node in self._entries:
            self.update(node, self._entries[node])

    def clear(self) -> None:
        self._leaves.clear()
        self._entries.clear()
        self._by_use.clear()
        self._ends.clear()

    def __len__(self) -> int:
        return len(self._leaves)

    def is_current(self, node: TreeNode, entry: list) -> bool:
        return (self._entries.get(node) is entry and entry[:2] == [-self._next_use(node), node.last_access]
                and entry in self._leaves)


def _ranks(name: str, order: Sequence[int], n: int) -> np.ndarray:
    """[n] int64: each request's position in `order`, which must list 0..n-1 once each."""
    try:
        order = np.asarray(order)
    except (TypeError, ValueError):
        order = None
    if order is None or order.ndim != 1 or (order.size and order.dtype.kind not in "iu"):
        raise TypeError(f"{name} must be a sequence of request indices (ints)")
    order = order.astype(np.int64, copy=False)
    if len(order) != n or not np.array_equal(np.sort(order), np.arange(n)):
        raise ValueError(f"{name} must list each of the {n} requests' indices 0..{n - 1} once (a permutation), got "
                         f"{len(order)} indices")
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    return rank


def oracle_policies(requests: Sequence, order: Sequence[int], config: ReplayConfig) -> dict:
    """The policy objects a replay of `config` hands its cache: Belady's, over a FutureIndex of `requests`, for
    each tier when `config.eviction_policy` is "belady"; nothing otherwise (the cache builds its own)."""
    if config.eviction_policy != "belady":
        return {}
    index = FutureIndex(requests, order)
    policies = {"eviction_policy": BeladyPolicy(index)}
    if config.host_capacity_tokens is not None:
        policies["host_eviction_policy"] = BeladyPolicy(index)
    return policies
