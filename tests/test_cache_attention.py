"""OpenPPL's MultiHeadCacheAttention over kvmem's pools: it agrees with the engine's paged attention on a
scheduler's batches, and with itself over every OpenPPL cache layout and indexing mode."""

import math

import numpy as np
import pytest
import torch

from kvmem import (
    MHAKVPool,
    PagedTokenAllocator,
    RadixCache,
    Req,
    ReqToTokenPool,
    Scheduler,
    SchedulerConfig,
    TokenAllocator,
)
from kvmem.attention import KVPages, MultiHeadCacheAttention, kv_pages, openppl_cache_pool
from kvmem.engine.attention import TorchAttention

H, HKV, D, LAYERS = 4, 2, 16, 2
SHAPES = {0: lambda t: (t, LAYERS, 2, HKV, D), 1: lambda t: (LAYERS, t, 2, HKV, D),
          2: lambda t: (LAYERS, HKV, t, 2, D), 3: lambda t: (2, LAYERS, HKV, t, D)}


def scheduler_batches(page_size: int):
    """An extend batch (two requests reusing a cached prefix, one chunked) and the decode batch after it."""
    pool = ReqToTokenPool(8, 128)
    alloc = TokenAllocator(256) if page_size == 1 else PagedTokenAllocator(256, page_size)
    sched = Scheduler(pool, alloc, RadixCache(pool, alloc, page_size=page_size),
                      SchedulerConfig(chunked_prefill_size=48))
    system = list(range(100, 140))
    sched.add_request(Req("warm", system + [1], max_new_tokens=1))
    sched.process_batch_result(sched.step(), [0])
    for i, tail in enumerate(([2, 3, 4], [5] * 30, [6])):
        sched.add_request(Req(i, system + tail, max_new_tokens=3))
    extend = sched.step()
    yield extend
    sched.process_batch_result(extend, [7] * extend.batch_size())
    while True:
        batch = sched.step()
        if batch.forward_mode.value == "decode":
            yield batch
            return
        sched.process_batch_result(batch, [7] * batch.batch_size())


def openppl_inputs(batch):
    """OpenPPL's table-mode indexing of a ScheduleBatch: one cache position (a kvmem slot) per key."""
    table = batch.req_to_token_pool.req_to_token
    seq_lens, prefix = batch.seq_lens, batch.prefix_lens
    cachestarts = torch.cat([table[r, :s] for r, s in zip(batch.req_pool_indices.tolist(), seq_lens.tolist())])
    zero = torch.zeros(1, dtype=torch.int64)
    return dict(seqstarts=torch.cat((zero, torch.cumsum(seq_lens - prefix, 0))),
                kvstarts=torch.cat((zero, torch.cumsum(seq_lens, 0))), cachestarts=cachestarts.long(),
                start_pos=prefix, max_seqlen=int((seq_lens - prefix).max()), max_kvlen=int(seq_lens.max()))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "int4"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_cache_attention_equals_the_engine_attention_on_scheduler_batches(page_size, kv_cache_dtype):
    quant = {"auto": (0, None), "int8": (8, 8), "int4": (4, 8)}[kv_cache_dtype]
    pool = MHAKVPool(256, page_size, torch.float32, HKV, D, LAYERS, kv_cache_dtype=kv_cache_dtype,
                     quant_group=quant[1])
    g = torch.Generator().manual_seed(page_size)
    pool.set_kv_buffer(1, torch.arange(pool.num_slots), torch.randn(pool.num_slots, HKV, D, generator=g),
                       torch.randn(pool.num_slots, HKV, D, generator=g))  # earlier tokens' K/V
    op = MultiHeadCacheAttention(H, D, num_kv_heads=HKV, num_layer=LAYERS, layer_idx=1, quant_bit=quant[0],
                                 cache_mode=1)
    engine_attention = TorchAttention()
    for batch in scheduler_batches(page_size):
        n = len(batch.out_cache_loc)
        q, k, v = (torch.randn(n, heads, D, generator=g) for heads in (H, HKV, HKV))
        decode = batch.forward_mode.value == "decode"
        out = op(q, k, v, decoding_batches=batch.batch_size() if decode else 0, cache=pool, **openppl_inputs(batch))
        pool.set_kv_buffer(1, batch.out_cache_loc, k, v)  # the engine's write: the same values, same slots
        engine_attention.plan(batch.attention_metadata(), batch.seq_lens, decode)
        expected = engine_attention.mha(pool, 1, q, 1 / math.sqrt(D))
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def cache_tensors(layout: int, max_t: int, quant_bit: int):
    shape = list(SHAPES[layout](max_t))
    if quant_bit == 0:
        return torch.zeros(shape), None
    scale_shape = shape[:4] + [D // 8]
    if quant_bit == 4:
        shape[4] //= 2
    return torch.zeros(shape, dtype=torch.int8), torch.zeros(scale_shape)


def ragged_inputs(g):
    seq_lens, start = [3, 1, 5], [4, 6, 0]
    kv_lens = [s + p for s, p in zip(seq_lens, start)]
    zero = [0]
    return dict(seqstarts=torch.tensor(zero + np.cumsum(seq_lens).tolist()),
                kvstarts=torch.tensor(zero + np.cumsum(kv_lens).tolist()), start_pos=torch.tensor(start),
                max_seqlen=5, max_kvlen=7), sum(seq_lens)


@pytest.mark.parametrize("quant_bit", [0, 8, 4])
@pytest.mark.parametrize("cache_mode", [0, 1])
def test_every_cache_layout_is_a_view_that_gives_the_same_attention(cache_mode, quant_bit):
    g = torch.Generator().manual_seed(cache_mode + quant_bit)
    inputs, n = ragged_inputs(g)
    q, k, v = (torch.randn(n, heads, D, generator=g) for heads in (H, HKV, HKV))
    max_t = 40
    past_k, past_v = torch.randn(max_t, HKV, D, generator=g), torch.randn(max_t, HKV, D, generator=g)
    starts = torch.tensor([1, 10, 20])  # sequence b's position p lives at starts[b] + p
    if cache_mode == 0:
        cachestarts = starts
    else:  # the same positions as a table
        cachestarts = torch.cat([torch.arange(s, s + n) for s, n in zip(starts.tolist(), [7, 7, 5])])
    outputs = []
    for layout in range(4):
        cache, scale = cache_tensors(layout, max_t, quant_bit)
        pool = openppl_cache_pool(cache, scale, cache_layout=layout, num_layer=LAYERS, num_kv_heads=HKV, head_dim=D,
                                  quant_bit=quant_bit)
        pool.set_kv_buffer(1, torch.arange(max_t), past_k, past_v)
        op = MultiHeadCacheAttention(H, D, num_kv_heads=HKV, num_layer=LAYERS, layer_idx=1, quant_bit=quant_bit,
                                     cache_mode=cache_mode, cache_layout=layout)
        outputs.append(op(q, k, v, cachestarts=cachestarts, decoding_batches=1, cache=cache, scale=scale, **inputs))
        if quant_bit == 0:  # the first current token of sequence 0 sits at position 4, slot 5, layer 1, K
            index = {0: (5, 1, 0), 1: (1, 5, 0), 2: (1, slice(None), 5, 0), 3: (0, 1, slice(None), 5)}[layout]
            assert torch.equal(cache[index], k[0])
    for out in outputs[1:]:
        torch.testing.assert_close(out, outputs[0], atol=0, rtol=0)


def test_openppl_tensors_hold_what_a_kvmem_pool_stores():
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(39, HKV, D, generator=g), torch.randn(39, HKV, D, generator=g)
    pool = MHAKVPool(39, 1, torch.float32, HKV, D, LAYERS, kv_cache_dtype="int4", quant_group=8)
    pool.set_kv_buffer(0, torch.arange(1, 40), k, v)
    cache, scale = cache_tensors(1, 40, 4)
    viewed = openppl_cache_pool(cache, scale, cache_layout=1, num_layer=LAYERS, num_kv_heads=HKV, head_dim=D,
                                quant_bit=4)
    viewed.set_kv_buffer(0, torch.arange(1, 40), k, v)
    assert torch.equal(cache[0, :, 0].view(torch.uint8), pool.k_buffer[0])
    assert torch.equal(scale[0, :, 1], pool.v_scale_buffer[0])


def test_causal_mask_and_custom_mask_follow_positions():
    g = torch.Generator().manual_seed(9)
    op = MultiHeadCacheAttention(2, 8, cache_mode=1)
    pool = MHAKVPool(15, 1, torch.float32, 2, 8, 1)
    q, k, v = (torch.randn(3, 2, 8, generator=g) for _ in range(3))
    args = dict(seqstarts=torch.tensor([0, 3]), kvstarts=torch.tensor([0, 3]), cachestarts=torch.tensor([4, 5, 6]),
                start_pos=torch.tensor([0]), decoding_batches=0, max_seqlen=3, max_kvlen=3, cache=pool)
    causal = op(q, k, v, **args)
    torch.testing.assert_close(causal[0], v[0])  # the first query sees only its own key
    mask = torch.zeros(3, 3)
    mask[2, :2] = float("-inf")
    torch.testing.assert_close(op(q, k, v, attn_mask=mask, **args)[2], v[2])
    full = MultiHeadCacheAttention(2, 8, cache_mode=1, is_causal=False)(q, k, v, **args)
    assert not torch.allclose(full[0], v[0])


def test_bad_inputs_raise_by_name_and_write_nothing():
    op = MultiHeadCacheAttention(2, 8, cache_mode=0, quant_bit=8, cache_layout=0)
    cache, scale = torch.zeros(16, 1, 2, 2, 8, dtype=torch.int8), torch.zeros(16, 1, 2, 2, 1)
    x = torch.ones(2, 2, 8)
    good = dict(seqstarts=torch.tensor([0, 2]), kvstarts=torch.tensor([0, 3]), cachestarts=torch.tensor([3]),
                start_pos=torch.tensor([1]), decoding_batches=0, max_seqlen=2, max_kvlen=3, cache=cache, scale=scale)
    for change, error, match in [
            (dict(start_pos=torch.tensor([0])), ValueError, r"sequence 0: start_pos 0 \+ seq_len 2 must equal"),
            (dict(cachestarts=torch.tensor([14])), IndexError, "cache position 16, outside"),
            (dict(max_kvlen=4), ValueError, "max_kvlen 4 must equal the longest sequence, 3"),
            (dict(scale=scale.half()), TypeError, "scale must be float32"),
            (dict(scale=None), ValueError, "scale is required"),
            (dict(cache=cache[:, :, :1]), ValueError, "cache has shape"),
            (dict(start_pos=[1]), TypeError, "start_pos must be a 1-D int32/int64 tensor"),
            (dict(attn_mask=torch.zeros(7, 2, 3)), ValueError, r"attn_mask has shape \(7, 2, 3\), needs \[2, 2, 3\]"),
            (dict(attn_mask=torch.zeros(1, 2, 2, 3)), ValueError, "attn_mask has shape"),
            (dict(attn_mask=torch.ones(2, 3, dtype=torch.bool)), TypeError, "additive floating-point tensor")]:
        with pytest.raises(error, match=match):
            op(x, x, x, **{**good, **change})
    assert not cache.any() and not scale.any()
    op(x, x, x, **good)
    assert cache.any()
    with pytest.raises(ValueError, match="num_heads 3 must be a multiple of num_kv_heads 2"):
        MultiHeadCacheAttention(3, 8, num_kv_heads=2)
    with pytest.raises(ValueError, match="cache_layout"):
        MultiHeadCacheAttention(2, 8, cache_layout=4)


def test_kv_pages_of_a_quantized_pool_are_the_named_pages_dequantized():
    pool = MHAKVPool(64, 16, torch.float32, HKV, D, 1, kv_cache_dtype="fp8_e4m3")
    k = torch.randn(pool.num_slots, HKV, D)
    pool.set_kv_buffer(0, torch.arange(pool.num_slots), k, -k)
    pages = kv_pages(pool, 0, torch.tensor([3, 1, 3], dtype=torch.int32))
    assert isinstance(pages, KVPages) and pages.layout == "NHD" and pages.kv_indices.tolist() == [1, 0, 1]
    expected_k, expected_v = pool.read_kv(0, torch.arange(48, 64))
    torch.testing.assert_close(pages.k_pages[1], expected_k)
    torch.testing.assert_close(pages.v_pages[1], expected_v)
    plain = MHAKVPool(64, 16, torch.float32, HKV, D, 1)
    assert kv_pages(plain, 0, torch.tensor([3])).k_pages.data_ptr() == plain.k_buffer[0].data_ptr()  # a view
