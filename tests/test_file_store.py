"""The file store's rarely reached paths: a rewrite that copies pages still in use, segments cut or gone under a
running store, and the records a walk must stop at. (The store's main behaviours are in test_storage.py.)"""

import functools
import os
import threading

import pytest
import torch

from kvmem.storage import FileStore
from kvmem.storage.file_store import RECORD_BYTES, _unpack
from kvmem.storage.page_format import CHECKSUM_BYTES, HEADER_BYTES
from kvmem.tiers import HostSlotPool
from tests.test_storage import PROMPT, PS, forget_open_stores, keys_of, kv_world


def filler(chain):
    return keys_of(list(range(1000 * (chain + 1), 1000 * (chain + 1) + 4 * PS)))


def same_kv(host, a, b):
    return all(torch.equal(p.view(torch.uint8), q.view(torch.uint8))
               for layer in range(host.layer_num) for p, q in zip(host.host_rows(a, layer), host.host_rows(b, layer)))


def live_bytes_add_up(store):
    """Each segment counts as live exactly the bytes of the index's pages in it (what a rewrite chooses by)."""
    folder = store._folder
    held = {number: 0 for number in folder.segments}
    for loc in folder.pages.entries.values():
        number, _, length = _unpack(loc)
        held[number] += length
    return held == {number: segment.live for number, segment in folder.segments.items()}


def in_time(call, timeout=30):
    """call()'s result, or a failed test if it has not returned within `timeout` seconds (a store that loops)."""
    result = []
    worker = threading.Thread(target=lambda: result.append(call()), daemon=True)
    worker.start()
    worker.join(timeout)
    assert not worker.is_alive(), f"still running after {timeout} s"
    return result[0]


def test_a_store_reopened_with_a_smaller_cap_copies_the_pages_in_use_out_of_the_segments_it_rewrites(tmp_path):
    _, host, slots = kv_world()
    hot = keys_of(PROMPT[:4 * PS])
    value = HEADER_BYTES + host.page_payload_bytes() + CHECKSUM_BYTES
    record = RECORD_BYTES + value
    store = FileStore(tmp_path, capacity_bytes=20 * value, segment_bytes=10 * record)
    assert store.batch_set(filler(0), host, slots[:4 * PS]) == 4   # a cold chain shares the hot one's segment
    assert store.batch_set(hot, host, slots[:4 * PS]) == 4
    for chain in range(1, 4):
        assert store.batch_set(filler(chain), host, slots[:4 * PS]) == 4
    assert store.batch_get(hot, host, host.allocator.alloc(4 * PS)) == 4   # the most recently used
    home = store.locate(hot[0])[0]
    del store
    forget_open_stores()
    # Room for the hot chain alone, and segments of one record: the rewrite must copy the hot pages out of their
    # half-dead segment, and stop (it once copied its own segment of use records to a new one for ever).
    small = FileStore(tmp_path, capacity_bytes=4 * value, segment_bytes=record)
    dst = host.allocator.alloc(4 * PS)
    assert small.batch_get(hot, host, dst) == 4 and same_kv(host, slots[:4 * PS], dst)
    assert in_time(functools.partial(small.batch_set, hot, host, slots[:4 * PS])) == 4
    assert live_bytes_add_up(small)
    assert not home.exists() and small.locate(hot[0])[0] != home
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= 2 * small.capacity_bytes + small.segment_bytes
    del small
    forget_open_stores()
    again = FileStore(tmp_path, capacity_bytes=4 * value)          # another process finds the copies, intact
    dst = host.allocator.alloc(4 * PS)
    assert again.batch_get(hot, host, dst) == 4 and same_kv(host, slots[:4 * PS], dst) and again.stats.corrupt == 0
    assert [again.batch_exists(filler(c)) for c in range(4)] == [0] * 4


def test_a_segment_takes_records_until_exactly_full_then_the_next_write_starts_another(tmp_path):
    pool = HostSlotPool(64, PS)
    slots = pool.allocator.alloc(PS)
    record = RECORD_BYTES + HEADER_BYTES + CHECKSUM_BYTES  # a page of a slot-only pool: header and checksum
    store = FileStore(tmp_path, segment_bytes=2 * record)
    sizes = []
    for chain in range(3):
        assert store.batch_set(keys_of(list(range(100 * chain, 100 * chain + PS))), pool, slots) == 1
        sizes.append(sorted(p.stat().st_size for p in tmp_path.iterdir()))
    assert sizes == [[record], [2 * record], [record, 2 * record]]


def test_a_store_that_finds_its_own_segment_deleted_on_a_lookup_writes_the_next_pages_to_a_new_one(tmp_path):
    pool = HostSlotPool(64, PS)
    slots = pool.allocator.alloc(2 * PS)
    first, later = keys_of(list(range(2 * PS))), keys_of(list(range(500, 500 + 2 * PS)))
    store = FileStore(tmp_path)
    assert store.batch_set(first, pool, slots) == 2
    for segment in tmp_path.iterdir():
        segment.unlink()
    # A miss makes the store look at the folder: it forgets the segment gone, the one it was writing.
    assert store.batch_exists(later) == 0 and store.batch_exists(first) == 0
    assert store.batch_set(later, pool, slots) == 2 and store.batch_exists(later) == 2
    del store
    forget_open_stores()
    assert FileStore(tmp_path).batch_exists(later) == 2


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts this process's open files in /proc")
def test_a_store_closes_the_files_of_segments_gone_from_its_folder(tmp_path):
    pool = HostSlotPool(64, PS)
    slots = pool.allocator.alloc(2 * PS)
    first, later = keys_of(list(range(2 * PS))), keys_of(list(range(500, 500 + 2 * PS)))
    before = len(os.listdir("/proc/self/fd"))
    store = FileStore(tmp_path)
    assert store.batch_set(first, pool, slots) == 2 and store.batch_get(first, pool, slots) == 2
    assert len(os.listdir("/proc/self/fd")) > before  # the segment, open to write and to read
    for segment in tmp_path.iterdir():
        segment.unlink()
    assert store.batch_exists(later) == 0
    assert len(os.listdir("/proc/self/fd")) == before
