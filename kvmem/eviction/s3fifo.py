"""S3-FIFO: a small probationary FIFO queue, a main FIFO queue with second chances, and a ghost list.

Source: Juncheng Yang, Yazhuo Zhang, Ziyue Qiu, Yao Yue, K. V. Rashmi, "FIFO queues are all you need for
cache eviction", SOSP 2023. Most objects are used once soon after they arrive ("one-hit wonders"); a short
FIFO queue S lets them go early, and what was reused while in S moves to the main queue M, where an entry that
was reused since it last reached M's head gets another round (frequency capped at 3) instead of going.
Evicted from S, a prefix leaves its name in a ghost list; recomputed while remembered, it enters M directly.

In the tree: queues hold evictable leaves; S's share is measured against the tokens the policy holds (all
evictable tokens), the ghost list's against the most it has held, and `hit_count` (matches reaching a node)
is the access count. A node keeps its queue and its place while it is internal or locked, and takes them up
again when it becomes a leaf. Hits need no re-ranking (FIFO order ignores them), so an access costs nothing
here; each second chance is one re-insertion, O(log n), and a node gets at most `max_freq` of them per hit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmem._checks import check_int, check_number
from kvmem.eviction.queues import QueuedPolicy

if TYPE_CHECKING:
    from kvmem.radix_tree import TreeNode

SMALL, MAIN = 0, 1


class S3FIFO(QueuedPolicy):
    """S3-FIFO over a tier's evictable leaves. `small_ratio`: S's target share of the evictable tokens, in (0, 1)
    (the paper's 10%); `max_freq`: the cap on a node's access count, >= 1 (the paper's 3)."""

    name = "s3fifo"

    def __init__(self, small_ratio: float = 0.1, max_freq: int = 3) -> None:
        if not 0 < check_number("small_ratio", small_ratio) < 1:
            raise ValueError(f"small_ratio must lie in (0, 1), got {small_ratio!r}")
        # Checked here: pop() reads max_freq after taking a victim out of its queue, too late to fail cleanly.
        self.max_freq = check_int("max_freq", max_freq, minimum=1)
        super().__init__(queues=2, ghosts=1)  # state: node -> [queue, hit_count when its count restarted, order]
        self.small_ratio = float(small_ratio)
        self._seq = 0

    def _state_of(self, node: TreeNode) -> list:
        state = self._state.get(node)
        if state is None:
            queue = MAIN if self._ghosts[0].take(self._page_key(node)) else SMALL
            state = self._state[node] = [queue, node.hit_count, self._next()]
        return state

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def add(self, node: TreeNode) -> list:
        queue, _, order = self._state_of(node)
        return self._queues.add(queue, order, node)

    def update(self, node: TreeNode, entry: list) -> list:
        if entry[4] == node.num_tokens:
            return entry  # a hit: FIFO order does not change, the count lives in node.hit_count
        self._queues.remove(entry)  # a split shortened it
        entry[4] = node.num_tokens
        self._queues.insert(entry)
        return entry

    def pop(self) -> TreeNode | None:
        queues = self._queues
        small, main = queues.sets
        while small or main:
            from_small = bool(small) and (not main or queues.tokens[SMALL] >= self.small_ratio * queues.total)
            entry = queues.pop_first(SMALL if from_small else MAIN)
            node = entry[2]
            state = self._state[node]
            freq = min(node.hit_count - state[1], self.max_freq)
            if freq > 0:  # reused since it entered (S) or since its last chance (M): another round in M
                state[0], state[2] = MAIN, self._next()
                state[1] = node.hit_count if from_small else node.hit_count - (freq - 1)
                entry[0], entry[3] = state[2], MAIN
                queues.insert(entry)
                continue
            del self._state[node]
            if from_small:
                self._ghosts[0].add(self._page_key(node), entry[4], (1 - self.small_ratio) * queues.peak)
            return node
        return None

    def is_current(self, node: TreeNode, entry: list) -> bool:
        state = self._state.get(node)
        return (state is not None and entry[2] is node and [entry[3], entry[0]] == [state[0], state[2]]
                and entry[4] == node.num_tokens and self._queues.holds(entry))
