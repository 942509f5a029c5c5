"""Choosing between a Triton kernel and its torch fallback, and the argument checks the kernels share.

Rule: Triton runs on CUDA tensors; on CPU tensors it runs only when the kernel was decorated under
`TRITON_INTERPRET=1` (triton reads that variable when `@triton.jit` runs, i.e. when the kernel module is
imported, so the kernel object itself says whether it is interpreted). Everything else uses the torch
fallback. `backend="triton"` / `"torch"` forces a path so tests and benchmarks can compare the two.

Value checks (ranges, alignment) read tensor contents, which costs a device-to-host sync on CUDA; the
kernels therefore check values only when the tensors live on the CPU, and check shapes and dtypes always.
"""

from __future__ import annotations

import numpy as np

from kvmem._checks import check_int
from kvmem._torch import torch

try:  # triton is a dependency, but a broken or absent install should still leave the torch path usable
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = tl = InterpretedFunction = None

BACKENDS = (None, "triton", "torch")


def triton_jit(fn):
    """`triton.jit(fn)`, or None when triton is not importable (the dispatcher then picks torch)."""
    return triton.jit(fn) if triton is not None else None


def use_triton(kernel, device: torch.device, backend: str | None) -> bool:
    """Whether to launch `kernel` for tensors on `device`; raises if `backend="triton"` cannot run there."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    runnable = kernel is not None and (
        device.type == "cuda" or (device.type == "cpu" and isinstance(kernel, InterpretedFunction)))
    if backend == "triton" and not runnable:
        raise RuntimeError(
            f"backend='triton' cannot run on {device} tensors: Triton needs CUDA tensors, or CPU tensors "
            "with TRITON_INTERPRET=1 set before the kernels module is imported")
    return runnable


def check_page_size(page_size) -> int:
    # Page ids and offsets are int32 in FlashInfer's arrays and in the kernels.
    return check_int("page_size", page_size, minimum=1, maximum=2**31 - 1)


def check_index_tensor(name: str, value, dim: int = 1) -> torch.Tensor:
    """Raises unless `value` is an int32/int64 tensor with `dim` dimensions; returns it."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must have dtype int32 or int64, got {value.dtype}")
    if value.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(value.shape)}")
    if value.device.type == "meta":
        raise ValueError(f"{name} is on the 'meta' device, which holds no values")
    # The kernels index 1-D arguments densely (only req_to_token passes its strides).
    if dim == 1 and not value.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got stride {value.stride()}; pass {name}.contiguous()")
    return value


def check_length(name: str, value: torch.Tensor, expected: int, what: str) -> None:
    if len(value) != expected:
        raise ValueError(f"{name} must have {what} ({expected}) entries, got {len(value)}")


def check_same_device(device: torch.device, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device} like the other arguments")


def host_values(t: torch.Tensor) -> np.ndarray:
    """An int64 numpy view of a CPU index tensor. Value checks run in numpy: on tiny arrays its operations
    cost less than torch's dispatch."""
    return t.numpy().astype(np.int64, copy=False)


def first_bad(mask: np.ndarray) -> int:
    """Index of the first True in a 1-D bool array."""
    return int(np.flatnonzero(mask)[0])


def check_rows(req_pool_indices: torch.Tensor, num_rows: int) -> np.ndarray:
    """The host values of req_pool_indices, each checked to be a row of a table with num_rows rows."""
    rows = host_values(req_pool_indices)
    bad = (rows < 0) | (rows >= num_rows)
    if bad.any():
        i = first_bad(bad)
        raise IndexError(f"req_pool_indices[{i}] = {rows[i]} is out of range [0, {num_rows})")
    return rows


def exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    """[n] -> [n] int64 with out[i] = sum(x[:i])."""
    return torch.cumsum(x, 0, dtype=torch.int64) - x
