"""GPU checks: the Triton kernels against their torch fallbacks on CUDA tensors, and FlashInfer's paged
decode / prefill against `reference_paged_attention` over metadata built by kvmem. Skipped without CUDA
(and the FlashInfer tests without the flashinfer package)."""

import pytest
import torch

from kvmem._paging import pages_for
from kvmem.allocator import PagedTokenAllocator
from kvmem.attention import FlashInferAttention, build_decode_metadata, build_extend_metadata, reference_paged_attention
from kvmem.kernels.kv_indices import create_kv_indices, create_kv_indptr
from kvmem.kernels.req_to_token import write_req_to_token

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = "cuda"
HEAD_DIM = 128
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


def random_lens(n, high, seed):
    return torch.randint(0, high, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("bs, max_len", [(1, 40000), (7, 9000), (96, 3000)])
def test_kv_indices_triton_equals_torch_on_cuda(page_size, bs, max_len):
    g = torch.Generator().manual_seed(bs)
    req_to_token = torch.randint(0, 1 << 24, (bs + 3, max_len + 64), generator=g, dtype=torch.int32).to(CUDA)
    rows = torch.randperm(bs + 3, generator=g)[:bs].to(CUDA)
    lens = random_lens(bs, max_len, bs).to(CUDA)
    starts = (torch.randint(0, 64 // page_size, (bs,), generator=g) * page_size).to(CUDA)
    kv_indptr = create_kv_indptr(lens, page_size)
    args = (req_to_token, rows, lens, kv_indptr, starts, page_size)
    assert torch.equal(create_kv_indices(*args, backend="triton"), create_kv_indices(*args, backend="torch"))


@pytest.mark.parametrize("page_size", [1, 16])
def test_write_triton_equals_torch_on_cuda(page_size):
    bs = 48
    prefix = random_lens(bs, 3000, 1) + 1
    seq = prefix + random_lens(bs, 3000, 2) + 1
    alloc = PagedTokenAllocator(int(pages_for(seq, page_size).sum() + bs) * page_size, page_size)
    first = alloc.alloc_extend(torch.zeros(bs, dtype=torch.int64), prefix, torch.full((bs,), -1))
    last = first[torch.cumsum(prefix, 0) - 1]  # each request's slot of token prefix - 1
    slots = alloc.alloc_extend(prefix, seq, last).to(CUDA)
    prefix, seq = prefix.to(CUDA), seq.to(CUDA)
    tables = []
    for backend in ("triton", "torch"):
        table = torch.zeros(bs + 2, 6000, dtype=torch.int32, device=CUDA)
        write_req_to_token(table, torch.arange(bs, device=CUDA) + 1, prefix, seq, slots, backend=backend)
        tables.append(table)
    assert torch.equal(*tables)


def paged_batch(prefix_lens, seq_lens, page_size, num_kv_heads, layout, dtype, seed=0):
    """req_to_token filled through the kernels (on CPU), random paged K/V on CUDA."""
    g = torch.Generator().manual_seed(seed)
    prefix_lens, seq_lens = torch.tensor(prefix_lens), torch.tensor(seq_lens)
    bs = len(seq_lens)
    num_pages = int(pages_for(seq_lens, page_size).sum()) + 8
    zeros = torch.zeros(bs, dtype=torch.int64)
    alloc = PagedTokenAllocator((num_pages - 1) * page_size, page_size)
    alloc.alloc((num_pages - 1) * page_size)  # free the pages back in a random order: scattered slots
    pages = torch.randperm(num_pages - 1, generator=g) + 1
    alloc.free((pages[:, None] * page_size + torch.arange(page_size)).reshape(-1))
    slots = alloc.alloc_extend(zeros, seq_lens, zeros - 1)
    req_to_token = torch.zeros(bs + 1, int(seq_lens.max()), dtype=torch.int32)
    rows = torch.arange(bs) + 1
    write_req_to_token(req_to_token, rows, zeros, seq_lens, slots)
    shape = ((num_pages, page_size, num_kv_heads, HEAD_DIM) if layout == "NHD"
             else (num_pages, num_kv_heads, page_size, HEAD_DIM))
    k_pages = torch.randn(shape, generator=g).to(CUDA, dtype)
    v_pages = torch.randn(shape, generator=g).to(CUDA, dtype)
    return req_to_token.to(CUDA), rows.to(CUDA), prefix_lens.to(CUDA), seq_lens.to(CUDA), (k_pages, v_pages)


CASES = [pytest.param(ps, layout, heads, torch.float16, id=f"ps{ps}-{layout}-{heads[0]}q{heads[1]}kv-fp16")
         for ps in (1, 16) for layout in ("NHD", "HND") for heads in ((8, 8), (32, 8), (32, 4))]
CASES.append(pytest.param(16, "NHD", (32, 8), torch.bfloat16, id="ps16-NHD-32q8kv-bf16"))


@pytest.mark.parametrize("page_size, layout, heads, dtype", CASES)
def test_flashinfer_decode_equals_reference(page_size, layout, heads, dtype):
    pytest.importorskip("flashinfer")
    num_qo_heads, num_kv_heads = heads
    seq_lens = [1, 17, 300, 2049, 16, 1000]
    req_to_token, rows, _, seq, kv_cache = paged_batch(seq_lens, seq_lens, page_size, num_kv_heads, layout, dtype)
    metadata = build_decode_metadata(req_to_token, rows, seq, page_size)
    attention = FlashInferAttention(num_qo_heads, num_kv_heads, HEAD_DIM, kv_layout=layout)
    attention.plan_decode(metadata, q_dtype=dtype)
    q = torch.randn(len(seq_lens), num_qo_heads, HEAD_DIM, device=CUDA, dtype=dtype)
    want = reference_paged_attention(q, *kv_cache, metadata.qo_indptr, metadata.kv_indptr, metadata.kv_indices,
                                     metadata.kv_last_page_len, layout=layout)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(attention.run(q, kv_cache), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("page_size, layout, heads, dtype", CASES)
def test_flashinfer_causal_extend_equals_reference(page_size, layout, heads, dtype):
    pytest.importorskip("flashinfer")
    num_qo_heads, num_kv_heads = heads
    prefix_lens, seq_lens = [0, 100, 16, 5, 1999], [37, 130, 17, 300, 2049]
    req_to_token, rows, prefix, seq, kv_cache = paged_batch(prefix_lens, seq_lens, page_size, num_kv_heads,
                                                            layout, dtype)
    metadata = build_extend_metadata(req_to_token, rows, prefix, seq, page_size)
    attention = FlashInferAttention(num_qo_heads, num_kv_heads, HEAD_DIM, kv_layout=layout)
    attention.plan_extend(metadata, q_dtype=dtype)
    q = torch.randn(int(metadata.qo_indptr[-1]), num_qo_heads, HEAD_DIM, device=CUDA, dtype=dtype)
    want = reference_paged_attention(q, *kv_cache, metadata.qo_indptr, metadata.kv_indptr, metadata.kv_indices,
                                     metadata.kv_last_page_len, layout=layout)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(attention.run(q, kv_cache), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("heads", [(8, 8), (32, 4)], ids=["8q8kv", "32q4kv-tensor-core-decode"])
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_flashinfer_reads_an_fp8_kv_cache_under_float16_queries(heads, mode):
    # FlashInfer's "auto" backend picks its FA3 kernels on Hopper, which take fp8 K/V only with fp8 queries:
    # FlashInferAttention plans these on FA2. The reference reads the same fp8 values, upcast.
    pytest.importorskip("flashinfer")
    num_qo_heads, num_kv_heads = heads
    head_dim, page_size = 64, 16
    prefix_lens, seq_lens = ([1, 17, 300, 2049], [1, 17, 300, 2049]) if mode == "decode" else \
        ([0, 100, 16, 1999], [37, 130, 17, 2049])
    req_to_token, rows, prefix, seq, (k, v) = paged_batch(prefix_lens, seq_lens, page_size, num_kv_heads, "NHD",
                                                          torch.float16)
    k8, v8 = (t[..., :head_dim].contiguous().to(torch.float8_e4m3fn) for t in (k, v))
    attention = FlashInferAttention(num_qo_heads, num_kv_heads, head_dim)
    if mode == "decode":
        metadata = build_decode_metadata(req_to_token, rows, seq, page_size)
        attention.plan_decode(metadata, q_dtype=torch.float16, kv_dtype=torch.float8_e4m3fn)
    else:
        metadata = build_extend_metadata(req_to_token, rows, prefix, seq, page_size)
        attention.plan_extend(metadata, q_dtype=torch.float16, kv_dtype=torch.float8_e4m3fn)
    q = torch.randn(int(metadata.qo_indptr[-1]), num_qo_heads, head_dim, device=CUDA, dtype=torch.float16)
    want = reference_paged_attention(q, k8.to(torch.float16), v8.to(torch.float16), metadata.qo_indptr,
                                     metadata.kv_indptr, metadata.kv_indices, metadata.kv_last_page_len)
    torch.testing.assert_close(attention.run(q, (k8, v8)), want, atol=2e-2, rtol=2e-2)
