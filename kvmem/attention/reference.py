"""Plain torch attention over FlashInfer's paged layout (flat and cascade): the CPU oracle for tests and the
CPU engine."""

from __future__ import annotations

import math

from kvmem._torch import torch
from kvmem.attention.cascade import CascadeMetadata
from kvmem.attention.flashinfer import KV_LAYOUTS
from kvmem.attention.merge import merge_states
from kvmem.kernels._dispatch import check_index_tensor, check_length, host_values

LOG2_E = math.log2(math.e)  # natural-log lse x LOG2_E = base-2 lse


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
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain torch attention (float32 accumulate) reading FlashInfer's paged layout; the CPU test oracle.

    Args:
        q: [total_q, Hq, D] with total_q = qo_indptr[-1].
        k_pages: [num_pages, page_size, Hkv, D] (NHD) or [num_pages, Hkv, page_size, D] (HND).
        v_pages: same layout with head dim Dv.
        qo_indptr, kv_indptr, kv_indices, kv_last_page_len: as in the module docstring.
        layout: "NHD" or "HND".
        causal: query t of a request with qo_len q and kv_len k sees kv positions <= k - q + t.
        sm_scale: softmax scale, default 1 / sqrt(D).
        return_lse: also return each query's log-sum-exp, as FlashInfer's `return_lse=True`.

    Returns:
        out [total_q, Hq, Dv] in q's dtype, or (out, lse) with lse [total_q, Hq] float32: the base-2
        log-sum-exp of the scaled, masked scores, log2(sum_k exp(sm_scale * q.k)), FlashInfer's convention
        (see `kvmem.attention.merge`). Query head h reads KV head h // (Hq // Hkv) (GQA). A request with no
        KV tokens gets zeros and lse -inf. Loops over requests in Python: an oracle, not a kernel.
    """
    _check_args(q, k_pages, v_pages, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, layout)
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
    lse = torch.full((total_q, num_qo_heads), float("-inf"), dtype=torch.float32, device=q.device)
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
        if return_lse:
            lse[q0:q1] = torch.logsumexp(scores, dim=-1).T * LOG2_E
    return (out.to(q.dtype), lse) if return_lse else out.to(q.dtype)


def reference_cascade_attention(
    q: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    cascade_metadata: CascadeMetadata,
    layout: str = "NHD",
    sm_scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Cascade attention in plain torch: each level attended on its own, then the states merged.

    Args:
        q: [total_q, Hq, D] in the batch's order (as for flat attention).
        kv_cache: (k_pages, v_pages) of one layer, as in `reference_paged_attention`.
        cascade_metadata: from `build_cascade_metadata`.
        layout, sm_scale: as in `reference_paged_attention`.
        return_lse: also return the merged base-2 log-sum-exp [total_q, Hq] float32.

    Returns:
        out [total_q, Hq, Dv] in q's dtype and in the batch's order, equal (up to rounding) to flat
        attention over each request's whole KV; shared levels are attended without a mask, the last level
        causally, as FlashInfer's MultiLevelCascadeAttentionWrapper plans them.
    """
    k_pages, v_pages = kv_cache
    md = cascade_metadata
    if q.dim() != 3 or len(q) != len(md.qo_order):
        raise ValueError(f"q must be [total_q, Hq, D] with total_q = {len(md.qo_order)} (the metadata's queries), "
                         f"got shape {tuple(q.shape)}")
    q = md.permute_queries(q)
    last = md.num_levels - 1
    outs, lses = [], []
    for i, level in enumerate(md.levels):
        out, lse = reference_paged_attention(q, k_pages, v_pages, level.qo_indptr, level.kv_indptr,
                                             level.kv_indices, level.kv_last_page_len, layout=layout,
                                             causal=i == last, sm_scale=sm_scale, return_lse=True)
        outs.append(out)
        lses.append(lse)
    out, lse = merge_states(torch.stack(outs, dim=1), torch.stack(lses, dim=1))
    out = md.unpermute_outputs(out)
    return (out, md.unpermute_outputs(lse)) if return_lse else out


def _check_args(q, k_pages, v_pages, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, layout) -> None:
    if layout not in KV_LAYOUTS:
        raise ValueError(f"layout must be one of {KV_LAYOUTS}, got {layout!r}")
    for name, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.device.type == "meta":
            raise ValueError(f"{name} is on the 'meta' device, which holds no values")
    for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                    ("kv_last_page_len", kv_last_page_len)):
        check_index_tensor(name, t)
    # An oracle reads every index on the host anyway: check that each one addresses what it should.
    qo, kv, pages = host_values(qo_indptr.cpu()), host_values(kv_indptr.cpu()), host_values(kv_indices.cpu())
    for name, indptr, end in (("qo_indptr", qo, None), ("kv_indptr", kv, len(pages))):
        past_end = end is not None and len(indptr) and indptr[-1] > end
        if len(indptr) and (indptr[0] < 0 or (indptr[1:] < indptr[:-1]).any() or past_end):
            raise ValueError(f"{name} must start at >= 0, never decrease{'' if end is None else f' and end by {end}'}")
    num_pages = k_pages.shape[0] if k_pages.dim() == 4 else 0
    if len(pages) and (pages.min() < 0 or pages.max() >= num_pages):
        raise IndexError(f"kv_indices holds page {pages.min() if pages.min() < 0 else pages.max()}, outside the "
                         f"{num_pages} pages of k_pages")
    if len(kv_last_page_len):
        last = host_values(kv_last_page_len.cpu())
        page_size = k_pages.shape[2 if layout == "HND" else 1] if k_pages.dim() == 4 else 0
        if last.min() < 0 or last.max() > page_size:
            raise ValueError(f"kv_last_page_len must lie in [0, page_size {page_size}], got "
                             f"{last.min() if last.min() < 0 else last.max()}")
