"""Eviction policies of the radix cache: the order in which unlocked leaves give their slots back.

A policy only says how to rank one leaf (`sort_key`); the cache keeps its evictable leaves sorted by
`(sort_key(node), node.id)` and pops from the front, so the smallest key is evicted first. Keys are read
when a node becomes an evictable leaf and again whenever the cache changes a field the key may read
(access time, hit count, priority), so a policy must depend on nothing else.

Node fields a key may read: `last_access` and `created` (ticks of the cache's logical clock, which
advances once per match_prefix / insert: deterministic, unlike wall time), `hit_count` (how many
match_prefix calls reached the node) and `priority` (the highest priority of the requests that inserted
through it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmem.radix_cache import TreeNode


class EvictionPolicy:
    """Base class: subclasses set `name` and define `sort_key` (smaller is evicted first)."""

    name = ""

    def sort_key(self, node: TreeNode):
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def sort_key(self, node: TreeNode) -> int:
        return node.last_access


class LFUPolicy(EvictionPolicy):
    """Fewest prefix hits first; least recently used among equals."""

    name = "lfu"

    def sort_key(self, node: TreeNode) -> tuple[int, int]:
        return node.hit_count, node.last_access


class FIFOPolicy(EvictionPolicy):
    """Oldest first, however often it is used. A node split off another keeps the original's age."""

    name = "fifo"

    def sort_key(self, node: TreeNode) -> int:
        return node.created


class PriorityPolicy(EvictionPolicy):
    """Lowest request priority first; least recently used among equals."""

    name = "priority"

    def sort_key(self, node: TreeNode) -> tuple[int, int]:
        return node.priority, node.last_access


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    p.name: p for p in (LRUPolicy, LFUPolicy, FIFOPolicy, PriorityPolicy)
}


def get_eviction_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """The policy named `policy` ("lru", "lfu", "fifo", "priority"), or `policy` itself if it is one."""
    if isinstance(policy, EvictionPolicy):
        return policy
    if not isinstance(policy, str) or policy.lower() not in EVICTION_POLICIES:
        raise ValueError(f"eviction_policy must be one of {sorted(EVICTION_POLICIES)} or an EvictionPolicy, "
                         f"got {policy!r}")
    return EVICTION_POLICIES[policy.lower()]()
