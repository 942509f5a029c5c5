"""kvmem: KV-cache memory management for LLM serving, in SGLang's vocabulary.

The library's classes need torch (the `torch` extra); they are imported when first named, so that the trace
replay on the compiled engine (`kvmem.replay`) runs on an install without torch.
"""

from __future__ import annotations

import importlib

# name -> the module that defines it
_EXPORTS = {
    "AllocatorState": "kvmem.allocator",
    "PagedTokenAllocator": "kvmem.allocator",
    "TokenAllocator": "kvmem.allocator",
    "ForwardMode": "kvmem.batch",
    "Req": "kvmem.batch",
    "ReqStatus": "kvmem.batch",
    "ScheduleBatch": "kvmem.batch",
    "MHAKVPool": "kvmem.kv_pool",
    "MLAKVPool": "kvmem.kv_pool",
    "MatchResult": "kvmem.radix_cache",
    "RadixCache": "kvmem.radix_cache",
    "TreeNode": "kvmem.radix_cache",
    "ReqToTokenPool": "kvmem.req_to_token",
    "Scheduler": "kvmem.scheduler",
    "SchedulerConfig": "kvmem.scheduler",
    "HiRadixCache": "kvmem.tiers",
    "HostKVPool": "kvmem.tiers",
    "PhaseTimer": "kvmem.timing",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvmem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
