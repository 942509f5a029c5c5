"""Index arguments (slots, lengths, rows) as host int64 numpy arrays: the form kvmem's host bookkeeping
works in (see kvmem/allocator.py for why numpy, not torch)."""

from __future__ import annotations

from array import array

import numpy as np

from kvmem._torch import torch


def as_index_array(name: str, value) -> np.ndarray:
    """A 1-D int64 numpy view (no copy when possible) of an integer tensor, array or sequence."""
    if type(value) is torch.Tensor and value.dtype is torch.int64 and value.is_cpu and value.dim() == 1:
        return value.numpy()  # the common case, in half the time of the checks below (they read .device)
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got dtype {value.dtype}")
        if value.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
        if value.device.type == "meta":
            raise ValueError(f"{name} is on the 'meta' device, which holds no values")
        if value.device.type != "cpu":
            value = value.cpu()
        arr = value.numpy()
    else:
        if isinstance(value, (bytes, bytearray, str)):
            raise TypeError(f"{name} must hold integers, got {type(value).__name__}")
        arr = np.asarray(value)
        if arr.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr if arr.dtype == np.int64 else arr.astype(np.int64)


def key_bytes(name: str, key) -> memoryview:
    """A byte view of `key` as native int64 token ids: zero-copy for an `array("q")` or a memoryview of one,
    one C-speed conversion for a list or tuple, a cast for an integer tensor or numpy array."""
    if isinstance(key, (bytes, bytearray, str)):
        raise TypeError(f"{name} must be a sequence of int token ids, got {type(key).__name__}")
    if isinstance(key, array) and key.typecode == "q":
        buf = key
    elif isinstance(key, memoryview) and key.format == "q" and key.ndim == 1:
        buf = key  # a slice of an int64 array: zero-copy, unlike slicing the array itself
    elif isinstance(key, (torch.Tensor, np.ndarray)):
        buf = np.ascontiguousarray(as_index_array(name, key))
    else:
        try:
            buf = array("q", key)
        except TypeError as e:
            raise TypeError(f"{name} must be a sequence of int token ids, got {type(key).__name__} ({e})") from None
        except OverflowError:
            raise ValueError(f"{name} holds a token id outside int64") from None
    return memoryview(buf).cast("B")
