"""What two instances must share for one's KV pages to be the other's, and where a pool keeps its pages.

A page of a pool is, in each stored buffer of each layer, one contiguous run of bytes: buffer b of layer l holds page
p at bytes [p * page_bytes[b], (p + 1) * page_bytes[b]) of `layer_buffers(pool, l)[b]`, in either MHA layout (NHD
buffers are [num_slots, H, D], HND ones [num_pages, H, page_size, D]) and in MLA's [num_slots, 1, kv_dim]. So a
transfer moves a page as one copy per buffer, whatever the layout, provided both sides store pages alike: that is
what `KVLayout` fingerprints, and the handshake refuses a peer whose layout differs in any field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvmem.kv_pool import MHAKVPool, MLAKVPool


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
        page_bytes = tuple(b.numel() * b.element_size() // pool.num_pages for b in layer_buffers(pool, 0))
        return cls(model, attention, str(pool.dtype).removeprefix("torch."), pool.kv_cache_dtype, pool.layer_num,
                   heads, layout, group, pool.page_size, page_bytes)

    def mismatch(self, other: KVLayout) -> str | None:
        """The first field in which `other` differs, as "name: ours vs theirs", or None when the layouts are equal."""
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if mine != theirs:
                return f"{field.name} {mine!r} here, {theirs!r} at the peer"
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
        return cls(**{**fields, "head_shape": tuple(fields["head_shape"]), "page_bytes": tuple(fields["page_bytes"])})

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page over every buffer of every layer: what moving a page costs."""
        return sum(self.page_bytes) * self.layer_num


def layer_buffers(pool: MHAKVPool | MLAKVPool, layer_id: int) -> list[torch.Tensor]:
    """Layer `layer_id`'s stored buffers, in the order `KVLayout.page_bytes` lists them: MHA's K, V (then their
    int8/int4 scales), MLA's latent rows."""
    if isinstance(pool, MLAKVPool):
        return [pool.kv_buffer[layer_id]]
    scales = [pool.k_scale_buffer[layer_id], pool.v_scale_buffer[layer_id]] if pool.k_scale_buffer else []
    return [pool.k_buffer[layer_id], pool.v_buffer[layer_id], *scales]


def engine_layout(engine) -> KVLayout:
    """The layout of a `kvmem.engine.Engine`'s pool, its model named by architecture and sizes."""
    config = engine.model.config
    model = f"{config.model_type} vocab={engine.adapter.vocab_size} hidden={config.hidden_size}"
    return KVLayout.of(engine.pool, model)
