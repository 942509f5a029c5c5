"""Random operation sequences on HybridRadixCache against simple models.

Window: the model is the set of cached pages (each a prefix of whole pages) with, per page, whether its window KV
is live, plus the locked prefixes. Inserts (of requests whose window may have left their first pages), matches,
locks, unlocks, full and window evictions; after each, the tree must agree with the model: a match is the deepest
cached end whose last keep = W - 1 tokens are live (or whose whole path is), locked prefixes keep their full KV and
their window tails, and every size adds up. Which unlocked node an eviction takes is the LRU's business; the model
learns it from the tree and checks what every eviction promises.

States: requests are admitted over the tree (match, lock, a state slot copied from the matched state), computed, and
cached, finished, retracted or aborted; evictions of either kind come between. A state's content is the length of
the prefix it summarises: every cached state must hold its node's depth, every admitted request the length of its
match, and a match must end at the deepest cached state of the key's prefixes.
"""

import math

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvmem import Req, ReqToTokenPool, TokenAllocator
from kvmem.hybrid import HybridRadixCache, HybridTokenAllocator, StatePool

CAPACITY = 48
keys = st.lists(st.integers(0, 2), min_size=1, max_size=12)


def path_pages(cache):
    """{prefix (tuple of tokens, whole pages): live} for every cached page of the tree."""
    pages, ps = {}, cache.page_size
    stack = [(cache.root_node, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            tokens = prefix + tuple(child.token_ids())
            for end in range(len(prefix) + ps, len(tokens) + 1, ps):
                pages[tokens[:end]] = child.window_live
            stack.append((child, tokens))
    return pages


class WindowTreeMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2]), window=st.integers(1, 6))
    def setup(self, page_size, window):
        self.ps, self.keep = page_size, window - 1
        tail = -(-max(self.keep, page_size) // page_size) * page_size
        self.window_total = tail + 4 * page_size + 16
        self.alloc = HybridTokenAllocator(CAPACITY, self.window_total, page_size)
        self.cache = HybridRadixCache(ReqToTokenPool(1, 64), self.alloc, page_size, window=window,
                                      window_free_interval=page_size)
        self.locks = []  # (node, locked length)

    def aligned(self, key):
        return list(key[:len(key) // self.ps * self.ps])

    def expected_match(self, key, pages):
        key = self.aligned(key)
        cached = 0
        while cached < len(key) and tuple(key[:cached + self.ps]) in pages:
            cached += self.ps
        for end in range(cached, 0, -self.ps):
            run, start = 0, end
            while start > 0 and pages[tuple(key[:start])]:
                run, start = run + self.ps, start - self.ps
            if start == 0 or run >= self.keep:
                return end
        return 0

    @rule(key=keys, freed=st.integers(0, 6))
    def insert(self, key, freed):
        key = self.aligned(key)
        if not key:
            return
        slots = self.alloc.alloc(len(key))
        if slots is None:
            self.cache.evict(len(key))
            slots = self.alloc.alloc(len(key))
            if slots is None:
                return
        freed = min(freed, len(key) // self.ps) * self.ps  # this request's window left its first pages
        if freed:
            self.alloc.free_window(slots[:freed])
        before = path_pages(self.cache)
        cached = 0
        while cached < len(key) and tuple(key[:cached + self.ps]) in before:
            cached += self.ps
        assert self.cache.insert(key, slots) == cached
        self.alloc.free(slots[:cached])
        after = path_pages(self.cache)
        expected = dict(before)
        for end in range(self.ps, len(key) + 1, self.ps):
            prefix = tuple(key[:end])
            expected[prefix] = before.get(prefix, False) or end > freed  # new, or revived where it is live
        assert after == expected

    @rule(key=keys)
    def match(self, key):
        expected = self.expected_match(key, path_pages(self.cache))
        m = self.cache.match_prefix(key)
        assert len(m.indices) == expected
        assert m.last_node.depth + m.last_node.num_tokens == expected or m.last_node.parent is None

    @rule(key=keys)
    def lock(self, key):
        m = self.cache.match_prefix(key)
        if m.last_node.parent is not None:
            self.cache.inc_lock_ref(m.last_node)
            self.locks.append((m.last_node, len(m.indices), tuple(key[:len(m.indices)])))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 10))
    def unlock(self, i):
        node, _, _ = self.locks.pop(i % len(self.locks))
        self.cache.dec_lock_ref(node)

    @rule(n=st.integers(0, 20))
    def evict_window(self, n):
        before = path_pages(self.cache)
        freed = self.cache.evict_window(n)
        after = path_pages(self.cache)
        lost = sum(live and not after.get(prefix, False) for prefix, live in before.items())
        assert freed == lost * self.ps
        assert all(not live or prefix in before and before[prefix] for prefix, live in after.items())
        if freed < n:
            assert self.cache.window_evictable_size() == 0

    @rule(n=st.integers(0, 20))
    def evict(self, n):
        before = path_pages(self.cache)
        freed = self.cache.evict(n)
        after = path_pages(self.cache)
        assert set(after) <= set(before) and freed == (len(before) - len(after)) * self.ps
        if freed < n:
            assert self.cache.evictable_size() == 0

    @invariant()
    def agrees_with_the_model(self):
        if not hasattr(self, "cache"):
            return
        cache, ps = self.cache, self.ps
        cache.check_invariants()
        pages = path_pages(cache)
        for node, length, prefix in self.locks:
            assert all(prefix[:end] in pages for end in range(ps, length + 1, ps))
            start = max(length - self.keep, 0) // ps * ps
            assert all(pages[prefix[:end]] for end in range(start + ps, length + 1, ps)), "a locked tail lost its KV"
        live = sum(pages.values()) * ps
        assert cache.window_evictable_size() + cache.window_protected_size() == live
        assert cache.total_size() == len(pages) * ps
        assert self.alloc.available_size() + cache.total_size() == CAPACITY
        assert self.alloc.window_available_size() + live == self.window_total


GRID = 64
BLOCKS = [list(range(1000 * b, 1000 * b + GRID)) for b in range(3)]  # keys share prefixes at grid points
state_keys = st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=3), st.lists(st.integers(0, 1), max_size=3))


class StateTreeMachine(RuleBasedStateMachine):
    """Requests over a cache with states (and a window), driven through the scheduler's surface."""

    @initialize(window=st.sampled_from([None, 6]), slots=st.integers(2, 5))
    def setup(self, window, slots):
        self.pool = ReqToTokenPool(4, 4 * GRID + 8)
        self.alloc = HybridTokenAllocator(640, 640) if window else TokenAllocator(640)
        self.states = StatePool(slots, 1, (1,), (1,), torch.float64, torch.float64)
        self.cache = HybridRadixCache(self.pool, self.alloc, window=window, state_pool=self.states,
                                      window_free_interval=1)
        self.running: list[Req] = []
        self.next_id = 0

    def state_of(self, slot):
        return int(self.states.ssm_states[0][slot, 0])

    def expected_match(self, key):
        """The deepest prefix of `key` (the match key) on the grid whose node holds a state."""
        best, node, depth = 0, self.cache.root_node, 0
        while depth < len(key):
            child = next((c for c in node.children.values() if c.token_ids()[0] == key[depth]), None)
            if child is None or tuple(child.token_ids()) != tuple(key[depth:depth + child.num_tokens]):
                return best  # the key leaves the tree, or ends inside this node
            depth += child.num_tokens
            node = child
            if node.state:
                best = depth
        return best

    @precondition(lambda self: len(self.running) < 3)
    @rule(spec=state_keys, chunk=st.booleans())
    def admit(self, spec, chunk):
        """A request whose prompt is whole blocks and a short tail prefills it, or (`chunk`) its blocks only."""
        blocks, tail = spec
        prompt = [t for b in blocks for t in BLOCKS[b]] + tail
        req = Req(self.next_id, prompt, 1)
        self.next_id += 1
        key = list(req.match_key())
        expected = self.expected_match(key)
        cache = self.cache
        m = cache.match_prefix(key)
        assert len(m.indices) == expected
        req.prefix_indices, req.last_node, req.cache_protected_len = m.indices, m.last_node, len(m.indices)
        cache.lock(m.last_node)
        end = len(blocks) * GRID if chunk and tail else len(prompt)
        if not self.reserve(end - expected, 1):
            cache.release_req(req, cache=False)
            return
        row = self.pool.alloc(1)[0]
        fresh = self.alloc.alloc(end - expected) if end > expected else m.indices[:0]  # a chunk served whole
        self.pool.write((row, slice(0, end)), torch.cat([m.indices, fresh]))
        req.req_pool_idx, req.kv_len = row, end
        cache.start_reqs([req])
        slot = int(cache.req_state_slots([row])[0])
        assert self.state_of(slot) == expected, "copy on write gave the request another prefix's state"
        self.states.ssm_states[0][slot, 0] = end  # the prefill computed tokens [expected, end)
        self.running.append(req)

    def reserve(self, need, reqs):
        if not self.cache.fits(need, reqs):
            self.cache.evict_for(need, reqs)
        return self.cache.fits(need, reqs)

    @precondition(lambda self: any(r.kv_len < len(r.input_ids) for r in self.running))
    @rule()
    def extend(self):
        """A chunked request prefills the rest of its prompt."""
        req = next(r for r in self.running if r.kv_len < len(r.input_ids))
        need = len(req.input_ids) - req.kv_len
        if not self.reserve(need, 0):
            return
        self.pool.write((req.req_pool_idx, slice(req.kv_len, len(req.input_ids))), self.alloc.alloc(need))
        req.kv_len = len(req.input_ids)
        self.states.ssm_states[0][int(self.cache.req_state_slots([req.req_pool_idx])[0]), 0] = req.kv_len

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 5), how=st.sampled_from(["finish", "retract", "checkpoint"]))
    def leave(self, i, how):
        req = self.running[i % len(self.running)]
        if how == "checkpoint":
            self.cache.cache_req(req, finished=False)
            return
        self.running.remove(req)
        on_grid = req.kv_len % GRID == 0
        self.cache.release_req(req, cache=how == "finish")
        if how == "finish" and on_grid:
            assert self.expected_match(list(req.input_ids[:req.kv_len])) == req.kv_len, "its state was not handed over"

    @rule(n=st.integers(0, 3))
    def evict_states(self, n):
        before = self.cache.state_evictable_size()
        assert self.cache.evict_states(n) == min(n, before)

    @rule(n=st.integers(0, 200))
    def evict(self, n):
        self.cache.evict(n)

    @invariant()
    def agrees_with_the_model(self):
        if not hasattr(self, "cache"):
            return
        cache = self.cache
        cache.check_invariants()
        cache.check_held(self.running)
        stack = [cache.root_node]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                if child.state:
                    assert self.state_of(child.state) == child.depth + child.num_tokens
                stack.append(child)
        for req in self.running:
            assert self.state_of(int(cache.req_state_slots([req.req_pool_idx])[0])) == req.kv_len
        assert math.lcm(GRID, 1) == cache.chunk_grid


TestWindowTree = WindowTreeMachine.TestCase
TestWindowTree.settings = settings(max_examples=120, stateful_step_count=40, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])
TestStateTree = StateTreeMachine.TestCase
TestStateTree.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])
