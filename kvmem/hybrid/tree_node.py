"""The node of the hybrid cache's tree: the full-attention slots (`value`, as every node) and each component's own
fields."""

from __future__ import annotations

import numpy as np

from kvmem.radix_tree import TreeNode


class HybridTreeNode(TreeNode):
    """A tree node of `HybridRadixCache`.

    Window component: `window_live` (True: every token of the node has its window KV; False: a tombstone, full KV
    only), `window_lock` (requests whose window tail covers the node), `window_entry` (its record in the window
    LRU, None when not there: a tombstone or window-locked), `window_tick` (the clock tick the LRU ranks it by) and
    `window_tail` (the window tail eviction kept of a longer node: it ranks after every other node).
    State component: `state` (the state slot of the prefix ending at the node's end, 0 = none), `state_lock`
    (requests that matched the node), `state_entry` and `state_tick` (its record and rank in the state LRU).
    """

    __slots__ = ("window_live", "window_lock", "window_entry", "window_tick", "window_tail", "state", "state_lock",
                 "state_entry", "state_tick")

    def __init__(self, key: bytes, value: np.ndarray, parent: TreeNode | None, created: int, id: int) -> None:
        super().__init__(key, value, parent, created, id)
        self.window_live = True
        self.window_lock = 0
        self.window_entry: tuple | None = None
        self.window_tick = created
        self.window_tail = False
        self.state = 0
        self.state_lock = 0
        self.state_entry: tuple | None = None
        self.state_tick = created
