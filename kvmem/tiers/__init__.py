"""Tiers under the device cache: host memory (`HostKVPool`, `HiRadixCache`)."""

from kvmem.tiers.hiradix_cache import WRITE_POLICIES, HiRadixCache, TierStats
from kvmem.tiers.host_pool import HOST_LAYOUTS, HostKVPool, HostSlotPool, Transfer

__all__ = ["HOST_LAYOUTS", "WRITE_POLICIES", "HiRadixCache", "HostKVPool", "HostSlotPool", "TierStats", "Transfer"]
