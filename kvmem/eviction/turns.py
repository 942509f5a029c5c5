"""The conversation turns a cache stamps on its nodes, for the policies that rank by them (`tracks_turns`).

A request's turn is inferred once, at its first insert, by the cache's turn-tracking policy
(`EvictionPolicy.request_turn`); the cache then stamps it on every node the request's inserts go through,
each node keeping the highest turn that reached it. The table belongs to the cache and is shared by the
policies of its tiers that track turns, so that a host tier ranks a host-only leaf by the turn its device
tier stamped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmem.radix_tree import TreeNode


class TurnTable:
    """Turns by node (0 for a node never stamped) and by request (None until inferred)."""

    def __init__(self) -> None:
        self._nodes: dict[TreeNode, int] = {}
        self._requests: dict[Any, int] = {}

    def of(self, node: TreeNode) -> int:
        return self._nodes.get(node, 0)

    def stamp(self, node: TreeNode, turn: int) -> None:
        """Raises `node`'s turn to `turn`."""
        if turn > self._nodes.get(node, 0):
            self._nodes[node] = turn

    def stamp_path(self, last: TreeNode, turn: int) -> None:
        """Raises the turns of the nodes root..last to `turn`."""
        if turn:
            while last.parent is not None:
                self.stamp(last, turn)
                last = last.parent

    def split(self, head: TreeNode, child: TreeNode) -> None:
        """A split cut `head` off the front of `child`: it has the turns that went through child."""
        turn = self._nodes.get(child)
        if turn is not None:
            self._nodes[head] = turn

    def forget(self, node: TreeNode) -> None:
        """`node` left the tree."""
        self._nodes.pop(node, None)

    def request(self, req) -> int | None:
        return self._requests.get(req)

    def set_request(self, req, turn: int) -> None:
        self._requests[req] = turn

    def forget_request(self, req) -> None:
        """`req` finished: its later inserts, if any, would be a new request's."""
        self._requests.pop(req, None)

    def clear_nodes(self) -> None:
        """The tree was reset (requests keep the turns they were given)."""
        self._nodes.clear()
