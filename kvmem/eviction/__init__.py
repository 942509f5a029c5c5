"""Eviction policies of the radix cache: which evictable leaf of a tier gives its slots back first.

Every policy implements `EvictionPolicy` (kvmem.eviction.base), which the tree calls at the few points where
a node becomes, stays or stops being an evictable leaf; each call is O(log n) or better and none scans the
tree. `eviction_policy=` takes one of EVICTION_POLICIES' names, a key function of a TreeNode (the smallest
key goes first: a `KeyedPolicy`), or a policy object (one per tier of one cache).

    lru, lfu, fifo, priority   key functions of a node (kvmem.eviction.base)
    s3fifo                     S3-FIFO, SOSP'23 (kvmem.eviction.s3fifo)
    arc                        ARC, FAST'03 (kvmem.eviction.arc)
    2q                         2Q, VLDB'94 (kvmem.eviction.two_queue)
    gdsf                       Greedy-Dual-Size-Frequency, recompute cost by position (kvmem.eviction.gdsf)
    lookahead                  CachedAttention's (ATC'24): what queued requests will match goes last (over
    lookahead+s3fifo           LRU, or over S3-FIFO, or over multiturn) (kvmem.eviction.lookahead)
    lookahead+multiturn
    multiturn                  LRU with a head start per conversation turn, inferred from the tree and ghosts
                               of evicted prefixes (kvmem.eviction.multiturn)
    belady                     the offline optimum: replay only (kvmem.replay.belady), refused here
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

from kvmem.eviction.arc import ARC
from kvmem.eviction.base import EvictionKey, EvictionPolicy, KeyedPolicy, fifo, lfu, lru, priority
from kvmem.eviction.gdsf import GDSF
from kvmem.eviction.lookahead import Lookahead
from kvmem.eviction.multiturn import MultiTurn
from kvmem.eviction.s3fifo import S3FIFO
from kvmem.eviction.two_queue import TwoQ


def _offline_only() -> EvictionPolicy:
    raise ValueError("eviction_policy 'belady' is the offline optimum: it needs every page's next use, which "
                     "only a trace replay knows (kvmem-replay --eviction-policy belady, or "
                     "kvmem.replay.belady.BeladyPolicy over a trace)")


EVICTION_POLICIES: MappingProxyType[str, Callable[[], EvictionPolicy]] = MappingProxyType({
    "lru": lambda: KeyedPolicy(lru, "lru"),
    "lfu": lambda: KeyedPolicy(lfu, "lfu"),
    "fifo": lambda: KeyedPolicy(fifo, "fifo"),
    "priority": lambda: KeyedPolicy(priority, "priority"),
    "s3fifo": S3FIFO,
    "arc": ARC,
    "2q": TwoQ,
    "gdsf": GDSF,
    "lookahead": Lookahead,
    "lookahead+s3fifo": lambda: Lookahead(S3FIFO()),
    "multiturn": MultiTurn,
    "lookahead+multiturn": lambda: Lookahead(MultiTurn()),
    "belady": _offline_only,
})
ONLINE_POLICIES = tuple(name for name in EVICTION_POLICIES if name != "belady")

EvictionPolicySpec = str | EvictionKey | EvictionPolicy


def make_policy(policy: EvictionPolicySpec) -> EvictionPolicy:
    """A policy object for `policy`: a name of EVICTION_POLICIES (a new object each call), a key function of
    a TreeNode (named after the function), or a policy object (returned as is)."""
    if isinstance(policy, EvictionPolicy):
        return policy
    if isinstance(policy, str) and policy.lower() in EVICTION_POLICIES:
        return EVICTION_POLICIES[policy.lower()]()
    if callable(policy) and not isinstance(policy, type):
        return KeyedPolicy(policy)
    raise ValueError(f"eviction_policy must be one of {sorted(EVICTION_POLICIES)}, a key function of a TreeNode "
                     f"or an EvictionPolicy, got {policy!r}")


__all__ = ["ARC", "EVICTION_POLICIES", "GDSF", "ONLINE_POLICIES", "S3FIFO", "EvictionKey", "EvictionPolicy",
           "EvictionPolicySpec", "KeyedPolicy", "Lookahead", "MultiTurn", "TwoQ", "make_policy"]
