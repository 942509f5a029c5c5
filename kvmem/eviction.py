"""Eviction policies of the radix cache: the order in which unlocked leaves give their slots back.

A policy is a key function of a leaf: the cache keeps its evictable leaves sorted by `(key(node), node.id)`
and pops from the front, so the smallest key is evicted first. Keys are read when a node becomes an
evictable leaf and again whenever the cache changes a field the key may read (access time, hit count,
priority), so a key must depend on nothing else.

Node fields a key may read: `last_access` and `created` (ticks of the cache's logical clock, which
advances once per match_prefix / insert: deterministic, unlike wall time), `hit_count` (how many
match_prefix calls reached the node), `priority` (the highest priority of the requests that inserted
through it) and `num_tokens`.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmem.radix_tree import TreeNode

EvictionKey = Callable[["TreeNode"], Any]

EVICTION_POLICIES: MappingProxyType[str, EvictionKey] = MappingProxyType({
    "lru": lambda node: node.last_access,                      # least recently used first
    "lfu": lambda node: (node.hit_count, node.last_access),    # fewest hits first, then LRU
    "fifo": lambda node: node.created,                         # oldest first (a split keeps its age)
    "priority": lambda node: (node.priority, node.last_access),  # lowest request priority first, then LRU
})


def eviction_key(policy: str | EvictionKey) -> tuple[str, EvictionKey]:
    """(name, key function) of `policy`: one of EVICTION_POLICIES' names, or a key function of its own
    (named after the function)."""
    if callable(policy):
        return getattr(policy, "__name__", type(policy).__name__), policy
    if isinstance(policy, str) and policy.lower() in EVICTION_POLICIES:
        return policy.lower(), EVICTION_POLICIES[policy.lower()]
    raise ValueError(f"eviction_policy must be one of {sorted(EVICTION_POLICIES)} or a key function of a "
                     f"TreeNode, got {policy!r}")
