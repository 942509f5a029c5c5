"""What the optional extras bring, checked without importing them: torch is the heavy one."""

from __future__ import annotations

import importlib.util

INSTALL_TORCH = ("pip install 'kvmem[torch]' (the CPU build: pip install torch --index-url "
                 "https://download.pytorch.org/whl/cpu)")
TORCH_MISSING = f"kvmem's library and the replay's Python engine need torch, which is not installed: {INSTALL_TORCH}"


def torch_available() -> bool:
    """Whether torch can be imported here (found, not imported: importing it takes seconds)."""
    return importlib.util.find_spec("torch") is not None
