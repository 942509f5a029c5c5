"""The paged K/V of one pool layer in the form attention reads: FlashInfer's paged layout in the model dtype.

A pool that stores the model dtype ("auto") is read in place: views of its storage, no copy. fp8, int8 and
int4 pools are read by dequantizing the pages a batch touches into a compact buffer and renumbering
`kv_indices` to it, so that one attention implementation (the torch reference, FlashInfer in float16/bfloat16)
serves every storage format: a copy of the batch's pages per layer, the price of not having a kernel that
reads quantized pages with their scales.
"""

from __future__ import annotations

from typing import NamedTuple

from kvmem._torch import torch
from kvmem.kv_pool import MHAKVPool, MLAKVPool


class KVPages(NamedTuple):
    """k_pages / v_pages in `layout` ("NHD": [num_pages, page_size, H, D], "HND": [num_pages, H, page_size, D]),
    and the kv_indices (int32 page ids) that address them."""

    k_pages: torch.Tensor
    v_pages: torch.Tensor
    kv_indices: torch.Tensor
    layout: str


def kv_pages(pool: MHAKVPool | MLAKVPool, layer_id: int, kv_indices: torch.Tensor) -> KVPages:
    """Layer `layer_id` of `pool` as paged K/V for the pages `kv_indices` names.

    MHA: K [.., head_num, head_dim], V [.., head_num, v_head_dim]. MLA: one head, K = the whole latent row
    [kv_lora_rank + qk_rope_head_dim] and V = its ckv part [kv_lora_rank] (MLA as multi-query attention over
    the latent, after absorbing W_UK into the query). Quantized pools: a dequantized copy of the named pages
    only, in NHD, with kv_indices renumbered (see the module docstring).
    """
    if isinstance(pool, MLAKVPool):
        return _mla_pages(pool, layer_id, kv_indices)
    if pool.kv_cache_dtype == "auto":
        k, v = pool.get_paged_kv_buffer(layer_id)
        return KVPages(k, v, kv_indices, pool.layout)
    pages, inverse, slots = _touched_slots(pool.page_size, kv_indices)
    k, v = pool.read_kv(layer_id, slots)
    return KVPages(k.view(len(pages), pool.page_size, *k.shape[1:]), v.view(len(pages), pool.page_size, *v.shape[1:]),
                   inverse, "NHD")


def _mla_pages(pool: MLAKVPool, layer_id: int, kv_indices: torch.Tensor) -> KVPages:
    ps, rank = pool.page_size, pool.kv_lora_rank
    if pool.kv_cache_dtype == "auto":
        k = pool.get_key_buffer(layer_id).view(pool.num_pages, ps, 1, pool.kv_dim)
        return KVPages(k, k[..., :rank], kv_indices, "NHD")
    pages, inverse, slots = _touched_slots(ps, kv_indices)
    k = pool.read_kv(layer_id, slots)[0].view(len(pages), ps, 1, pool.kv_dim)
    return KVPages(k, k[..., :rank], inverse, "NHD")


def _touched_slots(page_size: int, kv_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(distinct pages, kv_indices renumbered into them as int32, the slots of those pages in page order)."""
    pages, inverse = torch.unique(kv_indices.long(), return_inverse=True)
    offsets = torch.arange(page_size, device=pages.device)
    return pages, inverse.to(torch.int32), (pages[:, None] * page_size + offsets).reshape(-1)
