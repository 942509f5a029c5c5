"""A thin wrapper over FlashInfer's batch decode / prefill / multi-level cascade with a paged KV cache (CUDA
only; flashinfer is imported only when a wrapper is built, so the CPU never imports it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmem._torch import torch
from kvmem.attention.metadata import PagedKVMetadata

if TYPE_CHECKING:
    from kvmem.attention.cascade import CascadeMetadata

KV_LAYOUTS = ("NHD", "HND")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


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
        self._tensor_core_decode = num_qo_heads // num_kv_heads > 4
        self._backend = backend
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace_buffer, kv_layout, use_tensor_cores=self._tensor_core_decode)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace_buffer, kv_layout,
                                                                       backend=backend)
        self._fa2: dict[str, object] = {}  # "decode" / "prefill" -> a wrapper on FlashInfer's FA2 kernels
        self._flashinfer = flashinfer
        self._cascade: dict[int, object] = {}  # num_levels -> MultiLevelCascadeAttentionWrapper, built on first use
        self._planned = None
        self._cascade_order: CascadeMetadata | None = None

    def plan_decode(self, metadata: PagedKVMetadata, q_dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
                    sm_scale: float | None = None) -> None:
        """Plans one query per request (metadata from `build_decode_metadata`); sm_scale defaults to 1/sqrt(D)."""
        decode = self._decode
        if self._tensor_core_decode and self._needs_fa2(q_dtype, kv_dtype):
            decode = self._fa2_wrapper("decode")
        decode.plan(
            metadata.kv_indptr, metadata.kv_indices, metadata.kv_last_page_len,
            self.num_qo_heads, self.num_kv_heads, self.head_dim, metadata.page_size,
            q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=sm_scale)
        self._planned, self._cascade_order = decode, None

    def plan_extend(self, metadata: PagedKVMetadata, q_dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
                    causal: bool = True, sm_scale: float | None = None) -> None:
        """Plans an extend (metadata from `build_extend_metadata`), causal aligned bottom-right by default."""
        prefill = self._fa2_wrapper("prefill") if self._needs_fa2(q_dtype, kv_dtype) else self._prefill
        prefill.plan(
            metadata.qo_indptr, metadata.kv_indptr, metadata.kv_indices, metadata.kv_last_page_len,
            self.num_qo_heads, self.num_kv_heads, self.head_dim, metadata.page_size,
            causal=causal, sm_scale=sm_scale, q_data_type=q_dtype, kv_data_type=kv_dtype)
        self._planned, self._cascade_order = prefill, None

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

    def _needs_fa2(self, q_dtype: torch.dtype, kv_dtype: torch.dtype | None) -> bool:
        """Whether an fp8 KV cache read by 16-bit queries must take FlashInfer's FA2 kernels: on Hopper its
        "auto" backend picks FA3 whatever the KV dtype, and FA3 reads fp8 K/V only with fp8 queries (its
        kernels for float16 queries over e4m3 K/V do not compile)."""
        return self._backend == "auto" and kv_dtype in _FP8 and q_dtype not in _FP8

    def _fa2_wrapper(self, kind: str):
        wrapper = self._fa2.get(kind)
        if wrapper is None:
            fi = self._flashinfer
            wrapper = self._fa2[kind] = (
                fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace_buffer, self.kv_layout, use_tensor_cores=True,
                                                      backend="fa2") if kind == "decode" else
                fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace_buffer, self.kv_layout, backend="fa2"))
        return wrapper

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
