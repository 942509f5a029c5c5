"""The parts the queue-based policies (S3-FIFO, ARC, 2Q) are built from: ordered queues of evictable leaves
with their token counts, ghost lists of recently evicted prefixes, and the base class that holds them.

Sizes are tokens, not entries: a node of a radix tree holds anywhere from one page to a whole prompt, and a
queue's share of the cache is a share of its tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from sortedcontainers import SortedList

from kvmem._checks import check_int
from kvmem.eviction.base import EvictionPolicy

if TYPE_CHECKING:
    from kvmem.radix_tree import TreeNode


class Queues:
    """`count` ordered sets of evictable leaves. An entry is a list `[order, node id, node, queue, tokens]`:
    a list, so that a policy can move an entry between queues (a second chance) and the tier's reference to
    it stays valid; ordered by (order, id), smallest first."""

    def __init__(self, count: int) -> None:
        self.sets = [SortedList() for _ in range(count)]
        self.tokens = [0] * count
        self.total = 0
        self.peak = 0  # the most tokens the queues have held: the size a ghost list is measured against

    def add(self, queue: int, order, node: TreeNode) -> list:
        entry = [order, node.id, node, queue, node.num_tokens]
        self.insert(entry)
        return entry

    def insert(self, entry: list) -> None:
        self.sets[entry[3]].add(entry)
        self.tokens[entry[3]] += entry[4]
        self.total += entry[4]
        if self.total > self.peak:
            self.peak = self.total

    def remove(self, entry: list) -> None:
        self.sets[entry[3]].remove(entry)
        self.tokens[entry[3]] -= entry[4]
        self.total -= entry[4]

    def pop_first(self, queue: int) -> list:
        entry = self.sets[queue].pop(0)
        self.tokens[queue] -= entry[4]
        self.total -= entry[4]
        return entry

    def clear(self) -> None:
        for s in self.sets:
            s.clear()
        self.tokens = [0] * len(self.sets)
        self.total = self.peak = 0

    def __len__(self) -> int:
        return sum(len(s) for s in self.sets)

    def holds(self, entry: list) -> bool:
        return entry in self.sets[entry[3]]


class Ghosts:
    """Names of evicted prefixes (see EvictionPolicy._page_key) and their tokens, oldest first, trimmed to a
    token budget on each add. O(1) per operation."""

    def __init__(self) -> None:
        self._names: OrderedDict[int, int] = OrderedDict()
        self.tokens = 0

    def add(self, name: int, tokens: int, budget: float) -> None:
        old = self._names.pop(name, 0)
        self._names[name] = tokens
        self.tokens += tokens - old
        while self.tokens > budget and self._names:
            self.tokens -= self._names.popitem(last=False)[1]

    def take(self, name: int) -> int:
        """The tokens of `name` if it is a ghost (and forgets it), else 0."""
        tokens = self._names.pop(name, 0)
        self.tokens -= tokens
        return tokens

    def clear(self) -> None:
        self._names.clear()
        self.tokens = 0


class QueuedPolicy(EvictionPolicy):
    """What S3-FIFO, ARC and 2Q share: `queues` ordered sets of evictable leaves, `ghosts` ghost lists, and a
    per-node state (a list) that a node keeps while it is internal or locked and that the head of a split
    inherits."""

    def __init__(self, queues: int, ghosts: int) -> None:
        super().__init__()
        self._queues = Queues(check_int("queues", queues, minimum=1))
        self._ghosts = [Ghosts() for _ in range(check_int("ghosts", ghosts, minimum=0))]
        self._state: dict[TreeNode, list] = {}

    def remove(self, node: TreeNode, entry: list) -> None:
        self._queues.remove(entry)

    def evicted(self, node: TreeNode) -> None:
        # A pinned leaf the tier let go once the queues were empty: it never was this policy's victim.
        self._state.pop(node, None)

    def split(self, head: TreeNode, child: TreeNode) -> None:
        state = self._state.get(child)
        if state is not None:
            self._state[head] = list(state)

    def clear(self) -> None:
        self._queues.clear()
        for ghosts in self._ghosts:
            ghosts.clear()
        self._state.clear()

    def __len__(self) -> int:
        return len(self._queues)
