"""A hybrid model's memory by layer: which pool, and which of its layers, each model layer reads and writes."""

from __future__ import annotations

from typing import NamedTuple

from kvmem.hybrid.state_pool import StatePool
from kvmem.kv_pool import MHAKVPool
from kvmem.sizing import LAYER_TYPES, WINDOW_LAYER_TYPES


class LayerPool(NamedTuple):
    """Where layer `layer_id`'s memory lives: its `kind` (a kvmem.sizing.LAYER_TYPES name), the `pool`
    (an MHAKVPool, or a StatePool for a linear layer) and its layer `index` there."""

    kind: str
    pool: MHAKVPool | StatePool
    index: int


class HybridKVPool:
    """The pools of a model whose layers are of several kinds.

    layer_types: one kind per model layer ("full_attention", "sliding_attention", "chunked_attention",
        "linear_attention"), as transformers' `config.layer_types`.
    full_pool: the full-attention layers' KV, indexed by full slots (`req_to_token`'s).
    window_pool: the sliding (and chunked) layers' KV, indexed by window slots (`HybridTokenAllocator.window_slots`
        of the full ones); None when there are none.
    state_pool: the linear layers' recurrent states, indexed by state slots; None when there are none.
    Each pool's layer count must be the number of layers of its kind, in model order.

    >>> import torch
    >>> from kvmem import MHAKVPool
    >>> from kvmem.hybrid import HybridKVPool
    >>> kv = lambda layers: MHAKVPool(16, 1, torch.float32, head_num=1, head_dim=4, layer_num=layers)
    >>> pools = HybridKVPool(["sliding_attention", "full_attention"] * 2, kv(2), kv(2))
    >>> pools.layer(3).kind, pools.layer(3).index
    ('full_attention', 1)
    """

    def __init__(self, layer_types, full_pool: MHAKVPool, window_pool: MHAKVPool | None = None,
                 state_pool: StatePool | None = None) -> None:
        if isinstance(layer_types, (str, bytes)) or not isinstance(layer_types, (list, tuple)):
            raise TypeError(f"layer_types must be a list of layer kinds, got {type(layer_types).__name__}")
        kinds = tuple(layer_types)
        bad = next((i for i, kind in enumerate(kinds) if kind not in LAYER_TYPES), None)
        if bad is not None:
            raise ValueError(f"layer_types[{bad}] is {kinds[bad]!r}, not one of {', '.join(LAYER_TYPES)}")
        groups = (("full_attention", "full_pool", full_pool, ("full_attention",), MHAKVPool),
                  ("sliding or chunked", "window_pool", window_pool, WINDOW_LAYER_TYPES, MHAKVPool),
                  ("linear_attention", "state_pool", state_pool, ("linear_attention",), StatePool))
        for what, name, pool, members, kind in groups:
            count = sum(k in members for k in kinds)
            if pool is None:
                if count:
                    raise ValueError(f"layer_types lists {count} {what} layers, but {name} is None")
                continue
            if not isinstance(pool, kind):
                raise TypeError(f"{name} must be a {kind.__name__}, got {type(pool).__name__}")
            layers = pool.layer_num if isinstance(pool, MHAKVPool) else pool.num_layers
            if layers != count:
                raise ValueError(f"layer_types lists {count} {what} layers, but {name} has {layers}")
        if window_pool is not None and window_pool.page_size != full_pool.page_size:
            raise ValueError(f"window_pool's page size {window_pool.page_size} != full_pool's {full_pool.page_size}")
        self.layer_types = kinds
        self.full_pool, self.window_pool, self.state_pool = full_pool, window_pool, state_pool
        seen = {"full": 0, "window": 0, "linear": 0}
        self._layers = []
        for kind in kinds:
            group = "full" if kind == "full_attention" else "linear" if kind == "linear_attention" else "window"
            pool = {"full": full_pool, "window": window_pool, "linear": state_pool}[group]
            self._layers.append(LayerPool(kind, pool, seen[group]))
            seen[group] += 1

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def layer(self, layer_id: int) -> LayerPool:
        """Where model layer `layer_id` keeps its memory."""
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or not 0 <= layer_id < len(self._layers):
            raise IndexError(f"layer_id {layer_id!r} out of range [0, {len(self._layers)})")
        return self._layers[layer_id]
