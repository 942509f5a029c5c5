"""The memory a hybrid model's layers read and write, as the model side sees it.

- `full`: an MHAKVPool over the full-attention layers (its layer l = the l-th full layer), indexed by the slots
  req_to_token holds (full slots);
- `window`: an MHAKVPool over the sliding-window layers, indexed by window slots: `window_slots(full_slots)`
  translates;
- `states`: a StatePool over the linear-attention layers, one slot per request (`state_slot(req)`).

`OwnHybridMemory` is the engine's own: the window pool as large as the full pool and indexed by the same slots
(window KV is kept as long as full KV), and request state slots it hands out itself.
"""

from __future__ import annotations

import torch

from kvmem._checks import check_int
from kvmem.kv_pool import MHAKVPool
from kvmem.radix_cache import MatchResult, RadixCache
from kvmem.radix_tree import key_bytes


class StatePool:
    """Per-request states of linear-attention layers: conv_states[l] [size + 1, *conv_shape] in the model dtype and
    ssm_states[l] [size + 1, *ssm_shape] float32 (transformers keeps the recurrent state in float32 at any model
    dtype); slot 0 is padding, slots 1..size are handed out by `alloc`."""

    def __init__(self, size: int, layer_num: int, conv_shape: tuple[int, ...], ssm_shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device) -> None:
        self.size = check_int("size", size, minimum=1)
        self.conv_states = [torch.zeros((size + 1, *conv_shape), dtype=dtype, device=device)
                            for _ in range(layer_num)]
        self.ssm_states = [torch.zeros((size + 1, *ssm_shape), dtype=torch.float32, device=device)
                           for _ in range(layer_num)]
        self._free = list(range(size, 0, -1))

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """A free slot, or None when none is left."""
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)


class OwnHybridMemory:
    """Full and window pools and a state pool, with window slots equal to full slots and state slots kept per
    request id."""

    def __init__(self, full: MHAKVPool | None, window: MHAKVPool | None, states: StatePool | None) -> None:
        self.full = full
        self.window = window
        self.states = states
        self._state_of: dict = {}

    def window_slots(self, full_slots: torch.Tensor) -> torch.Tensor:
        return full_slots

    def state_slot(self, req) -> int:
        """The request's state slot, taken at its first call (RuntimeError when the pool has none left)."""
        if self.states is None:
            return 0
        slot = self._state_of.get(req.rid)
        if slot is None:
            slot = self.states.alloc()
            if slot is None:
                raise RuntimeError(f"the state pool's {self.states.size} slots are all held by running requests")
            self._state_of[req.rid] = slot
        return slot

    def release(self, req) -> None:
        """Frees the state slot of a request that finished or was retracted (it restarts from its first token)."""
        slot = self._state_of.pop(req.rid, None)
        if slot is not None:
            self.states.free(slot)


class NoPrefixReuse(RadixCache):
    """A radix cache that matches nothing: a linear-attention model continues a prefix only from the state at its
    end, which this engine's own memory does not keep for cached prefixes."""

    def match_prefix(self, key, namespace: str | None = None) -> MatchResult:
        key_bytes("key", key)
        return MatchResult(self._empty, self._root(namespace))
