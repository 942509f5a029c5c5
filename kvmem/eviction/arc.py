"""ARC: an LRU list of what was used once (T1), one of what was used again (T2), a ghost list behind each
(B1, B2), and a target size for T1 that the ghost hits move.

Source: Nimrod Megiddo, Dharmendra S. Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", FAST 2003.
A miss on a name in B1 says T1 was too small (the target p grows), one in B2 that T2 was (p shrinks), each by
the ratio of the ghost lists' sizes; eviction takes T1's LRU leaf while T1 holds more than p, else T2's.

In the tree: sizes are tokens (the variable-size form of ARC), the lists hold evictable leaves, and c (the
cache) is the most tokens the policy has held. A node joins T2 once a match reaches it after it entered, or when it
enters as a ghost of B1 or B2 (a prefix evicted and recomputed). Each operation is O(log n).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmem.eviction.queues import QueuedPolicy

if TYPE_CHECKING:
    from kvmem.radix_tree import TreeNode

RECENT, FREQUENT = 0, 1


class ARC(QueuedPolicy):
    """Adaptive Replacement Cache over a tier's evictable leaves (see the module docstring)."""

    name = "arc"

    def __init__(self) -> None:
        # queues T1, T2 (LRU order: last_access); ghosts B1, B2; state: node -> [hit_count when it entered,
        # entered as a ghost]
        super().__init__(queues=2, ghosts=2)
        self.target = 0.0  # p: T1's target size, tokens

    def _list_of(self, node: TreeNode) -> int:
        state = self._state.get(node)
        if state is None:
            state = self._state[node] = [node.hit_count, self._ghost_hit(node)]
        return FREQUENT if state[1] or node.hit_count > state[0] else RECENT

    def _ghost_hit(self, node: TreeNode) -> bool:
        """Adapts the target to a prefix coming back; True if it was a ghost."""
        name = self._page_key(node)
        b1, b2 = self._ghosts
        c = self._queues.peak
        # The ratio of the ghost lists as they were with the returning prefix in them (FAST'03's delta).
        if b1_tokens := b1.take(name):
            self.target = min(c, self.target + max(1.0, b2.tokens / (b1.tokens + b1_tokens)) * b1_tokens)
            return True
        if b2_tokens := b2.take(name):
            self.target = max(0.0, self.target - max(1.0, b1.tokens / (b2.tokens + b2_tokens)) * b2_tokens)
            return True
        return False

    def add(self, node: TreeNode) -> list:
        return self._queues.add(self._list_of(node), node.last_access, node)

    def pop(self) -> TreeNode | None:
        lists = self._queues
        t1, t2 = lists.sets
        if not t1 and not t2:
            return None
        which = RECENT if t1 and (not t2 or lists.tokens[RECENT] > self.target) else FREQUENT
        entry = lists.pop_first(which)
        node = entry[2]
        del self._state[node]
        self._ghosts[which].add(self._page_key(node), entry[4], lists.peak)
        return node

    def clear(self) -> None:
        super().clear()
        self.target = 0.0

    def is_current(self, node: TreeNode, entry: list) -> bool:
        return (node in self._state and entry[2] is node and entry[3] == self._list_of(node)
                and entry[0] == node.last_access and entry[4] == node.num_tokens and self._queues.holds(entry))
