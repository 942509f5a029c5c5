"""Paged attention over the KV pool: FlashInfer's metadata, a thin FlashInfer wrapper, a torch reference.

FlashInfer's paged layout (https://docs.flashinfer.ai/tutorials/kv_layout.html) is a CSR over pages:

    qo_indptr        [bs + 1] int32  request i's queries are q[qo_indptr[i]:qo_indptr[i+1]]
    kv_indptr        [bs + 1] int32  request i's pages are kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices       [kv_indptr[-1]] int32 page ids into the paged K/V buffers
    kv_last_page_len [bs] int32      tokens in the last page: 1..page_size (0 for a request with no pages)

so request i has kv_len = (num_pages - 1) * page_size + kv_last_page_len[i] tokens. The paged buffers are
[num_pages, page_size, H, D] ("NHD") or [num_pages, H, page_size, D] ("HND"); with page_size 1 a page is
a slot and kv_indices lists slots. In an extend, query t of a request with qo_len q and kv_len k sits at
position k - q + t and attends causally to kv positions <= k - q + t (the mask is aligned bottom-right).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels._dispatch import check_index_tensor, check_length, first_bad, host_values
from kernels.kv_indices import create_kv_indices, create_kv_indptr, kv_last_page_len

KV_LAYOUTS = ("NHD", "HND")


@dataclass(frozen=True)
class PagedKVMetadata:
    """One batch's FlashInfer paged-KV arrays (see the module docstring), all on req_to_token's device."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    page_size: int


def build_decode_metadata(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                          page_size: int = 1) -> PagedKVMetadata:
    """Metadata for one decode query per request over its seq_lens[i] tokens (the new token included).

    Args: req_to_token [num_rows, max_context_len] int32; req_pool_indices, seq_lens [bs] int32/int64.
    qo_indptr is arange(bs + 1). Sizing kv_indices reads kv_indptr[-1], one host sync on CUDA.
    """
    check_index_tensor("seq_lens", seq_lens)
    qo_indptr = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=seq_lens.device)
    return _build(req_to_token, req_pool_indices, seq_lens, qo_indptr, page_size)


def build_extend_metadata(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                          seq_lens: torch.Tensor, page_size: int = 1) -> PagedKVMetadata:
    """Metadata for an extend: queries are tokens prefix_lens[i]..seq_lens[i]-1, keys all seq_lens[i] tokens.

    qo_indptr is the cumsum of seq_lens - prefix_lens; the new tokens' slots must already be in req_to_token
    (see `kernels.req_to_token.write_req_to_token`). Causal masking aligns each request's queries with the
    last tokens of its KV, as FlashInfer does.
    """
    check_index_tensor("prefix_lens", prefix_lens)
    check_index_tensor("seq_lens", seq_lens)
    check_length("prefix_lens", prefix_lens, len(seq_lens), "one per request, len(seq_lens)")
    extend_lens = seq_lens - prefix_lens
    if seq_lens.device.type == "cpu" and ((host_values(prefix_lens) < 0) | (host_values(extend_lens) < 0)).any():
        i = first_bad((host_values(prefix_lens) < 0) | (host_values(extend_lens) < 0))
        raise ValueError(f"request {i}: need 0 <= prefix_lens <= seq_lens, got {int(prefix_lens[i])} and "
                         f"{int(seq_lens[i])}")
    qo_indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32, device=seq_lens.device)
    qo_indptr[1:] = torch.cumsum(extend_lens, 0)
    return _build(req_to_token, req_pool_indices, seq_lens, qo_indptr, page_size)


def _build(req_to_token, req_pool_indices, seq_lens, qo_indptr, page_size) -> PagedKVMetadata:
    kv_indptr = create_kv_indptr(seq_lens, page_size)
    kv_indices = create_kv_indices(req_to_token, req_pool_indices, seq_lens, kv_indptr, page_size=page_size)
    return PagedKVMetadata(qo_indptr, kv_indptr, kv_indices, kv_last_page_len(seq_lens, page_size), page_size)


class FlashInferAttention:
    """FlashInfer's batch decode / prefill over the paged pool: plan once per batch, run once per layer.

    Needs CUDA and the optional `flashinfer` package (`pip install kvmem[gpu]`); constructing one without
    them raises RuntimeError. Decode and prefill share one float workspace buffer, which is safe because a
    batch runs one of them at a time on one stream.
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
        self._planned = None

    def plan_decode(self, metadata: PagedKVMetadata, q_dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
                    sm_scale: float | None = None) -> None:
        """Plans one query per request (metadata from `build_decode_metadata`); sm_scale defaults to 1/sqrt(D)."""
        self._decode.plan(
            metadata.kv_indptr, metadata.kv_indices, metadata.kv_last_page_len,
            self.num_qo_heads, self.num_kv_heads, self.head_dim, metadata.page_size,
            q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=sm_scale)
        self._planned = self._decode

    def plan_extend(self, metadata: PagedKVMetadata, q_dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
                    causal: bool = True, sm_scale: float | None = None) -> None:
        """Plans an extend (metadata from `build_extend_metadata`), causal aligned bottom-right by default."""
        self._prefill.plan(
            metadata.qo_indptr, metadata.kv_indptr, metadata.kv_indices, metadata.kv_last_page_len,
            self.num_qo_heads, self.num_kv_heads, self.head_dim, metadata.page_size,
            causal=causal, sm_scale=sm_scale, q_data_type=q_dtype, kv_data_type=kv_dtype)
        self._planned = self._prefill

    def run(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """q [total_q, num_qo_heads, head_dim] -> out of the same shape, over (k_pages, v_pages) of one layer."""
        if self._planned is None:
            raise RuntimeError("FlashInferAttention.run needs plan_decode() or plan_extend() first")
        dims = (kv_cache[0].shape[-1], kv_cache[1].shape[-1])
        if dims != (self.head_dim, self.head_dim):
            # The plans above pass one head_dim; a pool with its own v_head_dim would be read wrongly.
            raise ValueError(f"kv_cache head dims (K, V) = {dims}; this wrapper plans FlashInfer for "
                             f"head_dim {self.head_dim} on both")
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


def reference_paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    layout: str = "NHD",
    causal: bool = True,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Plain torch attention (float32 accumulate) reading FlashInfer's paged layout; the CPU test oracle.

    Args:
        q: [total_q, Hq, D] with total_q = qo_indptr[-1].
        k_pages: [num_pages, page_size, Hkv, D] (NHD) or [num_pages, Hkv, page_size, D] (HND).
        v_pages: same layout with head dim Dv.
        qo_indptr, kv_indptr, kv_indices, kv_last_page_len: as in the module docstring.
        layout: "NHD" or "HND".
        causal: query t of a request with qo_len q and kv_len k sees kv positions <= k - q + t.
        sm_scale: softmax scale, default 1 / sqrt(D).

    Returns:
        [total_q, Hq, Dv] in q's dtype. Query head h reads KV head h // (Hq // Hkv) (GQA). A request with
        no KV tokens gets zeros. Loops over requests in Python: an oracle, not a kernel.
    """
    if layout not in KV_LAYOUTS:
        raise ValueError(f"layout must be one of {KV_LAYOUTS}, got {layout!r}")
    if q.dim() != 3 or k_pages.dim() != 4 or v_pages.dim() != 4:
        raise ValueError(f"q must be 3-D and k_pages, v_pages 4-D, got shapes {tuple(q.shape)}, "
                         f"{tuple(k_pages.shape)}, {tuple(v_pages.shape)}")
    if layout == "HND":  # to NHD: [num_pages, page_size, H, D]
        k_pages, v_pages = k_pages.transpose(1, 2), v_pages.transpose(1, 2)
    page_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    total_q, num_qo_heads, head_dim = q.shape
    if num_qo_heads % num_kv_heads or k_pages.shape[3] != head_dim:
        raise ValueError(f"q has {num_qo_heads} heads of dim {head_dim}; k_pages must have a divisor of that many "
                         f"heads of the same dim, got {num_kv_heads} of dim {k_pages.shape[3]}")
    bs = len(kv_last_page_len)
    check_length("qo_indptr", qo_indptr, bs + 1, "batch size + 1")
    check_length("kv_indptr", kv_indptr, bs + 1, "batch size + 1")
    if int(qo_indptr[-1]) != total_q:
        raise ValueError(f"qo_indptr[-1] = {int(qo_indptr[-1])} must equal q's {total_q} rows")
    group = num_qo_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    out = torch.zeros(total_q, num_qo_heads, v_pages.shape[3], dtype=torch.float32, device=q.device)
    for i in range(bs):
        q0, q1 = int(qo_indptr[i]), int(qo_indptr[i + 1])
        pages = kv_indices[int(kv_indptr[i]):int(kv_indptr[i + 1])].long()
        kv_len = (len(pages) - 1) * page_size + int(kv_last_page_len[i]) if len(pages) else 0
        qo_len = q1 - q0
        if kv_len == 0 or qo_len == 0:
            continue
        if causal and qo_len > kv_len:
            raise ValueError(f"request {i}: causal attention needs qo_len <= kv_len, got {qo_len} > {kv_len}")
        k = k_pages[pages].reshape(-1, num_kv_heads, head_dim)[:kv_len].float().repeat_interleave(group, dim=1)
        v = v_pages[pages].reshape(-1, num_kv_heads, v_pages.shape[3])[:kv_len].float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * scale
        if causal:
            last_visible = torch.arange(kv_len - qo_len, kv_len, device=q.device)[:, None]
            scores.masked_fill_(torch.arange(kv_len, device=q.device)[None, :] > last_visible, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    return out.to(q.dtype)
