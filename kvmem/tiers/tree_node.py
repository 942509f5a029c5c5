"""The node of the hierarchical cache's tree: device slots, host slots or both."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvmem.radix_tree import TreeNode

if TYPE_CHECKING:
    from kvmem.tiers.backups import Backup

NO_SLOTS = np.empty(0, dtype=np.int64)  # the value of a node that is not on device


class HiTreeNode(TreeNode):
    """A tree node of the hierarchical cache: `value` is its device slots (empty when host-only),
    `host_value` its host slots (None when not backed up), `host_entry` its record in the host-evictable set,
    `device_children` how many of its children are on device, `backup` the backup in flight for it, if any."""

    __slots__ = ("host_value", "host_entry", "device_children", "backup", "stored")

    def __init__(self, key: bytes, value: np.ndarray, parent: TreeNode | None, created: int, id: int) -> None:
        super().__init__(key, value, parent, created, id)
        self.host_value: np.ndarray | None = None
        self.host_entry: tuple | None = None
        self.device_children = 0
        self.backup: Backup | None = None
        self.stored = False  # its pages were handed to the storage tier
