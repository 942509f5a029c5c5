"""Writing an extend batch's KV slots into the req_to_token table in one launch.

Row r of req_to_token lists the KV slots of request r's tokens in order. Before an extend (prefill)
step each request's row gets its cached prefix (slots matched in the radix tree) at columns
0..n_i-1 and the freshly allocated `out_cache_loc` slots at columns prefix_lens[i]..seq_lens[i]-1.
"""

from __future__ import annotations

import numpy as np

from kvmem._torch import torch

from ._dispatch import (
    check_index_tensor,
    check_length,
    check_rows,
    check_same_device,
    exclusive_cumsum,
    first_bad,
    host_values,
    tl,
    triton_jit,
    use_triton,
)

BLOCK = 1024


def write_req_to_token(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    prefix_indices: torch.Tensor | None = None,
    prefix_indptr: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> None:
    """Writes, in place, each request's prefix slots (optional) and extend slots into its row.

    Args:
        req_to_token: [num_rows, max_context_len] int32 table (int64 accepted), written in place.
        req_pool_indices: [bs] int32/int64 row of each request; rows must be distinct.
        prefix_lens: [bs] tokens already cached; the extend slots start at this column.
        seq_lens: [bs] tokens after the step; seq_lens[i] - prefix_lens[i] extend tokens per request.
        out_cache_loc: [sum(seq_lens - prefix_lens)] int64/int32 slots of the extend tokens, requests
            concatenated in batch order.
        prefix_indices: optional [P] slots of the cached prefixes, requests concatenated.
        prefix_indptr: optional [bs + 1] offsets into prefix_indices: request i's prefix is
            prefix_indices[prefix_indptr[i]:prefix_indptr[i+1]] and goes to columns 0..n_i-1. n_i may be
            0 (a chunked request whose prefix is already in its row) and at most prefix_lens[i].
        backend: None (Triton on CUDA or under TRITON_INTERPRET=1, else torch), "triton" or "torch".

    Shapes and dtypes are always checked; values only on CPU tensors (reading them on CUDA would sync).
    Nothing is written when a check fails.
    """
    _check_args(req_to_token, req_pool_indices, prefix_lens, seq_lens, out_cache_loc, prefix_indices,
                prefix_indptr)
    _write_req_to_token(req_to_token, req_pool_indices, prefix_lens, seq_lens, out_cache_loc, prefix_indices,
                        prefix_indptr, backend)


def _write_req_to_token(req_to_token, req_pool_indices, prefix_lens, seq_lens, out_cache_loc, prefix_indices=None,
                        prefix_indptr=None, backend=None) -> None:
    """write_req_to_token's body, for callers that checked its arguments (ScheduleBatch)."""
    if len(req_pool_indices) == 0:
        return
    if use_triton(_write_req_to_token_kernel, req_to_token.device, backend):
        has_prefix = prefix_indptr is not None
        _write_req_to_token_kernel[(len(req_pool_indices),)](
            req_to_token, req_pool_indices, prefix_lens, seq_lens, out_cache_loc,
            prefix_indices if has_prefix else out_cache_loc, prefix_indptr if has_prefix else seq_lens,
            req_to_token.stride(0), req_to_token.stride(1),
            HAS_PREFIX=has_prefix, BLOCK=BLOCK,
        )
    else:
        _write_req_to_token_torch(req_to_token, req_pool_indices, prefix_lens, seq_lens, out_cache_loc,
                                  prefix_indices, prefix_indptr)


@triton_jit
def _write_req_to_token_kernel(
    req_to_token_ptr, req_pool_indices_ptr, prefix_lens_ptr, seq_lens_ptr, out_cache_loc_ptr,
    prefix_indices_ptr, prefix_indptr_ptr, row_stride, col_stride,
    HAS_PREFIX: tl.constexpr, BLOCK: tl.constexpr,
):
    req = tl.program_id(0)
    row = req_to_token_ptr + tl.load(req_pool_indices_ptr + req).to(tl.int64) * row_stride
    # Where this request's extend slots start in out_cache_loc: the extend tokens of the requests before
    # it. Summed here rather than by a torch.cumsum launch so that the whole write is one launch.
    ext_offset = tl.zeros([], dtype=tl.int64)
    for first in range(0, req, BLOCK):
        k = first + tl.arange(0, BLOCK)
        mask = k < req
        ext = tl.load(seq_lens_ptr + k, mask=mask, other=0) - tl.load(prefix_lens_ptr + k, mask=mask, other=0)
        ext_offset += tl.sum(ext.to(tl.int64), axis=0)
    if HAS_PREFIX:
        p0 = tl.load(prefix_indptr_ptr + req)
        n = tl.load(prefix_indptr_ptr + req + 1) - p0
        for first in range(0, n, BLOCK):
            j = first + tl.arange(0, BLOCK)
            mask = j < n
            tl.store(row + j * col_stride, tl.load(prefix_indices_ptr + p0 + j, mask=mask), mask=mask)
    prefix_len = tl.load(prefix_lens_ptr + req)
    n = tl.load(seq_lens_ptr + req) - prefix_len
    for first in range(0, n, BLOCK):
        j = first + tl.arange(0, BLOCK)
        mask = j < n
        slots = tl.load(out_cache_loc_ptr + ext_offset + j, mask=mask)
        tl.store(row + (prefix_len + j) * col_stride, slots, mask=mask)


def _write_req_to_token_torch(req_to_token, req_pool_indices, prefix_lens, seq_lens, out_cache_loc,
                              prefix_indices, prefix_indptr):
    if req_to_token.device.type == "cpu":
        _write_req_to_token_host(req_to_token.numpy(), host_values(req_pool_indices), host_values(prefix_lens),
                                 host_values(seq_lens), out_cache_loc.numpy(),
                                 None if prefix_indices is None else prefix_indices.numpy(),
                                 None if prefix_indptr is None else host_values(prefix_indptr))
        return
    _write_req_to_token_vectorized(req_to_token, req_pool_indices, prefix_lens, seq_lens, out_cache_loc,
                                   prefix_indices, prefix_indptr)


def _write_req_to_token_vectorized(req_to_token, req_pool_indices, prefix_lens, seq_lens, out_cache_loc,
                                   prefix_indices, prefix_indptr):
    """The fallback on a device without Triton: scatters with no host round trip (works on any device)."""
    device = req_to_token.device
    bs = len(req_pool_indices)
    rows = req_pool_indices.long()
    arange_bs = torch.arange(bs, device=device)
    if prefix_indptr is not None:
        indptr = prefix_indptr.long()
        n = indptr[1:] - indptr[:-1]
        total = int(indptr[-1] - indptr[0])
        req = torch.repeat_interleave(arange_bs, n, output_size=total)
        cols = torch.arange(total, device=device) - exclusive_cumsum(n)[req]
        req_to_token[rows[req], cols] = prefix_indices[indptr[req] + cols].to(req_to_token.dtype)
    ext = (seq_lens - prefix_lens).long()
    req = torch.repeat_interleave(arange_bs, ext, output_size=len(out_cache_loc))
    cols = torch.arange(len(out_cache_loc), device=device) - exclusive_cumsum(ext)[req] + prefix_lens.long()[req]
    req_to_token[rows[req], cols] = out_cache_loc.to(req_to_token.dtype)


def _write_req_to_token_host(table: np.ndarray, rows: np.ndarray, prefix: np.ndarray, seq: np.ndarray,
                             out_cache_loc: np.ndarray, prefix_indices: np.ndarray | None,
                             prefix_indptr: np.ndarray | None) -> None:
    # On the host a slice copy per request into a numpy view of the table beats both the vectorized torch
    # scatter (several token-sized index temporaries) and per-request torch slices (torch's dispatch per
    # slice; docs/benchmarks.md). Numpy's assignment narrows int64 to the table's dtype by wrapping, as the
    # kernel's stores do.
    ends = np.cumsum(seq - prefix).tolist()
    starts = [0] + ends[:-1]
    for row, p, s, e0, e1 in zip(rows.tolist(), prefix.tolist(), seq.tolist(), starts, ends):
        table[row, p:s] = out_cache_loc[e0:e1]
    if prefix_indptr is not None:
        indptr = prefix_indptr.tolist()
        for row, i0, i1 in zip(rows.tolist(), indptr[:-1], indptr[1:]):
            if i1 > i0:
                table[row, :i1 - i0] = prefix_indices[i0:i1]


def _check_args(req_to_token, req_pool_indices, prefix_lens, seq_lens, out_cache_loc, prefix_indices,
                prefix_indptr):
    check_index_tensor("req_to_token", req_to_token, dim=2)
    for name, t in (("req_pool_indices", req_pool_indices), ("prefix_lens", prefix_lens),
                    ("seq_lens", seq_lens), ("out_cache_loc", out_cache_loc)):
        check_index_tensor(name, t)
    bs = len(req_pool_indices)
    check_length("prefix_lens", prefix_lens, bs, "one per request, len(req_pool_indices)")
    check_length("seq_lens", seq_lens, bs, "one per request, len(req_pool_indices)")
    if (prefix_indices is None) != (prefix_indptr is None):
        raise ValueError("prefix_indices and prefix_indptr must be given together, got "
                         f"prefix_indices={'a tensor' if prefix_indices is not None else None} and "
                         f"prefix_indptr={'a tensor' if prefix_indptr is not None else None}")
    if prefix_indptr is not None:
        check_index_tensor("prefix_indices", prefix_indices)
        check_index_tensor("prefix_indptr", prefix_indptr)
        check_length("prefix_indptr", prefix_indptr, bs + 1, "batch size + 1")
    device = req_to_token.device
    check_same_device(device, req_pool_indices=req_pool_indices, prefix_lens=prefix_lens, seq_lens=seq_lens,
                      out_cache_loc=out_cache_loc, prefix_indices=prefix_indices, prefix_indptr=prefix_indptr)
    if device.type == "cpu":
        _check_values(req_to_token, req_pool_indices, prefix_lens, seq_lens, out_cache_loc, prefix_indices,
                      prefix_indptr)


def _check_values(req_to_token, req_pool_indices, prefix_lens, seq_lens, out_cache_loc, prefix_indices,
                  prefix_indptr):
    num_rows, max_context_len = req_to_token.shape
    rows = check_rows(req_pool_indices, num_rows)
    prefix, seq = host_values(prefix_lens), host_values(seq_lens)
    seen = np.zeros(num_rows, dtype=bool)
    seen[rows] = True
    if np.count_nonzero(seen) != len(rows):  # a third of np.add.at's cost on the extend path
        raise ValueError(f"req_pool_indices names row {first_bad(np.bincount(rows) > 1)} more than once")
    bad = (prefix < 0) | (seq < prefix)
    if bad.any():
        i = first_bad(bad)
        raise ValueError(f"request {i}: need 0 <= prefix_lens <= seq_lens, got {prefix[i]} and {seq[i]}")
    if (seq > max_context_len).any():
        i = first_bad(seq > max_context_len)
        raise IndexError(f"seq_lens[{i}] = {seq[i]} exceeds req_to_token's max_context_len {max_context_len}")
    num_extend = int((seq - prefix).sum())
    if len(out_cache_loc) != num_extend:
        raise ValueError(f"out_cache_loc has {len(out_cache_loc)} slots, sum(seq_lens - prefix_lens) = {num_extend}")
    bound = np.iinfo(req_to_token.numpy().dtype).max
    for name, slots in (("out_cache_loc", out_cache_loc), ("prefix_indices", prefix_indices)):
        values = host_values(slots) if slots is not None and len(slots) else None
        if values is not None and (values.min() < 0 or values.max() > bound):  # would wrap in the table
            bad = values.min() if values.min() < 0 else values.max()
            raise ValueError(f"{name} holds slot {bad}, outside [0, {bound}] of req_to_token's {req_to_token.dtype}")
    if prefix_indptr is not None:
        indptr = host_values(prefix_indptr)
        if indptr[0] < 0 or indptr[-1] > len(prefix_indices):
            raise ValueError(f"prefix_indptr spans [{indptr[0]}, {indptr[-1]}), outside prefix_indices' "
                             f"{len(prefix_indices)} entries")
        n = np.diff(indptr)
        bad = (n < 0) | (n > prefix)
        if bad.any():
            i = first_bad(bad)
            raise ValueError(f"request {i}: prefix_indptr gives {n[i]} prefix slots, need 0..prefix_lens = {prefix[i]}")
