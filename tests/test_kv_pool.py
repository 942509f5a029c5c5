import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem import sizing
from kvmem.kv_pool import MHAKVPool, MLAKVPool, pack_int4, unpack_int4

SIZE, PAGE, HEADS, DIM, LAYERS = 12, 4, 2, 8, 2
QUANTIZED = ["fp8_e4m3", "fp8_e5m2", "int8", "int4"]
ALL_KV_CACHE_DTYPES = ["auto", *QUANTIZED]
# Half the spacing of representable values: relative below the smallest normal, absolute under it.
FP8_HALF_ULP = {"fp8_e4m3": (2.0 ** -4, 2.0 ** -10), "fp8_e5m2": (2.0 ** -3, 2.0 ** -17)}
# (kv_cache_dtype, quant_group) pairs; only int8/int4 take a quant_group.
STORAGE_CASES = [("auto", None), ("fp8_e4m3", None), ("fp8_e5m2", None),
                 ("int8", None), ("int8", 4), ("int4", None), ("int4", 2)]
FP8_DTYPE = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def mha(**kwargs) -> MHAKVPool:
    args = dict(size=SIZE, page_size=PAGE, dtype=torch.float16, head_num=HEADS, head_dim=DIM, layer_num=LAYERS)
    return MHAKVPool(**{**args, **kwargs})


def mla(**kwargs) -> MLAKVPool:
    args = dict(size=SIZE, page_size=PAGE, dtype=torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=8, layer_num=LAYERS)
    return MLAKVPool(**{**args, **kwargs})


def kv(pool: MHAKVPool, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n, pool.head_num, pool.head_dim, generator=gen).to(pool.dtype)
    v = torch.randn(n, pool.head_num, pool.v_head_dim, generator=gen).to(pool.dtype)
    return k, v


def buffers(pool) -> list[torch.Tensor]:
    if isinstance(pool, MLAKVPool):
        return pool.kv_buffer
    return pool.k_buffer + pool.v_buffer + pool.k_scale_buffer + pool.v_scale_buffer


def snapshot(pool) -> list[torch.Tensor]:
    return [t.clone() for t in buffers(pool)]


def assert_unchanged(pool, before: list[torch.Tensor]) -> None:
    assert all(torch.equal(a, b) for a, b in zip(before, buffers(pool), strict=True))


def rows_at(pool: MHAKVPool, buf: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
    """buf's [n, head_num, last_dim] rows for slots loc, in either layout."""
    if pool.layout == "NHD":
        return buf[loc]
    return buf[loc // pool.page_size, :, loc % pool.page_size]


INT_QMAX = {"int8": 127, "int4": 7}


def group_step(pool: MHAKVPool, x: torch.Tensor) -> torch.Tensor:
    """The quantization step of each element of `x` [n, heads, dim], computed from the input alone: its group's
    absmax / qmax (never read back from the pool, so that a quantizer at the wrong resolution cannot pass). The
    pool keeps no scale below float32's smallest normal, so a group whose step would be smaller gets that."""
    group = pool.quant_group or x.shape[-1]
    absmax = x.double().unflatten(-1, (-1, group)).abs().amax(-1, keepdim=True)
    step = (absmax / INT_QMAX[pool.kv_cache_dtype]).clamp_min(torch.finfo(torch.float32).tiny)
    return step.expand(*step.shape[:-1], group).flatten(-2)


def assert_within_quantization_bound(pool: MHAKVPool, written: torch.Tensor, read: torch.Tensor) -> None:
    """|read - written| <= step / 2 for int8/int4 (step = group absmax / qmax), half an fp8 ulp for fp8, plus
    the model dtype's rounding of the dequantized value."""
    x, r = written.double(), read.double()
    out_eps = torch.finfo(pool.dtype).eps  # rounding the dequantized float32 value back to the model dtype
    if pool.kv_cache_dtype in FP8_HALF_ULP:
        rel, absolute = FP8_HALF_ULP[pool.kv_cache_dtype]
        bound = rel * x.abs() + absolute
    else:
        bound = group_step(pool, written) * (0.5 + 1e-5) + out_eps * x.abs() + 2.0 ** -149
    assert ((r - x).abs() <= bound).all(), (r - x).abs().max()


# --- round trips ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_model_dtype_round_trip_is_exact(layout, dtype):
    pool = mha(dtype=dtype, layout=layout, v_head_dim=4)
    loc = torch.tensor([1, 4, 7, 12, 15])
    k, v = kv(pool, 5)
    pool.set_kv_buffer(1, loc, k, v)
    rk, rv = pool.read_kv(1, loc)
    assert rk.dtype == dtype and torch.equal(rk, k) and torch.equal(rv, v)
    assert pool.k_buffer[1].dtype == dtype


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_cache_dtype, quant_group", STORAGE_CASES[1:])
def test_quantized_round_trip_stays_within_its_error_bound(layout, kv_cache_dtype, quant_group):
    pool = mha(layout=layout, kv_cache_dtype=kv_cache_dtype, quant_group=quant_group, dtype=torch.float32)
    loc = torch.tensor([2, 3, 9, 15])
    k, v = kv(pool, 4, seed=1)
    pool.set_kv_buffer(0, loc, k * 10, v)
    rk, rv = pool.read_kv(0, loc)
    assert rk.dtype == torch.float32 and rk.shape == k.shape
    assert_within_quantization_bound(pool, k * 10, rk)
    assert_within_quantization_bound(pool, v, rv)


@settings(max_examples=60, deadline=None)
@given(
    kv_cache_dtype=st.sampled_from(QUANTIZED),
    quant_group=st.sampled_from([None, 2, 4]),
    layout=st.sampled_from(["NHD", "HND"]),
    exponent=st.integers(-30, 30),
    values=st.lists(st.floats(-1.0, 1.0, width=32), min_size=2 * HEADS * DIM, max_size=2 * HEADS * DIM),
)
def test_quantization_error_is_bounded_for_any_values(kv_cache_dtype, quant_group, layout, exponent, values):
    if kv_cache_dtype.startswith("fp8"):
        quant_group, exponent = None, min(exponent, 8)  # keep fp8 inputs inside its finite range
    pool = mha(layout=layout, kv_cache_dtype=kv_cache_dtype, quant_group=quant_group, dtype=torch.float32)
    k = (torch.tensor(values, dtype=torch.float32) * 2.0 ** exponent).view(2, HEADS, DIM)
    loc = torch.tensor([5, 13])
    pool.set_kv_buffer(1, loc, k, k.flip(-1))
    rk, rv = pool.read_kv(1, loc)
    assert_within_quantization_bound(pool, k, rk)
    assert_within_quantization_bound(pool, k.flip(-1), rv)


def test_a_group_of_zeros_reads_back_as_zeros():
    pool = mha(kv_cache_dtype="int8", quant_group=4)
    k = torch.zeros(1, HEADS, DIM, dtype=torch.float16)
    k[0, 0, :4] = 3.0
    pool.set_kv_buffer(0, torch.tensor([1]), k, k)
    assert torch.equal(pool.read_kv(0, torch.tensor([1]))[0], k)


@pytest.mark.parametrize("kv_cache_dtype, limit", [("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)])
def test_fp8_saturates_values_beyond_its_range(kv_cache_dtype, limit):
    pool = mha(kv_cache_dtype=kv_cache_dtype)
    k = torch.full((1, HEADS, DIM), 60000.0, dtype=torch.float16)
    pool.set_kv_buffer(0, torch.tensor([1]), k, -k)
    rk, rv = pool.read_kv(0, torch.tensor([1]))
    assert (rk == limit).all() and (rv == -limit).all()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_is_stored_as_bytes_and_returned_as_float8_views(kv_cache_dtype):
    pool = mha(kv_cache_dtype=kv_cache_dtype)
    k, v = kv(pool, 1)
    pool.set_kv_buffer(0, torch.tensor([3]), k, v)
    assert pool.k_buffer[0].dtype == torch.uint8
    key, value = pool.get_kv_buffer(0)
    assert key.dtype == value.dtype == FP8_DTYPE[kv_cache_dtype]
    assert key.data_ptr() == pool.k_buffer[0].data_ptr()
    assert torch.equal(key[3].float(), k[0].to(FP8_DTYPE[kv_cache_dtype]).float())


def test_int4_packs_two_values_per_byte_and_unpacks_every_value():
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(2)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (16,)
    assert torch.equal(unpack_int4(packed), q)
    assert torch.equal(unpack_int4(torch.zeros(4, dtype=torch.uint8)), torch.zeros(8, dtype=torch.int8))


def test_int4_puts_element_2i_in_the_low_nibble_and_2i_plus_1_in_the_high_one():
    # The documented byte layout (two's complement nibbles): kernels that read the pool depend on it.
    assert pack_int4(torch.tensor([1, 2, -1, 7], dtype=torch.int8)).tolist() == [0x21, 0x7F]
    assert unpack_int4(torch.tensor([0x21, 0x7F], dtype=torch.uint8)).tolist() == [1, 2, -1, 7]
    pool = mha(kv_cache_dtype="int4", dtype=torch.float32)
    k = torch.zeros(1, HEADS, DIM)
    k[0, 0] = torch.tensor([7.0, -7.0, 1.0, 2.0, 0.0, 3.0, -3.0, 4.0])  # absmax 7: the codes are the values
    pool.set_kv_buffer(0, torch.tensor([5]), k, k)
    assert pool.k_buffer[0][5, 0].tolist() == [0x97, 0x21, 0x30, 0x4D]
    assert pool.k_scale_buffer[0][5, 0].tolist() == pytest.approx([1.0])


@pytest.mark.parametrize("kv_cache_dtype, qmax", [("int8", 127), ("int4", 7)])
def test_each_group_is_stored_as_its_absmax_over_qmax_and_the_rounded_codes(kv_cache_dtype, qmax):
    pool = mha(kv_cache_dtype=kv_cache_dtype, quant_group=4, dtype=torch.float32)
    k = torch.zeros(1, HEADS, DIM)
    k[0, 0] = torch.tensor([1.0, -3.5, 2.0, 0.5, 0.0, 0.25, -0.1, 0.0])  # no code on a .5 tie
    pool.set_kv_buffer(0, torch.tensor([2]), k, k)
    scales = pool.k_scale_buffer[0][2, 0].tolist()
    assert scales == pytest.approx([3.5 / qmax, 0.25 / qmax], rel=1e-6)
    codes = [round(v / scales[i // 4]) for i, v in enumerate(k[0, 0].tolist())]
    assert codes[:4] == [round(1.0 * qmax / 3.5), -qmax, round(2.0 * qmax / 3.5), round(0.5 * qmax / 3.5)]
    stored = pool.k_buffer[0][2, 0]
    assert (unpack_int4(stored) if kv_cache_dtype == "int4" else stored).tolist() == codes


@pytest.mark.parametrize("layout, scale_shape", [("NHD", (16, HEADS, 4)), ("HND", (4, HEADS, PAGE, 4))])
def test_int4_storage_is_packed_with_float32_scales_per_slot_head_and_group(layout, scale_shape):
    pool = mha(kv_cache_dtype="int4", quant_group=2, layout=layout)
    assert pool.k_buffer[0].dtype == torch.uint8 and pool.k_buffer[0].shape[-1] == DIM // 2
    assert pool.k_scale_buffer[0].dtype == torch.float32 and pool.k_scale_buffer[0].shape == scale_shape


def test_unwritten_and_padding_slots_read_zero():
    for kv_cache_dtype in ALL_KV_CACHE_DTYPES:
        k, v = mha(kv_cache_dtype=kv_cache_dtype).read_kv(0, torch.tensor([0, 1, 15]))
        assert not k.any() and not v.any()


def test_layers_are_independent():
    pool = mha()
    k, v = kv(pool, 1)
    pool.set_kv_buffer(1, torch.tensor([2]), k, v)
    assert not pool.k_buffer[0].any() and torch.equal(pool.k_buffer[1][2], k[0])


def test_int32_loc_is_accepted():
    pool = mha()
    k, v = kv(pool, 2)
    pool.set_kv_buffer(0, torch.tensor([1, 2], dtype=torch.int32), k, v)
    assert torch.equal(pool.read_kv(0, torch.tensor([1, 2], dtype=torch.int32))[0], k)


# --- paged views ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "int8"])
def test_paged_view_aliases_the_storage(layout, kv_cache_dtype):
    pool = mha(layout=layout, kv_cache_dtype=kv_cache_dtype, v_head_dim=4)
    k_pages, v_pages = pool.get_paged_kv_buffer(1)  # taken before the write: a view must see it
    if layout == "NHD":
        assert k_pages.shape == (pool.num_pages, PAGE, HEADS, DIM) and v_pages.shape == (pool.num_pages, PAGE, HEADS, 4)
    else:
        assert k_pages.shape == (pool.num_pages, HEADS, PAGE, DIM) and v_pages.shape == (pool.num_pages, HEADS, PAGE, 4)
    assert k_pages.data_ptr() == pool.k_buffer[1].data_ptr()
    loc = torch.tensor([1, 6, 11, 15])
    k, v = kv(pool, 4)
    pool.set_kv_buffer(1, loc, k, v)
    for i, slot in enumerate(loc.tolist()):
        page, offset = divmod(slot, PAGE)
        k_row = k_pages[page, offset] if layout == "NHD" else k_pages[page, :, offset]
        v_row = v_pages[page, offset] if layout == "NHD" else v_pages[page, :, offset]
        stored_k = rows_at(pool, pool.get_key_buffer(1), torch.tensor([slot]))[0]
        assert torch.equal(k_row.view(torch.uint8), stored_k.view(torch.uint8))
        if kv_cache_dtype == "auto":
            assert torch.equal(k_row, k[i]) and torch.equal(v_row, v[i])


def test_hnd_storage_is_already_flashinfer_hnd_pages():
    pool = mha(layout="HND")
    assert pool.num_pages == SIZE // PAGE + 1 and pool.num_slots == SIZE + PAGE
    assert pool.k_buffer[0].shape == (pool.num_pages, HEADS, PAGE, DIM)
    assert pool.get_paged_kv_buffer(0)[0] is pool.k_buffer[0]


# --- memory accounting ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_cache_dtype, quant_group", STORAGE_CASES)
def test_mem_usage_is_slots_times_sizing_bytes_per_token(layout, kv_cache_dtype, quant_group):
    pool = mha(layout=layout, kv_cache_dtype=kv_cache_dtype, quant_group=quant_group, v_head_dim=4)
    config = sizing.MHAConfig(LAYERS, HEADS, DIM, v_head_dim=4, dtype="float16")
    expected = sizing.bytes_per_token(config, kv_cache_dtype, quant_group)
    assert pool.bytes_per_token == expected
    assert pool.mem_usage_bytes() == (SIZE + PAGE) * expected


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e5m2"])
def test_mla_mem_usage_is_slots_times_sizing_bytes_per_token(kv_cache_dtype):
    pool = mla(kv_cache_dtype=kv_cache_dtype)
    expected = sizing.bytes_per_token(sizing.MLAConfig(LAYERS, 16, 8, dtype="bfloat16"), kv_cache_dtype)
    assert pool.bytes_per_token == expected and pool.mem_usage_bytes() == (SIZE + PAGE) * expected


# --- bad arguments -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    ({"size": 0}, ValueError, "size must be a positive int"),
    ({"size": -4}, ValueError, "size must be a positive int"),
    ({"page_size": 0}, ValueError, "page_size must be a positive int"),
    ({"size": 10}, ValueError, "size 10 must be a multiple of page_size 4"),
    ({"head_num": 0}, ValueError, "head_num"),
    ({"head_dim": 2.0}, ValueError, "head_dim"),
    ({"layer_num": 0}, ValueError, "layer_num"),
    ({"v_head_dim": -1}, ValueError, "v_head_dim"),
    ({"layout": "NDH"}, ValueError, "layout must be one of"),
    ({"dtype": torch.int8}, TypeError, "model dtype"),
    ({"kv_cache_dtype": "fp16"}, ValueError, "kv_cache_dtype"),
    ({"kv_cache_dtype": "int8", "quant_group": 3}, ValueError, "quant_group 3 must divide head_dim 8"),
    ({"kv_cache_dtype": "int8", "quant_group": 4, "v_head_dim": 6}, ValueError, "must divide v_head_dim 6"),
    ({"kv_cache_dtype": "auto", "quant_group": 4}, ValueError, "quant_group applies to int8/int4 only"),
    ({"kv_cache_dtype": "int4", "head_dim": 7}, ValueError, "int4 needs even head dims"),
])
def test_bad_constructor_arguments_raise_naming_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        mha(**kwargs)


def test_mla_rejects_int_quantization_and_bad_dims():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        mla(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla(kv_lora_rank=0)
    with pytest.raises(ValueError, match="multiple of page_size"):
        mla(size=6)


def bad_set_kv_cases():
    k, v = torch.zeros(2, HEADS, DIM, dtype=torch.float16), torch.zeros(2, HEADS, DIM, dtype=torch.float16)
    loc = torch.tensor([1, 2])
    return [
        ((-1, loc, k, v), IndexError, "layer_id -1 out of range"),
        ((LAYERS, loc, k, v), IndexError, f"layer_id {LAYERS} out of range"),
        (("0", loc, k, v), TypeError, "layer_id must be an int"),
        ((0, [1, 2], k, v), TypeError, "loc must be a torch.Tensor"),
        ((0, loc.view(2, 1), k, v), ValueError, "loc must be 1-D"),
        ((0, loc.float(), k, v), TypeError, "loc must be int64 or int32"),
        ((0, loc.to(torch.uint8), k, v), TypeError, "loc must be int64 or int32"),
        ((0, torch.tensor([True, False]), k, v), TypeError, "loc must be int64 or int32"),
        ((0, torch.tensor([1, SIZE + PAGE]), k, v), IndexError, f"slot {SIZE + PAGE}, out of range"),
        ((0, torch.tensor([-1, 2]), k, v), IndexError, "slot -1, out of range"),
        ((0, torch.empty(2, dtype=torch.int64, device="meta"), k, v), ValueError, "loc is on meta"),
        ((0, loc, k.float(), v), TypeError, "cache_k dtype torch.float32 must equal the model dtype"),
        ((0, loc, k, v.bfloat16()), TypeError, "cache_v dtype"),
        ((0, loc, k[:, :1], v), ValueError, r"cache_k shape \(2, 1, 8\) must be \[n, 2, 8\]"),
        ((0, loc, k, v[..., :4]), ValueError, "cache_v shape"),
        ((0, loc, k[0], v), ValueError, "cache_k shape"),
        ((0, loc, k[:1], v[:1]), ValueError, "cache_k has 1 rows but loc has 2 slots"),
        ((0, loc, k, v[:1]), ValueError, "cache_v has 1 rows but loc has 2 slots"),
        ((0, loc, k.numpy(), v), TypeError, "cache_k must be a torch.Tensor"),
    ]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int4"])
@pytest.mark.parametrize("args, error, match", bad_set_kv_cases())
def test_bad_set_kv_buffer_arguments_raise_and_write_nothing(kv_cache_dtype, args, error, match):
    pool = mha(kv_cache_dtype=kv_cache_dtype)
    k, v = kv(pool, 2)
    pool.set_kv_buffer(0, torch.tensor([1, 2]), k, v)
    before = snapshot(pool)
    with pytest.raises(error, match=match):
        pool.set_kv_buffer(*args)
    assert_unchanged(pool, before)


@pytest.mark.parametrize("loc, error", [
    (torch.tensor([SIZE + PAGE]), IndexError), (torch.tensor([[1]]), ValueError), (torch.tensor([1.0]), TypeError)])
def test_read_kv_checks_loc(loc, error):
    with pytest.raises(error, match="loc|slot"):
        mha().read_kv(0, loc)


@pytest.mark.parametrize("getter", ["get_key_buffer", "get_value_buffer", "get_kv_buffer", "get_paged_kv_buffer"])
def test_getters_reject_a_layer_out_of_range(getter):
    with pytest.raises(IndexError, match="layer_id 2"):
        getattr(mha(), getter)(LAYERS)
    with pytest.raises(IndexError, match="layer_id -1"):
        getattr(mla(), getter)(-1)


# --- MLA -----------------------------------------------------------------------------------------------------

def latent(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 1, 24, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_mla_round_trip_is_exact_and_v_is_the_leading_kv_lora_rank_dims():
    pool = mla()
    assert pool.kv_buffer[0].shape == (SIZE + PAGE, 1, 24)
    loc = torch.tensor([1, 8, 15])
    rows = latent(3)
    pool.set_kv_buffer(1, loc, rows)
    k, v = pool.read_kv(1, loc)
    assert torch.equal(k, rows) and torch.equal(v, rows[..., :16])
    value = pool.get_value_buffer(1)
    assert value.shape == (SIZE + PAGE, 1, 16) and value.data_ptr() == pool.kv_buffer[1].data_ptr()
    assert torch.equal(value[loc], rows[..., :16])


def test_set_mla_kv_buffer_equals_writing_the_concatenated_row():
    a, b = mla(), mla()
    rows = latent(2)
    loc = torch.tensor([3, 4])
    a.set_kv_buffer(0, loc, rows)
    b.set_mla_kv_buffer(0, loc, rows[..., :16], rows[..., 16:])
    assert torch.equal(a.kv_buffer[0], b.kv_buffer[0])


def test_mla_fp8_round_trip_is_within_half_an_ulp():
    pool = mla(kv_cache_dtype="fp8_e4m3")
    rows = latent(4)
    pool.set_kv_buffer(0, torch.tensor([1, 2, 3, 4]), rows)
    assert pool.kv_buffer[0].dtype == torch.uint8 and pool.get_key_buffer(0).dtype == torch.float8_e4m3fn
    k, _ = pool.read_kv(0, torch.tensor([1, 2, 3, 4]))
    rel, absolute = FP8_HALF_ULP["fp8_e4m3"]
    error = (k.double() - rows.double()).abs()
    assert (error <= rel * rows.double().abs() + absolute + torch.finfo(torch.bfloat16).eps * k.double().abs()).all()


def test_mla_paged_view_is_the_ckv_kpe_pair_aliasing_the_storage():
    pool = mla()
    ckv, kpe = pool.get_paged_kv_buffer(0)
    assert ckv.shape == (pool.num_pages, PAGE, 16) and kpe.shape == (pool.num_pages, PAGE, 8)
    rows = latent(2)
    pool.set_kv_buffer(0, torch.tensor([5, 14]), rows)
    for i, slot in enumerate([5, 14]):
        page, offset = divmod(slot, PAGE)
        assert torch.equal(ckv[page, offset], rows[i, 0, :16]) and torch.equal(kpe[page, offset], rows[i, 0, 16:])


@pytest.mark.parametrize("call, match", [
    (lambda p, r: p.set_kv_buffer(0, torch.tensor([1, 2]), r[..., :20]), r"cache_k shape \(2, 1, 20\)"),
    (lambda p, r: p.set_kv_buffer(0, torch.tensor([1, 2]), r.half()), "cache_k dtype"),
    (lambda p, r: p.set_kv_buffer(0, torch.tensor([1]), r), "cache_k has 2 rows but loc has 1"),
    (lambda p, r: p.set_kv_buffer(2, torch.tensor([1, 2]), r), "layer_id 2"),
    (lambda p, r: p.set_mla_kv_buffer(0, torch.tensor([1, 2]), r[..., :8], r[..., 16:]), "cache_k_nope shape"),
    (lambda p, r: p.set_mla_kv_buffer(0, torch.tensor([1, 2]), r[..., :16], r[:1, :, 16:]), "cache_k_rope has 1 rows"),
    (lambda p, r: p.set_mla_kv_buffer(0, torch.tensor([1, 99]), r[..., :16], r[..., 16:]), "slot 99"),
])
def test_bad_mla_writes_raise_and_write_nothing(call, match):
    pool = mla()
    pool.set_kv_buffer(0, torch.tensor([1, 2]), latent(2, seed=1))
    before = snapshot(pool)
    with pytest.raises((ValueError, TypeError, IndexError), match=match):
        call(pool, latent(2))
    assert_unchanged(pool, before)


# --- what mutation testing found unpinned (scripts/mutation.py kv_pool) --------------------------------------

def test_quantizing_a_2d_tensor_groups_its_last_dim_and_reads_back_in_the_asked_dtype():
    from kvmem.kv_pool import dequantize_symmetric, quantize_symmetric

    x = torch.tensor([[1.0, -2.0, 0.5, 0.25], [4.0, 0.0, -1.0, 2.0]])
    q, scale = quantize_symmetric(x, 127, 2)
    assert q.shape == (2, 4) and q.dtype == torch.int8 and scale.shape == (2, 2)
    back = dequantize_symmetric(q, scale, 2, torch.float16)
    assert back.shape == (2, 4) and back.dtype == torch.float16
    assert torch.allclose(back.float(), x, atol=4.0 / 127)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_a_group_with_infinities_and_nan_saturates_and_keeps_its_finite_scale(kv_cache_dtype, dtype):
    pool = mha(kv_cache_dtype=kv_cache_dtype, quant_group=4, dtype=dtype)
    k = torch.zeros(1, HEADS, DIM, dtype=dtype)
    k[0, 0] = torch.tensor([float("inf"), -0.25, float("nan"), float("-inf"), 0.0, 0.0, 0.0, 0.0])
    k[0, 1] = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, 1.0, -1.0, 0.5, 0.25])
    pool.set_kv_buffer(0, torch.tensor([3]), k, k)
    read = pool.read_kv(0, torch.tensor([3]))[0][0]
    assert read.dtype == dtype
    # Head 0, group 0: the finite absmax 0.25 sets the scale; +-inf read back as +-0.25, NaN as 0.
    assert read[0, :4].tolist() == [0.25, -0.25, 0.0, -0.25] and read[0, 4:].tolist() == [0.0] * 4
    # Head 1, group 0 has no finite nonzero value: +-inf read back as the dtype's largest finite value.
    top = torch.finfo(dtype).max
    assert read[1, :4].tolist() == pytest.approx([top, -top, 0.0, 0.0], rel=1e-5)
    assert torch.isfinite(read).all() and read[1, 4:].tolist() == pytest.approx([1.0, -1.0, 0.5, 0.25], abs=0.15)


def test_fp8_stores_saturate_what_would_round_to_infinity():
    for kv_cache_dtype, limit in (("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)):
        pool = mha(kv_cache_dtype=kv_cache_dtype)
        k = torch.full((1, HEADS, DIM), 65504.0, dtype=torch.float16)  # past e5m2's rounding to infinity
        pool.set_kv_buffer(0, torch.tensor([1]), k, -k)
        rk, rv = pool.read_kv(0, torch.tensor([1]))
        assert (rk == limit).all() and (rv == -limit).all()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_a_quantized_pool_reads_back_in_its_model_dtype(kv_cache_dtype):
    pool = mha(kv_cache_dtype=kv_cache_dtype, dtype=torch.float16)
    k, v = kv(pool, 2)
    pool.set_kv_buffer(0, torch.tensor([1, 2]), k, v)
    assert all(t.dtype == torch.float16 for t in pool.read_kv(0, torch.tensor([1, 2])))
    mla_pool = mla(kv_cache_dtype="fp8_e4m3")
    assert all(t.dtype == torch.bfloat16 for t in mla_pool.read_kv(0, torch.tensor([1])))


def test_bytes_per_token_follow_the_model_dtype():
    assert mha(dtype=torch.float32).bytes_per_token == LAYERS * HEADS * 2 * DIM * 4
    assert mla(dtype=torch.float32).bytes_per_token == LAYERS * (16 + 8) * 4


def test_a_pool_larger_than_the_machine_s_memory_is_refused(monkeypatch):
    pool = mha()
    need = pool.num_slots * pool.bytes_per_token
    monkeypatch.setattr("os.sysconf", lambda name: {"SC_PAGE_SIZE": 1, "SC_PHYS_PAGES": need}[name])
    mha()  # exactly what the machine has
    with pytest.raises(ValueError) as raised:
        mha(size=SIZE + PAGE)
    assert str(raised.value).startswith(f"a KV pool of {SIZE + PAGE} tokens needs 0.0 GiB of host memory")


def test_kv_pool_refusals_in_full():
    pool = mha()
    k = torch.zeros(1, HEADS, DIM, dtype=torch.float16)
    loc = torch.tensor([1])

    def message(call):
        with pytest.raises((ValueError, TypeError, IndexError)) as raised:
            call()
        return str(raised.value)

    assert message(lambda: pool.set_kv_buffer(0, [1], k, k)) == "loc must be a torch.Tensor of slots, got list"
    assert message(lambda: pool.read_kv(0, torch.tensor([0, 99]))) == "loc holds slot 99, out of range [0, 16)"
    assert message(lambda: pool.set_kv_buffer(0, loc, k.numpy(), k)) == "cache_k must be a torch.Tensor, got ndarray"
    assert message(lambda: pool.set_kv_buffer(0, loc, k.to("meta"), k)) == "cache_k is on meta, the pool on cpu"
    assert message(lambda: mla(kv_lora_rank=0)) == "kv_lora_rank must be a positive int, got 0"
    assert message(lambda: mla(qk_rope_head_dim=0)) == "qk_rope_head_dim must be a positive int, got 0"
    small = mla(kv_lora_rank=1, qk_rope_head_dim=1)
    assert small.kv_dim == 2 and small.get_kv_buffer(1)[1].shape == (SIZE + PAGE, 1, 1)


def test_an_empty_loc_reads_and_writes_nothing():
    pool = mha()
    empty = torch.empty(0, dtype=torch.int64)
    before = snapshot(pool)
    pool.set_kv_buffer(0, empty, torch.empty(0, HEADS, DIM, dtype=torch.float16),
                       torch.empty(0, HEADS, DIM, dtype=torch.float16))
    assert pool.read_kv(0, empty)[0].shape == (0, HEADS, DIM)
    assert_unchanged(pool, before)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_cache_dtype, quant_group", STORAGE_CASES)
def test_stored_rows_copy_slots_bit_for_bit_between_pools(layout, kv_cache_dtype, quant_group):
    src = mha(layout=layout, kv_cache_dtype=kv_cache_dtype, quant_group=quant_group)
    dst = mha(layout=layout, kv_cache_dtype=kv_cache_dtype, quant_group=quant_group)
    k, v = kv(src, 3, seed=4)
    src.set_kv_buffer(1, torch.tensor([1, 6, 11]), k, v)
    rows = src.slot_rows(1, torch.tensor([1, 6, 11]))
    formats = src.row_formats()
    assert [(tuple(r.shape[1:]), r.dtype) for r in rows] == formats and all(len(r) == 3 for r in rows)
    assert len(formats) == (4 if kv_cache_dtype in ("int8", "int4") else 2)
    dst.set_slot_rows(1, torch.tensor([2, 3, 15]), rows)
    for a, b in zip(src.read_kv(1, torch.tensor([1, 6, 11])), dst.read_kv(1, torch.tensor([2, 3, 15]))):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(rows, dst.slot_rows(1, torch.tensor([2, 3, 15]))))
    assert not dst.read_kv(0, torch.tensor([2]))[0].any()  # layer 0 untouched


def test_mla_stored_rows_are_its_latent_rows():
    src, dst = mla(), mla()
    rows = torch.randn(2, 1, 24, dtype=torch.bfloat16)
    src.set_kv_buffer(0, torch.tensor([1, 2]), rows)
    (latent,) = src.slot_rows(0, torch.tensor([1, 2]))
    assert src.row_formats() == [((1, 24), torch.bfloat16)] and torch.equal(latent, rows)
    dst.set_slot_rows(0, torch.tensor([5, 6]), [latent])
    assert torch.equal(dst.read_kv(0, torch.tensor([5, 6]))[0], rows)


def test_stored_rows_of_the_wrong_count_shape_or_dtype_are_refused_and_write_nothing():
    pool = mha(kv_cache_dtype="int8")
    rows = pool.slot_rows(0, torch.tensor([1, 2]))
    before = snapshot(pool)

    def message(new_rows, layer=0):
        with pytest.raises((ValueError, TypeError, IndexError)) as raised:
            pool.set_slot_rows(layer, torch.tensor([3, 4]), new_rows)
        return str(raised.value)

    assert message(rows[:3]) == "rows must hold 4 tensors (one per stored buffer), got 3"
    assert message([rows[0].float()] + rows[1:]) == \
        "rows must be [2, 2, 8] torch.int8 tensors, got (2, 2, 8)"
    assert message(rows[:1] + [rows[1][:1]] + rows[2:]) == "rows must be [2, 2, 8] torch.int8 tensors, got (1, 2, 8)"
    assert message(rows[:3] + [rows[3].numpy()]) == "rows must be [2, 2, 1] torch.float32 tensors, got ndarray"
    assert message(rows, layer=LAYERS) == f"layer_id {LAYERS} out of range [0, {LAYERS})"
    with pytest.raises(IndexError):
        pool.slot_rows(LAYERS, torch.tensor([1]))
    with pytest.raises(IndexError):
        pool.slot_rows(0, torch.tensor([99]))
    assert_unchanged(pool, before)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_writes_keep_no_autograd_graph(kind):
    x = torch.randn(1, 1, 4, requires_grad=True)
    if kind == "mha":
        pool = MHAKVPool(8, 1, torch.float32, 1, 4, 1)
        pool.set_kv_buffer(0, torch.tensor([1]), x * 2, x * 3)
        buffers = (pool.k_buffer[0], pool.v_buffer[0])
    else:
        pool = MLAKVPool(8, 1, torch.float32, 2, 2, 1)
        pool.set_kv_buffer(0, torch.tensor([1]), x * 2)
        buffers = (pool.kv_buffer[0],)
    assert all(not b.requires_grad and b.grad_fn is None for b in buffers)
