"""FlashInfer's paged-KV metadata for a batch, built from the req_to_token table (layout: see kvmem.attention).

The public builders check their arguments once; `ScheduleBatch`, which already validated its batch, calls
the unchecked bodies (`decode_metadata`, `extend_metadata`), as FlashInfer's `plan()` hands off to its
implementation.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmem._torch import torch
from kvmem.kernels._dispatch import check_index_tensor, check_length, check_same_device, first_bad, host_values
from kvmem.kernels.kv_indices import _create_kv_indices, _create_kv_indptr, _kv_last_page_len, check_gather_args


@dataclass(frozen=True)
class PagedKVMetadata:
    """One batch's FlashInfer paged-KV arrays (see kvmem.attention), all on req_to_token's device."""

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
    check_gather_args(req_to_token, req_pool_indices, seq_lens, None, page_size, lens_name="seq_lens")
    return decode_metadata(req_to_token, req_pool_indices, seq_lens, page_size)


def build_extend_metadata(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                          seq_lens: torch.Tensor, page_size: int = 1) -> PagedKVMetadata:
    """Metadata for an extend: queries are tokens prefix_lens[i]..seq_lens[i]-1, keys all seq_lens[i] tokens.

    qo_indptr is the cumsum of seq_lens - prefix_lens; the new tokens' slots must already be in req_to_token
    (see `kvmem.kernels.write_req_to_token`). Causal masking aligns each request's queries with the last
    tokens of its KV, as FlashInfer does.
    """
    check_gather_args(req_to_token, req_pool_indices, seq_lens, None, page_size, lens_name="seq_lens")
    check_index_tensor("prefix_lens", prefix_lens)
    check_same_device(req_to_token.device, prefix_lens=prefix_lens)
    check_length("prefix_lens", prefix_lens, len(seq_lens), "one per request, len(seq_lens)")
    if seq_lens.device.type == "cpu":
        bad = (host_values(prefix_lens) < 0) | (host_values(seq_lens) < host_values(prefix_lens))
        if bad.any():
            i = first_bad(bad)
            raise ValueError(f"request {i}: need 0 <= prefix_lens <= seq_lens, got {int(prefix_lens[i])} and "
                             f"{int(seq_lens[i])}")
    return extend_metadata(req_to_token, req_pool_indices, prefix_lens, seq_lens, page_size)


def decode_metadata(req_to_token, req_pool_indices, seq_lens, page_size) -> PagedKVMetadata:
    """build_decode_metadata without its checks."""
    qo_indptr = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=seq_lens.device)
    return _assemble(req_to_token, req_pool_indices, seq_lens, qo_indptr, page_size)


def extend_metadata(req_to_token, req_pool_indices, prefix_lens, seq_lens, page_size) -> PagedKVMetadata:
    """build_extend_metadata without its checks."""
    qo_indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32, device=seq_lens.device)
    qo_indptr[1:] = torch.cumsum(seq_lens - prefix_lens, 0)
    return _assemble(req_to_token, req_pool_indices, seq_lens, qo_indptr, page_size)


def _assemble(req_to_token, req_pool_indices, seq_lens, qo_indptr, page_size) -> PagedKVMetadata:
    kv_indptr = _create_kv_indptr(seq_lens, page_size)
    kv_indices = _create_kv_indices(req_to_token, req_pool_indices, seq_lens, kv_indptr, page_size=page_size)
    return PagedKVMetadata(qo_indptr, kv_indptr, kv_indices, _kv_last_page_len(seq_lens, page_size), page_size)
