"""kvmem: KV-cache memory management for LLM serving, in SGLang's vocabulary."""

from kvmem.allocator import AllocatorState, PagedTokenAllocator, TokenAllocator
from kvmem.batch import ForwardMode, Req, ReqStatus, ScheduleBatch
from kvmem.kv_pool import MHAKVPool, MLAKVPool
from kvmem.radix_cache import MatchResult, RadixCache, TreeNode
from kvmem.req_to_token import ReqToTokenPool
from kvmem.scheduler import Scheduler, SchedulerConfig
from kvmem.tiers import HiRadixCache, HostKVPool
from kvmem.timing import PhaseTimer

__all__ = [
    "AllocatorState",
    "ForwardMode",
    "HiRadixCache",
    "HostKVPool",
    "MHAKVPool",
    "MLAKVPool",
    "MatchResult",
    "PagedTokenAllocator",
    "PhaseTimer",
    "RadixCache",
    "Req",
    "ReqStatus",
    "ReqToTokenPool",
    "ScheduleBatch",
    "Scheduler",
    "SchedulerConfig",
    "TokenAllocator",
    "TreeNode",
]
