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
