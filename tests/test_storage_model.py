"""Two replicas over one store, under any sequence of operations: inserts, prefetches, evictions in both tiers,
and a store that loses or corrupts pages. Slots carry content (each slot holds the token whose KV it is), so
the check after every step is the one that matters: every slot either tier of either replica hands out holds
the right token, and a page read from the store is loaded only when it is the page asked for."""

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_hiradix_cache import ContentHost, check_content

from kvmem import HiRadixCache, PagedTokenAllocator, ReqToTokenPool, TokenAllocator
from kvmem.storage import PageStore


class ContentPages(ContentHost):
    """A ContentHost whose pages can go to a store: a page's payload is its slots' token ids."""

    def __init__(self, size, page_size, device_kv):
        super().__init__(size, page_size, device_kv)
        self.page_size = page_size

    def storage_format(self):
        return "test-content-pages"

    def page_payload_bytes(self):
        return 8 * self.page_size

    def read_pages(self, host_slots):
        pages = self.kv[np.asarray(host_slots)].reshape(-1, self.page_size)
        return [page.tobytes() for page in pages]

    def write_pages(self, host_slots, payloads):
        if len(host_slots):
            self.kv[np.asarray(host_slots)] = np.frombuffer(b"".join(payloads), dtype=np.int64)

    def check_host_slots(self, host_slots):
        return np.asarray(host_slots)


class MemoryStore(PageStore):
    """A store in a dict, shared by the replicas; `values` may be damaged by the test."""

    def __init__(self):
        super().__init__(batch_size=3)  # small batches: lookups and reads cross batch boundaries
        self.values = {}

    def _exists(self, keys):
        for i, key in enumerate(keys):
            if key not in self.values:
                return i
        return len(keys)

    def _read(self, keys, value_bytes):
        out = []
        for key in keys:
            if key not in self.values:
                break
            out.append(self.values[key])
        return out

    def _write(self, keys, values):
        for key, value in zip(keys, values):
            self.values.setdefault(key, value)
        return len(keys)

    def _discard(self, key):
        self.values.pop(key, None)


class Replica:
    def __init__(self, store, page_size):
        self.ps = page_size
        self.alloc = TokenAllocator(16) if page_size == 1 else PagedTokenAllocator(16, page_size)
        self.device_kv = np.full(16 + page_size, -1, dtype=np.int64)
        self.host = ContentPages(40, page_size, self.device_kv)
        self.cache = HiRadixCache(ReqToTokenPool(2, 64), self.alloc, self.host, page_size=page_size,
                                  storage=store, prefetch_policy="wait_complete")

    def put(self, tokens):
        short = len(tokens) - self.alloc.available_size()
        if short > 0:
            self.cache.evict(short)
        slots = self.alloc.alloc(len(tokens))
        if slots is None:
            return
        self.device_kv[slots.numpy()] = tokens
        cached = self.cache.insert(tokens, slots)
        if cached:
            self.alloc.free(slots[:cached])

    def check_content(self):
        check_content(self.cache, self.device_kv, self.host.kv)


class SharedStore(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.store = MemoryStore()
        self.replicas = None

    @precondition(lambda self: self.replicas is None)
    @rule(page_size=st.sampled_from([1, 2]))
    def start(self, page_size):
        self.replicas = [Replica(self.store, page_size) for _ in range(2)]

    def key(self, parts):
        ps = self.replicas[0].ps
        return [t for p in parts for t in range(100 * p, 100 * p + 2 * ps)]

    @precondition(lambda self: self.replicas is not None)
    @rule(r=st.integers(0, 1), parts=st.lists(st.integers(1, 4), min_size=1, max_size=4))
    def insert(self, r, parts):
        key = self.key(parts)
        replica = self.replicas[r]
        if len(key) <= replica.alloc.size:
            replica.put(key)
            replica.cache.storage_link.drain_writes()  # deterministic: the other replica may read them now

    @precondition(lambda self: self.replicas is not None)
    @rule(r=st.integers(0, 1), parts=st.lists(st.integers(1, 4), min_size=1, max_size=4))
    def prefetch_and_load(self, r, parts):
        key = self.key(parts)
        replica = self.replicas[r]
        cache = replica.cache
        cache.finish_prefetch(cache.prefetch(key + [1]))
        m = cache.match_prefix(key)
        prefix = m.indices.numel()
        assert replica.device_kv[m.indices.numpy()].tolist() == key[:prefix]
        if m.host_hit_length:
            loaded = cache.load_back(m.last_host_node, m.host_hit_length)
            if loaded is not None:
                assert replica.device_kv[loaded.numpy()].tolist() == key[:prefix + m.host_hit_length]

    @precondition(lambda self: self.replicas is not None)
    @rule(r=st.integers(0, 1), n=st.integers(0, 20), host=st.booleans())
    def evict(self, r, n, host):
        cache = self.replicas[r].cache
        cache.evict_host(n) if host else cache.evict(n)

    @precondition(lambda self: self.replicas is not None and self.store.values)
    @rule(which=st.integers(0, 1 << 30), damage=st.sampled_from(["flip", "truncate", "drop", "swap"]))
    def damage_the_store(self, which, damage):
        keys = sorted(self.store.values)
        key = keys[which % len(keys)]
        value = self.store.values[key]
        if damage == "flip":
            self.store.values[key] = value[:-6] + bytes([value[-6] ^ 1]) + value[-5:]
        elif damage == "truncate":
            self.store.values[key] = value[:-9]
        elif damage == "drop":
            del self.store.values[key]
        else:  # another page's (intact) value filed under this key
            self.store.values[key] = self.store.values[keys[(which + 1) % len(keys)]]

    @invariant()
    def every_slot_holds_the_right_token(self):
        for replica in self.replicas or []:
            replica.cache.check_invariants()
            replica.check_content()


SharedStore.TestCase.settings = settings(max_examples=50, stateful_step_count=40, deadline=None,
                                         suppress_health_check=list(HealthCheck))
test_replicas_over_a_damaged_store_load_only_the_right_pages = SharedStore.TestCase
