"""Hybrid models: sliding-window and linear-attention (Mamba-style) layers beside full attention.

`HybridTokenAllocator` pairs a window slot with every full slot; `StatePool` holds the linear layers' recurrent
states; `HybridKVPool` routes each layer to its pool; `HybridRadixCache` is the radix cache whose nodes carry each
kind's memory. `kvmem.sizing.HybridConfig` describes a model's layer kinds and `kvmem.sizing.hybrid_capacity` sizes
the pools for a budget. See docs/hybrid.md.
"""

from kvmem.hybrid.allocator import HybridAllocatorState, HybridTokenAllocator
from kvmem.hybrid.cache import HybridAdmission, HybridRadixCache
from kvmem.hybrid.kv_pool import HybridKVPool
from kvmem.hybrid.state_pool import StatePool, StateSlotPool
from kvmem.hybrid.tree_node import HybridTreeNode

__all__ = ["HybridAdmission", "HybridAllocatorState", "HybridKVPool", "HybridRadixCache", "HybridTokenAllocator",
           "HybridTreeNode", "StatePool", "StateSlotPool"]
