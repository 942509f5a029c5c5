"""Slot computation of a paged allocator: which slot each extend or decode token gets.

Page p holds slots p*page_size .. p*page_size + page_size - 1. A request's new tokens first fill the
rest of its partial last page (the slots right after `last_loc`, the slot of its last cached token), then
take whole new pages from `free_pages` in batch order. The allocator owns the free list: it calls
`num_new_pages` (one host read on CUDA), returns None itself on a shortage, and passes the pages to use
and `extend_num_tokens` (known on the host) to `alloc_extend_slots`, which then reads nothing back.
"""

from __future__ import annotations

import torch

from kernels._dispatch import (
    check_index_tensor, check_length, check_page_size, check_same_device, exclusive_cumsum, first_bad, host_values,
    tl, triton_jit, use_triton)

BLOCK = 1024


def new_pages_per_request(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """[bs] int64 whole new pages each request takes: ceil(seq_lens / page_size) - ceil(prefix_lens / page_size)."""
    check_page_size(page_size)
    check_index_tensor("prefix_lens", prefix_lens)
    check_index_tensor("seq_lens", seq_lens)
    check_length("prefix_lens", prefix_lens, len(seq_lens), "one per request, len(seq_lens)")
    return (seq_lens.long() + page_size - 1) // page_size - (prefix_lens.long() + page_size - 1) // page_size


def num_new_pages(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> int:
    """Total whole new pages an extend of tokens prefix_lens[i]..seq_lens[i]-1 takes; one host read on CUDA."""
    return int(new_pages_per_request(prefix_lens, seq_lens, page_size).sum())


def alloc_extend_slots(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
    *,
    extend_num_tokens: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """The slot of every extend token, requests concatenated in batch order.

    Args:
        prefix_lens: [bs] int32/int64 tokens each request already has.
        seq_lens: [bs] tokens after the extend (>= prefix_lens).
        last_loc: [bs] slot of token prefix_lens[i] - 1; read only when prefix_lens[i] % page_size != 0
            (-1 or anything for a request that starts on a page boundary).
        free_pages: [>= num_new_pages(...)] page ids to take, in order; request i takes
            free_pages[o_i : o_i + new_i] with o_i the pages of the requests before it.
        page_size: tokens per page.
        extend_num_tokens: sum(seq_lens - prefix_lens) when the caller knows it on the host; saves the
            device-to-host read that sizing the output costs on CUDA.
        backend: None (Triton on CUDA or under TRITON_INTERPRET=1, else torch), "triton" or "torch".

    Returns:
        out_cache_loc [sum(seq_lens - prefix_lens)] int64: for the j-th extend token of request i, slot
        last_loc[i] + 1 + j while j < ceil(prefix_lens[i] / page_size) * page_size - prefix_lens[i] (its
        partial page), else free_pages[o_i + k // page_size] * page_size + k % page_size for the k-th
        remaining token. The number of pages taken is `num_new_pages(prefix_lens, seq_lens, page_size)`.

    A shortage is the caller's to detect (it returns None); too few `free_pages` here is a bad argument,
    caught on CPU tensors. As elsewhere, values are checked only on CPU tensors, shapes always.
    """
    _check_args(prefix_lens, seq_lens, last_loc, free_pages, page_size, extend_num_tokens)
    if extend_num_tokens is None:
        extend_num_tokens = int((seq_lens - prefix_lens).sum())
    out_cache_loc = torch.empty(extend_num_tokens, dtype=torch.int64, device=seq_lens.device)
    if len(seq_lens) == 0:
        return out_cache_loc
    if use_triton(_alloc_extend_kernel, seq_lens.device, backend):
        _alloc_extend_kernel[(len(seq_lens),)](
            prefix_lens, seq_lens, last_loc, free_pages, out_cache_loc, PAGE_SIZE=int(page_size), BLOCK=BLOCK)
    else:
        _alloc_extend_torch(prefix_lens, seq_lens, last_loc, free_pages, page_size, out_cache_loc)
    return out_cache_loc


def alloc_decode_slots(
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """[bs] int64 slot for each request's new token seq_lens[i] - 1 (seq_lens count it).

    The new token goes to last_loc[i] + 1 unless it starts a page; the requests that start one take
    free_pages in batch order (`num_new_pages(seq_lens - 1, seq_lens, page_size)` of them).
    """
    check_index_tensor("seq_lens", seq_lens)
    if seq_lens.device.type == "cpu" and (host_values(seq_lens) < 1).any():
        i = first_bad(host_values(seq_lens) < 1)
        raise ValueError(f"seq_lens[{i}] = {int(seq_lens[i])}: decode lengths count the new token, so are >= 1")
    return alloc_extend_slots(seq_lens - 1, seq_lens, last_loc, free_pages, page_size,
                              extend_num_tokens=len(seq_lens), backend=backend)


@triton_jit
def _alloc_extend_kernel(
    prefix_lens_ptr, seq_lens_ptr, last_loc_ptr, free_pages_ptr, out_cache_loc_ptr,
    PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr,
):
    req = tl.program_id(0)
    # Tokens and pages taken by the requests before this one, summed in-kernel so that the step is one
    # launch (a torch.cumsum would add two).
    token_offset = tl.zeros([], dtype=tl.int64)
    page_offset = tl.zeros([], dtype=tl.int64)
    for first in range(0, req, BLOCK):
        k = first + tl.arange(0, BLOCK)
        mask = k < req
        prefix = tl.load(prefix_lens_ptr + k, mask=mask, other=0).to(tl.int64)
        seq = tl.load(seq_lens_ptr + k, mask=mask, other=0).to(tl.int64)
        token_offset += tl.sum(seq - prefix, axis=0)
        page_offset += tl.sum((seq + PAGE_SIZE - 1) // PAGE_SIZE - (prefix + PAGE_SIZE - 1) // PAGE_SIZE, axis=0)
    prefix_len = tl.load(prefix_lens_ptr + req).to(tl.int64)
    num = tl.load(seq_lens_ptr + req).to(tl.int64) - prefix_len
    next_slot = tl.load(last_loc_ptr + req).to(tl.int64) + 1
    in_partial = tl.minimum(num, (prefix_len + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE - prefix_len)
    for first in range(0, num, BLOCK):
        j = first + tl.arange(0, BLOCK)
        mask = j < num
        k = tl.maximum(j - in_partial, 0)  # index among the tokens that go to new pages
        on_new_page = j >= in_partial
        page = tl.load(free_pages_ptr + page_offset + k // PAGE_SIZE, mask=mask & on_new_page, other=0)
        slot = tl.where(on_new_page, page.to(tl.int64) * PAGE_SIZE + k % PAGE_SIZE, next_slot + j)
        tl.store(out_cache_loc_ptr + token_offset + j, slot, mask=mask)


def _alloc_extend_torch(prefix_lens, seq_lens, last_loc, free_pages, page_size, out_cache_loc):
    device = seq_lens.device
    prefix = prefix_lens.long()
    num = seq_lens.long() - prefix
    in_partial = torch.minimum(num, (prefix + page_size - 1) // page_size * page_size - prefix)
    page_offset = exclusive_cumsum(new_pages_per_request(prefix_lens, seq_lens, page_size))
    total = len(out_cache_loc)
    req = torch.repeat_interleave(torch.arange(len(num), device=device), num, output_size=total)
    j = torch.arange(total, device=device) - exclusive_cumsum(num)[req]
    k = j - in_partial[req]
    out_cache_loc.copy_(last_loc.long()[req] + 1 + j)
    on_new_page = k >= 0
    k = k[on_new_page]
    pages = free_pages.long()[page_offset[req[on_new_page]] + k // page_size]
    out_cache_loc[on_new_page] = pages * page_size + k % page_size


def _check_args(prefix_lens, seq_lens, last_loc, free_pages, page_size, extend_num_tokens):
    check_page_size(page_size)
    for name, t in (("prefix_lens", prefix_lens), ("seq_lens", seq_lens), ("last_loc", last_loc),
                    ("free_pages", free_pages)):
        check_index_tensor(name, t)
    bs = len(seq_lens)
    check_length("prefix_lens", prefix_lens, bs, "one per request, len(seq_lens)")
    check_length("last_loc", last_loc, bs, "one per request, len(seq_lens)")
    if extend_num_tokens is not None and (isinstance(extend_num_tokens, bool) or extend_num_tokens < 0):
        raise ValueError(f"extend_num_tokens must be a non-negative int, got {extend_num_tokens!r}")
    device = seq_lens.device
    check_same_device(device, prefix_lens=prefix_lens, last_loc=last_loc, free_pages=free_pages)
    if device.type == "cpu":
        _check_values(prefix_lens, seq_lens, last_loc, free_pages, page_size, extend_num_tokens)


def _check_values(prefix_lens, seq_lens, last_loc, free_pages, page_size, extend_num_tokens):
    prefix, seq, last = host_values(prefix_lens), host_values(seq_lens), host_values(last_loc)
    bad = (prefix < 0) | (seq < prefix)
    if bad.any():
        i = first_bad(bad)
        raise ValueError(f"request {i}: need 0 <= prefix_lens <= seq_lens, got {prefix[i]} and {seq[i]}")
    num_extend = int((seq - prefix).sum())
    if extend_num_tokens is not None and extend_num_tokens != num_extend:
        raise ValueError(f"extend_num_tokens {extend_num_tokens} != sum(seq_lens - prefix_lens) = {num_extend}")
    needed = int(((seq + page_size - 1) // page_size - (prefix + page_size - 1) // page_size).sum())
    if len(free_pages) < needed:
        raise ValueError(f"free_pages has {len(free_pages)} pages, the extend needs {needed}; check "
                         "num_new_pages() before computing slots")
    used = host_values(free_pages)[:needed]
    if (used <= 0).any():
        # Page 0 holds the padding slot 0; a negative page would address slots before the pool.
        i = first_bad(used <= 0)
        raise ValueError(f"free_pages[{i}] = {used[i]}: pages start at 1 (page 0 holds the padding slot)")
    partial = (prefix % page_size != 0) & (seq > prefix)
    bad = partial & ((last < 0) | ((last + 1) % page_size != prefix % page_size))
    if bad.any():
        i = first_bad(bad)
        raise ValueError(f"request {i}: last_loc {last[i]} is not the slot of token {prefix[i] - 1} "
                         f"(expected offset {(prefix[i] - 1) % page_size} in its page)")
