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

In the tree: a node's H is set when it becomes an evictable leaf and each time it is reached as one (H uses
the inflation of that moment), so a prefix whose branches were just evicted competes from the current L with
the frequency it earned. O(log n) per operation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmem.eviction.base import KeyedPolicy

if TYPE_CHECKING:
    from kvmem.radix_tree import TreeNode

ATTENTION_CROSSOVER = 32768  # tokens; an 8B Llama's linear and attention prefill FLOPs per token meet near 30k


class GDSF(KeyedPolicy):
    """GDSF over a tier's evictable leaves. `attention_crossover`: the position (tokens) at which a token's
    attention costs as much as its linear layers (see the module docstring)."""

    def __init__(self, attention_crossover: float = ATTENTION_CROSSOVER) -> None:
        if not attention_crossover > 0:
            raise ValueError(f"attention_crossover must be > 0, got {attention_crossover!r}")
        super().__init__(self._priority, "gdsf")
        self.attention_crossover = float(attention_crossover)
        self.inflation = 0.0  # L

    def _priority(self, node: TreeNode) -> float:
        n = node.num_tokens
        return self.inflation + (node.hit_count + 1) * (1.0 + (node.depth + n / 2) / self.attention_crossover)

    def pop(self) -> TreeNode | None:
        if not self._leaves:
            return None
        entry = self._leaves.pop(0)
        self.inflation = max(self.inflation, entry[0])
        return entry[2]

    def clear(self) -> None:
        super().clear()
        self.inflation = 0.0

    def is_current(self, node: TreeNode, entry: tuple) -> bool:
        # H was computed with the inflation of its moment: check the entry, not a recomputed key.
        return entry[1] == node.id and entry[2] is node and entry in self._leaves
