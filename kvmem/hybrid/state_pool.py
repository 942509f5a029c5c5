"""The recurrent states of linear-attention layers (Mamba-style, gated DeltaNet): one slot per request, or per
prefix the radix cache keeps a state for.

A linear layer summarises everything before a position in a fixed-size state: a short causal conv's last inputs and
an SSM matrix. A request holds one slot while it runs (written in place by every forward); a cached prefix's state is
a slot of its own, which a request that matches the prefix copies into its slot before running (copy on write: the
cached state is never written). Slots come from the pool's own allocator, slot 0 being padding as in the KV pools.
`StateSlotPool` is the same slots without tensors, for simulations that only account for them (the replay).
"""

from __future__ import annotations

import math

import numpy as np

from kvmem._checks import check_host_bytes, check_int
from kvmem._device import check_device
from kvmem._index import as_index_array
from kvmem._torch import torch
from kvmem.allocator import TokenAllocator


class StatePool:
    """Conv and SSM states of `num_layers` linear-attention layers for slots 1..size (slot 0 is padding).

    conv_states[l]: [size + 1, *conv_shape] `conv_dtype` (transformers: [conv_dim, kernel], the model dtype);
    ssm_states[l]: [size + 1, *ssm_shape] `ssm_dtype` (transformers: [value heads, key dim, value dim], float32).
    Shapes and dtypes are the model's; buffers start zeroed. `allocator` hands out the slots.

    >>> import torch
    >>> from kvmem.hybrid import StatePool
    >>> pool = StatePool(4, num_layers=2, conv_shape=(8, 4), ssm_shape=(2, 4, 4), conv_dtype=torch.bfloat16)
    >>> a, b = pool.allocator.alloc(2).tolist()
    >>> pool.ssm_states[0][a] += 1
    >>> pool.copy(torch.tensor([a]), torch.tensor([b]))      # b starts from a's state
    >>> bool(pool.ssm_states[0][b].eq(1).all()), pool.bytes_per_slot
    (True, 384)
    """

    def __init__(self, size: int, num_layers: int, conv_shape: tuple[int, ...], ssm_shape: tuple[int, ...],
                 conv_dtype: torch.dtype, ssm_dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        size = check_int("size", size, minimum=1)
        num_layers = check_int("num_layers", num_layers, minimum=1)
        conv_shape = _check_shape("conv_shape", conv_shape)
        ssm_shape = _check_shape("ssm_shape", ssm_shape)
        for name, dtype in (("conv_dtype", conv_dtype), ("ssm_dtype", ssm_dtype)):
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"{name} must be a torch.dtype, got {dtype!r}")
        self.device = torch.empty(0, device=check_device(device)).device
        self.size = size
        self.num_layers = num_layers
        self.conv_shape, self.ssm_shape = conv_shape, ssm_shape
        self.conv_dtype, self.ssm_dtype = conv_dtype, ssm_dtype
        self.bytes_per_slot = num_layers * (math.prod(conv_shape) * conv_dtype.itemsize +
                                            math.prod(ssm_shape) * ssm_dtype.itemsize)
        if self.device.type == "cpu":
            check_host_bytes(f"a state pool of {size} slots", (size + 1) * self.bytes_per_slot)
        self.allocator = TokenAllocator(size, device=self.device)
        self.conv_states = [torch.zeros((size + 1, *conv_shape), dtype=conv_dtype, device=self.device)
                            for _ in range(num_layers)]
        self.ssm_states = [torch.zeros((size + 1, *ssm_shape), dtype=ssm_dtype, device=self.device)
                           for _ in range(num_layers)]

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copies every layer's states of slots `src` into slots `dst` ([n] integer tensors, dst distinct)."""
        src_np, dst_np = self._check_slots("src", src), self._check_slots("dst", dst)
        if len(src_np) != len(dst_np):
            raise ValueError(f"src and dst must have the same length, got {len(src_np)} and {len(dst_np)}")
        if len(np.unique(dst_np)) != len(dst_np):
            raise ValueError("dst lists a slot more than once")
        self.copy_slots(src_np, dst_np)

    def zero(self, slots: torch.Tensor) -> None:
        """Zeroes every layer's states of `slots` ([n] integer tensor): a request that starts from no prefix."""
        self.zero_slots(self._check_slots("slots", slots))

    def copy_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Trusted: copy of host int64 slots (in range, dst distinct)."""
        s, d = self._index(src), self._index(dst)
        for buf in self.conv_states + self.ssm_states:
            buf[d] = buf[s]

    def zero_slots(self, slots: np.ndarray) -> None:
        """Trusted: zero of host int64 slots (in range)."""
        index = self._index(slots)
        for buf in self.conv_states + self.ssm_states:
            buf[index] = 0

    def mem_usage_bytes(self) -> int:
        """Bytes held by all buffers, padding slot included."""
        return sum(t.numel() * t.element_size() for t in self.conv_states + self.ssm_states)

    def _index(self, slots: np.ndarray) -> torch.Tensor:
        index = torch.from_numpy(slots)
        return index if self.device.type == "cpu" else index.to(self.device)

    def _check_slots(self, name: str, slots) -> np.ndarray:
        if not isinstance(slots, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of slots, got {type(slots).__name__}")
        arr = as_index_array(name, slots)
        if len(arr) and (arr.min() < 1 or arr.max() > self.size):
            bad = arr.min() if arr.min() < 1 else arr.max()
            raise IndexError(f"{name} holds slot {bad}, out of range [1, {self.size}]")
        return arr


class StateSlotPool:
    """`size` state slots with no tensors behind them: copies and zeroes move nothing. For simulations (the replay)
    that account for where states would be, not for the states."""

    def __init__(self, size: int) -> None:
        self.size = check_int("size", size, minimum=1)
        self.allocator = TokenAllocator(self.size)

    def copy_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        pass

    def zero_slots(self, slots: np.ndarray) -> None:
        pass


def _check_shape(name: str, shape) -> tuple[int, ...]:
    if not isinstance(shape, (tuple, list)) or not shape:
        raise ValueError(f"{name} must be a non-empty tuple of ints, got {shape!r}")
    return tuple(check_int(f"{name}[{i}]", d, minimum=1) for i, d in enumerate(shape))
