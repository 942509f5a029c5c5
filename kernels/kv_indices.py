"""FlashInfer's paged-KV index arrays from the req_to_token table.

FlashInfer reads a batch's KV cache through a CSR over pages: request i owns the page ids
`kv_indices[kv_indptr[i]:kv_indptr[i+1]]`, and its last page holds `kv_last_page_len[i]` tokens. With
page_size 1 a page is a token slot, so kv_indices lists slots. This module builds those arrays from
`req_to_token` (row r = the KV slots of request r's tokens, in order).
"""

from __future__ import annotations

import numpy as np

from kvmem._paging import pages_for
from kvmem._torch import torch

from ._dispatch import (
    check_index_tensor,
    check_length,
    check_page_size,
    check_rows,
    check_same_device,
    first_bad,
    host_values,
    tl,
    triton_jit,
    use_triton,
)

# Entries gathered per loop iteration of one program.
BLOCK = 1024
# Each request is split over up to MAX_SPLITS programs so that the grid holds about PROGRAMS_PER_SM
# programs per SM: with one program per request, a batch of a few long requests leaves most SMs idle while
# one program walks a 32k-token row (scripts/bench_kv_indices.py measures both layouts; docs/benchmarks.md).
PROGRAMS_PER_SM = 8
MAX_SPLITS = 32
# The interpreter runs programs one after another, so on CPU only a token split (to exercise the split
# path in tests) is worth its cost.
CPU_PROGRAMS = 4
INT32_MAX = 2**31 - 1


def create_kv_indptr(kv_lens: torch.Tensor, page_size: int = 1) -> torch.Tensor:
    """[bs + 1] int32 CSR offsets: kv_indptr[i+1] - kv_indptr[i] = ceil(kv_lens[i] / page_size) pages."""
    check_index_tensor("kv_lens", kv_lens)
    check_page_size(page_size)
    lens = _checked_lens(kv_lens)
    if lens is not None and (total := int(pages_for(lens, page_size).sum())) > INT32_MAX:
        raise ValueError(f"kv_lens: {total} pages in all, more than kv_indptr's int32 offsets hold ({INT32_MAX})")
    return _create_kv_indptr(kv_lens, page_size)


def _checked_lens(kv_lens: torch.Tensor) -> np.ndarray | None:
    """kv_lens' values, refused if any is negative; None on CUDA, where reading them back would sync."""
    if kv_lens.device.type != "cpu":
        return None
    lens = host_values(kv_lens)
    if (lens < 0).any():
        i = first_bad(lens < 0)
        raise ValueError(f"kv_lens[{i}] = {lens[i]} is negative")
    return lens


def _create_kv_indptr(kv_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    kv_indptr = torch.zeros(len(kv_lens) + 1, dtype=torch.int32, device=kv_lens.device)
    kv_indptr[1:] = torch.cumsum(pages_for(kv_lens, page_size), 0)
    return kv_indptr


def kv_last_page_len(kv_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """[bs] int32 tokens in each request's last page: in [1, page_size], and 0 for a request with no tokens.

    0 for an empty request because FlashInfer's planner derives a request's KV length as
    (num_pages - 1 clamped at 0) * page_size + last_page_len (`flashinfer.page.get_seq_lens`), so only 0
    makes that length 0; its kernels treat a request with no pages as empty whatever the value.
    """
    check_index_tensor("kv_lens", kv_lens)
    check_page_size(page_size)
    _checked_lens(kv_lens)
    return _kv_last_page_len(kv_lens, page_size)


def _kv_last_page_len(kv_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    return torch.where(kv_lens > 0, (kv_lens - 1) % page_size + 1, 0).to(torch.int32)


def create_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_start_idx: torch.Tensor | None = None,
    page_size: int = 1,
    kv_indices: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Gathers each request's KV slots (page_size 1) or page ids (page_size > 1) into one flat array.

    Args:
        req_to_token: [num_rows, max_context_len] int32 (int64 accepted) slot table.
        req_pool_indices: [bs] int32/int64 row of each request.
        kv_lens: [bs] int32/int64 KV tokens of each request.
        kv_indptr: [bs + 1] int32/int64 offsets into kv_indices, counting pages:
            kv_indptr[i+1] - kv_indptr[i] must be ceil(kv_lens[i] / page_size) (see `create_kv_indptr`).
        kv_start_idx: optional [bs] first token of each request's range (a multiple of page_size).
        page_size: tokens per page.
        kv_indices: optional int32 output of at least kv_indptr[-1] entries; passing it avoids the
            device-to-host read of kv_indptr[-1] that sizing a new output costs on CUDA.
        backend: None (Triton on CUDA or under TRITON_INTERPRET=1, else torch), "triton" or "torch".

    Returns:
        kv_indices [kv_indptr[-1]] int32 (or the given buffer) with, for j < ceil(kv_lens[i]/page_size),
        kv_indices[kv_indptr[i] + j] = req_to_token[req_pool_indices[i], kv_start_idx[i] + j*page_size]
        // page_size. Entries outside those ranges are left untouched.

    Shapes and dtypes are always checked; values (row range, lengths, alignment, kv_indptr consistency)
    only on CPU tensors, since reading them on CUDA would cost a host sync on the decode hot path.
    """
    _check_args(req_to_token, req_pool_indices, kv_lens, kv_indptr, kv_start_idx, page_size, kv_indices)
    return _create_kv_indices(req_to_token, req_pool_indices, kv_lens, kv_indptr, kv_start_idx, page_size,
                              kv_indices, backend)


def _create_kv_indices(req_to_token, req_pool_indices, kv_lens, kv_indptr, kv_start_idx=None, page_size=1,
                       kv_indices=None, backend=None) -> torch.Tensor:
    """create_kv_indices' body, for callers that checked its arguments (the metadata builders)."""
    if kv_indices is None:
        kv_indices = torch.empty(int(kv_indptr[-1]), dtype=torch.int32, device=req_to_token.device)
    if len(kv_lens) == 0:
        return kv_indices
    if use_triton(_create_kv_indices_kernel, req_to_token.device, backend):
        _launch(req_to_token, req_pool_indices, kv_lens, kv_indptr, kv_start_idx, page_size, kv_indices)
    else:
        _create_kv_indices_torch(req_to_token, req_pool_indices, kv_lens, kv_indptr, kv_start_idx, page_size,
                                 kv_indices)
    return kv_indices


@triton_jit
def _create_kv_indices_kernel(
    req_to_token_ptr, req_pool_indices_ptr, kv_lens_ptr, kv_indptr_ptr, kv_start_idx_ptr, kv_indices_ptr,
    row_stride, col_stride,
    PAGE_SIZE: tl.constexpr, HAS_START: tl.constexpr, BLOCK: tl.constexpr,
):
    # Program (i, s) copies blocks s, s + S, s + 2S, ... of request i, S = the grid's second dimension.
    req = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    row = tl.load(req_pool_indices_ptr + req).to(tl.int64)
    num = (tl.load(kv_lens_ptr + req).to(tl.int64) + PAGE_SIZE - 1) // PAGE_SIZE  # int32 lengths would wrap
    src = req_to_token_ptr + row * row_stride
    if HAS_START:
        src += tl.load(kv_start_idx_ptr + req).to(tl.int64) * col_stride
    dst = kv_indices_ptr + tl.load(kv_indptr_ptr + req)
    for first in range(split * BLOCK, num, num_splits * BLOCK):
        j = first + tl.arange(0, BLOCK)
        mask = j < num
        slots = tl.load(src + j * (PAGE_SIZE * col_stride), mask=mask)
        if PAGE_SIZE > 1:
            slots = slots // PAGE_SIZE
        tl.store(dst + j, slots.to(tl.int32), mask=mask)


def _launch(req_to_token, req_pool_indices, kv_lens, kv_indptr, kv_start_idx, page_size, kv_indices):
    bs = len(kv_lens)
    has_start = kv_start_idx is not None
    grid = (bs, _num_splits(bs, req_to_token.device))
    _create_kv_indices_kernel[grid](
        req_to_token, req_pool_indices, kv_lens, kv_indptr, kv_start_idx if has_start else kv_lens, kv_indices,
        req_to_token.stride(0), req_to_token.stride(1),
        PAGE_SIZE=int(page_size), HAS_START=has_start, BLOCK=BLOCK,
    )


def _num_splits(batch_size: int, device: torch.device) -> int:
    """Programs per request: enough to fill the GPU without reading the lengths (that would sync)."""
    if device.type == "cuda":
        target = PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = CPU_PROGRAMS
    return max(1, min(MAX_SPLITS, target // batch_size))


def _create_kv_indices_torch(req_to_token, req_pool_indices, kv_lens, kv_indptr, kv_start_idx, page_size,
                             kv_indices):
    # A loop over requests, not tokens: each request's entries are one strided slice of its row, copied with
    # no temporaries. A vectorized gather needs several token-sized int64 temporaries and loses badly on the
    # CPU. On the host the slices are taken from numpy views, whose slicing costs a fraction of torch's.
    rows, lens = req_pool_indices.tolist(), kv_lens.tolist()
    starts = [0] * len(lens) if kv_start_idx is None else kv_start_idx.tolist()
    first, last = int(kv_indptr[0]), int(kv_indptr[-1])
    on_host = req_to_token.device.type == "cpu"
    # Page ids: the page-start slots are gathered in the table's dtype and divided before they are narrowed
    # to int32, as the kernel does.
    gathered = kv_indices[first:last] if page_size == 1 else req_to_token.new_empty(last - first)
    table, dst = (req_to_token.numpy(), gathered.numpy()) if on_host else (req_to_token, gathered)
    pos = 0
    for row, n, start in zip(rows, lens, starts):
        slots = table[row, start:start + n:page_size]
        dst[pos:pos + len(slots)] = slots
        pos += len(slots)
    if page_size == 1 or last == first:
        return
    if on_host and dst.min() >= 0:
        # Floor division equals the kernel's truncating one on non-negative ids, and numpy divides ints by a
        # scalar faster than torch.
        np.floor_divide(dst, page_size, out=kv_indices.numpy()[first:last], casting="unsafe")
    else:
        kv_indices[first:last] = torch.div(gathered, page_size, rounding_mode="trunc")


def _check_args(req_to_token, req_pool_indices, kv_lens, kv_indptr, kv_start_idx, page_size, kv_indices):
    check_gather_args(req_to_token, req_pool_indices, kv_lens, kv_start_idx, page_size)
    check_index_tensor("kv_indptr", kv_indptr)
    check_length("kv_indptr", kv_indptr, len(req_pool_indices) + 1, "batch size + 1")
    if kv_indices is not None:
        check_index_tensor("kv_indices", kv_indices)
        if kv_indices.dtype != torch.int32:
            raise TypeError(f"kv_indices must have dtype int32 (FlashInfer's index type), got {kv_indices.dtype}")
    check_same_device(req_to_token.device, kv_indptr=kv_indptr, kv_indices=kv_indices)
    if req_to_token.device.type != "cpu":
        return
    indptr = host_values(kv_indptr)
    if indptr[0] < 0:
        raise ValueError(f"kv_indptr[0] = {indptr[0]} is negative")
    num = pages_for(host_values(kv_lens), page_size)
    step = indptr[1:] - indptr[:-1]
    if (step != num).any():
        i = first_bad(step != num)
        raise ValueError(f"kv_indptr[{i + 1}] - kv_indptr[{i}] = {step[i]} must equal the request's "
                         f"page count ceil(kv_lens[{i}] / page_size) = {num[i]}")
    if kv_indices is not None and len(kv_indices) < indptr[-1]:
        raise ValueError(f"kv_indices has {len(kv_indices)} entries, kv_indptr[-1] needs {indptr[-1]}")


def check_gather_args(req_to_token, req_pool_indices, kv_lens, kv_start_idx, page_size, *,
                      lens_name: str = "kv_lens") -> None:
    """Raises unless gathering each request's kv_lens[i] slots (from column kv_start_idx[i]) out of
    req_to_token is well defined: index tensors on one device, one length per request, rows in range,
    lengths non-negative and within max_context_len, and (page_size > 1) each range starting a page. Values
    are read on CPU tensors only. The metadata builders check their arguments with it, calling the
    lengths by their own name (`lens_name`)."""
    check_page_size(page_size)
    check_index_tensor("req_to_token", req_to_token, dim=2)
    check_index_tensor("req_pool_indices", req_pool_indices)
    check_index_tensor(lens_name, kv_lens)
    bs = len(req_pool_indices)
    check_length(lens_name, kv_lens, bs, "one per request, len(req_pool_indices)")
    if kv_start_idx is not None:
        check_index_tensor("kv_start_idx", kv_start_idx)
        check_length("kv_start_idx", kv_start_idx, bs, "one per request, len(req_pool_indices)")
    device = req_to_token.device
    check_same_device(device, req_pool_indices=req_pool_indices, kv_start_idx=kv_start_idx, **{lens_name: kv_lens})
    if device.type == "cpu":
        _check_gather_values(req_to_token, req_pool_indices, kv_lens, kv_start_idx, page_size, lens_name)


def _check_gather_values(req_to_token, req_pool_indices, kv_lens, kv_start_idx, page_size, lens_name):
    num_rows, max_context_len = req_to_token.shape
    rows = check_rows(req_pool_indices, num_rows)
    lens = host_values(kv_lens)
    if (lens < 0).any():
        i = first_bad(lens < 0)
        raise ValueError(f"{lens_name}[{i}] = {lens[i]} is negative")
    end = lens
    if kv_start_idx is not None:
        start = host_values(kv_start_idx)
        if (start < 0).any():
            i = first_bad(start < 0)
            raise ValueError(f"kv_start_idx[{i}] = {start[i]} is negative")
        if (start % page_size != 0).any():
            i = first_bad(start % page_size != 0)
            raise ValueError(f"kv_start_idx[{i}] = {start[i]} is not a multiple of page_size {page_size}")
        end = start + lens
    if (end > max_context_len).any():
        i = first_bad(end > max_context_len)
        raise IndexError(f"request {i}: tokens up to {end[i]} exceed req_to_token's max_context_len "
                         f"{max_context_len}")
    if page_size > 1:
        # A page id is slot // page_size, right only if the slot starts its page; a row whose first slot
        # does not would send FlashInfer to the wrong slots. Later pages follow the allocator's whole pages.
        starts = np.zeros_like(lens) if kv_start_idx is None else start
        used = lens > 0
        first = req_to_token.numpy()[rows[used], starts[used]]
        if (first % page_size != 0).any():
            i = int(np.flatnonzero(used)[first_bad(first % page_size != 0)])
            raise ValueError(f"request {i}: its first slot {first[first % page_size != 0][0]} does not start a "
                             f"page of {page_size} slots, so its page id would be wrong")
