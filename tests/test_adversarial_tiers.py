"""The tier, storage, event and routing APIs under fire, with test_adversarial's promise: a call works (and the
component's invariants hold) or raises ValueError, IndexError or TypeError naming one of its arguments, with
the component exactly as it was. Decoders of bytes from elsewhere (a stored page, an event payload) never raise
anything but their documented error, whatever the bytes."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_adversarial import NASTY, PROMISED, SETTINGS, allocator_snapshot, arity, attempt

from kvmem import HiRadixCache, HostKVPool, MHAKVPool, PagedTokenAllocator, ReqToTokenPool, TokenAllocator
from kvmem.events import BlockStored, EventBatch, EventDecodeError, decode_batch, encode_batch
from kvmem.page_hash import page_digests, storage_key
from kvmem.router import BlockIndex, ReplicaLoad, Router
from kvmem.storage import FileStore, PageStore
from kvmem.storage.page_format import decode_page, encode_page, fingerprint


# ---- the hierarchical cache -------------------------------------------------------------------------------
def tiers_snapshot(cache):
    cache.check_invariants()
    return (cache.evictable_size(), cache.protected_size(), cache.host_evictable_size(),
            cache.host_protected_size(), allocator_snapshot(cache.token_allocator),
            allocator_snapshot(cache.host_allocator))


@pytest.mark.parametrize("page_size", [1, 4])
@SETTINGS
@given(data=st.data())
def test_the_hierarchical_cache_refuses_hostile_arguments(tmp_path_factory, page_size, data):
    device = MHAKVPool(32, page_size, torch.float32, 1, 2, 1)
    alloc = TokenAllocator(32) if page_size == 1 else PagedTokenAllocator(32, page_size)
    cache = HiRadixCache(ReqToTokenPool(2, 32), alloc, HostKVPool(device, ratio=4), page_size=page_size,
                         storage=FileStore(tmp_path_factory.mktemp("store")), prefetch_policy="wait_complete")
    key = list(range(4 * page_size))
    cache.insert(key, alloc.alloc(len(key)))
    cache.evict(2 * page_size)  # the tail is host-only now
    m = cache.match_prefix(key)
    cache.inc_lock_ref(m.last_node)
    nodes = st.sampled_from([m.last_node, m.last_host_node, cache.root_node, None])
    fresh = alloc.alloc(page_size)
    values = st.sampled_from([fresh, torch.cat([fresh, fresh]), m.last_node.value, torch.tensor([0] * page_size)])
    lengths = st.sampled_from([m.host_hit_length, 2 * page_size, page_size, 0])
    calls = [cache.match_prefix, cache.prefix_len, cache.insert, cache.inc_lock_ref, cache.dec_lock_ref, cache.evict,
             cache.evict_host, cache.load_back, cache.prefetch]
    for _ in range(6):
        call = data.draw(st.sampled_from(calls))
        args = [data.draw(st.one_of(NASTY, nodes, values, lengths, st.just(key))) for _ in range(arity(call))]

        def check():
            cache.check_invariants()
            cache.storage_link.drain_writes()

        attempt(call, args, lambda: tiers_snapshot(cache), check)
    cache.close()


# ---- the host pool --------------------------------------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def test_the_host_pool_refuses_hostile_arguments(data):
    device = MHAKVPool(16, 4, torch.float32, 1, 2, 2, kv_cache_dtype=data.draw(st.sampled_from(["auto", "int4"])))
    host = HostKVPool(device, ratio=2)
    held = host.allocator.alloc(4)
    good = st.sampled_from([held, held.numpy(), torch.arange(4, 8), 0, 1, [b"\x00" * host.page_payload_bytes()]])
    for _ in range(4):
        call = data.draw(st.sampled_from([host.backup, host.load, host.host_rows, host.read_pages, host.write_pages]))
        args = [data.draw(st.one_of(NASTY, good)) for _ in range(arity(call))]

        def snapshot():
            return ([b.clone() for part in host._buffers for b in (part if isinstance(part, list) else [part])]
                    + [b.clone() for b in device._all_buffers()], allocator_snapshot(host.allocator))

        before = snapshot()
        try:
            result = call(*args)
            if hasattr(result, "wait"):
                result.wait()
        except PROMISED:
            after = snapshot()
            assert all(torch.equal(a, b) for a, b in zip(after[0], before[0])) and after[1] == before[1], \
                f"{call.__name__} raised and changed the pools"


# ---- stores and the page format -------------------------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def test_a_file_store_refuses_hostile_arguments(tmp_path_factory, data):
    device = MHAKVPool(16, 4, torch.float32, 1, 2, 1)
    host = HostKVPool(device, ratio=2)
    slots = host.allocator.alloc(8)
    keys = [storage_key(d) for d in page_digests(list(range(8)), 4)]
    store = FileStore(tmp_path_factory.mktemp("store"))
    store.batch_set(keys[:1], host, slots[:4])
    good = st.sampled_from([keys, keys[:1], keys[1:], host, slots, slots[:4], slots.numpy()])
    for _ in range(4):
        call = data.draw(st.sampled_from([store.batch_exists, store.batch_get, store.batch_set]))
        args = [data.draw(st.one_of(NASTY, good)) for _ in range(arity(call))]
        stored = sorted((p.name, p.stat().st_size) for p in store.path.iterdir())
        try:
            call(*args)
        except PROMISED as e:
            assert any(n in str(e) for n in ("keys", "host_pool", "host_slots")), str(e)
            assert sorted((p.name, p.stat().st_size) for p in store.path.iterdir()) == stored


@SETTINGS
@given(value=st.binary(max_size=200), flips=st.lists(st.integers(0, 10**6), max_size=4))
def test_decoding_any_bytes_as_a_page_gives_the_page_or_none(value, flips):
    digest, fp = bytes(range(32)), fingerprint("f")
    page = bytearray(encode_page(digest, fp, 4, b"payload!"))
    for i in flips:
        page[i % len(page)] ^= 1 + i % 255
    for candidate in (value, bytes(page)):
        payload = decode_page(candidate, digest, fp, 4)
        assert payload is None or bytes(payload) == b"payload!"


# ---- events and routing ---------------------------------------------------------------------------------------
@SETTINGS
@given(payload=st.one_of(st.binary(max_size=64), st.builds(
    lambda n, cut: encode_batch(EventBatch(1.0, [BlockStored([n], None, list(range(4)), 4)]))[:cut],
    st.integers(0, 2**64 - 1), st.integers(0, 80))))
def test_decoding_any_bytes_as_an_event_batch_gives_a_batch_or_a_decode_error(payload):
    try:
        batch = decode_batch(payload)
    except EventDecodeError:
        return
    assert isinstance(batch, EventBatch)


@SETTINGS
@given(data=st.data())
def test_the_block_index_and_router_refuse_hostile_arguments(data):
    index = BlockIndex(2)
    index.apply(0, EventBatch(1.0, [BlockStored([11, 12], None, list(range(8)), 4)]))
    router = Router(data.draw(st.sampled_from(["round-robin", "least-load", "cache-aware", "kv-overlap"])), 2,
                    index=index, block_size=4)
    loads = [ReplicaLoad(0, 0), ReplicaLoad(1, 64)]
    good = st.sampled_from([0, 1, [11, 12], loads, 8, EventBatch(2.0, [])])
    for _ in range(4):
        call = data.draw(st.sampled_from([index.apply, index.clear, index.num_blocks, index.prefix_overlaps,
                                          router.route]))
        args = [data.draw(st.one_of(NASTY, good)) for _ in range(arity(call))]
        before = [index.blocks(r) for r in range(2)]
        try:
            result = call(*args)
        except PROMISED:
            assert [index.blocks(r) for r in range(2)] == before, f"{call.__name__} raised and changed the index"
            continue
        if call is router.route:
            assert result in (0, 1)


def test_numpy_keys_and_values_reach_the_tiers_like_lists():
    alloc = TokenAllocator(16)
    cache = HiRadixCache(ReqToTokenPool(2, 16), alloc, HostKVPool(MHAKVPool(16, 1, torch.float32, 1, 2, 1), ratio=2))
    cache.insert(np.arange(5, 9), alloc.alloc(4).numpy())
    assert cache.match_prefix(np.arange(5, 9)).indices.numel() == 4


# ---- stores that lie about what they have -------------------------------------------------------------------
class LyingStore(PageStore):
    """Answers every lookup (and read) with `count(asked)`: negative, too large, not an int, or raising."""

    def __init__(self, count):
        super().__init__()
        self.count = count

    def batch_exists(self, keys):
        return self.count(len(keys))

    def batch_get(self, keys, host_pool, host_slots):
        return self.count(len(keys))

    def batch_set(self, keys, host_pool, host_slots):
        return self.count(len(keys))


def _raise(n):
    raise OSError("store gone")


LIES = {"negative": lambda n: -3, "too many": lambda n: n + 5, "a float": lambda n: n / 2, "None": lambda n: None,
        "a bool": lambda n: True, "a string": lambda n: "1", "numpy too many": lambda n: np.int64(n + 1),
        "raising": _raise}


@pytest.mark.parametrize("policy", ["wait_complete", "best_effort"])
@pytest.mark.parametrize("lie", list(LIES))
def test_a_store_that_miscounts_costs_hits_and_is_counted_never_an_exception(policy, lie):
    from kvmem import Req, Scheduler

    store = LyingStore(LIES[lie])
    device = MHAKVPool(64, 4, torch.float32, 1, 1, 1)
    alloc, rows = PagedTokenAllocator(64, 4), ReqToTokenPool(2, 64)
    tree = HiRadixCache(rows, alloc, HostKVPool(device, ratio=4), page_size=4, storage=store,
                        prefetch_policy=policy)
    sched = Scheduler(rows, alloc, tree)
    for rid, prompt in (("a", list(range(1, 20))), ("b", list(range(1, 12)) + [500] * 8)):
        sched.add_request(Req(rid, prompt, 2))
        while not sched.is_idle():
            sched.process_batch_result(sched.step(), [7])
            sched.check_invariants()
    tree.writing_check()
    tree.storage_link.drain_writes()
    assert store.stats.failed_ops > 0 and tree.storage_link.stats.prefetched_tokens == 0
    assert tree.storage_link.stats.stored_tokens == 0
    tree.close()
    tree.check_invariants()


def test_a_read_that_reports_more_pages_than_it_was_asked_for_attaches_none():
    class OverReading(FileStore):
        def batch_get(self, keys, host_pool, host_slots):
            return super().batch_get(keys, host_pool, host_slots) + 2

    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        device = MHAKVPool(64, 4, torch.float32, 1, 1, 1)
        alloc = PagedTokenAllocator(64, 4)
        first = HiRadixCache(ReqToTokenPool(2, 64), alloc, HostKVPool(device, ratio=4), page_size=4,
                             storage=FileStore(folder), prefetch_policy="wait_complete")
        first.insert(list(range(16)), alloc.alloc(16))
        first.close()
        store = OverReading(folder)
        second = HiRadixCache(ReqToTokenPool(2, 64), PagedTokenAllocator(64, 4), HostKVPool(device, ratio=4),
                              page_size=4, storage=store, prefetch_policy="wait_complete")
        free = second.host_allocator.available_size()
        assert second.finish_prefetch(second.prefetch(list(range(17)))) == 0 and store.stats.failed_ops == 1
        assert second.host_allocator.available_size() == free
        second.check_invariants()
