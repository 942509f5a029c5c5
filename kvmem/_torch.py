"""torch, for the library's modules, or one line that says how to install it.

The library (pools, allocators, the radix cache, the scheduler, kernels, attention, the engine) and the trace
replay's Python engine need torch, the `torch` extra; the replay on the compiled engine does not, so that a
planner's install stays light. Every module that needs torch imports it from here.
"""

from kvmem._extras import TORCH_MISSING

try:
    import torch
except ModuleNotFoundError as e:
    if e.name != "torch":
        raise
    raise ModuleNotFoundError(TORCH_MISSING, name="torch") from None

__all__ = ["torch"]
