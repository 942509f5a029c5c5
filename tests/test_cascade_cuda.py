"""GPU checks of cascade attention: FlashInfer's lse base and merge against kvmem's, and its
MultiLevelCascadeAttentionWrapper planned by kvmem against the CPU reference and against flat BatchDecode.
Skipped without CUDA, and without the flashinfer package."""

import pytest
import torch

from kvmem import PagedTokenAllocator, RadixCache, Req, ReqToTokenPool, Scheduler, SchedulerConfig, TokenAllocator
from kvmem.attention import (
    CascadeMetadata,
    FlashInferAttention,
    PagedKVMetadata,
    build_cascade_metadata,
    merge_state,
    reference_cascade_attention,
    reference_paged_attention,
)
from kvmem.batch import ForwardMode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = "cuda"
HEAD_DIM = 128
TOLERANCE = 5e-3  # fp16


def to_cuda(md):
    if isinstance(md, CascadeMetadata):
        return CascadeMetadata(tuple(to_cuda(m) for m in md.levels), md.request_order.to(CUDA), md.qo_order.to(CUDA))
    return PagedKVMetadata(md.qo_indptr.to(CUDA), md.kv_indptr.to(CUDA), md.kv_indices.to(CUDA),
                           md.kv_last_page_len.to(CUDA), md.page_size)


def test_flashinfer_returns_lse_in_base_two_as_the_reference_does():
    flashinfer = pytest.importorskip("flashinfer")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, HEAD_DIM, generator=g).to(CUDA, torch.float16)
    k = torch.randn(40, 2, HEAD_DIM, generator=g).to(CUDA, torch.float16)
    v = torch.randn(40, 2, HEAD_DIM, generator=g).to(CUDA, torch.float16)
    out, lse = flashinfer.single_prefill_with_kv_cache(q, k, v, causal=False, return_lse=True)
    want_out, want_lse = reference_paged_attention(q, k[:, None], v[:, None], torch.tensor([0, 3], device=CUDA),
                                                   torch.tensor([0, 40], device=CUDA),
                                                   torch.arange(40, device=CUDA), torch.tensor([1], device=CUDA),
                                                   causal=False, return_lse=True)
    torch.testing.assert_close(out, want_out, atol=TOLERANCE, rtol=TOLERANCE)
    torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=1e-3)


def test_flashinfer_merge_state_equals_kvmem_merge_state():
    flashinfer = pytest.importorskip("flashinfer")
    g = torch.Generator().manual_seed(1)
    v_a, v_b = (torch.randn(64, 8, HEAD_DIM, generator=g).to(CUDA, torch.float16) for _ in range(2))
    s_a, s_b = (4 * torch.randn(64, 8, generator=g).to(CUDA) for _ in range(2))
    got_v, got_s = flashinfer.merge_state(v_a, s_a, v_b, s_b)
    want_v, want_s = merge_state(v_a, s_a, v_b, s_b)
    torch.testing.assert_close(got_v, want_v, atol=TOLERANCE, rtol=TOLERANCE)
    torch.testing.assert_close(got_s, want_s, atol=1e-4, rtol=1e-5)


def decode_batch(page_size):
    """A decode batch over a 1024-token system prompt, two 300-token chat histories under it, one request
    sharing nothing, and K/V pages on CUDA."""
    pool = ReqToTokenPool(32, 4096)
    capacity = 32768
    alloc = TokenAllocator(capacity) if page_size == 1 else PagedTokenAllocator(capacity, page_size)
    tree = RadixCache(pool, alloc, page_size=page_size)
    sched = Scheduler(pool, alloc, tree, SchedulerConfig(chunked_prefill_size=None))
    system = list(range(100, 1124))
    chats = [list(range(5000 + 1000 * c, 5300 + 1000 * c)) for c in range(2)]
    prompts = [system + chats[i % 3] + [90000 + i] * (5 + i) if i % 3 < 2 else system + [90000 + i] * (7 + i)
               for i in range(12)] + [list(range(200000, 200500))]
    for i, p in enumerate(prompts):
        sched.add_request(Req(i, p, max_new_tokens=4))
    while True:
        batch = sched.step()
        if batch.forward_mode is ForwardMode.DECODE:
            break
        sched.process_batch_result(batch, [7] * batch.batch_size())
    g = torch.Generator().manual_seed(page_size)
    shape = (capacity // page_size + 1, page_size, 8, HEAD_DIM)
    kv_cache = tuple(torch.randn(shape, generator=g).to(CUDA, torch.float16) for _ in range(2))
    return tree, batch, kv_cache


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("max_levels", [2, 3])
def test_flashinfer_cascade_equals_reference_and_flat_decode(page_size, max_levels):
    pytest.importorskip("flashinfer")
    tree, batch, kv_cache = decode_batch(page_size)
    md = build_cascade_metadata(batch, tree, min_shared_tokens=256, max_levels=max_levels)
    assert md.num_levels == max_levels
    flat = to_cuda(batch.attention_metadata())
    q = torch.randn(batch.batch_size(), 32, HEAD_DIM, device=CUDA, dtype=torch.float16)
    attention = FlashInferAttention(32, 8, HEAD_DIM)
    attention.plan_cascade(to_cuda(md), q_dtype=torch.float16)
    got = attention.run(q, kv_cache)
    want = reference_cascade_attention(q, kv_cache, to_cuda(md))
    torch.testing.assert_close(got, want, atol=TOLERANCE, rtol=TOLERANCE)
    attention.plan_decode(flat, q_dtype=torch.float16)
    torch.testing.assert_close(got, attention.run(q, kv_cache), atol=TOLERANCE, rtol=TOLERANCE)
