import pytest
import torch
import torch.nn.functional as F

from kvmem.allocator import PagedTokenAllocator
from kvmem.attention import FlashInferAttention, build_decode_metadata, build_extend_metadata, reference_paged_attention
from kvmem.kernels.req_to_token import write_req_to_token


def contiguous_attention(q, k, v, causal=True):
    """Llama-style oracle over one request's contiguous cache: q [qo, Hq, D], k/v [kv, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    qo_len, kv_len = q.shape[0], k.shape[0]
    # Query t sits at position kv_len - qo_len + t (bottom-right alignment).
    mask = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - qo_len, kv_len)[:, None] if causal else None
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)


def scrambled_allocator(num_pages, page_size, generator):
    """A paged allocator over pages 1..num_pages that hands them out in a random order."""
    alloc = PagedTokenAllocator(num_pages * page_size, page_size)
    alloc.alloc(num_pages * page_size)
    pages = torch.randperm(num_pages, generator=generator) + 1
    alloc.free((pages[:, None] * page_size + torch.arange(page_size)).reshape(-1))
    return alloc


class PagedBatch:
    """Requests whose prefixes were allocated first and extended later, through the kernels, as a server does."""

    def __init__(self, prefix_lens, seq_lens, page_size, num_kv_heads, head_dim, layout, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.page_size, self.layout = page_size, layout
        self.prefix_lens, self.seq_lens = torch.tensor(prefix_lens), torch.tensor(seq_lens)
        bs = len(seq_lens)
        self.rows = torch.randperm(bs + 2, generator=g)[:bs]
        self.req_to_token = torch.zeros(bs + 2, max(seq_lens) + 3, dtype=torch.int32)
        num_pages = sum(-(-s // page_size) for s in seq_lens) + 4
        self.alloc = scrambled_allocator(num_pages - 1, page_size, g)  # page 0 is the padding page
        self._extend(torch.zeros(bs, dtype=torch.int64), self.prefix_lens)
        self._extend(self.prefix_lens, self.seq_lens)
        self.k = [torch.randn(s, num_kv_heads, head_dim, generator=g) for s in seq_lens]
        self.v = [torch.randn(s, num_kv_heads, head_dim, generator=g) for s in seq_lens]
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k_pages, self.v_pages = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
        for i, s in enumerate(seq_lens):
            slots = self.req_to_token[self.rows[i], :s].long()
            for pages, values in ((self.k_pages, self.k[i]), (self.v_pages, self.v[i])):
                pages[slots // page_size, slots % page_size] = values
        if layout == "HND":
            self.k_pages = self.k_pages.transpose(1, 2).contiguous()
            self.v_pages = self.v_pages.transpose(1, 2).contiguous()

    def _extend(self, prefix_lens, seq_lens):
        grows = seq_lens > prefix_lens
        if not grows.any():
            return
        last_loc = self.req_to_token[self.rows, (prefix_lens - 1).clamp(min=0)].long()
        slots = self.alloc.alloc_extend(prefix_lens[grows], seq_lens[grows], last_loc[grows])
        write_req_to_token(self.req_to_token, self.rows, prefix_lens, seq_lens, slots)

    def attend(self, q, metadata):
        return reference_paged_attention(q, self.k_pages, self.v_pages, metadata.qo_indptr, metadata.kv_indptr,
                                         metadata.kv_indices, metadata.kv_last_page_len, layout=self.layout)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(2, 2), (4, 1), (6, 2)])
def test_decode_over_pages_equals_attention_over_contiguous_cache(layout, page_size, heads):
    num_qo_heads, num_kv_heads = heads
    seq_lens = [1, 5, 16, 17, 40]
    batch = PagedBatch([s - 1 for s in seq_lens], seq_lens, page_size, num_kv_heads, 8, layout)
    metadata = build_decode_metadata(batch.req_to_token, batch.rows, batch.seq_lens, page_size)
    q = torch.randn(len(seq_lens), num_qo_heads, 8)
    want = torch.cat([contiguous_attention(q[i:i + 1], batch.k[i], batch.v[i]) for i in range(len(seq_lens))])
    torch.testing.assert_close(batch.attend(q, metadata), want)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2)])
def test_causal_extend_with_prefixes_equals_attention_over_contiguous_cache(layout, page_size, heads):
    num_qo_heads, num_kv_heads = heads
    prefix_lens, seq_lens = [0, 3, 8, 9, 0], [5, 9, 12, 10, 1]
    batch = PagedBatch(prefix_lens, seq_lens, page_size, num_kv_heads, 8, layout, seed=1)
    metadata = build_extend_metadata(batch.req_to_token, batch.rows, batch.prefix_lens, batch.seq_lens, page_size)
    q = torch.randn(sum(seq_lens) - sum(prefix_lens), num_qo_heads, 8)
    qo = metadata.qo_indptr.tolist()
    want = torch.cat([contiguous_attention(q[qo[i]:qo[i + 1]], batch.k[i], batch.v[i]) for i in range(len(seq_lens))])
    torch.testing.assert_close(batch.attend(q, metadata), want)


def test_decode_metadata_is_a_csr_over_pages():
    req_to_token = torch.zeros(3, 12, dtype=torch.int32)
    req_to_token[2, :5] = torch.tensor([8, 9, 10, 11, 20])
    req_to_token[0, :4] = torch.tensor([4, 5, 6, 7])
    m = build_decode_metadata(req_to_token, torch.tensor([2, 0, 1]), torch.tensor([5, 4, 0]), page_size=4)
    assert m.qo_indptr.tolist() == [0, 1, 2, 3]
    assert m.kv_indptr.tolist() == [0, 2, 3, 3]
    assert m.kv_indices.tolist() == [2, 5, 1]
    assert m.kv_last_page_len.tolist() == [1, 4, 0]
    assert m.page_size == 4
    assert {t.dtype for t in (m.qo_indptr, m.kv_indptr, m.kv_indices, m.kv_last_page_len)} == {torch.int32}


def test_extend_metadata_queries_the_new_tokens_and_keys_the_whole_sequence():
    req_to_token = torch.arange(2 * 8, dtype=torch.int32).reshape(2, 8)
    m = build_extend_metadata(req_to_token, torch.tensor([1, 0]), torch.tensor([2, 0]), torch.tensor([5, 3]))
    assert m.qo_indptr.tolist() == [0, 3, 6]
    assert m.kv_indptr.tolist() == [0, 5, 8]
    assert m.kv_indices.tolist() == [8, 9, 10, 11, 12, 0, 1, 2]
    assert m.kv_last_page_len.tolist() == [1, 1]


def test_extend_metadata_rejects_prefix_longer_than_sequence():
    with pytest.raises(ValueError, match="request 0: need 0 <= prefix_lens <= seq_lens"):
        build_extend_metadata(torch.zeros(2, 8, dtype=torch.int32), torch.tensor([0]), torch.tensor([4]),
                              torch.tensor([3]))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_attention_through_the_kv_pool_equals_contiguous_attention(layout):
    from kvmem.kv_pool import MHAKVPool

    page_size, heads, head_dim, seq_lens = 4, 2, 8, [6, 3]
    pool = MHAKVPool(32, page_size, torch.float32, heads, head_dim, layer_num=2, layout=layout)
    req_to_token = torch.zeros(2, 8, dtype=torch.int32)
    rows, zeros, seqs = torch.tensor([1, 0]), torch.zeros(2, dtype=torch.int64), torch.tensor(seq_lens)
    alloc = PagedTokenAllocator(28, page_size)
    alloc.alloc(28)
    alloc.free((torch.tensor([5, 2, 7, 1, 3, 4, 6])[:, None] * page_size + torch.arange(page_size)).reshape(-1))
    slots = alloc.alloc_extend(zeros, seqs, zeros - 1)
    write_req_to_token(req_to_token, rows, zeros, seqs, slots)
    k, v = torch.randn(9, heads, head_dim), torch.randn(9, heads, head_dim)
    pool.set_kv_buffer(1, slots, k, v)
    m = build_extend_metadata(req_to_token, rows, zeros, seqs, page_size)
    q = torch.randn(9, 4, head_dim)
    got = reference_paged_attention(q, *pool.get_paged_kv_buffer(1), m.qo_indptr, m.kv_indptr, m.kv_indices,
                                    m.kv_last_page_len, layout=layout)
    want = torch.cat([contiguous_attention(q[:6], k[:6], v[:6]), contiguous_attention(q[6:], k[6:], v[6:])])
    torch.testing.assert_close(got, want)


def test_non_causal_reference_lets_every_query_see_every_key():
    batch = PagedBatch([0], [6], 4, 1, 8, "NHD")
    m = build_extend_metadata(batch.req_to_token, batch.rows, batch.prefix_lens, batch.seq_lens, 4)
    q = torch.randn(6, 2, 8)
    got = reference_paged_attention(q, batch.k_pages, batch.v_pages, m.qo_indptr, m.kv_indptr, m.kv_indices,
                                    m.kv_last_page_len, causal=False)
    torch.testing.assert_close(got, contiguous_attention(q, batch.k[0], batch.v[0], causal=False))


def test_reference_gives_zeros_for_a_request_without_keys():
    k_pages = torch.randn(4, 2, 1, 8)
    out = reference_paged_attention(torch.randn(1, 1, 8), k_pages, k_pages, torch.tensor([0, 1]),
                                    torch.tensor([0, 0]), torch.tensor([], dtype=torch.int32), torch.tensor([0]),
                                    causal=False)
    assert out.count_nonzero() == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(layout="HDN"), "layout must be one of"),
    (dict(q=torch.randn(2, 3, 8)), "must have a divisor of that many heads"),
    (dict(qo_indptr=torch.tensor([0, 3])), r"qo_indptr\[-1\] = 3 must equal q's 2 rows"),
    (dict(kv_last_page_len=torch.tensor([1])), "causal attention needs qo_len <= kv_len, got 2 > 1"),
    (dict(kv_last_page_len=torch.tensor([3])), r"kv_last_page_len must lie in \[0, page_size 2\], got 3"),
    (dict(kv_last_page_len=torch.tensor([-1])), r"kv_last_page_len must lie in \[0, page_size 2\], got -1"),
    (dict(kv_last_page_len=torch.tensor([5]), k_pages=torch.randn(4, 2, 4, 8), v_pages=torch.randn(4, 2, 4, 8),
          layout="HND"), r"page_size 4\], got 5"),  # HND: [pages, heads, page_size, dim]
])
def test_reference_rejects_inconsistent_arguments(kwargs, message):
    args = dict(q=torch.randn(2, 2, 8), k_pages=torch.randn(4, 2, 2, 8), v_pages=torch.randn(4, 2, 2, 8),
                qo_indptr=torch.tensor([0, 2]), kv_indptr=torch.tensor([0, 1]), kv_indices=torch.tensor([1]),
                kv_last_page_len=torch.tensor([2]))
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        reference_paged_attention(**args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_extend_metadata_refuses_prefix_lens_on_another_device():
    table = torch.zeros(2, 8, dtype=torch.int32, device="cuda")
    rows, seq_lens = torch.tensor([0], device="cuda"), torch.tensor([3], device="cuda")
    with pytest.raises(ValueError, match="prefix_lens is on cpu"):
        build_extend_metadata(table, rows, torch.tensor([1]), seq_lens)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_flashinfer_wrapper_without_cuda_raises_a_clear_runtime_error():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        FlashInferAttention(4, 4, 64)
