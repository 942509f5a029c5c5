"""GDSF: Greedy-Dual-Size-Frequency, with the cost of recomputing a node's KV as its cost.

Source: Ludmila Cherkasova, "Improving WWW Proxies Performance with Greedy-Dual-Size-Frequency Caching
Policy", HP Labs report HPL-98-69R1, 1998 (after Cao and Irani's GreedyDual-Size, USITS 1997). Each object
has a priority H = L + frequency x cost / size; the lowest H goes first and L, the inflation, becomes the H of
each victim, so what is not used again ages out as L rises past it.

Cost: what a miss costs is the prefill of the node's tokens, and a token's prefill grows with its position:
its linear layers cost the same anywhere, its attention grows with the tokens before it (per token and
layer, about 4 x hidden x position FLOPs against 2 x parameters / layers for the linear part; the two are
equal at the "attention crossover", about 30k tokens for an 8B Llama and 53k for a 70B one). So a node of n
tokens at depth d costs n x (1 + (d + n/2) / crossover), and cost / size is 1 + (d + n/2) / crossover: a page
deep in a long prefix is worth more than one of a short prefix. Frequency is hit_count + 1.

In the tree: a node's H uses the inflation of its last access (the tree stamps every node on an access's path
with the clock tick; the policy keeps the inflation's history by tick), so a prefix that becomes a leaf when
its branches are evicted competes with the priority its last use earned, not a fresh one. The history holds
one entry per tick at which evictions raised L, pruned (amortized O(1)) to what the evictable leaves need; a
node last used before the oldest kept entry is read at that entry. O(log n) per operation.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING

from kvmem._checks import check_number
from kvmem.eviction.base import KeyedPolicy

if TYPE_CHECKING:
    from kvmem.radix_tree import TreeNode

ATTENTION_CROSSOVER = 32768  # tokens; an 8B Llama's linear and attention prefill FLOPs per token meet near 30k


class GDSF(KeyedPolicy):
    """GDSF over a tier's evictable leaves. `attention_crossover`: the position (tokens) at which a token's
    attention costs as much as its linear layers (see the module docstring)."""

    def __init__(self, attention_crossover: float = ATTENTION_CROSSOVER) -> None:
        attention_crossover = check_number("attention_crossover", attention_crossover, 0, allow_minimum=False)
        super().__init__(self._priority, "gdsf")
        self.attention_crossover = attention_crossover
        self.inflation = 0.0  # L, now
        self._ticks: list[int] = []     # clock ticks at which evictions raised L ...
        self._levels: list[float] = []  # ... and L after them

    def _priority(self, node: TreeNode) -> float:
        n = node.num_tokens
        return self._inflation_at(node.last_access) + (node.hit_count + 1) * (
            1.0 + (node.depth + n / 2) / self.attention_crossover)

    def _inflation_at(self, tick: int) -> float:
        """L when the access of `tick` happened: the last level recorded at an earlier tick (the clock advances
        before an access stamps its path, so evictions during tick t came after its access)."""
        i = bisect_left(self._ticks, tick)
        return self._levels[i - 1] if i else (self._levels[0] if self._pruned else 0.0)

    def pop(self) -> TreeNode | None:
        if not self._leaves:
            return None
        entry = self._leaves.pop(0)
        if entry[0] > self.inflation:
            self.inflation = entry[0]
            tick = self._tree.clock
            if self._ticks and self._ticks[-1] == tick:
                self._levels[-1] = entry[0]
            else:
                self._ticks.append(tick)
                self._levels.append(entry[0])
                if len(self._ticks) > self._prune_at:
                    self._prune()
        return entry[2]

    _pruned = False
    _min_history = 1024  # entries kept before the first prune
    _prune_at = _min_history

    def _prune(self) -> None:
        """Drops the history no evictable leaf reads: entries before the one in force at the oldest access. The
        next prune waits until the history has doubled, so the scan of the leaves is amortized O(1) a pop."""
        oldest = min(entry[2].last_access for entry in self._leaves) if self._leaves else self._tree.clock
        keep = max(0, bisect_left(self._ticks, oldest) - 1)
        if keep:
            del self._ticks[:keep], self._levels[:keep]
            self._pruned = True
        self._prune_at = max(self._min_history, 2 * len(self._ticks), 2 * len(self._leaves))

    def clear(self) -> None:
        super().clear()
        self.inflation = 0.0
        self._ticks.clear()
        self._levels.clear()
        self._pruned = False
        self._prune_at = self._min_history
