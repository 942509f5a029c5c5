"""2Q: new entries wait in a FIFO queue (A1in); only a prefix that comes back after leaving it, while its name
is still in the ghost queue (A1out), joins the LRU main queue (Am).

Source: Theodore Johnson, Dennis Shasha, "2Q: A Low Overhead High Performance Buffer Management Replacement
Algorithm", VLDB 1994 (the full version, with Kin = 25% and Kout = 50% of the cache). Re-references while in
A1in do not promote (they are correlated: the same scan or request); a return after A1in has let the entry go
shows a reuse distance longer than A1in's, which is what Am keeps.

In the tree: the queues hold evictable leaves and their shares are measured against the tokens the policy
holds (A1out's against the most it has held). A node keeps its queue while it is internal or locked. Each
operation is O(log n).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmem._checks import check_number
from kvmem.eviction.queues import QueuedPolicy

if TYPE_CHECKING:
    from kvmem.radix_tree import TreeNode

A1IN, AM = 0, 1


class TwoQ(QueuedPolicy):
    """Full 2Q over a tier's evictable leaves. `kin`: A1in's share of the evictable tokens, in (0, 1); `kout`:
    A1out's (ghost) budget as a share of them, > 0."""

    name = "2q"

    def __init__(self, kin: float = 0.25, kout: float = 0.5) -> None:
        if not 0 < check_number("kin", kin) < 1:
            raise ValueError(f"kin must lie in (0, 1), got {kin!r}")
        kout = check_number("kout", kout, 0, allow_minimum=False)
        super().__init__(queues=2, ghosts=1)  # state: node -> [queue, FIFO order]
        self.kin, self.kout = float(kin), kout
        self._seq = 0

    def _state_of(self, node: TreeNode) -> list:
        state = self._state.get(node)
        if state is None:
            self._seq += 1
            state = self._state[node] = [AM if self._ghosts[0].take(self._page_key(node)) else A1IN, self._seq]
        return state

    def _order(self, node: TreeNode, state: list):
        return node.last_access if state[0] == AM else state[1]

    def add(self, node: TreeNode) -> list:
        state = self._state_of(node)
        return self._queues.add(state[0], self._order(node, state), node)

    def update(self, node: TreeNode, entry: list) -> list:
        if entry[3] == A1IN and entry[4] == node.num_tokens:
            return entry  # a hit in A1in changes nothing
        self._queues.remove(entry)
        return self.add(node)

    def pop(self) -> TreeNode | None:
        queues = self._queues
        a1in, am = queues.sets
        if not a1in and not am:
            return None
        from_a1in = bool(a1in) and (not am or queues.tokens[A1IN] > self.kin * queues.total)
        entry = queues.pop_first(A1IN if from_a1in else AM)
        node = entry[2]
        del self._state[node]
        if from_a1in:
            self._ghosts[0].add(self._page_key(node), entry[4], self.kout * queues.peak)
        return node

    def is_current(self, node: TreeNode, entry: list) -> bool:
        state = self._state.get(node)
        return (state is not None and entry[2] is node and entry[3] == state[0]
                and entry[0] == self._order(node, state) and entry[4] == node.num_tokens and self._queues.holds(entry))
