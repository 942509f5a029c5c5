"""The storage tier: the page format, the file store, and a hierarchical cache over a store: pages written behind
host backups, read back by another cache (another replica, or the same one after a restart), and never loaded
unless they are the page asked for."""

import os
import threading
import time

import numpy as np
import pytest
import torch

from kvmem import HiRadixCache, HostKVPool, MHAKVPool, PagedTokenAllocator, ReqToTokenPool
from kvmem.page_hash import page_digests, storage_key
from kvmem.storage import FileStore, PageStore, parse_store_spec
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
    assert not list(tmp_path.rglob("*.tmp"))  # writes land by rename


def test_a_corrupt_or_truncated_page_file_is_a_counted_miss_and_is_dropped(tmp_path):
    _, host, slots = kv_world()
    store = FileStore(tmp_path)
    keys = keys_of(PROMPT)
    store.batch_set(keys, host, slots)
    files = {f.stem: f for f in tmp_path.rglob("*.page")}
    data = bytearray(files[keys[2]].read_bytes())
    data[200] ^= 0xFF
    files[keys[2]].write_bytes(bytes(data))
    files[keys[5]].write_bytes(files[keys[5]].read_bytes()[:50])
    dst = host.allocator.alloc(len(PROMPT))
    assert store.batch_get(keys, host, dst) == 2 and store.stats.corrupt == 1
    assert not files[keys[2]].exists()
    assert store.batch_get(keys[3:], host, dst[:20]) == 2 and store.stats.corrupt == 2


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


def test_a_chains_page_files_are_timed_root_newest_whatever_the_clock(tmp_path):
    # The file system's clock is coarse: a chain refreshed within microseconds got one time for all its pages,
    # and a process opening the folder ordered them by name.
    store, pool, slots = capped_store(tmp_path, 64)
    chain = keys_of(list(range(8 * PS)))
    store.batch_set(chain, pool, slots[:8 * PS])
    times = [store._file(key).stat().st_mtime_ns for key in chain]
    assert times == sorted(times, reverse=True) and len(set(times)) == 8


def test_capped_file_stores_of_one_folder_share_its_cap(tmp_path):
    # A cluster's replicas over one store each open it: the folder must not hold the cap once per replica.
    first, pool, slots = capped_store(tmp_path, 4)
    second = FileStore(tmp_path, capacity_bytes=first.capacity_bytes)
    first.batch_set(keys_of(list(range(4 * PS))), pool, slots[:4 * PS])
    second.batch_set(keys_of(list(range(500, 500 + 4 * PS))), pool, slots[:4 * PS])
    assert len(list(tmp_path.glob("*/*/*.page"))) == 4 and first.used_bytes() == second.used_bytes()


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
    for spec in ("file:   ", "file:/tmp/x\0y", "file:", "nfs:/x"):
        with pytest.raises(ValueError, match="storage must be"):
            parse_store_spec(spec)
    assert parse_store_spec("file:~/kv") == ("file", os.path.expanduser("~/kv"))


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


def test_a_store_whose_lookup_fails_costs_hits_not_an_exception(tmp_path, monkeypatch):
    store_prompt(tmp_path)
    store = FileStore(tmp_path)
    keys = keys_of(PROMPT)
    unreadable = store._file(keys[2])
    real_exists = type(unreadable).exists

    def exists(path, *args, **kwargs):  # a folder it may not search (EACCES), as root never sees one
        if path == unreadable:
            raise PermissionError(13, "Permission denied", str(path))
        return real_exists(path, *args, **kwargs)
    monkeypatch.setattr(type(unreadable), "exists", exists)
    assert store.batch_exists(keys) == 2 and store.stats.failed_ops == 1
    second, _, _ = cache_over(store)
    assert second.finish_prefetch(second.prefetch(PROMPT + [1])) == 2 * PS   # the pages before it
    second.check_invariants()

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
