"""HostKVPool: the host tier's buffers mirror the device pool's storage, and copies round-trip bit for bit."""

import numpy as np
import pytest
import torch

from kvmem import HostKVPool, MHAKVPool, MLAKVPool
from kvmem.tiers import HostSlotPool

MHA_FORMATS = [("auto", torch.float16, None), ("auto", torch.bfloat16, None), ("auto", torch.float32, None),
               ("fp8_e4m3", torch.bfloat16, None), ("fp8_e5m2", torch.float16, None), ("int8", torch.float16, 4),
               ("int4", torch.bfloat16, None), ("int4", torch.float32, 4)]


def fill(pool, slots, seed=0):
    g = torch.Generator().manual_seed(seed)
    for layer in range(pool.layer_num):
        if isinstance(pool, MLAKVPool):
            pool.set_kv_buffer(layer, slots, torch.randn(len(slots), 1, pool.kv_dim, generator=g).to(pool.dtype))
        else:
            k = torch.randn(len(slots), pool.head_num, pool.head_dim, generator=g).to(pool.dtype)
            v = torch.randn(len(slots), pool.head_num, pool.v_head_dim, generator=g).to(pool.dtype)
            pool.set_kv_buffer(layer, slots, k, v)


def stored(pool, slots):
    return [[r.clone() for r in pool.slot_rows(layer, slots)] for layer in range(pool.layer_num)]


def same(a, b):
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for la, lb in zip(a, b) for x, y in zip(la, lb))


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_cache_dtype, dtype, group", MHA_FORMATS)
def test_a_round_trip_through_the_host_is_bit_exact(host_layout, layout, kv_cache_dtype, dtype, group):
    device = MHAKVPool(32, 4, dtype, 2, 8, 2, layout=layout, kv_cache_dtype=kv_cache_dtype, quant_group=group)
    host = HostKVPool(device, ratio=2.0, layout=host_layout)
    src = torch.arange(4, 12)  # two whole pages
    fill(device, src)
    before = stored(device, src)
    host_slots = host.allocator.alloc(8)
    assert host.backup(host_slots, src).done()
    dst = torch.arange(20, 28)
    transfer = host.load(dst, host_slots)
    transfer.wait()
    assert not transfer.failed
    assert same(stored(device, dst), before)
    assert [r.shape for r in host.host_rows(host_slots, 1)] == [r.shape for r in before[1]]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_an_mla_latent_round_trips_bit_exactly(kv_cache_dtype):
    device = MLAKVPool(16, 1, torch.bfloat16, 16, 8, 3, kv_cache_dtype=kv_cache_dtype)
    host = HostKVPool(device, size=48, layout="page_first")
    src, dst = torch.tensor([3, 7, 1]), torch.tensor([10, 11, 12])
    fill(device, src)
    host_slots = host.allocator.alloc(3)
    host.backup(host_slots, src)
    host.load(dst, host_slots)
    assert same(stored(device, dst), stored(device, src))


def test_a_per_layer_load_copies_only_that_layer():
    device = MHAKVPool(16, 1, torch.float32, 1, 4, 3)
    host = HostKVPool(device, size=32)
    src, dst = torch.tensor([1, 2]), torch.tensor([5, 6])
    fill(device, src)
    host_slots = host.allocator.alloc(2)
    host.backup(host_slots, src)
    host.load(dst, host_slots, layer_id=1)
    assert torch.equal(device.read_kv(1, dst)[0], device.read_kv(1, src)[0])
    assert device.read_kv(0, dst)[0].count_nonzero() == 0 and device.read_kv(2, dst)[0].count_nonzero() == 0


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(size=16), ValueError, "larger than the device"),
    (dict(ratio=0.5), ValueError, "larger than the device"),
    (dict(ratio=-1), ValueError, "ratio"),
    (dict(size=33), ValueError, "multiple of the page size"),
    (dict(layout="slot_first"), ValueError, "layout"),
])
def test_a_host_pool_that_cannot_back_the_device_is_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        HostKVPool(MHAKVPool(16, 4, torch.float16, 1, 8, 1), **kwargs)


def test_a_host_pool_needs_a_kv_pool():
    with pytest.raises(TypeError, match="device_pool"):
        HostKVPool(object())


def test_copies_refuse_slots_the_host_has_not_handed_out_or_mismatched_lengths():
    device = MHAKVPool(16, 1, torch.float32, 1, 4, 1)
    host = HostKVPool(device, size=32)
    held = host.allocator.alloc(2)
    with pytest.raises(ValueError, match="host_slots"):
        host.backup(torch.tensor([7, 8]), torch.tensor([1, 2]))  # never handed out
    with pytest.raises(ValueError, match="one for one"):
        host.load(torch.tensor([1, 2, 3]), held)
    with pytest.raises(ValueError, match="padding slot"):
        host.load(torch.tensor([0, 1]), held)
    with pytest.raises(IndexError, match="layer_id"):
        host.load(torch.tensor([1, 2]), held, layer_id=1)
    assert host.allocator.available_size() == 30


def test_copies_refuse_every_slot_of_the_padding_page():
    device = MHAKVPool(16, 4, torch.float32, 1, 4, 1)
    host = HostKVPool(device, size=32)
    held = host.allocator.alloc(4)
    with pytest.raises(ValueError, match="device_slots holds slot 1, in the padding page 0"):
        host.load(torch.tensor([1, 2, 3, 4]), held)
    assert host.load(torch.tensor([4, 5, 6, 7]), held).error is None


def test_the_storage_format_tells_mla_pools_of_different_rank_splits_apart():
    a = HostKVPool(MLAKVPool(8, 1, torch.float16, 6, 2, 1), ratio=2)
    b = HostKVPool(MLAKVPool(8, 1, torch.float16, 4, 4, 1), ratio=2)
    assert a.page_payload_bytes() == b.page_payload_bytes() and a.storage_format() != b.storage_format()


def test_a_copy_that_fails_is_reported_and_writes_nothing():
    device = MHAKVPool(16, 1, torch.float32, 1, 4, 2)
    host = HostKVPool(device, size=32)
    fill(device, torch.tensor([1, 2]))
    held = host.allocator.alloc(2)
    rows = device.slot_rows

    def broken(layer, loc):
        if layer == 1:
            raise RuntimeError("copy engine fault")
        return rows(layer, loc)

    device.slot_rows = broken
    transfer = host.backup(held, torch.tensor([1, 2]))
    assert transfer.failed and "fault" in str(transfer.error)
    del device.slot_rows
    assert all(r.count_nonzero() == 0 for r in host.host_rows(held, 0))  # staged, never scattered


def test_a_slot_pool_accounts_for_slots_without_bytes():
    pool = HostSlotPool(64, page_size=16)
    slots = pool.allocator.alloc(32)
    assert pool.backup(slots, torch.arange(16, 48)).done() and pool.load(torch.arange(16, 48), slots).done()
    free = min(set(range(16, 80, 16)) - set(slots[::16].tolist()))  # a page it has not handed out
    with pytest.raises(ValueError, match=f"host_slots holds slot {free}, which this host pool has not handed out"):
        pool.check_host_slots(torch.arange(free, free + 16))
    with pytest.raises(ValueError, match="multiple"):
        HostSlotPool(40, page_size=16)


def test_write_pages_names_a_payload_that_is_not_contiguous():
    host = HostKVPool(MHAKVPool(16, 1, torch.float32, 1, 4, 1), size=32)
    slots = host.allocator.alloc(1)
    page = np.zeros(2 * host.page_payload_bytes(), dtype=np.uint8)[::2]  # strided
    with pytest.raises(ValueError, match=r"payloads\[0\] must be contiguous bytes"):
        host.write_pages(slots, [page])
    host.write_pages(slots, [page.copy()])


# ---- what the storage tier and a capacity check read from a host pool ----------------------------------------
def test_the_storage_format_names_the_model_dtypes_layers_page_size_and_every_stored_part():
    # Stored pages are found again only under the same string: it is an on-disk contract, pinned whole.
    mha = HostKVPool(MHAKVPool(16, 4, torch.bfloat16, 2, 8, 3, kv_cache_dtype="int8", quant_group=4), ratio=2,
                     model_id="llama-x@rev1")
    assert mha.storage_format() == ("kvmem-kv-page-v1|MHAKVPool|model=llama-x@rev1|dtype=bfloat16|kv_cache_dtype=int8"
                                    "|layers=3|page_size=4|parts=2x8:int8;2x8:int8;2x2:float32;2x2:float32")
    mla = HostKVPool(MLAKVPool(16, 1, torch.float16, 6, 2, 2), ratio=2, layout="page_first")
    assert mla.storage_format() == ("kvmem-kv-page-v1|MLAKVPool|kv_lora_rank=6|model=|dtype=float16|"
                                    "kv_cache_dtype=auto|layers=2|page_size=1|parts=1x8:float16")


def expected_payload(host, page_slots):
    """A page's payload as the format documents it: each stored part's rows, layer by layer, token by token."""
    return b"".join(host.host_rows(page_slots, layer)[part].contiguous().view(torch.uint8).numpy().tobytes()
                    for part in range(len(host.device_pool.row_formats())) for layer in range(host.layer_num))


@pytest.mark.parametrize("pages", [1, 3])
@pytest.mark.parametrize("make_device", [lambda: MHAKVPool(32, 2, torch.float16, 2, 4, 3, kv_cache_dtype="int8",
                                                           quant_group=2),
                                         lambda: MLAKVPool(32, 2, torch.bfloat16, 6, 2, 3)], ids=["mha", "mla"])
def test_a_pages_payload_is_its_rows_layer_by_layer_whatever_the_host_layout(make_device, pages):
    device = make_device()
    src = torch.arange(2, 2 + 2 * pages)
    fill(device, src, seed=pages)
    payloads = []
    for layout in ("layer_first", "page_first"):
        host = HostKVPool(device, ratio=2, layout=layout)
        held = host.allocator.alloc(2 * pages)
        host.backup(held, src)
        payloads.append(host.read_pages(held))
        assert payloads[-1] == [expected_payload(host, held[2 * i:2 * i + 2]) for i in range(pages)]
        assert {len(p) for p in payloads[-1]} == {host.page_payload_bytes()}
    assert payloads[0] == payloads[1]


def test_the_host_pools_memory_is_every_buffer_of_every_layer_and_slot():
    device = MHAKVPool(16, 4, torch.bfloat16, 2, 8, 3, kv_cache_dtype="int8", quant_group=4)
    # 32 slots and the padding page, 3 layers, a row of 2 x 8 int8 codes for K and V and 2 x 2 float32 scales each.
    for layout in ("layer_first", "page_first"):
        assert HostKVPool(device, ratio=2, layout=layout).mem_usage_bytes() == 36 * 3 * (2 * 16 + 2 * 16)


# ---- copies refuse what they cannot copy, naming it ------------------------------------------------------------
def test_copies_name_the_argument_that_is_not_slots_or_lists_a_slot_twice_even_among_two():
    device = MHAKVPool(16, 1, torch.float32, 1, 4, 2)
    host = HostKVPool(device, size=32)
    held = host.allocator.alloc(2)
    with pytest.raises(TypeError, match="^device_slots must be a tensor of slots, got list$"):
        host.backup(held, [1, 2])
    with pytest.raises(ValueError, match="^device_slots is on the 'meta' device, which holds no values$"):
        host.backup(held, torch.tensor([1, 2], device="meta"))
    with pytest.raises(IndexError, match=r"^device_slots holds slot 99, out of range \[0, 17\)$"):
        host.load(torch.tensor([1, 99]), held)
    with pytest.raises(ValueError, match="^host_slots lists a slot more than once$"):
        host.backup(torch.stack([held[0], held[0]]), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="^device_slots lists a slot more than once$"):
        host.load(torch.tensor([3, 3]), held)
    with pytest.raises(TypeError, match="^layer_id must be"):
        host.load(torch.tensor([1, 2]), held, layer_id="1")
    with pytest.raises(TypeError, match="^layer_id must be"):
        host.host_rows(held, 1.0)


def test_write_pages_names_payloads_that_are_not_a_sequence_of_pages_or_miss_a_page():
    host = HostKVPool(MHAKVPool(16, 1, torch.float32, 1, 4, 1), size=32)
    slots, size = host.allocator.alloc(2), host.page_payload_bytes()
    with pytest.raises(TypeError, match="^payloads must be a sequence of page payloads, got bytes$"):
        host.write_pages(slots, bytes(2 * size))
    with pytest.raises(TypeError, match="^payloads must be a sequence of bytes-like page payloads$"):
        host.write_pages(slots, [1, 2])
    with pytest.raises(ValueError, match=rf"^payloads must be 2 pages of {size} bytes, got 1 of \[{size}\] bytes$"):
        host.write_pages(slots, [bytes(size)])
    with pytest.raises(ValueError, match=rf"^payloads must be 2 pages of {size} bytes, got 2 of \[3, {size}\] bytes$"):
        host.write_pages(slots, [bytes(size), bytes(3)])


def test_a_slot_pool_refuses_a_size_below_one_slot_by_name_and_its_pages_carry_no_bytes():
    for size in (0, -16):
        with pytest.raises(ValueError, match="^size must be"):
            HostSlotPool(size)
    with pytest.raises(TypeError, match="^size must be"):
        HostSlotPool(16.0)
    pool = HostSlotPool(64, page_size=16)
    slots = pool.allocator.alloc(32)
    assert pool.page_payload_bytes() == 0 and pool.read_pages(slots) == [b"", b""]
    pool.write_pages(slots, [b"", b""])
    with pytest.raises(ValueError, match="payloads must be 2 pages of 0 bytes"):
        pool.write_pages(slots, [b"", b"x"])


# ---- construction ---------------------------------------------------------------------------------------------
def test_a_host_pool_is_twice_the_device_by_default_and_whole_pages_at_any_ratio():
    device = MHAKVPool(16, 4, torch.float16, 1, 8, 1)
    assert HostKVPool(device).size == 32 and HostKVPool(device, ratio=2.6).size == 40   # 41.6 tokens: 10 pages
    host = HostKVPool(device, size=48)
    assert host.size == 48 and host.allocator.page_size == 4 and host.allocator.size == 48
    assert HostKVPool(MHAKVPool(16, 2, torch.float16, 1, 8, 1)).allocator.page_size == 2


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(ratio=0), ValueError, "^ratio must be a finite number > 0, got 0$"),
    (dict(size=0), ValueError, "^size must be a positive int, got 0$"),
    (dict(size="32"), TypeError, "^size must be a positive int, got '32'$"),
    (dict(size=1), ValueError, "^a host pool of 1 tokens must be larger than the device pool's 16$"),
    (dict(model_id=5), TypeError, "^model_id must be a str, got int$"),
])
def test_a_host_pool_names_the_argument_it_refuses(kwargs, error, message):
    with pytest.raises(error, match=message):
        HostKVPool(MHAKVPool(16, 1, torch.float16, 1, 8, 1), **kwargs)
    with pytest.raises(TypeError, match="^device_pool must be an MHAKVPool or MLAKVPool, got object$"):
        HostKVPool(object())


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinned memory is refused only without CUDA")
def test_pinned_host_memory_is_refused_without_cuda():
    with pytest.raises(ValueError, match="^pin_memory needs CUDA: page-locked memory is for copies to a GPU$"):
        HostKVPool(MHAKVPool(16, 1, torch.float16, 1, 8, 1), pin_memory=True)
    assert HostKVPool(MHAKVPool(16, 1, torch.float16, 1, 8, 1), pin_memory=False).size == 32


def test_a_host_pool_larger_than_the_machines_memory_is_refused(monkeypatch):
    device = MHAKVPool(16, 4, torch.float16, 2, 8, 3)
    need = (48 + 4) * 3 * (2 * 2 * 8 * 2)  # slots with the padding page x layers x a row's K and V bytes
    monkeypatch.setattr("os.sysconf", lambda name: {"SC_PAGE_SIZE": 1, "SC_PHYS_PAGES": need}[name])
    HostKVPool(device, size=48)  # exactly what the machine has
    with pytest.raises(ValueError) as raised:
        HostKVPool(device, size=52)
    assert str(raised.value).startswith("a host KV pool of 52 tokens needs 0.0 GiB of host memory")


def test_copies_name_a_padding_slot_exactly():
    host = HostKVPool(MHAKVPool(16, 1, torch.float32, 1, 4, 1), size=32)
    with pytest.raises(ValueError, match="^device_slots holds slot 0, the padding slot$"):
        host.load(torch.tensor([0, 1]), host.allocator.alloc(2))
