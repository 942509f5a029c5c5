"""Pins: prefixes a server wants kept (its system prompts), evicted only when nothing unpinned is left.

A pinned prefix's leaf sits in its tree's set of pinned leaves, oldest pin first, instead of its eviction
policy's; pins past the pin budget (pinned tokens, each pin counting its whole prefix) degrade, oldest first, to
ordinary cached prefixes. `PrefixPins` is a part of `RadixTree` (a mixin over its nodes and evictable set).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from kvmem._checks import fail_invariant
from kvmem._index import key_bytes

if TYPE_CHECKING:
    from kvmem.radix_tree import TreeNode


class PrefixPins:
    """RadixTree's pins (see the module docstring)."""

    def _clear_pins(self) -> None:
        self._pinned.clear()
        self._pins: OrderedDict[tuple, tuple[TreeNode, int]] = OrderedDict()  # (namespace, key) -> (node, tokens)
        self._pins_per_node: dict[TreeNode, int] = {}
        self._pinned_tokens = 0
        self._pin_seq = 0

    def pin(self, key, namespace: str | None = None) -> int:
        """Pins the cached prefix of `key` (whole pages, in `namespace`): its leaves go only when nothing
        unpinned is left to evict, so a pin never blocks a request that needs the memory. Pins past the pin
        budget (pinned tokens, each pin counting its whole prefix) degrade, oldest first, to ordinary cached
        prefixes. Pinning a key again refreshes its pin (newest, and as deep as the tree holds now). Returns
        the tokens pinned (0 when nothing of `key` is cached, or the pin alone exceeds the budget)."""
        view = key_bytes("key", key)
        nbytes = len(view) - len(view) % self._page_bytes
        name = (namespace, view[:nbytes].tobytes())
        node = self._pin_target(self._walk_to_node(self._descend(view, nbytes, self._root(namespace))))
        old = self._pins.pop(name, None)
        if old is not None:
            self._drop_pin(*old)
        if node.parent is None:
            return 0
        tokens = node.depth + node.num_tokens
        if tokens > self._pin_budget:  # alone past the budget: it pins nothing, and must cost the other pins nothing
            return 0
        self._pins[name] = (node, tokens)
        self._pins_per_node[node] = self._pins_per_node.get(node, 0) + 1
        self._pinned_tokens += tokens
        self._pin_seq += 1
        self._set_pin(node, self._pin_seq)
        while self._pinned_tokens > self._pin_budget:
            self._drop_pin(*self._pins.popitem(last=False)[1])
        return tokens

    def unpin(self, key, namespace: str | None = None) -> int:
        """Releases the pin of `key` (as given to `pin`); returns the tokens it pinned (0 if it had none:
        never pinned, degraded, or its prefix was evicted)."""
        view = key_bytes("key", key)
        if namespace is not None and not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str or None, got {type(namespace).__name__}")
        record = self._pins.pop((namespace, view[:len(view) - len(view) % self._page_bytes].tobytes()), None)
        if record is None:
            return 0
        self._drop_pin(*record)
        return record[1]

    def pinned_size(self) -> int:
        """Tokens pinned (each pin counting its whole prefix); at most the pin budget."""
        return self._pinned_tokens

    def _pin_target(self, node: TreeNode) -> TreeNode:
        """The node a pin of the prefix root..node marks (a tiered tree: the part its device tier holds)."""
        return node

    def _drop_pin(self, node: TreeNode, tokens: int) -> None:
        self._pinned_tokens -= tokens
        count = self._pins_per_node[node] - 1
        if count:
            self._pins_per_node[node] = count
        else:
            del self._pins_per_node[node]
            self._set_pin(node, 0)

    def _drop_pins_of(self, node: TreeNode) -> None:
        """A pinned leaf is being evicted: its pins go with it (a scan of the pins, which the budget keeps few)."""
        for name in [name for name, (pinned, _) in self._pins.items() if pinned is node]:
            self._pinned_tokens -= self._pins.pop(name)[1]
        del self._pins_per_node[node]
        node.pin = 0

    def _set_pin(self, node: TreeNode, pin: int) -> None:
        if node.entry is None:
            node.pin = pin
            return
        self._remove_evictable(node)
        node.pin = pin
        self._add_evictable(node)

    def _check_pins(self) -> None:
        counts: dict[TreeNode, int] = {}
        tokens = 0
        for node, n in self._pins.values():
            counts[node] = counts.get(node, 0) + 1
            tokens += n
            if not node.pin or n != node.depth + node.num_tokens or node.parent is None:
                fail_invariant(f"pinned node {node.id} is not marked, out of the tree, or not {n} tokens deep")
        if counts != self._pins_per_node or tokens != self._pinned_tokens or tokens > max(self._pin_budget, 0):
            fail_invariant(f"pins: {tokens} tokens on {len(counts)} nodes against counters {self._pinned_tokens} on "
                           f"{len(self._pins_per_node)} (budget {self._pin_budget})")
