"""HiRadixCache: device and host tiers under one radix tree.

Slots carry content here: a device "KV store" and a host one hold, for each slot, the token whose KV it is.
Inserts write it, backups and loads copy it, so every check can ask the question that matters: does each
slot the tree hands out hold the right token?
"""

import threading
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule, run_state_machine_as_test

from kvmem import HiRadixCache, HostKVPool, MHAKVPool, PagedTokenAllocator, RadixCache, ReqToTokenPool, TokenAllocator
from kvmem.eviction import ONLINE_POLICIES
from kvmem.replay.belady import BeladyPolicy
from kvmem.storage import FileStore
from kvmem.tiers import Transfer
from kvmem.tiers.backups import all_reduce_min
from tests.test_radix_cache import tree_nodes
from tests.test_radix_cache_model import future_index


class ContentHost:
    """A host tier of `size` slots whose 'KV' is one token id per slot; copies move ids. `fail` makes the next
    copies fail; `delay` makes backups complete only after that many polls (an asynchronous copy), and
    `fail_late` makes the next such copies fail when they complete. As a storage tier's host pool, a page's
    payload is its ids."""

    def __init__(self, size, page_size, device_kv):
        self.allocator = TokenAllocator(size) if page_size == 1 else PagedTokenAllocator(size, page_size)
        self.page_size = page_size
        self.kv = np.full(size + page_size, -1, dtype=np.int64)
        self.device_kv = device_kv
        self.fail = self.fail_late = 0
        self.delay = 0

    def _transfer(self, copy):
        if self.fail:
            self.fail -= 1
            return Transfer(error=RuntimeError("injected copy fault"))
        if not self.delay:
            copy()
            return Transfer()
        if self.fail_late:
            self.fail_late -= 1
            copy = _raise_copy_fault
        return DelayedTransfer(self.delay, copy)

    def storage_format(self):
        return "test-content"

    def page_payload_bytes(self):
        return 8 * self.page_size

    def check_host_slots(self, host_slots):
        return np.asarray(host_slots)

    def read_pages(self, host_slots):
        slots = np.asarray(host_slots)
        return [self.kv[slots[i:i + self.page_size]].tobytes() for i in range(0, len(slots), self.page_size)]

    def write_pages(self, host_slots, payloads):
        slots = np.asarray(host_slots)
        for i, payload in enumerate(payloads):
            self.kv[slots[i * self.page_size:(i + 1) * self.page_size]] = np.frombuffer(payload, dtype=np.int64)

    def backup(self, host_slots, device_slots):
        host, device = np.asarray(host_slots), np.asarray(device_slots)
        return self._transfer(lambda: self.kv.__setitem__(host, self.device_kv[device]))

    def load(self, device_slots, host_slots, layer_id=None):
        host, device = np.asarray(host_slots), np.asarray(device_slots)
        transfer = self._transfer(lambda: self.device_kv.__setitem__(device, self.kv[host]))
        transfer.wait()
        return transfer


def _raise_copy_fault():
    raise RuntimeError("injected late copy fault")


class DelayedTransfer(Transfer):
    def __init__(self, polls, copy):
        super().__init__(finish=copy)
        self.polls = polls

    def done(self):
        self.polls -= 1
        return self.polls < 0 and super().done()

    def wait(self):
        self.polls = -1
        super().wait()


class World:
    def __init__(self, device=64, host=256, page_size=1, write_policy="write_through", **policies):
        self.ps = page_size
        self.alloc = TokenAllocator(device) if page_size == 1 else PagedTokenAllocator(device, page_size)
        self.device_kv = np.full(device + page_size, -1, dtype=np.int64)
        self.host = ContentHost(host, page_size, self.device_kv)
        self.cache = HiRadixCache(ReqToTokenPool(2, 64), self.alloc, self.host, page_size=page_size,
                                  write_policy=write_policy, **policies)

    def put(self, tokens):
        """Inserts `tokens` the way a request finishing does: fresh slots holding them, duplicates freed."""
        short = len(tokens) - self.alloc.available_size()
        if short > 0:
            self.cache.evict(short)
        slots = self.alloc.alloc(len(tokens))
        if slots is None:  # locked prefixes hold the device: a request would wait
            return None
        self.device_kv[slots.numpy()] = tokens
        cached = self.cache.insert(tokens, slots)
        if cached:
            self.alloc.free(slots[:cached])
        return cached

    def check_content(self):
        check_content(self.cache, self.device_kv, self.host.kv)


def check_content(cache, device_kv, host_kv):
    """Every slot of either tier that the tree holds (host copies once complete) holds its node's tokens."""
    for node in cache._all_nodes():
        path = path_tokens(node)[-node.num_tokens:]
        if len(node.value):
            assert device_kv[node.value].tolist() == path, f"node {node.id}: device slots hold other tokens"
        if node.host_value is not None and node.backup is None:
            assert host_kv[node.host_value].tolist() == path, f"node {node.id}: host slots hold other tokens"


def path_tokens(node):
    out = []
    while node.parent is not None:
        out = node.token_ids() + out
        node = node.parent
    return out


def tokens(*runs):
    return [t for start, n in runs for t in range(start, start + n)]


# ---- the tiers in a few steps ----------------------------------------------------------------------------
def test_an_evicted_backed_up_prefix_stays_on_host_and_loads_back_with_its_kv():
    w = World(device=16, host=64)
    key = tokens((100, 12))
    w.put(key)
    assert w.cache.host_protected_size() == 12  # write_through: backed up as soon as inserted
    assert w.cache.evict(12) == 12 and w.cache.total_size() == 0
    assert w.cache.host_evictable_size() == 12
    m = w.cache.match_prefix(key)
    assert (m.indices.numel(), m.host_hit_length) == (0, 12) and m.last_node is w.cache.root_node
    indices = w.cache.load_back(m.last_host_node, 12)
    assert w.device_kv[indices.numpy()].tolist() == key
    assert w.cache.stats.loaded_tokens == 12 and w.cache.host_protected_size() == 12
    w.cache.check_invariants()
    w.check_content()


def test_a_load_back_marks_its_slots_cached_in_the_allocator():
    # The loaded slots are the tree's the moment they land: a checked insert refuses them as another prefix's.
    w = World(device=16, host=64)
    key = tokens((100, 12))
    w.put(key)
    assert w.cache.evict(12) == 12
    m = w.cache.match_prefix(key)
    loaded = w.cache.load_back(m.last_host_node, 12)
    assert w.alloc.cached_mask(loaded.numpy()).all()
    with pytest.raises(ValueError, match="already caches for another prefix"):
        w.cache.insert(tokens((500, 2)), loaded[:2])
    w.put(tokens((100, 12), (300, 4)))
    w.cache.check_invariants()


def test_a_match_splits_between_the_device_part_and_the_host_part():
    w = World(device=32, host=128)
    w.put(tokens((1, 8)))
    w.put(tokens((1, 8), (50, 8)))
    w.cache.evict(8)  # the leaf [50..57] goes to the host only
    m = w.cache.match_prefix(tokens((1, 8), (50, 8), (90, 3)))
    assert (m.indices.numel(), m.host_hit_length) == (8, 8)
    assert m.last_node.token_ids() == tokens((1, 8)) and m.last_host_node.token_ids() == tokens((50, 8))


def test_a_match_that_ends_one_host_only_token_past_the_device_part_reports_that_token():
    w = World(device=32, host=128)
    w.put(tokens((1, 8)))
    w.put(tokens((1, 8), (50, 1)))
    assert w.cache.evict(1) == 1  # the one-token leaf [50] goes to the host only
    m = w.cache.match_prefix(tokens((1, 8), (50, 1), (90, 3)))
    assert (m.indices.numel(), m.host_hit_length) == (8, 1)
    assert m.last_node.token_ids() == tokens((1, 8)) and m.last_host_node.token_ids() == [50]
    w.cache.check_invariants()


def test_check_invariants_names_a_host_slot_held_twice_and_a_host_only_leaf_missing_from_its_set():
    w = World(device=32, host=128)
    w.put(tokens((1, 4)))
    w.put(tokens((50, 4)))
    a, b = (n for n, path in tree_nodes(w.cache) if len(path) == 4)
    kept = b.host_value
    b.host_value = a.host_value.copy()
    with pytest.raises(AssertionError, match="^RadixCache invariant broken: the tree holds a host slot more than "
                                             "once$"):
        w.cache.check_invariants()
    b.host_value = kept
    assert w.cache.evict(4) == 4  # one leaf leaves the device: host only, in the host-evictable set
    (leaf,) = (n for n, _ in tree_nodes(w.cache) if n.host_entry is not None)
    entry, leaf.host_entry = leaf.host_entry, None
    with pytest.raises(AssertionError, match=rf"^RadixCache invariant broken: node {leaf.id} is not in the "
                                             "host-evictable set$"):
        w.cache.check_invariants()
    leaf.host_entry = entry
    w.cache.check_invariants()


def test_a_host_pool_for_another_device_pool_size_is_refused_naming_both():
    device = MHAKVPool(64, 1, torch.float32, 1, 1, 1)
    with pytest.raises(ValueError, match="^host_pool backs a device pool of 64 tokens, but token_allocator has 32$"):
        HiRadixCache(ReqToTokenPool(2, 64), TokenAllocator(32), HostKVPool(device))


def test_a_hybrid_models_allocator_is_refused_its_pools_stay_on_the_device():
    from kvmem.hybrid import HybridTokenAllocator
    from kvmem.tiers.host_pool import HostSlotPool

    alloc = HybridTokenAllocator(32, 16)
    host = HostSlotPool(64)
    with pytest.raises(TypeError, match="^token_allocator is a HybridTokenAllocator: a hybrid model's pools"):
        HiRadixCache(ReqToTokenPool(2, 64), alloc, host)
    assert alloc.available_size() == 32 and host.allocator.available_size() == 64


def test_write_back_backs_up_only_what_eviction_takes():
    w = World(device=16, host=64, write_policy="write_back")
    w.put(tokens((1, 10)))
    assert w.cache.host_total_size() == 0
    w.cache.evict(10)
    assert w.cache.host_evictable_size() == 10 and w.cache.stats.backed_up_tokens == 10
    w.check_content()


def test_write_through_selective_backs_up_after_the_second_hit():
    w = World(device=16, host=64, write_policy="write_through_selective")
    key = tokens((1, 10))
    w.put(key)
    w.cache.match_prefix(key)
    assert w.cache.host_total_size() == 0
    w.cache.match_prefix(key)
    assert w.cache.host_total_size() == 10
    w.check_content()


def test_host_eviction_takes_only_unlocked_host_only_leaves():
    w = World(device=32, host=128)
    w.put(tokens((1, 6)))            # stays on device (its host copy is protected)
    w.put(tokens((20, 6)))
    w.put(tokens((40, 6)))
    w.cache.evict(12)                # [1..] and [20..] leave the device (LRU), host-only now
    m = w.cache.match_prefix(tokens((1, 6)))
    w.cache.inc_lock_ref(m.last_host_node)  # a request plans to load [1..]: it must stay
    assert w.cache.evict_host(100) == 6     # only [20..] can go
    assert w.cache.match_prefix(tokens((20, 6))).host_hit_length == 0
    assert w.cache.stats.host_evicted_tokens == 6
    w.cache.dec_lock_ref(m.last_host_node)
    w.cache.check_invariants()


def test_inserting_over_a_host_only_prefix_puts_it_back_on_device_with_the_new_slots():
    w = World(device=32, host=128)
    key = tokens((1, 8), (30, 4))
    w.put(key)
    w.cache.evict(12)
    assert w.put(key + tokens((70, 4))) == 0  # nothing was on device: the tree takes all 16 new slots
    m = w.cache.match_prefix(key)
    assert m.host_hit_length == 0 and w.device_kv[m.indices.numpy()].tolist() == key
    w.cache.check_invariants()
    w.check_content()


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_failed_backup_leaves_the_node_on_device_only_and_leaks_nothing(page_size):
    w = World(device=32, host=64, page_size=page_size)
    w.host.fail = 1
    w.put(tokens((1, 8)))
    assert w.cache.host_total_size() == 0 and w.host.allocator.available_size() == 64
    assert w.cache.stats.failed_transfers == 1
    assert w.cache.evict(8) == 8 and w.cache.match_prefix(tokens((1, 8))).host_hit_length == 0  # dropped, not kept
    w.cache.check_invariants()


def test_a_failed_load_leaves_the_nodes_on_host_and_frees_its_device_slots():
    w = World(device=16, host=64)
    key = tokens((1, 8))
    w.put(key)
    w.cache.evict(8)
    m = w.cache.match_prefix(key)
    w.host.fail = 1
    assert w.cache.load_back(m.last_host_node, m.host_hit_length) is None
    assert w.alloc.available_size() == 16 and w.cache.host_evictable_size() == 8
    w.cache.check_invariants()
    assert w.cache.load_back(m.last_host_node, m.host_hit_length) is not None  # the host copy is intact


def test_an_asynchronous_backup_keeps_its_nodes_on_device_until_it_completes():
    w = World(device=16, host=64)
    w.host.delay = 3
    w.put(tokens((1, 8)))
    assert w.cache.protected_size() == 8 and w.cache.evict(8) == 0  # locked while the copy is in flight
    polls = 1
    while not w.cache.writing_check():
        polls += 1
        assert w.cache.protected_size() == 8 and w.cache.host_protected_size() == 8
    assert polls > 1 and w.cache.protected_size() == 0
    assert w.cache.evict(8) == 8 and w.cache.host_evictable_size() == 8
    w.check_content()


def test_a_backup_that_fails_late_discards_the_backups_issued_after_it():
    w = World(device=32, host=64)
    w.host.delay = 2
    w.put(tokens((1, 4)))
    w.put(tokens((1, 4), (9, 4)))           # backs up the child while its parent's copy is in flight
    w.cache._pending[0].transfer.error = RuntimeError("late fault")
    while w.cache._pending:
        w.cache.writing_check()
    assert w.cache.host_total_size() == 0 and w.host.allocator.available_size() == 64
    assert (w.cache.stats.failed_transfers, w.cache.stats.discarded_backups) == (1, 1)
    w.cache.check_invariants()


def test_a_backup_started_while_discarded_ones_are_in_flight_goes_with_them():
    # A's copy fails; B's (under A) is in flight and will be discarded; C's, started under B's copy then, must
    # not outlive it: both tiers stay prefix-closed after every step, and no host slot is left behind.
    w = World(device=64, host=128, page_size=4)
    a, b, c = tokens((100, 8)), tokens((200, 8)), tokens((300, 8))
    w.host.delay = 5
    w.put(a)
    w.put(a + b)
    assert [r.nodes[0].key for r in w.cache._pending] == [w.cache.match_prefix(a).last_node.key,
                                                          w.cache.match_prefix(a + b).last_node.key]
    w.cache._pending[0].transfer.error = RuntimeError("late fault")
    w.cache._pending[0].transfer.polls = -1
    w.cache.writing_check()                 # A's copy fails: B's is marked for discard, still in flight
    w.cache.check_invariants()
    w.put(a + b + c)                        # C's backup starts now, under B's copy
    w.cache.check_invariants()
    while w.cache._pending:
        w.cache._pending[0].transfer.wait()
        w.cache.writing_check()
    w.cache.check_invariants()
    assert (w.cache.stats.failed_transfers, w.cache.stats.discarded_backups) == (1, 2)
    assert w.cache.host_total_size() == 0 and w.cache.evict(1 << 20) == 24
    assert w.host.allocator.available_size() == 128
    w.cache.check_invariants()


@pytest.mark.parametrize("fault", [False, True])
def test_a_prefetch_hangs_its_pages_only_under_a_parent_whose_host_copy_landed(tmp_path, fault):
    # write_back: the prompt's first 8 tokens are on device only, so attaching the prefetch's pages backs them up
    # first; that copy is asynchronous, and when it fails the pages must not hang under a parent without one.
    prompt = tokens((100, 32))
    first = World(page_size=4, storage=FileStore(tmp_path))
    first.put(prompt)
    first.cache.close()
    w = World(page_size=4, write_policy="write_back", storage=FileStore(tmp_path), prefetch_policy="wait_complete")
    w.put(prompt[:8])
    w.host.delay, w.host.fail_late = 3, int(fault)
    prefetch = w.cache.prefetch(prompt + [1])
    assert w.cache.finish_prefetch(prefetch) == (0 if fault else 24)
    assert not w.cache._pending and w.cache.stats.failed_transfers == int(fault)
    w.cache.check_invariants()
    w.check_content()
    assert w.cache.evict(1 << 20) == 8   # write_back: the eviction backs the parent up, if it has no copy yet
    assert w.cache.match_prefix(prompt).host_hit_length == (8 if fault else 32)
    w.cache.evict_host(1 << 20)
    assert w.host.allocator.available_size() == 256
    w.cache.check_invariants()


class WaitedTransfer(DelayedTransfer):
    """A copy that lands only when waited for (a stream nothing else synchronizes): polling it never completes it,
    and a cache that polls it without end fails the test instead of hanging."""

    def done(self):
        self.polls_left = getattr(self, "polls_left", 1000) - 1
        assert self.polls_left > 0, "polled a copy that only a wait completes"
        return self.polls < 0 and super().done()


def test_a_prefetch_under_a_parent_whose_backup_is_queued_behind_another_waits_for_both(tmp_path):
    prompt = tokens((100, 32))
    first = World(page_size=4, storage=FileStore(tmp_path))
    first.put(prompt)
    first.cache.close()
    w = World(page_size=4, storage=FileStore(tmp_path), prefetch_policy="wait_complete")
    w.host.delay = 1
    w.host._transfer = lambda copy: WaitedTransfer(1, copy)
    w.put(tokens((500, 8)))              # another prompt's backup, issued first
    w.put(prompt[:8])                    # the backup of the parent the prefetch's pages will hang from
    assert len(w.cache._pending) == 2
    assert w.cache.finish_prefetch(w.cache.prefetch(prompt + [1])) == 24
    assert not w.cache._pending and w.cache.stats.backed_up_tokens == 16
    w.cache.check_invariants()
    w.check_content()


def test_load_back_refuses_a_stale_length_and_a_foreign_node():
    w = World(device=16, host=64)
    w.put(tokens((1, 8)))
    w.cache.evict(8)
    m = w.cache.match_prefix(tokens((1, 8)))
    with pytest.raises(ValueError, match="host_hit_length"):
        w.cache.load_back(m.last_host_node, 4)
    other = World()
    with pytest.raises(ValueError, match="another tree"):
        other.cache.load_back(m.last_host_node, 8)
    w.cache.check_invariants()


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(write_policy="write_around"), ValueError, "write_policy"),
    (dict(host=None), TypeError, "host_pool"),
])
def test_a_hiradix_cache_refuses_a_bad_configuration(kwargs, error, message):
    alloc = TokenAllocator(64)
    host = kwargs.pop("host", ContentHost(128, 1, np.zeros(65, dtype=np.int64)))
    with pytest.raises(error, match=message):
        HiRadixCache(ReqToTokenPool(2, 16), alloc, host, **kwargs)


def test_a_host_tier_no_larger_than_the_device_or_of_another_page_size_is_refused():
    alloc = PagedTokenAllocator(64, 4)
    with pytest.raises(ValueError, match="larger than the device"):
        HiRadixCache(ReqToTokenPool(2, 16), alloc, ContentHost(64, 4, None), page_size=4)
    with pytest.raises(ValueError, match="page size"):
        HiRadixCache(ReqToTokenPool(2, 16), alloc, ContentHost(256, 1, None), page_size=4)


def test_a_plain_radix_cache_reports_no_host_hit():
    alloc = TokenAllocator(16)
    cache = RadixCache(ReqToTokenPool(2, 16), alloc)
    cache.insert([1, 2, 3], alloc.alloc(3))
    m = cache.match_prefix([1, 2, 3, 4])
    assert (m.host_hit_length, m.last_host_node, cache.writing_check()) == (0, None, 0)


def test_reset_empties_both_tiers_but_not_under_a_lock():
    w = World(device=16, host=64)
    w.put(tokens((1, 8)))
    w.put(tokens((20, 8)))
    w.cache.evict(8)
    assert_reset_refused_under_a_lock_then_empties_both_tiers(w, tokens((20, 8)))


def test_reset_waits_for_backups_in_flight_however_deep_they_lock_and_refuses_only_a_requests_lock():
    w = World(device=32, host=64)
    w.put(tokens((1, 4)))                    # backed up at once
    w.host.delay = 5                         # the next copies stay in flight, as on CUDA
    w.put(tokens((1, 4), (9, 4)))            # its backup locks the path down to the child
    w.put(tokens((1, 4), (9, 4), (30, 4)))   # and another one deeper on the same path
    assert_reset_refused_under_a_lock_then_empties_both_tiers(w, tokens((1, 4), (9, 4)))


def assert_reset_refused_under_a_lock_then_empties_both_tiers(w, key):
    m = w.cache.match_prefix(key)
    w.cache.inc_lock_ref(m.last_node)
    with pytest.raises(RuntimeError, match=r"^reset\(\) while requests lock cached tokens; release them "
                                           r"\(dec_lock_ref\) first$"):
        w.cache.reset()
    w.cache.check_invariants()
    w.cache.dec_lock_ref(m.last_node)
    w.cache.reset()
    assert (w.alloc.available_size(), w.host.allocator.available_size()) == (w.alloc.size, w.host.allocator.size)
    w.cache.check_invariants()


def test_load_back_that_cannot_fit_evicts_nothing():
    w = World(device=16, host=64)
    w.put(tokens((1, 12)))
    w.cache.evict(12)                        # host-only now
    w.put(tokens((50, 6)))
    m = w.cache.match_prefix(tokens((50, 6)))
    w.cache.inc_lock_ref(m.last_node)        # 6 locked on device, 10 free
    w.put(tokens((70, 4)))                   # 4 evictable: 6 free + 4 evictable < the 12 to load
    before = (w.cache.total_size(), w.cache.evictable_size(), w.alloc.available_size())
    m = w.cache.match_prefix(tokens((1, 12)))
    assert m.host_hit_length == 12
    assert w.cache.load_back(m.last_host_node, m.host_hit_length) is None
    assert (w.cache.total_size(), w.cache.evictable_size(), w.alloc.available_size()) == before
    w.cache.check_invariants()


# ---- tensor-parallel ranks: threads of one process, each with its own cache ---------------------------------
def on_ranks(fn, world=2):
    """fn(rank) on `world` threads at once (a collective needs every rank); their results, or the first error."""
    results, errors = [None] * world, []

    def run(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 - re-raised below, on the test's thread
            errors.append(e)
    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank is stuck in a collective"
    if errors:
        raise errors[0]
    return results


def tp_groups(world=2):
    """One gloo process group per rank over an in-memory store: a tensor-parallel group whose ranks are threads."""
    store = dist.HashStore()

    def group(rank):
        backend = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=30))
        g = dist.ProcessGroup(store, rank, world)
        g._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
        g._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        return g
    return on_ranks(group, world)


def test_ranks_agree_on_the_minimum_of_their_counts_and_on_a_flag_only_when_all_set_it():
    groups = tp_groups()
    assert on_ranks(lambda rank: all_reduce_min([3, 5][rank], groups[rank])) == [3, 3]
    flags = [[True, False, True, True], [True, True, False, True]]
    assert on_ranks(lambda rank: all_reduce_min(flags[rank], groups[rank])) == [[True, False, False, True]] * 2


def test_a_backup_completes_on_every_rank_at_the_poll_where_the_slowest_rank_finished_it():
    groups = tp_groups()

    def serve(rank):
        w = World(device=16, host=64, tp_group=groups[rank])
        w.host.delay = (1, 4)[rank]             # the insert's own check polls once: rank 0's copy lands at the
        w.put(tokens((1, 8)))                   # first poll after it, rank 1's at the fourth
        polls = [w.cache.writing_check() for _ in range(6)]
        return polls, w.cache.protected_size(), w.cache.host_protected_size(), w.cache.stats.backed_up_tokens
    assert on_ranks(serve) == [([0, 0, 0, 1, 0, 0], 0, 8, 8)] * 2


def test_a_copy_that_failed_on_one_rank_is_released_on_every_rank():
    groups = tp_groups()

    def serve(rank):
        w = World(device=16, host=64, tp_group=groups[rank])
        w.host.delay, w.host.fail_late = 2, rank   # rank 1's copy fails when it lands
        w.put(tokens((1, 8)))
        while w.cache._pending:
            w.cache.writing_check()
        w.cache.check_invariants()
        evicted = w.cache.evict(8)
        return (w.cache.stats.failed_transfers, w.cache.host_total_size(), w.host.allocator.available_size(),
                evicted, w.cache.match_prefix(tokens((1, 8))).host_hit_length)
    assert on_ranks(serve) == [(1, 0, 64, 8, 0)] * 2    # device-only on both: the eviction drops it everywhere


def test_ranks_prefetch_and_attach_only_the_pages_every_rank_has(tmp_path):
    prompt = tokens((100, 32))                          # 8 pages of 4
    for rank, stored in enumerate((32, 12)):            # rank 1's store has only the first 3 pages
        first = World(page_size=4, storage=FileStore(tmp_path / f"rank{rank}"))
        first.put(prompt[:stored])
        first.cache.close()
    groups = tp_groups()

    def serve(rank):
        w = World(page_size=4, storage=FileStore(tmp_path / f"rank{rank}"), tp_group=groups[rank])
        prefetch = w.cache.prefetch(prompt + [1])
        attached = w.cache.finish_prefetch(prefetch)
        w.cache.check_invariants()
        return prefetch.pages, attached, w.cache.match_prefix(prompt).host_hit_length, w.cache.host_total_size()
    assert on_ranks(serve) == [(3, 12, 12, 12)] * 2


def test_ranks_attach_only_the_pages_every_rank_read(tmp_path):
    prompt = tokens((100, 32))
    first = World(page_size=4, storage=FileStore(tmp_path))
    first.put(prompt)
    first.cache.close()
    groups = tp_groups()

    class ShortReads(FileStore):  # rank 1's reads load the first 2 pages they are asked for, and say so
        def batch_get(self, keys, host_pool, host_slots):
            return super().batch_get(keys[:2], host_pool, host_slots[:2 * 4])

    def serve(rank):
        w = World(page_size=4, storage=(FileStore, ShortReads)[rank](tmp_path), tp_group=groups[rank])
        prefetch = w.cache.prefetch(prompt + [1])
        attached = w.cache.finish_prefetch(prefetch)
        w.cache.check_invariants()
        return prefetch.pages, attached, w.cache.host_total_size(), w.host.allocator.available_size()
    assert on_ranks(serve) == [(8, 8, 8, 248)] * 2


# ---- any sequence of operations ----------------------------------------------------------------------------
class TieredCache(RuleBasedStateMachine):
    """Any sequence of operations, under one device eviction policy and one host eviction policy."""

    locks = Bundle("locks")

    def __init__(self, device_policy="lru", host_policy="lru"):
        super().__init__()
        self.w = None
        self.policies = device_policy, host_policy

    @rule(page_size=st.sampled_from([1, 2]), policy=st.sampled_from(["write_through", "write_through_selective",
                                                                       "write_back"]),
          trace=st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=4), min_size=8, max_size=8))
    def start(self, page_size, policy, trace):
        if self.w is None:
            self.ps = page_size
            self.trace = [self.key(parts) for parts in trace]
            device, host = (BeladyPolicy(future_index(self.trace)) if p == "belady" else p for p in self.policies)
            self.w = World(device=24, host=60, page_size=page_size, write_policy=policy, eviction_policy=device,
                           host_eviction_policy=host)
            self.queued, self.next_request = [], 0

    def key(self, parts):
        ps = self.ps
        out = [t for p in parts for t in range(100 * p, 100 * p + 2 * ps)]
        return out

    @rule(parts=st.lists(st.integers(1, 4), min_size=1, max_size=4))
    def insert(self, parts):
        if self.w is None:
            return
        key = self.key(parts)
        if len(key) > self.w.alloc.size:
            return
        if self.w.put(key) is None:
            return
        m = self.w.cache.match_prefix(key)
        assert m.indices.numel() == len(key) and self.w.device_kv[m.indices.numpy()].tolist() == key

    @rule(target=locks, parts=st.lists(st.integers(1, 4), min_size=1, max_size=4), load=st.booleans())
    def match(self, parts, load):
        if self.w is None:
            return None
        key = self.key(parts)
        m = self.w.cache.match_prefix(key)
        prefix = m.indices.numel()
        assert self.w.device_kv[m.indices.numpy()].tolist() == key[:prefix]
        node = m.last_node
        if load and m.host_hit_length:
            loaded = self.w.cache.load_back(m.last_host_node, m.host_hit_length)
            if loaded is not None:
                assert self.w.device_kv[loaded.numpy()].tolist() == key[:prefix + m.host_hit_length]
                node = m.last_host_node
        self.w.cache.inc_lock_ref(node)
        return node

    @rule(node=consumes(locks))
    def unlock(self, node):  # each lock released once, as a request does
        if node is not None:
            self.w.cache.dec_lock_ref(node)

    @rule(n=st.integers(0, 30))
    def evict(self, n):
        if self.w is not None:
            self.w.cache.evict(n)

    @rule(n=st.integers(0, 30))
    def evict_host(self, n):
        if self.w is not None:
            self.w.cache.evict_host(n)

    @rule(parts=st.lists(st.integers(1, 4), min_size=1, max_size=4), pin=st.booleans())
    def pin(self, parts, pin):
        if self.w is not None:
            key = self.key(parts)
            (self.w.cache.pin if pin else self.w.cache.unpin)(key)

    @rule(admit=st.booleans())
    def queue_or_admit(self, admit):
        if self.w is None:
            return
        if admit and self.queued:
            self.w.cache.request_admitted(self.queued.pop(0))
        elif self.next_request < len(self.trace):
            self.w.cache.request_waiting(self.next_request, self.trace[self.next_request])
            self.queued.append(self.next_request)
            self.next_request += 1

    @invariant()
    def tiers_hold_the_right_tokens(self):
        if self.w is not None:
            self.w.cache.check_invariants()
            self.w.check_content()
            assert self.w.alloc.available_size() + self.w.cache.total_size() == self.w.alloc.size


TIER_POLICIES = [("lru", "lru"), *((p, p) for p in ONLINE_POLICIES if p != "lru"), ("belady", "belady"),
                 ("lookahead", "s3fifo"), ("gdsf", "arc")]


@pytest.mark.parametrize("device_policy, host_policy", TIER_POLICIES)
def test_any_sequence_of_operations_keeps_both_tiers_consistent(device_policy, host_policy):
    run_state_machine_as_test(lambda: TieredCache(device_policy, host_policy), settings=settings(
        max_examples=25, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)))
