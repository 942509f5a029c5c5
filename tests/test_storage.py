"""The storage tier: the page format, the file store, and a hierarchical cache over a store: pages written behind
host backups, read back by another cache (another replica, or the same one after a restart), and never loaded
unless they are the page asked for."""

import os
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmem import HiRadixCache, HostKVPool, MHAKVPool, PagedTokenAllocator, ReqToTokenPool
from kvmem.page_hash import page_digests, storage_key
from kvmem.storage import FileStore, PageStore, SimStore, parse_store_spec
from kvmem.storage.page_format import CHECKSUM_BYTES, HEADER_BYTES, decode_page, encode_page, fingerprint, is_intact
from kvmem.tiers import HostSlotPool

PS = 4
PROMPT = list(range(100, 132))  # 8 pages


def keys_of(tokens, namespace=None):
    return [storage_key(d) for d in page_digests(tokens, PS, namespace=namespace)]


# ---- the page format -------------------------------------------------------------------------------------
def test_a_page_decodes_only_with_its_digest_fingerprint_and_page_size_intact():
    digest, fp = bytes(range(32)), fingerprint("model-a|fp16")
    value = encode_page(digest, fp, PS, b"kv bytes")
    assert bytes(decode_page(value, digest, fp, PS)) == b"kv bytes"
    assert decode_page(value, bytes(32), fp, PS) is None                 # filed under another page's key
    assert decode_page(value, digest, fingerprint("model-b|fp16"), PS) is None  # another model or format
    assert decode_page(value, digest, fp, 16) is None                    # another page size
    corrupt = bytearray(value)
    corrupt[90] ^= 1
    assert decode_page(bytes(corrupt), digest, fp, PS) is None
    assert decode_page(value[:-3], digest, fp, PS) is None               # truncated
    assert decode_page(b"", digest, fp, PS) is None
    assert is_intact(value) and not any(map(is_intact, (bytes(corrupt), value[:-3], b"", b"x" * 200)))


# ---- the file store -------------------------------------------------------------------------------------------
def kv_world(layout="layer_first", model_id="m", kv_cache_dtype="int8"):
    device = MHAKVPool(64, PS, torch.bfloat16, 2, 8, 2, kv_cache_dtype=kv_cache_dtype)
    host = HostKVPool(device, ratio=4, layout=layout, model_id=model_id)
    slots = host.allocator.alloc(len(PROMPT))
    g = torch.Generator().manual_seed(0)
    src = torch.arange(PS, PS + len(PROMPT))
    for layer in range(2):
        device.set_kv_buffer(layer, src, torch.randn(len(src), 2, 8, generator=g).bfloat16(),
                             torch.randn(len(src), 2, 8, generator=g).bfloat16())
    host.backup(slots, src)
    return device, host, slots


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "int8", "int4"])
def test_pages_round_trip_through_a_file_store_bit_exactly_across_host_layouts(tmp_path, kv_cache_dtype):
    _, host, slots = kv_world("layer_first", kv_cache_dtype=kv_cache_dtype)
    store = FileStore(tmp_path)
    assert store.batch_set(keys_of(PROMPT), host, slots) == 8 and store.batch_exists(keys_of(PROMPT)) == 8
    _, other_host, _ = kv_world("page_first", kv_cache_dtype=kv_cache_dtype)  # a reader laying pages out otherwise
    dst = other_host.allocator.alloc(len(PROMPT))
    assert FileStore(tmp_path).batch_get(keys_of(PROMPT), other_host, dst) == 8  # a second store: another process
    for layer in range(2):
        assert all(torch.equal(a, b) for a, b in zip(host.host_rows(slots, layer), other_host.host_rows(dst, layer)))
    assert [p.suffix for p in tmp_path.iterdir()] == [".kvseg"]  # 8 pages, one segment file


def damage(store, key, *, flip_at=None, cut_at=None):
    """Flips a byte of page `key`'s stored value, or cuts its segment file there (a torn write)."""
    path, offset, _ = store.locate(key)
    data = bytearray(path.read_bytes())
    if flip_at is not None:
        data[offset + flip_at] ^= 0xFF
    else:
        del data[offset + cut_at:]
    path.write_bytes(bytes(data))


def test_a_corrupt_or_truncated_page_is_a_counted_miss_and_the_next_write_repairs_it(tmp_path):
    _, host, slots = kv_world()
    store = FileStore(tmp_path)
    keys = keys_of(PROMPT)
    store.batch_set(keys, host, slots)
    damage(store, keys[2], flip_at=200)
    damage(store, keys[5], cut_at=50)                             # pages 5.. torn off the segment's end
    dst = host.allocator.alloc(len(PROMPT))
    assert store.batch_get(keys, host, dst) == 2 and store.stats.corrupt == 1
    assert store.batch_exists(keys) == 2                          # dropped, not found again
    assert store.batch_get(keys[3:], host, dst[:20]) == 2 and store.stats.corrupt == 2
    assert store.batch_set(keys, host, slots) == 8                # the next write of the pages stores them again
    assert FileStore(tmp_path).batch_get(keys, host, dst) == 8
    assert all(torch.equal(a, b) for a, b in zip(host.host_rows(slots, 1), host.host_rows(dst, 1)))
    assert store.stats.corrupt == 2


def test_a_page_of_another_model_is_a_miss_that_stays_for_its_model(tmp_path):
    _, host, slots = kv_world(model_id="model-a")
    FileStore(tmp_path).batch_set(keys_of(PROMPT), host, slots)
    _, other, _ = kv_world(model_id="model-b")
    store = FileStore(tmp_path)
    assert store.batch_get(keys_of(PROMPT), other, other.allocator.alloc(len(PROMPT))) == 0
    assert (store.stats.foreign, store.stats.corrupt) == (1, 0)   # not taken for damage, so not deleted
    assert store.batch_get(keys_of(PROMPT), host, host.allocator.alloc(len(PROMPT))) == len(PROMPT) // PS


def test_a_capped_file_store_deletes_its_least_recently_used_pages(tmp_path):
    pool = HostSlotPool(64, PS)
    slots = pool.allocator.alloc(4 * PS)
    page = len(encode_page(bytes(32), fingerprint(pool.storage_format()), PS, b""))
    store = FileStore(tmp_path, capacity_bytes=3 * page)
    a, b = keys_of(list(range(8))), keys_of(list(range(50, 58)))
    store.batch_set(a, pool, slots[:8])
    store.batch_get(a[:1], pool, slots[8:12])        # a[0] is now the most recently used
    store.batch_set(b, pool, slots[:8])              # room for one more: a[1] goes, then a[0]... by age
    assert store.used_bytes() <= 3 * page
    assert store.batch_exists(a[:1]) == 1 and store.batch_exists(a[1:]) == 0 and store.batch_exists(b) == 2
    assert FileStore(tmp_path, capacity_bytes=3 * page).used_bytes() == 3 * page  # reopened: it knows its pages


def test_a_capped_file_store_drops_a_chains_deepest_pages_first(tmp_path):
    # A lookup stops at the first missing page: dropping a chain's root first left the rest unreachable.
    pool = HostSlotPool(256, PS)
    slots = pool.allocator.alloc(12 * PS)
    page = len(encode_page(bytes(32), fingerprint(pool.storage_format()), PS, b""))
    store = FileStore(tmp_path, capacity_bytes=8 * page)
    a, b = keys_of(list(range(8 * PS))), keys_of(list(range(1000, 1000 + PS)))
    assert store.batch_set(a, pool, slots[:8 * PS]) == 8 and store.batch_exists(a) == 8
    store.batch_set(b, pool, slots[8 * PS:9 * PS])
    assert store.batch_exists(a) == 7 and store.batch_exists(b) == 1
    store.batch_get(a[:7], pool, slots[:7 * PS])     # read again, root first: b's page is now the oldest
    store.batch_set(keys_of(list(range(2000, 2000 + PS))), pool, slots[8 * PS:9 * PS])
    assert store.batch_exists(a) == 7 and store.batch_exists(b) == 0
    store.batch_set(keys_of(list(range(3000, 3000 + PS))), pool, slots[8 * PS:9 * PS])
    assert store.batch_exists(a) == 6                # then a's deepest page
    assert FileStore(tmp_path, capacity_bytes=8 * page).batch_exists(a) == 6


def capped_store(tmp_path, pages, batch_size=64):
    pool = HostSlotPool(512, PS)
    page = len(encode_page(bytes(32), fingerprint(pool.storage_format()), PS, b""))
    return FileStore(tmp_path, capacity_bytes=pages * page, batch_size=batch_size), pool, pool.allocator.alloc(
        64 * PS)


def test_a_chain_longer_than_a_capped_file_store_keeps_its_leading_pages(tmp_path):
    store, pool, slots = capped_store(tmp_path, 3)
    chain = keys_of(list(range(5 * PS)))
    assert store.batch_set(chain, pool, slots[:5 * PS]) == 3          # not its root, to fit its own deeper pages
    assert store.batch_exists(chain) == 3 and store.stats.failed_ops == 1


def test_a_capped_file_store_keeps_a_chain_whole_across_its_batches(tmp_path):
    store, pool, slots = capped_store(tmp_path, 4, batch_size=2)
    chain, other = keys_of(list(range(4 * PS))), keys_of(list(range(900, 900 + PS)))
    assert store.batch_set(chain, pool, slots[:4 * PS]) == 4
    store.batch_set(other, pool, slots[:PS])
    assert store.batch_exists(chain) == 3                            # its deepest page went, not a middle one
    assert store.batch_get(chain[:3], pool, slots[:3 * PS]) == 3
    store.batch_set(keys_of(list(range(950, 950 + PS))), pool, slots[:PS])
    assert store.batch_exists(chain) == 3 and store.batch_exists(other) == 0


def forget_open_stores():
    """Drops this process's index of every folder no store holds any more: the next store of a folder reads it
    from disk, as another process would."""
    import gc

    gc.collect()


def test_a_reopened_capped_store_evicts_in_the_order_the_last_one_used_its_pages(tmp_path):
    # The order lives in the records' times (a nanosecond apart, root newest): a chain refreshed within
    # microseconds must not come back in another order.
    import weakref

    store, pool, slots = capped_store(tmp_path, 9)
    index = weakref.ref(store._folder)
    a, b = keys_of(list(range(8 * PS))), keys_of(list(range(1000, 1000 + PS)))
    store.batch_set(a, pool, slots[:8 * PS])
    store.batch_set(b, pool, slots[:PS])
    assert store.batch_get(a, pool, slots[:8 * PS]) == 8          # b's page, then a[7], are the oldest now
    capacity = store.capacity_bytes
    del store
    forget_open_stores()
    assert index() is None                                       # read from disk again, as another process would
    reopened = FileStore(tmp_path, capacity_bytes=capacity)
    reopened.batch_set(keys_of(list(range(2000, 2000 + PS))), pool, slots[:PS])
    assert reopened.batch_exists(a) == 8 and reopened.batch_exists(b) == 0
    reopened.batch_set(keys_of(list(range(3000, 3000 + PS))), pool, slots[:PS])
    assert reopened.batch_exists(a) == 7                          # then a's deepest page, not its root


def test_capped_file_stores_of_one_folder_share_its_cap(tmp_path):
    # A cluster's replicas over one store each open it: the folder must not hold the cap once per replica.
    first, pool, slots = capped_store(tmp_path, 4)
    second = FileStore(tmp_path, capacity_bytes=first.capacity_bytes)
    a, b = keys_of(list(range(4 * PS))), keys_of(list(range(500, 500 + 4 * PS)))
    first.batch_set(a, pool, slots[:4 * PS])
    second.batch_set(b, pool, slots[:4 * PS])
    assert first.batch_exists(a) == 0 and first.batch_exists(b) == 4
    assert first.used_bytes() == second.used_bytes() == first.capacity_bytes


def test_bad_arguments_to_a_store_are_refused(tmp_path):
    pool = HostSlotPool(64, PS)
    store = FileStore(tmp_path)
    with pytest.raises(ValueError, match="keys"):
        store.batch_exists(["not-a-key"])
    with pytest.raises(TypeError, match="keys"):
        store.batch_exists(keys_of(PROMPT)[0])
    with pytest.raises(ValueError, match="host_slots"):
        store.batch_set(keys_of(PROMPT)[:1], pool, torch.arange(1, 5))   # slots the pool never handed out
    with pytest.raises(ValueError, match="host_slots"):
        store.batch_set(keys_of(PROMPT)[:2], pool, pool.allocator.alloc(PS))
    with pytest.raises(ValueError, match="path"):
        FileStore("/proc/kvmem-cannot-be-here")
    for bad in (0, -1, 2.5, "3"):
        with pytest.raises((TypeError, ValueError), match="batch_size"):
            FileStore(tmp_path, batch_size=bad)
    key = keys_of(PROMPT)[0]
    for bad in (" " + key[1:-1] + " ", key[:-2] + "\n\t", key.upper()):  # bytes.fromhex takes these
        with pytest.raises(ValueError, match="keys"):
            store.batch_exists([bad])
    for spec in ("file:   ", "file:/tmp/x\0y", "file:", "nfs:/x", "sim:", "sim:0", "sim:-5", "sim:1e6", "sim:x",
                 "sim:١٢"):
        with pytest.raises(ValueError, match="storage must be"):
            parse_store_spec(spec)
    assert parse_store_spec("file:~/kv") == ("file", os.path.expanduser("~/kv"))
    assert parse_store_spec("sim") == ("sim", "") and parse_store_spec("sim:4096") == ("sim", "4096")


@pytest.mark.parametrize("path, error", [("", ValueError), ("   ", ValueError), ("a\0b", ValueError),
                                         (123, TypeError), (b"/tmp/kv", TypeError), (None, TypeError)])
def test_a_file_store_refuses_a_path_that_names_no_directory(tmp_path, monkeypatch, path, error):
    monkeypatch.chdir(tmp_path)  # an empty path was the current directory
    with pytest.raises(error, match="path"):
        FileStore(path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name, bad", [("capacity_bytes", "3"), ("capacity_bytes", 0), ("capacity_bytes", 2.5),
                                       ("segment_bytes", 0), ("segment_bytes", None), ("min_free_bytes", -1),
                                       ("min_free_bytes", "1")])
def test_a_file_store_refuses_a_bad_count_naming_it(tmp_path, name, bad):
    with pytest.raises((TypeError, ValueError), match=name):
        FileStore(tmp_path, **{name: bad})


def test_a_file_store_packs_its_pages_into_a_few_segment_files(tmp_path):
    # One file per page made a page-size-1 replay write millions of files.
    pool = HostSlotPool(4096, 1)
    slots = pool.allocator.alloc(4000)
    keys = [storage_key(d) for d in page_digests(list(range(4000)), 1)]
    store = FileStore(tmp_path, segment_bytes=64 << 10)
    assert store.batch_set(keys, pool, slots) == 4000
    segments = sorted(tmp_path.iterdir())
    value = HEADER_BYTES + CHECKSUM_BYTES
    assert all(p.suffix == ".kvseg" for p in segments) and 1 < len(segments) <= 8
    assert sum(p.stat().st_size for p in segments) == 4000 * (value + 20)  # a 20-byte record header a page
    del store
    forget_open_stores()
    assert FileStore(tmp_path).batch_get(keys, pool, slots) == 4000


def test_another_process_finds_the_pages_written_after_it_opened_the_folder(tmp_path):
    import subprocess
    import sys

    pool = HostSlotPool(64, PS)
    slots = pool.allocator.alloc(8 * PS)
    store = FileStore(tmp_path)
    mine, theirs = keys_of(list(range(8 * PS))), keys_of(list(range(900, 900 + 8 * PS)))
    store.batch_set(mine, pool, slots)
    assert store.batch_exists(theirs) == 0
    writer = f"""
from kvmem.page_hash import page_digests, storage_key
from kvmem.storage import FileStore
from kvmem.tiers import HostSlotPool
pool = HostSlotPool(64, {PS})
keys = [storage_key(d) for d in page_digests(list(range(900, 900 + {8 * PS})), {PS})]
store = FileStore({str(tmp_path)!r})
assert store.batch_exists(keys[:1]) == 0 and store.batch_exists({mine[:1]!r}) == 1
assert store.batch_set(keys, pool, pool.allocator.alloc({8 * PS})) == 8
"""
    subprocess.run([sys.executable, "-c", writer], check=True, timeout=120)
    assert store.batch_exists(theirs) == 8 and store.batch_get(theirs, pool, slots) == 8
    assert store.batch_set(theirs, pool, slots) == 8 and len(list(tmp_path.iterdir())) == 2  # not written twice


def test_a_capped_store_rewrites_segments_so_its_disk_holds_at_most_twice_its_cap_and_a_segment(tmp_path):
    pool = HostSlotPool(512, PS)
    slots = pool.allocator.alloc(4 * PS)
    page = HEADER_BYTES + CHECKSUM_BYTES
    store = FileStore(tmp_path, capacity_bytes=20 * page, segment_bytes=8 * (page + 20))
    for chain in range(60):
        keys = keys_of(list(range(1000 * chain, 1000 * chain + 4 * PS)))
        assert store.batch_set(keys, pool, slots) == 4
        assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= 2 * store.capacity_bytes + store.segment_bytes
    last = [keys_of(list(range(1000 * c, 1000 * c + 4 * PS))) for c in range(55, 60)]
    assert [store.batch_exists(keys) for keys in last] == [4] * 5 and store.used_bytes() == 20 * page
    del store
    forget_open_stores()
    reopened = FileStore(tmp_path, capacity_bytes=20 * page)    # the copies, their order with them
    assert [reopened.batch_exists(keys) for keys in last] == [4] * 5 and reopened.used_bytes() == 20 * page
    reopened.batch_set(keys_of(list(range(99000, 99000 + 4 * PS))), pool, slots)
    assert reopened.batch_exists(last[0]) == 0 and reopened.batch_exists(last[1]) == 4


def test_a_store_stops_writing_with_one_warning_while_its_disk_is_nearly_full(tmp_path):
    pool = HostSlotPool(64, PS)
    slots = pool.allocator.alloc(8 * PS)
    store = FileStore(tmp_path, min_free_bytes=1 << 62)        # more than any disk: always nearly full
    with pytest.warns(RuntimeWarning, match="min_free_bytes") as warned:
        assert store.batch_set(keys_of(PROMPT), pool, slots) == 0
        assert store.batch_set(keys_of(list(range(300, 332))), pool, slots) == 0
    assert len(warned) == 1 and store.stats.failed_ops == 2 and store.stats.stored == 0
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) == 0


def test_a_cap_larger_than_the_disk_can_hold_is_refused(tmp_path):
    import shutil

    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(ValueError, match="capacity_bytes .* is more than"):
        FileStore(tmp_path, capacity_bytes=free + (1 << 40))
    with pytest.raises(ValueError, match="capacity_bytes"):
        FileStore(tmp_path, capacity_bytes=free // 2, min_free_bytes=free)


def test_a_torn_record_at_a_segments_end_hides_only_the_pages_it_held(tmp_path):
    # A crash in the middle of an append leaves a torn record: the pages before it are found, and a new process
    # writes after it in a segment of its own.
    pool = HostSlotPool(64, PS)
    slots = pool.allocator.alloc(8 * PS)
    keys = keys_of(PROMPT)
    store = FileStore(tmp_path)
    store.batch_set(keys, pool, slots)
    damage(store, keys[6], cut_at=10)
    del store
    forget_open_stores()
    reopened = FileStore(tmp_path)
    assert reopened.batch_exists(keys) == 6 and reopened.batch_get(keys, pool, slots) == 6
    assert reopened.batch_set(keys, pool, slots) == 8 and len(list(tmp_path.iterdir())) == 2
    assert reopened.stats.corrupt == 0 and reopened.batch_get(keys, pool, slots) == 8


def test_a_page_is_found_under_the_key_its_own_value_carries_whatever_file_holds_it(tmp_path):
    # Segment files swapped between two folders: each page is still found under its own key, never another's.
    _, host, slots = kv_world()
    a, b = keys_of(PROMPT), keys_of(list(range(600, 632)))
    FileStore(tmp_path / "x").batch_set(a, host, slots)
    FileStore(tmp_path / "y").batch_set(b, host, slots)
    forget_open_stores()
    (x,), (y,) = (tmp_path / "x").iterdir(), (tmp_path / "y").iterdir()
    x.rename(tmp_path / "y" / x.name)
    y.rename(tmp_path / "x" / y.name)
    store = FileStore(tmp_path / "x")
    dst = host.allocator.alloc(len(PROMPT))
    assert store.batch_exists(a) == 0 and store.batch_get(b, host, dst) == 8 and store.stats.corrupt == 0
    assert all(torch.equal(p, q) for p, q in zip(host.host_rows(slots, 0), host.host_rows(dst, 0)))


def test_a_store_whose_segment_another_process_deleted_writes_a_new_one(tmp_path):
    pool = HostSlotPool(64, PS)
    slots = pool.allocator.alloc(8 * PS)
    store = FileStore(tmp_path)
    store.batch_set(keys_of(PROMPT[:8]), pool, slots[:8])
    for segment in tmp_path.iterdir():
        segment.unlink()
    later = keys_of(list(range(400, 400 + 8 * PS)))
    assert store.batch_set(later, pool, slots) == 8
    del store
    forget_open_stores()
    assert FileStore(tmp_path).batch_exists(later) == 8


# ---- the simulated store -----------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["set", "get", "exists"]), st.integers(0, 5), st.integers(1, 6)),
                    max_size=25),
       capacity=st.one_of(st.none(), st.integers(1, 14)), page_size=st.sampled_from([1, 4]))
def test_a_simulated_store_holds_what_a_capped_file_store_holds(tmp_path_factory, ops, capacity, page_size):
    # The simulated store is what a replay plans with: it must keep, find and evict as the file store does.
    pool = HostSlotPool(64 * page_size, page_size)
    slots = pool.allocator.alloc(6 * page_size)
    page = HEADER_BYTES + CHECKSUM_BYTES
    files = FileStore(tmp_path_factory.mktemp("store"), None if capacity is None else capacity * page, batch_size=2)
    sim = SimStore(None if capacity is None else capacity * page_size)
    for op, chain, pages in ops:
        keys = [storage_key(d) for d in page_digests(list(range(100 * chain, 100 * chain + 6 * page_size)),
                                                     page_size)][:pages]
        if op == "exists":
            assert sim.batch_exists(keys) == files.batch_exists(keys)
        else:
            call = "batch_set" if op == "set" else "batch_get"
            got = getattr(sim, call)(keys, pool, slots[:len(keys) * page_size])
            assert got == getattr(files, call)(keys, pool, slots[:len(keys) * page_size])
        assert sim.used_tokens() // page_size == files.used_bytes() // page
    assert (sim.stats.hits, sim.stats.stored, sim.stats.failed_ops) == \
        (files.stats.hits, files.stats.stored, files.stats.failed_ops)


def test_a_simulated_store_never_serves_a_host_pool_that_holds_kv_bytes(tmp_path):
    _, host, slots = kv_world()
    store = SimStore()
    for call in (store.batch_set, store.batch_get):
        with pytest.raises(ValueError, match="host_pool holds KV bytes"):
            call(keys_of(PROMPT), host, slots)
    with pytest.raises(ValueError, match="storage SimStore keeps no KV bytes"):
        cache_over(store, host_pool=host)
    with pytest.raises((TypeError, ValueError), match="capacity_tokens"):
        SimStore(0)


def test_a_simulated_store_shared_by_threads_counts_every_page(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    pool = HostSlotPool(4096, 1)
    store = SimStore(capacity_tokens=1000)
    chains = [[storage_key(d) for d in page_digests(list(range(t * 10_000, t * 10_000 + 200)), 1)] for t in range(8)]

    slots = pool.allocator.alloc(200)

    def write(keys):
        return store.batch_set(keys, pool, slots)
    with ThreadPoolExecutor(4) as workers:
        stored = list(workers.map(write, chains))
    assert stored == [200] * 8 and store.used_tokens() == 1000 and store.stats.stored == 1600


# ---- what every store does with a value that fails its checks -----------------------------------------------
class DictStore(PageStore):
    """A store in a dict, whose values a test may damage."""

    def __init__(self):
        super().__init__()
        self.values = {}

    def _exists(self, keys):
        return next((i for i, key in enumerate(keys) if key not in self.values), len(keys))

    def _read(self, keys, value_bytes):
        return [self.values[key] for key in keys[:self._exists(keys)]]

    def _write(self, keys, values):
        for key, value in zip(keys, values):
            self.values.setdefault(key, value)
        return len(keys)

    def _discard(self, key):
        self.values.pop(key, None)


def test_a_page_filed_under_another_key_is_dropped_and_the_next_write_repairs_it():
    _, host, slots = kv_world()
    store, keys = DictStore(), keys_of(PROMPT)
    store.batch_set(keys, host, slots)
    store.values[keys[3]], store.values[keys[4]] = store.values[keys[4]], store.values[keys[3]]  # swapped
    dst = host.allocator.alloc(len(PROMPT))
    assert store.batch_get(keys, host, dst) == 3 and (store.stats.corrupt, store.stats.foreign) == (1, 0)
    assert keys[3] not in store.values
    assert store.batch_set(keys, host, slots) == 8 and store.batch_get(keys, host, dst) == 4   # 4 is still wrong
    assert store.batch_set(keys, host, slots) == 8 and store.batch_get(keys, host, dst) == 8
    assert all(torch.equal(a, b) for a, b in zip(host.host_rows(slots, 0), host.host_rows(dst, 0)))


def test_an_intact_page_of_the_wrong_length_is_a_counted_miss_not_an_exception():
    _, host, slots = kv_world()
    store, keys = DictStore(), keys_of(PROMPT)
    store.batch_set(keys, host, slots)
    fp, n = fingerprint(host.storage_format()), host.page_payload_bytes()
    for i, length in ((2, n - 1), (5, n + 16)):  # a valid checksum over a short or long payload
        store.values[keys[i]] = encode_page(bytes.fromhex(keys[i]), fp, PS, bytes(length))
    dst = host.allocator.alloc(len(PROMPT))
    assert store.batch_get(keys, host, dst) == 2 and store.stats.corrupt == 1 and keys[2] not in store.values
    assert store.batch_get(keys[3:], host, dst[:20]) == 2 and store.stats.corrupt == 2
    assert decode_page(encode_page(bytes(32), fp, PS, bytes(n - 1)), bytes(32), fp, PS, n) is None


def test_a_scheduler_over_a_store_of_wrong_length_pages_admits_its_request_and_counts_the_miss():
    from kvmem import Req, Scheduler, TokenAllocator

    store = DictStore()
    device = MHAKVPool(64, 1, torch.float32, 1, 1, 1)
    alloc, rows = TokenAllocator(64), ReqToTokenPool(2, 64)
    tree = HiRadixCache(rows, alloc, HostKVPool(device, ratio=4), storage=store, prefetch_policy="wait_complete")
    prompt = list(range(1, 20))
    fp, n = fingerprint(tree.host_pool.storage_format()), tree.host_pool.page_payload_bytes()
    for key in [storage_key(d) for d in page_digests(prompt, 1)]:
        store.values[key] = encode_page(bytes.fromhex(key), fp, 1, bytes(n - 1))
    sched = Scheduler(rows, alloc, tree)
    sched.add_request(Req("a", prompt + [99], 1))
    while not sched.is_idle():
        sched.process_batch_result(sched.step(), [7])
        sched.check_invariants()
    assert store.stats.corrupt == 1 and tree.storage_link.stats.prefetched_tokens == 0
    tree.close()


# ---- a hierarchical cache over a store -------------------------------------------------------------------
def cache_over(store, policy="wait_complete", device_pool=None, host_pool=None):
    device = device_pool or MHAKVPool(64, PS, torch.float32, 1, 1, 1)
    host = host_pool or HostKVPool(device, ratio=4)
    alloc = PagedTokenAllocator(device.size, PS)
    return HiRadixCache(ReqToTokenPool(2, 64), alloc, host, page_size=PS, storage=store,
                        prefetch_policy=policy), device, alloc


def store_prompt(tmp_path) -> None:
    """PROMPT's pages in a file store at tmp_path, as a first cache leaves them."""
    first, device, alloc = cache_over(FileStore(tmp_path))
    put(first, device, alloc, PROMPT)
    first.close()


def put(cache, device, alloc, tokens, namespace=None):
    slots = alloc.alloc(len(tokens))
    kv = torch.tensor(tokens, dtype=torch.float32).reshape(-1, 1, 1)
    device.set_kv_buffer(0, slots, kv, kv)
    cached = cache.insert(tokens, slots, namespace=namespace)
    if cached:
        alloc.free(slots[:cached])


def test_a_second_cache_reads_what_the_first_stored_and_gets_the_right_kv(tmp_path):
    store_prompt(tmp_path)
    second, device2, _ = cache_over(FileStore(tmp_path))         # another replica, or a restart
    prefetch = second.prefetch(PROMPT + [1])
    assert second.finish_prefetch(prefetch) == len(PROMPT)
    m = second.match_prefix(PROMPT + [1])
    assert (m.indices.numel(), m.host_hit_length) == (0, len(PROMPT))
    indices = second.load_back(m.last_host_node, m.host_hit_length)
    assert device2.read_kv(0, indices)[0].flatten().long().tolist() == PROMPT
    second.check_invariants()
    assert second.storage_link.stats.prefetched_tokens == len(PROMPT)


def test_pages_are_found_only_in_their_namespace(tmp_path):
    first, device, alloc = cache_over(FileStore(tmp_path))
    put(first, device, alloc, PROMPT, namespace="tenant-a")
    first.close()
    second, _, _ = cache_over(FileStore(tmp_path))
    assert second.prefetch(PROMPT + [1], "tenant-b") is None
    assert second.prefetch(PROMPT + [1]) is None
    assert second.finish_prefetch(second.prefetch(PROMPT + [1], "tenant-a")) == len(PROMPT)


def test_only_the_pages_beyond_the_trees_own_prefix_are_read(tmp_path):
    store_prompt(tmp_path)
    second, device2, alloc2 = cache_over(FileStore(tmp_path))
    put(second, device2, alloc2, PROMPT[:12])                    # 3 pages already cached here
    prefetch = second.prefetch(PROMPT + [1])
    assert prefetch.start == 12 and prefetch.pages == 5
    assert second.finish_prefetch(prefetch) == 20
    second.check_invariants()


class GatedStore(PageStore):
    """A store whose reads wait for a gate: a slow store, on demand (no sleeps)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.gate = inner, threading.Event()

    def batch_exists(self, keys):
        return self.inner.batch_exists(keys)

    def batch_get(self, keys, host_pool, host_slots):
        self.gate.wait(timeout=10)
        return self.inner.batch_get(keys, host_pool, host_slots)

    def batch_set(self, keys, host_pool, host_slots):
        return self.inner.batch_set(keys, host_pool, host_slots)


@pytest.mark.parametrize("policy", ["best_effort", "timeout"])
def test_admission_does_not_wait_for_a_slow_store_and_its_slots_come_back(tmp_path, policy):
    store_prompt(tmp_path)
    store = GatedStore(FileStore(tmp_path))
    second, _, _ = cache_over(store, policy)
    free = second.host_allocator.available_size()
    prefetch = second.prefetch(PROMPT + [1])
    assert second.finish_prefetch(prefetch) == 0                   # not arrived: admission goes on without it
    assert second.host_allocator.available_size() == free - len(PROMPT)
    second.check_invariants()                                     # its slots are held by the read, counted
    store.gate.set()
    assert prefetch.wait(timeout=10)
    second.writing_check()                                        # the read ended: its slots are released
    assert second.host_allocator.available_size() == free
    second.check_invariants()


class ChunkGatedStore(GatedStore):
    """A store whose reads after the first `open_reads` wait for the gate: a read that lands part of the way."""

    def __init__(self, inner, open_reads=1):
        super().__init__(inner)
        self.open_reads, self.reads, self.waiting = open_reads, 0, threading.Event()

    def batch_get(self, keys, host_pool, host_slots):
        self.reads += 1
        if self.reads > self.open_reads:
            self.waiting.set()
            self.gate.wait(timeout=10)
        return self.inner.batch_get(keys, host_pool, host_slots)


@pytest.mark.parametrize("policy", ["best_effort", "timeout"])
def test_a_late_prefetch_gives_the_chunks_that_landed_and_the_right_kv(tmp_path, policy):
    store_prompt(tmp_path)
    store = ChunkGatedStore(FileStore(tmp_path))
    second, device2, _ = cache_over(store, policy)
    second.storage_link.read_chunk_pages = 2                   # 8 pages: 4 reads; the second waits at the gate
    free = second.host_allocator.available_size()
    prefetch = second.prefetch(PROMPT + [1])
    assert len(prefetch.futures) == 4 and prefetch.futures[0].result(timeout=10) == 2
    assert store.waiting.wait(timeout=10)                        # the second read has started
    assert second.finish_prefetch(prefetch) == 2 * PS            # the first chunk, as SGLang keeps fetched pages
    assert prefetch.futures[2].cancelled() and prefetch.futures[3].cancelled()   # never read
    assert second.host_allocator.available_size() == free - 4 * PS   # 2 pages the tree's, 2 the running read's
    second.check_invariants()
    m = second.match_prefix(PROMPT + [1])
    assert (m.indices.numel(), m.host_hit_length) == (0, 2 * PS)
    indices = second.load_back(m.last_host_node, m.host_hit_length)
    assert device2.read_kv(0, indices)[0].flatten().long().tolist() == PROMPT[:2 * PS]
    store.gate.set()
    assert prefetch.wait(timeout=10) and prefetch.futures[1].result() == 2   # the running read ends
    second.writing_check()
    assert second.host_allocator.available_size() + second.host_total_size() == free
    second.check_invariants()
    assert second.storage_link.stats.dropped_prefetch_tokens == 2 * PS


def test_a_prefetch_takes_nothing_past_a_chunk_that_failed_or_came_short(tmp_path):
    store_prompt(tmp_path)
    inner = FileStore(tmp_path)

    class ShortSecondRead(GatedStore):
        reads = 0

        def batch_get(self, keys, host_pool, host_slots):
            self.reads += 1
            if self.reads == 2:
                return self.inner.batch_get(keys[:1], host_pool, host_slots[:PS])  # one page of two
            if self.reads == 3:
                raise OSError("disk gone")
            return self.inner.batch_get(keys, host_pool, host_slots)

    store = ShortSecondRead(inner)
    second, device2, _ = cache_over(store, "wait_complete")
    second.storage_link.read_chunk_pages = 2
    free = second.host_allocator.available_size()
    assert second.finish_prefetch(second.prefetch(PROMPT + [1])) == 3 * PS   # chunk 1 whole, then one page
    assert second.host_allocator.available_size() + second.host_total_size() == free
    second.check_invariants()
    m = second.match_prefix(PROMPT + [1])
    indices = second.load_back(m.last_host_node, m.host_hit_length)
    assert device2.read_kv(0, indices)[0].flatten().long().tolist() == PROMPT[:3 * PS]


def test_a_read_that_ends_while_reap_runs_is_reaped_later_not_lost(tmp_path):
    class EndsDuringReap:  # done() False, then True: the worker finished between two looks
        looks = 0

        def done(self):
            self.looks += 1
            return self.looks > 1

    cache, _, _ = cache_over(FileStore(tmp_path), "best_effort")
    link, slots = cache.storage_link, np.arange(4)
    link._late.append((EndsDuringReap(), slots))
    assert link.reap() == [] and link.late_tokens() == 4
    assert [list(s) for s in link.reap()] == [[0, 1, 2, 3]] and link.late_tokens() == 0


def test_after_close_the_cache_goes_on_without_its_storage_tier(tmp_path):
    store_prompt(tmp_path)
    cache, device, alloc = cache_over(FileStore(tmp_path))
    cache.close()
    free = cache.host_allocator.available_size()
    assert cache.prefetch(PROMPT + [1]) is None and cache.host_allocator.available_size() == free
    put(cache, device, alloc, list(range(600, 616)))              # its backup is not written to the store
    cache.writing_check()
    cache.check_invariants()
    assert cache.match_prefix(list(range(600, 616))).indices.numel() == 16


def test_wait_complete_waits_for_the_read(tmp_path):
    store_prompt(tmp_path)
    store = GatedStore(FileStore(tmp_path))
    second, _, _ = cache_over(store, "wait_complete")
    prefetch = second.prefetch(PROMPT + [1])
    threading.Timer(0.01, store.gate.set).start()
    assert second.finish_prefetch(prefetch) == len(PROMPT)


def test_a_store_that_fails_costs_hits_not_correctness(tmp_path):
    class BrokenStore(PageStore):
        def batch_exists(self, keys):
            return len(keys)            # claims everything...

        def batch_get(self, keys, host_pool, host_slots):
            raise OSError("disk gone")  # ...and then fails

        def batch_set(self, keys, host_pool, host_slots):
            raise OSError("disk gone")

    cache, device, alloc = cache_over(BrokenStore())
    put(cache, device, alloc, PROMPT)  # the write fails on the worker: nothing changes here
    assert cache.finish_prefetch(cache.prefetch(list(range(500, 540)))) == 0
    cache.check_invariants()
    m = cache.match_prefix(PROMPT)
    assert m.indices.numel() == len(PROMPT)


def test_a_prefetch_whose_prefix_left_the_tree_is_released(tmp_path):
    store_prompt(tmp_path)
    second, device2, alloc2 = cache_over(FileStore(tmp_path))
    put(second, device2, alloc2, PROMPT[:8])
    prefetch = second.prefetch(PROMPT + [1])
    second.evict(64)
    second.evict_host(1 << 20)                                   # the 2 pages it hangs from are gone
    assert second.finish_prefetch(prefetch) == 0
    second.check_invariants()


def test_a_full_file_store_costs_hits_not_correctness(tmp_path):
    store = FileStore(tmp_path, capacity_bytes=HEADER_BYTES + CHECKSUM_BYTES)  # smaller than any page
    cache, device, alloc = cache_over(store)
    put(cache, device, alloc, PROMPT)
    cache.storage_link.drain_writes()
    assert store.stats.failed_ops > 0 and store.stats.stored == 0 and store.used_bytes() == 0
    assert cache.prefetch(PROMPT + [1]) is None                  # nothing was stored: a miss, no error
    cache.check_invariants()
    assert cache.match_prefix(PROMPT).indices.numel() == len(PROMPT)


def test_storage_needs_a_real_store_and_a_known_policy(tmp_path):
    with pytest.raises(TypeError, match="storage"):
        cache_over(object())
    with pytest.raises(ValueError, match="prefetch_policy"):
        cache_over(FileStore(tmp_path), policy="eager")


# ---- the Mooncake store ---------------------------------------------------------------------------------------
def mooncake_or_skip():
    try:
        from kvmem.storage import MooncakeServer, MooncakeStore
        from kvmem.storage.mooncake_store import _mooncake_store_class
        _mooncake_store_class()
    except RuntimeError as e:
        pytest.skip(f"the Mooncake store cannot load here: {e}")
    return MooncakeServer, MooncakeStore


@pytest.mark.mooncake
def test_mooncake_pages_outlive_the_client_that_wrote_them():
    MooncakeServer, MooncakeStore = mooncake_or_skip()
    _, host, slots = kv_world()
    with MooncakeServer(64) as server:
        writer = MooncakeStore(server.master_addr, server.metadata_server)
        assert writer.batch_set(keys_of(PROMPT), host, slots) == 8
        writer.close()
        reader = MooncakeStore(server.master_addr, server.metadata_server)
        dst = host.allocator.alloc(len(PROMPT))
        assert reader.batch_exists(keys_of(PROMPT)) == 8 and reader.batch_get(keys_of(PROMPT), host, dst) == 8
        assert all(torch.equal(a, b) for a, b in zip(host.host_rows(slots, 1), host.host_rows(dst, 1)))
        reader.close()


@pytest.mark.mooncake
def test_a_killed_mooncake_master_costs_hits_and_nothing_hangs():
    MooncakeServer, MooncakeStore = mooncake_or_skip()
    with MooncakeServer(64) as server:
        store = MooncakeStore(server.master_addr, server.metadata_server)
        cache, device, alloc = cache_over(store)
        put(cache, device, alloc, PROMPT)
        cache.storage_link.drain_writes()
        server.kill_master()
        put(cache, device, alloc, list(range(300, 316)))       # its write fails, counted
        assert cache.prefetch(list(range(900, 940))) is None  # lookups miss at once (no 4 s stall per call)
        cache.storage_link.drain_writes()
        assert store.stats.failed_ops >= 1
        cache.check_invariants()
        cache.close()
        store.close()


@pytest.mark.mooncake
def test_a_mooncake_master_that_cannot_be_reached_is_a_clear_error():
    MooncakeServer, MooncakeStore = mooncake_or_skip()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RuntimeError, match="cannot join"):
        MooncakeStore(f"127.0.0.1:{port}")
    for bad in ("127.0.0.1:70000", "127.0.0.1:0", "127.0.0.1", ":80"):
        with pytest.raises(ValueError, match="master_addr"):
            MooncakeStore(bad)


@pytest.mark.mooncake
def test_joining_a_port_where_no_mooncake_master_speaks_fails_within_connect_timeout_s():
    # Mooncake retried such a setup for a minute; the store bounds it, and says so in one line.
    import socket

    MooncakeServer, MooncakeStore = mooncake_or_skip()
    outcome = []

    def join(port):
        try:
            MooncakeStore(f"127.0.0.1:{port}", connect_timeout_s=0.5)
        except RuntimeError as e:
            outcome.append(str(e))

    with socket.socket() as silent:  # accepts connections (the kernel's backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        worker = threading.Thread(target=join, args=(silent.getsockname()[1],), daemon=True)
        worker.start()
        worker.join(timeout=30)
    assert not worker.is_alive() and len(outcome) == 1
    assert "no Mooncake master answered within 0.5 s (connect_timeout_s" in outcome[0] and "\n" not in outcome[0]
    for bad in (0, -1, float("nan"), "5"):
        with pytest.raises(ValueError, match="connect_timeout_s"):
            MooncakeStore("127.0.0.1:1", connect_timeout_s=bad)


@pytest.mark.mooncake
def test_an_oversized_mooncake_value_is_dropped_and_the_next_write_repairs_its_key():
    MooncakeServer, MooncakeStore = mooncake_or_skip()
    _, host, slots = kv_world()
    keys = keys_of(PROMPT)
    with MooncakeServer(64) as server:
        store = MooncakeStore(server.master_addr, server.metadata_server)
        assert store.batch_set(keys, host, slots) == 8
        oversized = store._stage(1 << 16)
        oversized[:] = 7
        store._store.remove(keys[2], True)
        assert store._store.batch_put_from([keys[2]], [oversized.ctypes.data], [len(oversized)]) == [0]
        dst = host.allocator.alloc(len(PROMPT))
        assert store.batch_get(keys, host, dst) == 2 and (store.stats.corrupt, store.stats.failed_ops) == (1, 0)
        assert store.batch_exists(keys) == 2                          # removed, not found again
        assert store.batch_set(keys, host, slots) == 8 and store.batch_get(keys, host, dst) == 8
        assert all(torch.equal(a, b) for a, b in zip(host.host_rows(slots, 1), host.host_rows(dst, 1)))
        store.close()


@pytest.mark.mooncake
def test_a_mooncake_master_that_times_out_marks_the_store_down_with_growing_waits():
    MooncakeServer, MooncakeStore = mooncake_or_skip()
    with MooncakeServer(64) as server:
        with pytest.raises(RuntimeError, match="already started"):
            server.start()
        store = MooncakeStore(server.master_addr, server.metadata_server, retry_s=0.3)
        real, calls = store._store, []

        class Hung:  # a master that hangs answers -901 (RPC timeout), after 30 s, to every call
            def __getattr__(self, name):
                return getattr(real, name)

            def batch_is_exist(self, keys):
                calls.append(len(keys))
                return [-901] * len(keys)

        store._store = Hung()
        keys = keys_of(PROMPT)
        assert store.batch_exists(keys) == 0 and len(calls) == 1
        assert store.batch_exists(keys) == 0 and len(calls) == 1        # down: skipped, a miss
        time.sleep(0.35)
        assert store.batch_exists(keys) == 0 and len(calls) == 2        # its port answers: tried, failed again
        time.sleep(0.35)
        assert store.batch_exists(keys) == 0 and len(calls) == 2        # the wait doubled after a second error
        store._store = real
        time.sleep(0.3)
        assert store.batch_exists(keys) == 0 and len(calls) == 2 and store._backoff == 0   # back: no error
        store.close()


def test_a_storage_key_has_no_collision_across_namespaces_by_construction():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, 64).tolist()
    names = [set(keys_of(tokens, ns)) for ns in (None, "a", "b", "a:b", "")]
    assert sum(len(n) for n in names) == len(set().union(*names))


# ---- replays over a store ---------------------------------------------------------------------------------
def replay_twice(storage, **extra):
    from kvmem.replay.config import ReplayConfig
    from kvmem.replay.simulator import replay
    from kvmem.replay.synthetic import multi_turn_chat

    trace = multi_turn_chat(60, system_len=64, turns=(2, 3), user_len=(16, 32), output_len=(4, 8), seed=1)
    config = ReplayConfig(capacity_tokens=512, max_context_len=trace.max_context_len, page_size=PS,
                          host_capacity_tokens=1024, storage=storage, honour_arrivals=False, max_running=8,
                          **extra)
    return [replay(trace, config).to_json() for _ in range(2)]


def test_a_replay_finds_its_previous_runs_pages_in_a_file_store(tmp_path):
    first, second = replay_twice(f"file:{tmp_path}")
    assert first["stored_tokens"] > 0 and first["storage_misses_corrupt"] == 0
    assert second["storage_hit_rate"] > first["storage_hit_rate"] and second["hit_rate"] > first["hit_rate"]
    assert second["prefetched_tokens"] > 0


@pytest.mark.mooncake
def test_a_replay_finds_its_previous_runs_pages_in_mooncake():
    MooncakeServer, _ = mooncake_or_skip()
    with MooncakeServer(64) as server:
        first, second = replay_twice(f"mooncake:{server.master_addr}", storage_metadata=server.metadata_server)
    assert second["storage_hit_rate"] > 0 and second["hit_rate"] > first["hit_rate"]
    assert first["storage_failed_ops"] == second["storage_failed_ops"] == 0


@pytest.mark.mooncake
def test_serving_goes_on_with_device_and_host_tiers_when_the_mooncake_master_dies():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_tiered_scheduler import TokenModel, expected, workload

    from kvmem import Req, Scheduler, SchedulerConfig

    MooncakeServer, MooncakeStore = mooncake_or_skip()
    with MooncakeServer(64) as server:
        store = MooncakeStore(server.master_addr, server.metadata_server)
        device = MHAKVPool(160, 1, torch.float32, 1, 1, 1)
        alloc, rows = __import__("kvmem").TokenAllocator(160), ReqToTokenPool(8, 256)
        tree = HiRadixCache(rows, alloc, HostKVPool(device, ratio=8), storage=store, prefetch_policy="wait_complete")
        sched = Scheduler(rows, alloc, tree, SchedulerConfig(schedule_policy="fcfs", max_running_requests=4,
                                                             chunked_prefill_size=48))
        model = TokenModel(sched, device)
        reqs = workload(seed=1, sessions=8)
        for rid, prompt, n in reqs:
            sched.add_request(Req(rid, prompt, n))
        finished, steps = {}, 0
        while not sched.is_idle():
            steps += 1
            if steps == 30:
                server.kill_master()
            batch = sched.step()
            for r in sched.process_batch_result(batch, model.forward(batch)):
                finished[r.rid] = r.output_ids
            sched.check_invariants()
        assert finished == {rid: expected(p, n) for rid, p, n in reqs}
        tree.close()
        assert store.stats.failed_ops > 0
        store.close()


@pytest.mark.mooncake
def test_a_full_mooncake_store_costs_hits_not_correctness():
    MooncakeServer, MooncakeStore = mooncake_or_skip()
    device = MHAKVPool(256, PS, torch.float32, 8, 128, 4)          # 128 KiB pages: 16 MiB holds ~100
    with MooncakeServer(16) as server:
        store = MooncakeStore(server.master_addr, server.metadata_server)
        cache, device, alloc = cache_over(store, device_pool=device, host_pool=HostKVPool(device, ratio=16))
        for start in range(0, 40 * 32, 32):                        # 320 pages: three times what the store holds
            cache.insert(list(range(10_000 + start, 10_000 + start + 32)), alloc.alloc(32))  # KV left as it is
            cache.evict(1 << 20)
        cache.storage_link.drain_writes()
        assert store.stats.failed_ops > 0 and 0 < store.stats.stored < 320
        cache.check_invariants()
        cache.close()
        store.close()


@pytest.mark.mooncake
def test_the_mooncake_server_command_stops_its_processes_on_sigterm():
    import signal
    import socket
    import subprocess
    import sys

    mooncake_or_skip()
    proc = subprocess.Popen([sys.executable, "-m", "kvmem.storage.mooncake_server", "--segment-mb", "16"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()          # printed once the master and the storage process listen
        host, port = line.split()[1].removeprefix("mooncake:").rsplit(":", 1)
        socket.create_connection((host, int(port)), 1).close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        with pytest.raises(OSError):
            socket.create_connection((host, int(port)), 1).close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_store_whose_reads_or_listing_fail_costs_hits_not_an_exception(tmp_path, monkeypatch):
    import kvmem.storage.file_store as file_store

    store_prompt(tmp_path)
    store = FileStore(tmp_path)
    keys = keys_of(PROMPT)
    _, unreadable, _ = store.locate(keys[2])
    real_pread = os.pread

    def pread(fd, n, offset):  # an I/O error under one page
        if offset == unreadable:
            raise OSError(5, "Input/output error")
        return real_pread(fd, n, offset)
    monkeypatch.setattr(file_store.os, "pread", pread)
    second, _, _ = cache_over(store)
    assert second.finish_prefetch(second.prefetch(PROMPT + [1])) == 2 * PS   # the pages before it
    assert store.stats.failed_ops == 1
    second.check_invariants()

    def scandir(path):  # a folder it may not list (EACCES), as root never sees one
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(file_store.os, "scandir", scandir)
    assert store.batch_exists(keys_of(list(range(700, 708)))) == 0 and store.stats.failed_ops == 2

    class DownStore(PageStore):  # any store: its lookup raising is a miss
        def batch_exists(self, keys):
            raise ConnectionError("master down")

        def batch_get(self, keys, host_pool, host_slots):
            raise AssertionError("never read what no lookup found")

        batch_set = batch_get
    down, _, _ = cache_over(DownStore())
    assert down.prefetch(PROMPT + [1]) is None and down.storage_link.storage.stats.failed_ops == 1
    down.check_invariants()


def test_finish_prefetch_refuses_a_prefetch_it_did_not_start_or_finished_already(tmp_path):
    store_prompt(tmp_path)
    second, _, _ = cache_over(FileStore(tmp_path))
    other, _, _ = cache_over(FileStore(tmp_path))
    prefetch, foreign = second.prefetch(PROMPT + [1]), other.prefetch(PROMPT + [1])
    assert second.finish_prefetch(prefetch) == len(PROMPT)
    free = second.host_allocator.available_size()
    for bad in (prefetch, foreign):  # its slots are the tree's now; another cache's slots are not this one's
        with pytest.raises(ValueError) as raised:
            second.finish_prefetch(bad)
        assert str(raised.value) == "prefetch was not started by this cache's prefetch(), or was finished already"
    with pytest.raises(TypeError, match="prefetch must be a Prefetch .* got str"):
        second.finish_prefetch("x")
    assert second.host_allocator.available_size() == free and second.match_prefix(PROMPT).host_hit_length == 32
    second.check_invariants()
    assert other.finish_prefetch(foreign) == len(PROMPT)
    other.check_invariants()


@pytest.mark.parametrize("late", [False, True])
def test_reset_keeps_count_of_the_slots_a_prefetch_still_reads_into(tmp_path, late):
    store_prompt(tmp_path)
    store = GatedStore(FileStore(tmp_path))
    second, _, _ = cache_over(store, "best_effort")
    size = second.host_allocator.size
    prefetch = second.prefetch(PROMPT + [1])
    if late:
        assert second.finish_prefetch(prefetch) == 0   # taken before its read ended: writing_check reaps it
    second.reset()
    second.check_invariants()                            # its slots are still the read's
    store.gate.set()
    assert prefetch.wait(timeout=10)
    if not late:  # read from the root: its pages are still the right ones, and hang there
        assert second.finish_prefetch(prefetch) == len(PROMPT)
    second.writing_check()
    assert second.host_allocator.available_size() + second.host_total_size() == size
    second.check_invariants()


def test_a_prefetch_makes_host_room_without_evicting_the_prefix_it_hangs_from(tmp_path):
    store_prompt(tmp_path)
    second, device2, alloc2 = cache_over(FileStore(tmp_path))
    put(second, device2, alloc2, PROMPT[:8])
    second.evict(64)                                     # the prefix is on host only, the host's only leaf
    host = second.host_allocator
    filler = host.alloc(host.available_size() - 16)   # 8 short of the 24 tokens the prefetch reads
    prefetch = second.prefetch(PROMPT + [1])
    assert prefetch is None and second.match_prefix(PROMPT).host_hit_length == 8   # no read it would waste
    host.free(filler)
    assert second.finish_prefetch(second.prefetch(PROMPT + [1])) == len(PROMPT) - 8
    second.check_invariants()


@pytest.mark.parametrize("policy", ["best_effort", "timeout"])
def test_a_lookup_waits_neither_for_a_slow_read_nor_for_the_writes_queued_behind_it(tmp_path, policy):
    store_prompt(tmp_path)
    store = GatedStore(FileStore(tmp_path))
    second, device2, alloc2 = cache_over(store, policy)
    slow = second.prefetch(PROMPT + [1])              # its read waits at the gate
    other = list(range(500, 532))
    put(second, device2, alloc2, other)               # its pages' write is queued behind that read
    digests = b"".join(bytes.fromhex(k) for k in keys_of(other + [1]))
    t0 = time.monotonic()
    assert second.storage_link.lookup(digests) == len(other) // PS   # counted, not waited for
    assert time.monotonic() - t0 < 5 and not slow.wait(0) and store.batch_exists(keys_of(other)) == 0
    store.gate.set()
    assert slow.wait(timeout=10)
    second.storage_link.drain_writes()
    assert store.batch_exists(keys_of(other)) == len(other) // PS
    assert second.finish_prefetch(slow) == len(PROMPT)
    second.check_invariants()
