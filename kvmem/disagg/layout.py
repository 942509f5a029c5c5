"""What two instances must share for one's KV pages to be the other's, and where a pool keeps its pages.

A page of a pool is, in each stored buffer of each layer, one contiguous run of bytes: buffer b of layer l holds page
p at bytes [p * page_bytes[b], (p + 1) * page_bytes[b]) of `layer_buffers(pool, l)[b]`, in either MHA layout (NHD
buffers are [num_slots, H, D], HND ones [num_pages, H, page_size, D]) and in MLA's [num_slots, 1, kv_dim]. So a
transfer moves a page as one copy per buffer, whatever the layout, provided both sides store pages alike: that is
what `KVLayout` fingerprints, and the handshake refuses a peer whose layout differs in any field.

A hybrid engine (`kvmem.hybrid.HybridKVPool`) has up to three pools, each moved as its own registration: the full
layers' KV pages as above, the window layers' KV pages (the same layout, window slots), and the linear layers' state
slots, which store as pages of one slot: buffer b of linear layer l is [size + 1, ...] (the conv state, then the SSM
state), so slot s is one contiguous run there too. Its layout adds the layer kinds, the window and the state shapes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvmem._torch import torch
from kvmem.hybrid import HybridKVPool, StatePool
from kvmem.kv_pool import MHAKVPool, MLAKVPool
from kvmem.sizing import WINDOW_LAYER_TYPES

Pool = MHAKVPool | MLAKVPool | StatePool  # what a transport registers and moves pages of


@dataclass(frozen=True)
class KVLayout:
    """The fingerprint of a KV pool's pages (and of the model that writes them): equal layouts mean a page copied
    byte for byte from one pool into the other reads back as the same KV.

    model: what the KV belongs to (`engine_layout` writes the architecture and its sizes; "" for a bare pool).
    Weights are not compared: two checkpoints of one architecture pass.
    """

    model: str
    attention: str                 # "mha" or "mla"
    dtype: str                     # the model dtype, e.g. "bfloat16"
    kv_cache_dtype: str            # how the pool stores it ("auto", "fp8_e4m3", "int8", ...)
    layer_num: int
    head_shape: tuple[int, ...]    # MHA: (head_num, head_dim, v_head_dim); MLA: (kv_lora_rank, qk_rope_head_dim)
    layout: str                    # MHA: "NHD" or "HND"; MLA: "NHD"
    quant_group: int | None        # elements per int8/int4 scale (None: one per head, or no scales)
    page_size: int
    page_bytes: tuple[int, ...]    # bytes of one page in each stored buffer of a layer
    # A hybrid engine's: the kind of each model layer (transformers' layer_types; () when every layer is full
    # attention, whose pool the fields above describe), the sliding window, a window layer's page bytes per buffer,
    # and one slot's (conv, SSM) state shapes and dtypes in a linear layer.
    layer_kinds: tuple[str, ...] = ()
    window: int | None = None
    window_page_bytes: tuple[int, ...] = ()
    state_shape: tuple[tuple[int, ...], ...] = ()
    state_dtype: tuple[str, ...] = ()

    @classmethod
    def of_hybrid(cls, pools: HybridKVPool, model: str = "", window: int | None = None) -> KVLayout:
        """The layout of a hybrid engine's pools (`window`: the model's sliding window, for window layers)."""
        if not isinstance(pools, HybridKVPool):
            raise TypeError(f"pools must be a HybridKVPool, got {type(pools).__name__}")
        if (pools.window_pool is None) != (window is None):
            raise ValueError(f"window {window!r} does not go with {'no ' if pools.window_pool is None else ''}window "
                             "pool")
        layout = cls.of(pools.full_pool, model)
        window_bytes = () if pools.window_pool is None else page_bytes(pools.window_pool)
        states = pools.state_pool
        shape = () if states is None else (states.conv_shape, states.ssm_shape)
        dtype = () if states is None else tuple(str(d).removeprefix("torch.") for d in (states.conv_dtype,
                                                                                        states.ssm_dtype))
        return dataclasses.replace(layout, layer_kinds=pools.layer_types, window=window,
                                   window_page_bytes=window_bytes, state_shape=shape, state_dtype=dtype)

    @classmethod
    def of(cls, pool: MHAKVPool | MLAKVPool, model: str = "") -> KVLayout:
        """The layout of `pool` (TypeError for anything else)."""
        if isinstance(pool, MHAKVPool):
            attention, heads, layout, group = "mha", (pool.head_num, pool.head_dim, pool.v_head_dim), pool.layout, \
                pool.quant_group
        elif isinstance(pool, MLAKVPool):
            attention, heads, layout, group = "mla", (pool.kv_lora_rank, pool.qk_rope_head_dim), "NHD", None
        else:
            raise TypeError(f"pool must be an MHAKVPool or MLAKVPool, got {type(pool).__name__}")
        return cls(model, attention, str(pool.dtype).removeprefix("torch."), pool.kv_cache_dtype, pool.layer_num,
                   heads, layout, group, pool.page_size, page_bytes(pool))

    def mismatch(self, other: KVLayout) -> str | None:
        """The first field in which `other` differs, as "name: ours vs theirs", or None when the layouts are equal."""
        for name in _MISMATCH_ORDER:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name} {mine!r} here, {theirs!r} at the peer"
        return None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict) -> KVLayout:
        """The layout a peer sent (`to_dict`), its tuples restored; ValueError naming what is missing or unknown."""
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(fields, dict) or set(fields) != names:
            got = sorted(fields) if isinstance(fields, dict) else type(fields).__name__
            raise ValueError(f"a KV layout needs the fields {sorted(names)}, got {got}")
        return cls(**{name: _tuples(value) for name, value in fields.items()})

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one full-attention page over every buffer of every full layer: what moving a page costs."""
        return sum(self.page_bytes) * self.layer_num

    @property
    def window_bytes_per_page(self) -> int:
        """Bytes of one window page over every window layer (0 without)."""
        return sum(self.window_page_bytes) * sum(kind in WINDOW_LAYER_TYPES for kind in self.layer_kinds)

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's state over every linear layer (0 without)."""
        if not self.state_shape:
            return 0
        slot = sum(math.prod(shape) * getattr(torch, dtype).itemsize
                   for shape, dtype in zip(self.state_shape, self.state_dtype))
        return slot * self.layer_kinds.count("linear_attention")


# What the KV belongs to first (model, then a hybrid model's layer kinds, window and state shapes), then how a pool
# stores it: the first difference named is the one that explains the others.
_MISMATCH_ORDER = ("model", "layer_kinds", "window", "state_shape", "state_dtype") + tuple(
    f.name for f in dataclasses.fields(KVLayout) if f.name not in ("model", "layer_kinds", "window", "state_shape",
                                                                     "state_dtype"))


def _tuples(value):
    """A JSON value with its lists made tuples (the layout's sequences are tuples)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def layer_buffers(pool: Pool, layer_id: int) -> list[torch.Tensor]:
    """Layer `layer_id`'s stored buffers, in the order `KVLayout.page_bytes` lists them: MHA's K, V (then their
    int8/int4 scales), MLA's latent rows, a linear layer's conv and SSM states."""
    if isinstance(pool, StatePool):
        return [pool.conv_states[layer_id], pool.ssm_states[layer_id]]
    if isinstance(pool, MLAKVPool):
        return [pool.kv_buffer[layer_id]]
    scales = [pool.k_scale_buffer[layer_id], pool.v_scale_buffer[layer_id]] if pool.k_scale_buffer else []
    return [pool.k_buffer[layer_id], pool.v_buffer[layer_id], *scales]


def num_pages(pool: Pool) -> int:
    """Pages of a pool, padding page 0 included (a state pool's pages are its slots)."""
    return pool.size + 1 if isinstance(pool, StatePool) else pool.num_pages


def num_layers(pool: Pool) -> int:
    return pool.num_layers if isinstance(pool, StatePool) else pool.layer_num


def page_bytes(pool: Pool) -> tuple[int, ...]:
    """Bytes of one page in each stored buffer of a layer."""
    return tuple(b.numel() * b.element_size() // num_pages(pool) for b in layer_buffers(pool, 0))


def engine_pools(engine) -> tuple[MHAKVPool | MLAKVPool, MHAKVPool | None, StatePool | None]:
    """The pools of a `kvmem.engine.Engine` that a transfer moves: its (full-attention layers') KV pool, and a hybrid
    engine's window pool and state pool (None where it has none)."""
    pool = engine.pool
    if isinstance(pool, HybridKVPool):
        return pool.full_pool, pool.window_pool, pool.state_pool
    return pool, None, None


def engine_layout(engine) -> KVLayout:
    """The layout of a `kvmem.engine.Engine`'s pools, its model named by architecture and sizes."""
    config = engine.model.config
    model = f"{config.model_type} vocab={engine.adapter.vocab_size} hidden={config.hidden_size}"
    if isinstance(engine.pool, HybridKVPool):
        return KVLayout.of_hybrid(engine.pool, model, engine.adapter.window)
    return KVLayout.of(engine.pool, model)
