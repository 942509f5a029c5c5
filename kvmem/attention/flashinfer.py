"""A thin wrapper over FlashInfer's batch decode / prefill / multi-level cascade with a paged KV cache (CUDA
only; flashinfer is imported only when a wrapper is built, so the CPU never imports it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvmem.attention.metadata import PagedKVMetadata

if TYPE_CHECKING:
    from kvmem.attention.cascade import CascadeMetadata

KV_LAYOUTS = ("NHD", "HND")


class FlashInferAttention:
    """FlashInfer's batch decode / prefill / cascade over the paged pool: plan once per batch, run once per layer.

    Needs CUDA and the optional `flashinfer` package (`pip install kvmem[gpu]`); constructing one without
    them raises RuntimeError. Decode, prefill and cascade share one float workspace buffer, which is safe
    because a batch runs one of them at a time on one stream.
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, *, kv_layout: str = "NHD",
                 device: str | torch.device = "cuda", workspace_bytes: int = 128 * 1024 * 1024,
                 backend: str = "auto") -> None:
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
        if num_kv_heads <= 0 or num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads {num_qo_heads} must be a positive multiple of num_kv_heads {num_kv_heads}")
        flashinfer = _import_flashinfer()
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.kv_layout = kv_layout
        self.workspace_buffer = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        # FlashInfer documents its tensor-core decode as faster for large GQA groups; more than 4 query heads
        # per KV head is the usual cut-over (the GPU tests cover groups of 1, 4 and 8).
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace_buffer, kv_layout, use_tensor_cores=num_qo_heads // num_kv_heads > 4)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace_buffer, kv_layout,
                                                                       backend=backend)
        self._flashinfer = flashinfer
        self._cascade: dict[int, object] = {}  # num_levels -> MultiLevelCascadeAttentionWrapper, built on first use
        self._planned = None
        self._cascade_order: CascadeMetadata | None = None

    def plan_decode(self, metadata: PagedKVMetadata, q_dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
                    sm_scale: float | None = None) -> None:
        """Plans one query per request (metadata from `build_decode_metadata`); sm_scale defaults to 1/sqrt(D)."""
        self._decode.plan(
            metadata.kv_indptr, metadata.kv_indices, metadata.kv_last_page_len,
            self.num_qo_heads, self.num_kv_heads, self.head_dim, metadata.page_size,
            q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=sm_scale)
        self._planned, self._cascade_order = self._decode, None

    def plan_extend(self, metadata: PagedKVMetadata, q_dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
                    causal: bool = True, sm_scale: float | None = None) -> None:
        """Plans an extend (metadata from `build_extend_metadata`), causal aligned bottom-right by default."""
        self._prefill.plan(
            metadata.qo_indptr, metadata.kv_indptr, metadata.kv_indices, metadata.kv_last_page_len,
            self.num_qo_heads, self.num_kv_heads, self.head_dim, metadata.page_size,
            causal=causal, sm_scale=sm_scale, q_data_type=q_dtype, kv_data_type=kv_dtype)
        self._planned, self._cascade_order = self._prefill, None

    def plan_cascade(self, metadata: CascadeMetadata, q_dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
                     sm_scale: float | None = None) -> None:
        """Plans FlashInfer's MultiLevelCascadeAttentionWrapper over `metadata` (from `build_cascade_metadata`):
        shared levels without a mask, the last level causal. `run` then takes q in the batch's order, runs
        the levels on it in cascade order and returns the output in the batch's order. One wrapper is kept
        per number of levels, since FlashInfer fixes that number when it builds one."""
        levels = metadata.levels
        wrapper = self._cascade.get(len(levels))
        if wrapper is None:
            wrapper = self._flashinfer.MultiLevelCascadeAttentionWrapper(len(levels), self.workspace_buffer,
                                                                         self.kv_layout)
            self._cascade[len(levels)] = wrapper
        wrapper.plan(
            [m.qo_indptr for m in levels], [m.kv_indptr for m in levels], [m.kv_indices for m in levels],
            [m.kv_last_page_len for m in levels], self.num_qo_heads, self.num_kv_heads, self.head_dim,
            metadata.page_size, causal=True, sm_scale=sm_scale, q_data_type=q_dtype, kv_data_type=kv_dtype)
        self._planned, self._cascade_order = wrapper, metadata

    def run(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """q [total_q, num_qo_heads, head_dim] -> out of the same shape, over (k_pages, v_pages) of one layer."""
        if self._planned is None:
            raise RuntimeError("FlashInferAttention.run needs plan_decode(), plan_extend() or plan_cascade() first")
        dims = (kv_cache[0].shape[-1], kv_cache[1].shape[-1])
        if dims != (self.head_dim, self.head_dim):
            # The plans above pass one head_dim; a pool with its own v_head_dim would be read wrongly.
            raise ValueError(f"kv_cache head dims (K, V) = {dims}; this wrapper plans FlashInfer for "
                             f"head_dim {self.head_dim} on both")
        order = self._cascade_order
        if order is not None:
            return order.unpermute_outputs(self._planned.run(order.permute_queries(q), kv_cache))
        return self._planned.run(q, kv_cache)


def _import_flashinfer():
    if not torch.cuda.is_available():
        raise RuntimeError("FlashInferAttention needs a CUDA device; use reference_paged_attention on the CPU")
    try:
        import flashinfer
    except ImportError as e:
        raise RuntimeError("FlashInferAttention needs the flashinfer package: pip install 'kvmem[gpu]' "
                           f"(import failed: {e})") from e
    return flashinfer
