"""The file store's rarely reached paths: a rewrite that copies pages still in use, segments cut or gone under a
running store, and the records a walk must stop at. (The store's main behaviours are in test_storage.py.)"""

import functools
import threading

import torch

from kvmem.storage import FileStore
from kvmem.storage.file_store import RECORD_BYTES
from kvmem.storage.page_format import CHECKSUM_BYTES, HEADER_BYTES
from tests.test_storage import PROMPT, PS, forget_open_stores, keys_of, kv_world


def filler(chain):
    return keys_of(list(range(1000 * (chain + 1), 1000 * (chain + 1) + 4 * PS)))


def same_kv(host, a, b):
    return all(torch.equal(p.view(torch.uint8), q.view(torch.uint8))
               for layer in range(host.layer_num) for p, q in zip(host.host_rows(a, layer), host.host_rows(b, layer)))


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
    assert not home.exists() and small.locate(hot[0])[0] != home
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= 2 * small.capacity_bytes + small.segment_bytes
    del small
    forget_open_stores()
    again = FileStore(tmp_path, capacity_bytes=4 * value)          # another process finds the copies, intact
    dst = host.allocator.alloc(4 * PS)
    assert again.batch_get(hot, host, dst) == 4 and same_kv(host, slots[:4 * PS], dst) and again.stats.corrupt == 0
    assert [again.batch_exists(filler(c)) for c in range(4)] == [0] * 4
