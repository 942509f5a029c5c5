"""OpenPPL's `dynamic_batching.MultiHeadCacheAttention` over kvmem's MHA pool.

The operator writes the current K/V of every sequence into the cache (quantized with per-group scales when
quant_bit is 8 or 4) and attends each query over its sequence's past + current keys, read back from the
cache. Sequences are ragged: `seqstarts` [B + 1] (queries), `kvstarts` [B + 1] (keys), `start_pos` [B] (where
the current tokens start, so kv_len = start_pos + seq_len), and `cachestarts` says where position p of
sequence b lives in the cache's MaxT axis:

    cache_mode 0 (offset): cachestarts[b] + p          cachestarts [B]
    cache_mode 1 (table):  cachestarts[kvstarts[b] + p]  cachestarts [kvstarts[B]]

Table mode is FlashInfer's page_size-1 layout under other names: seqstarts = qo_indptr, kvstarts = kv_indptr,
cachestarts = kv_indices, start_pos = prefix_lens, so a ScheduleBatch feeds it directly.

The cache is either a kvmem `MHAKVPool` (its own storage; cache_layout is then ignored) or OpenPPL's tensors,
which `openppl_cache_pool` wraps as a pool whose buffers are views of them, no copy, for every layout:

    layout  cache                 one layer's K (or V), as kvmem stores it
    0       (MaxT, L, 2, H, Dh)   cache[:, l, 0]     [MaxT, H, Dh]           NHD, token stride L*2*H*Dh
    1       (L, MaxT, 2, H, Dh)   cache[l, :, 0]     [MaxT, H, Dh]           NHD, token stride 2*H*Dh
    2       (L, H, MaxT, 2, Dh)   cache[l, :, :, 0]  [H, MaxT, Dh] -> HND pages of one token
    3       (2, L, H, MaxT, Dh)   cache[0, l]        [H, MaxT, Dh] -> HND pages of one token

`scale` has the cache's layout with Dh / quant_group in the last axis. What kvmem's own storage cannot be: a
single OpenPPL tensor. MHAKVPool allocates K and V (and each layer) separately, so no strided view gives them
the shared `2` (or `L`) axis; OpenPPL's layouts are therefore served by building the pool over OpenPPL's
tensors, not the other way round.

Differences from OpenPPL, by necessity of sharing kvmem's storage: scales must be float32 (kvmem's quantization
bound needs it, see kvmem.kv_pool); int4 packs two values per byte, element 2i in the low nibble (cache last
dim Dh / 2, int8 or uint8); the quantized values are kvmem's (scale = absmax / 127 or / 7 per group, round to
nearest). The current tokens are attended through the cache, i.e. after quantization, like the past ones.
"""

from __future__ import annotations

import math

import numpy as np

from kvmem._checks import check_int
from kvmem._torch import torch
from kvmem.kv_pool import MHAKVPool

CACHE_MODES = (0, 1)
CACHE_LAYOUTS = (0, 1, 2, 3)
_QUANT = {0: "auto", 8: "int8", 4: "int4"}


class _ViewedMHAKVPool(MHAKVPool):
    """An MHAKVPool whose per-layer buffers are given views instead of fresh allocations."""

    def __init__(self, views: list[tuple[str, list[torch.Tensor]]], **kwargs) -> None:
        self._views = iter(views)  # consumed in MHAKVPool.__init__'s order: K, V, K scales, V scales
        super().__init__(**kwargs)
        del self._views

    def _alloc(self, last_dim: int, dtype: torch.dtype) -> list[torch.Tensor]:
        name, bufs = next(self._views)
        if bufs[0].shape[-1] != last_dim or bufs[0].dtype != dtype:
            raise ValueError(f"{name} must have last dim {last_dim} and dtype {dtype} for this pool, got "
                             f"{bufs[0].shape[-1]} and {bufs[0].dtype}")
        return bufs


def _layer_views(t: torch.Tensor, cache_layout: int, num_layer: int, which: int) -> tuple[list[torch.Tensor], str]:
    """K (which=0) or V (which=1) of every layer of an OpenPPL tensor, as kvmem buffers, and their layout."""
    if cache_layout == 0:
        return [t[:, layer, which] for layer in range(num_layer)], "NHD"
    if cache_layout == 1:
        return [t[layer, :, which] for layer in range(num_layer)], "NHD"
    heads_major = [t[layer, :, :, which] if cache_layout == 2 else t[which, layer] for layer in range(num_layer)]
    # [H, MaxT, D] -> [MaxT pages, H, 1 token, D]: HND pages of size 1.
    return [x.transpose(0, 1).unsqueeze(2) for x in heads_major], "HND"


_SHAPES = {0: "(MaxT, L, 2, H, D)", 1: "(L, MaxT, 2, H, D)", 2: "(L, H, MaxT, 2, D)", 3: "(2, L, H, MaxT, D)"}


def openppl_cache_pool(cache: torch.Tensor, scale: torch.Tensor | None = None, *, cache_layout: int = 0,
                       num_layer: int, num_kv_heads: int, head_dim: int, quant_bit: int = 0,
                       quant_group: int = 8) -> MHAKVPool:
    """An MHAKVPool (page_size 1, slots 0..MaxT-1) over OpenPPL's `cache` and `scale` tensors, no copy.

    cache: the layout's 5-D shape (see the module docstring) with D = head_dim (float16/bfloat16/float32
    when quant_bit is 0), head_dim (int8, quant_bit 8) or head_dim / 2 (int8/uint8 packed, quant_bit 4).
    scale: float32, the same layout with head_dim / quant_group in the last axis; required iff quant_bit.
    Writes through the pool land in these tensors.
    """
    check_int("cache_layout", cache_layout, minimum=0, maximum=3)
    check_int("num_layer", num_layer, minimum=1)
    if quant_bit not in _QUANT:
        raise ValueError(f"quant_bit must be one of {tuple(_QUANT)}, got {quant_bit!r}")
    if not isinstance(cache, torch.Tensor) or cache.dim() != 5:
        raise ValueError(f"cache must be a 5-D tensor {_SHAPES[cache_layout]} for cache_layout {cache_layout}")
    max_t_axis, layer_axis, kv_axis, head_axis = {0: (0, 1, 2, 3), 1: (1, 0, 2, 3), 2: (2, 0, 3, 1),
                                                  3: (3, 1, 0, 2)}[cache_layout]
    packing = 2 if quant_bit == 4 else 1
    want = {max_t_axis: cache.shape[max_t_axis], layer_axis: num_layer, kv_axis: 2, head_axis: num_kv_heads,
            4: head_dim // packing}
    shape = tuple(want[i] for i in range(5))
    if tuple(cache.shape) != shape:
        raise ValueError(f"cache has shape {tuple(cache.shape)}; cache_layout {cache_layout} "
                         f"{_SHAPES[cache_layout]} needs {shape}")
    kv_cache_dtype = _QUANT[quant_bit]
    if quant_bit == 4:
        cache = cache.view(torch.uint8)
    views = [("cache (K)", _layer_views(cache, cache_layout, num_layer, 0)[0]),
             ("cache (V)", _layer_views(cache, cache_layout, num_layer, 1)[0])]
    if quant_bit:
        if scale is None:
            raise ValueError(f"scale is required when quant_bit is {quant_bit}")
        if scale.dtype != torch.float32:
            raise TypeError(f"scale must be float32 (kvmem's quantization bound needs it), got {scale.dtype}")
        groups = {**want, 4: head_dim // quant_group if head_dim % quant_group == 0 else -1}
        scale_shape = tuple(groups[i] for i in range(5))
        if tuple(scale.shape) != scale_shape:
            raise ValueError(f"scale has shape {tuple(scale.shape)}, needs {scale_shape} (the cache's layout with "
                             f"head_dim / quant_group = {head_dim} / {quant_group} in the last axis)")
        views += [("scale (K)", _layer_views(scale, cache_layout, num_layer, 0)[0]),
                  ("scale (V)", _layer_views(scale, cache_layout, num_layer, 1)[0])]
        dtype = torch.float32  # the dtype K/V are written and read in; the storage is the quantized one
    else:
        if scale is not None:
            raise ValueError("scale must be None when quant_bit is 0")
        dtype = cache.dtype
    layout = _layer_views(cache, cache_layout, 1, 0)[1]
    max_t = cache.shape[max_t_axis]
    if max_t < 2:
        raise ValueError(f"cache must hold at least 2 tokens (MaxT), got {max_t}")
    return _ViewedMHAKVPool(views, size=max_t - 1, page_size=1, dtype=dtype, head_num=num_kv_heads,
                            head_dim=head_dim, layer_num=num_layer, device=cache.device, layout=layout,
                            kv_cache_dtype=kv_cache_dtype, quant_group=quant_group if quant_bit else None)


class MultiHeadCacheAttention:
    """OpenPPL's fused KV-cache write + attention, over a kvmem MHAKVPool or OpenPPL's cache tensors.

    Attributes as OpenPPL names them: num_heads, head_dim, is_causal, num_kv_heads (0: num_heads), num_layer,
    layer_idx, quant_bit (0, 8, 4), quant_group, cache_mode (0 offset, 1 table), cache_layout (0..3).
    Softmax scale 1 / sqrt(head_dim). A plain torch implementation (loops over sequences): any device.
    """

    def __init__(self, num_heads: int, head_dim: int, *, is_causal: bool = True, num_kv_heads: int = 0,
                 num_layer: int = 1, layer_idx: int = 0, quant_bit: int = 0, quant_group: int = 8,
                 cache_mode: int = 0, cache_layout: int = 0) -> None:
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.head_dim = check_int("head_dim", head_dim, minimum=1)
        self.num_kv_heads = check_int("num_kv_heads", num_kv_heads, minimum=0) or num_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        self.num_layer = check_int("num_layer", num_layer, minimum=1)
        self.layer_idx = check_int("layer_idx", layer_idx, minimum=0, maximum=num_layer - 1)
        if quant_bit not in _QUANT:
            raise ValueError(f"quant_bit must be one of {tuple(_QUANT)}, got {quant_bit!r}")
        self.quant_bit = quant_bit
        self.quant_group = check_int("quant_group", quant_group, minimum=1)
        if quant_bit and head_dim % quant_group:
            raise ValueError(f"quant_group {quant_group} must divide head_dim {head_dim}")
        self.cache_mode = check_int("cache_mode", cache_mode, minimum=0, maximum=1)
        self.cache_layout = check_int("cache_layout", cache_layout, minimum=0, maximum=3)
        self.is_causal = bool(is_causal)

    def __call__(self, query: torch.Tensor, current_key: torch.Tensor, current_value: torch.Tensor,
                 seqstarts: torch.Tensor, kvstarts: torch.Tensor, cachestarts: torch.Tensor, start_pos: torch.Tensor,
                 decoding_batches: int, max_seqlen: int, max_kvlen: int, cache: torch.Tensor | MHAKVPool,
                 scale: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """attn_output [seqstarts[B], num_heads, head_dim] in query's dtype; `cache` (and `scale`) are written.

        query [seqstarts[B], num_heads, head_dim]; current_key / current_value [seqstarts[B], num_kv_heads,
        head_dim]; seqstarts, kvstarts [B + 1], start_pos [B], cachestarts [B] or [kvstarts[B]] (int64 or
        int32, read on the host). The first `decoding_batches` sequences get no causal mask; the others, when
        is_causal, see keys up to their own position (query t of sequence b sits at start_pos[b] + t).
        attn_mask: additive (floating point), [num_heads, seqstarts[B], kvstarts[B]] or [seqstarts[B],
        kvstarts[B]], applied per sequence block on top of the causal mask. Raises ValueError/TypeError naming
        the argument for inconsistent inputs, before anything is written.
        """
        pool = self._pool(cache, scale, query.dtype)
        seq, kv, start = _host("seqstarts", seqstarts), _host("kvstarts", kvstarts), _host("start_pos", start_pos)
        b = len(seq) - 1
        kv_indices, out_cache_loc = self._cache_locations(seq, kv, start, cachestarts, pool)
        check_int("decoding_batches", decoding_batches, minimum=0, maximum=b)
        seq_lens, kv_lens = np.diff(seq), np.diff(kv)
        for name, value, actual in (("max_seqlen", max_seqlen, seq_lens), ("max_kvlen", max_kvlen, kv_lens)):
            if check_int(name, value, minimum=0) != (int(actual.max()) if b else 0):
                raise ValueError(f"{name} {value} must equal the longest sequence, {int(actual.max()) if b else 0}")
        n, sum_kv = int(seq[-1]), int(kv[-1])
        for name, t, heads in (("query", query, self.num_heads), ("current_key", current_key, self.num_kv_heads),
                               ("current_value", current_value, self.num_kv_heads)):
            if tuple(t.shape) != (n, heads, self.head_dim):
                raise ValueError(f"{name} has shape {tuple(t.shape)}, needs ({n}, {heads}, {self.head_dim})")
        if attn_mask is not None:
            if not isinstance(attn_mask, torch.Tensor) or not attn_mask.dtype.is_floating_point:
                # A bool mask means keep/drop in SDPA; added here it would shift scores by 0/1.
                got = attn_mask.dtype if isinstance(attn_mask, torch.Tensor) else type(attn_mask).__name__
                raise TypeError(f"attn_mask must be an additive floating-point tensor, got {got}")
            if tuple(attn_mask.shape) not in ((self.num_heads, n, sum_kv), (n, sum_kv)):
                raise ValueError(f"attn_mask has shape {tuple(attn_mask.shape)}, needs [{self.num_heads}, {n}, "
                                 f"{sum_kv}] or [{n}, {sum_kv}]")
        pool.set_kv_buffer(self.layer_idx, out_cache_loc.to(pool.device), current_key.to(pool.dtype),
                           current_value.to(pool.dtype))
        keys, values = pool.read_kv(self.layer_idx, kv_indices.to(pool.device))
        return self._attend(query, keys, values, seq, kv, start, decoding_batches, attn_mask)

    def _pool(self, cache, scale, dtype: torch.dtype) -> MHAKVPool:
        if isinstance(cache, MHAKVPool):
            pool = cache
            if (pool.head_num, pool.head_dim, pool.layer_num) != (self.num_kv_heads, self.head_dim, self.num_layer):
                raise ValueError(f"cache pool has {pool.head_num} heads of dim {pool.head_dim} in {pool.layer_num} "
                                 f"layers; this operator needs {self.num_kv_heads}, {self.head_dim}, {self.num_layer}")
            if pool.kv_cache_dtype != _QUANT[self.quant_bit]:
                raise ValueError(f"cache pool stores {pool.kv_cache_dtype!r}, quant_bit {self.quant_bit} needs "
                                 f"{_QUANT[self.quant_bit]!r}")
        else:
            pool = openppl_cache_pool(cache, scale, cache_layout=self.cache_layout, num_layer=self.num_layer,
                                      num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                      quant_bit=self.quant_bit, quant_group=self.quant_group)
        if not self.quant_bit and pool.dtype != dtype:
            raise TypeError(f"an unquantized cache must have query's dtype {dtype}, got {pool.dtype}")
        return pool

    def _cache_locations(self, seq, kv, start, cachestarts, pool) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots of every key, kvstarts-ordered; slots of the current tokens, seqstarts-ordered), int64."""
        b = len(seq) - 1
        if b < 0 or len(kv) != b + 1 or len(start) != b:
            raise ValueError(f"seqstarts, kvstarts need B + 1 entries and start_pos B; got {len(seq)}, {len(kv)}, "
                             f"{len(start)}")
        seq_lens, kv_lens = np.diff(seq), np.diff(kv)
        if seq[0] != 0 or kv[0] != 0 or (seq_lens < 0).any() or (kv_lens < 0).any():
            raise ValueError("seqstarts and kvstarts must start at 0 and not decrease")
        if (start < 0).any() or (start + seq_lens != kv_lens).any():
            i = int(np.flatnonzero((start < 0) | (start + seq_lens != kv_lens))[0])
            raise ValueError(f"sequence {i}: start_pos {start[i]} + seq_len {seq_lens[i]} must equal its kv length "
                             f"{kv_lens[i]}")
        table = _host("cachestarts", cachestarts)
        if self.cache_mode == 1:
            if len(table) != kv[-1]:
                raise ValueError(f"cache_mode 1: cachestarts needs kvstarts[B] = {kv[-1]} entries, got {len(table)}")
            slots = table
        else:
            if len(table) != b:
                raise ValueError(f"cache_mode 0: cachestarts needs B = {b} entries, got {len(table)}")
            slots = np.repeat(table - kv[:-1], kv_lens) + np.arange(kv[-1])
        outside = slots[(slots < 0) | (slots >= pool.num_slots)]
        if len(outside):
            raise IndexError(f"cachestarts address cache position {int(outside[0])}, outside [0, MaxT = "
                             f"{pool.num_slots})")
        current = np.concatenate([slots[k0 + s:k1] for k0, k1, s in zip(kv[:-1], kv[1:], start)]) if b else slots[:0]
        return torch.from_numpy(slots), torch.from_numpy(np.ascontiguousarray(current))

    def _attend(self, query, keys, values, seq, kv, start, decoding_batches, attn_mask) -> torch.Tensor:
        group = self.num_heads // self.num_kv_heads
        out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
        sm_scale = 1.0 / math.sqrt(self.head_dim)
        for b in range(len(seq) - 1):
            q0, q1, k0, k1 = int(seq[b]), int(seq[b + 1]), int(kv[b]), int(kv[b + 1])
            if q0 == q1 or k0 == k1:
                continue
            k = keys[k0:k1].float().repeat_interleave(group, dim=1)
            v = values[k0:k1].float().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", query[q0:q1].float(), k) * sm_scale
            if attn_mask is not None:
                scores = scores + attn_mask[..., q0:q1, k0:k1].float()
            if self.is_causal and b >= decoding_batches:
                visible = torch.arange(q1 - q0, device=query.device)[:, None] + int(start[b])
                scores = scores.masked_fill(torch.arange(k1 - k0, device=query.device)[None, :] > visible,
                                            float("-inf"))
            out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
        return out.to(query.dtype)


def _host(name: str, t) -> np.ndarray:
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64) or t.dim() != 1:
        raise TypeError(f"{name} must be a 1-D int32/int64 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    return t.cpu().numpy().astype(np.int64)
