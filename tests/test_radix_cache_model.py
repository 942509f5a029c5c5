"""Random insert / match / lock / unlock / evict / pin / queue sequences against a naive model of the radix
cache, under every eviction policy.

The model is a dict from every cached prefix (a tuple of whole pages of tokens) to the slots of its last
page, plus the list of locked prefixes. After every step the tree must agree with it, and
free + evictable + protected == total slots. Eviction order is each policy's business; what the model checks
of it is what every policy promises: locked prefixes stay, a pinned prefix goes only when nothing unpinned is
left to evict, and the pins never exceed their budget.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvmem.allocator import PagedTokenAllocator, TokenAllocator
from kvmem.eviction import ONLINE_POLICIES
from kvmem.radix_cache import RadixCache
from kvmem.replay.belady import BeladyPolicy, FutureIndex
from kvmem.req_to_token import ReqToTokenPool

CAPACITY = 48
# A three-letter alphabet makes keys share prefixes and diverge mid-edge often.
keys = st.lists(st.integers(0, 2), max_size=12)
FUTURE = 12  # requests the machine can queue (the trace Belady's oracle sees)


def longest_first(node):
    """A custom key function: every policy name and a plain callable must pass the same machine."""
    return -node.num_tokens


POLICIES = [*ONLINE_POLICIES, longest_first, "belady"]


def future_index(trace):
    """Belady's oracle over `trace` (lists of token ids) as a replay would build it, arrival order = list order."""
    return FutureIndex([SimpleNamespace(input_ids=np.array(k + [0], dtype=np.int32)) for k in trace],
                       list(range(len(trace))))


class RadixCacheMachine(RuleBasedStateMachine):
    def __init__(self, policy="lru"):
        super().__init__()
        self.policy = policy

    @initialize(page_size=st.sampled_from([1, 2, 4]), trace=st.lists(keys, min_size=FUTURE, max_size=FUTURE))
    def setup(self, page_size, trace):
        self.ps = page_size
        self.alloc = TokenAllocator(CAPACITY) if page_size == 1 else PagedTokenAllocator(CAPACITY, page_size)
        self.trace = trace
        policy = BeladyPolicy(future_index(trace)) if self.policy == "belady" else self.policy
        self.cache = RadixCache(ReqToTokenPool(1, 8), self.alloc, page_size=page_size, eviction_policy=policy,
                                pin_budget=0.25)
        self.slots_of: dict[tuple, list[int]] = {}  # cached prefix -> slots of its last page
        self.locks: list[tuple] = []  # (node, locked prefix)
        self.queued: list[int] = []  # requests waiting (indices into trace)
        self.next_request = 0

    # ---- model helpers ----------------------------------------------------------------------------------
    def aligned(self, key):
        return list(key[:len(key) // self.ps * self.ps])

    def longest_cached(self, key) -> int:
        n = 0
        for end in range(self.ps, len(key) + 1, self.ps):
            if tuple(key[:end]) not in self.slots_of:
                break
            n = end
        return n

    def model_indices(self, key, n):
        return [s for end in range(self.ps, n + 1, self.ps) for s in self.slots_of[tuple(key[:end])]]

    def tree_prefixes(self) -> dict[tuple, list[int]]:
        """The tree's cached prefixes read straight from its nodes (no match, so no side effects)."""
        out, stack = {}, [(self.cache.root_node, ())]
        while stack:
            node, prefix = stack.pop()
            tokens, slots = node.token_ids(), node.value.tolist()
            for end in range(self.ps, len(tokens) + 1, self.ps):
                out[prefix + tuple(tokens[:end])] = slots[end - self.ps:end]
            prefix += tuple(tokens)
            stack.extend((child, prefix) for child in node.children.values())
        return out

    # ---- rules ------------------------------------------------------------------------------------------
    @rule(key=keys, priority=st.integers(0, 3))
    def insert(self, key, priority):
        key = self.aligned(key)
        if not key:
            return
        short = len(key) - self.alloc.available_size()
        if short > 0 and self.cache.evict(short) < short:
            return  # everything else is locked
        self.forget_evicted()
        slots = self.alloc.alloc(len(key))
        n = self.cache.insert(key, slots, priority=priority)
        assert n == self.longest_cached(key)
        if n:
            self.alloc.free(slots[:n])
        for end in range(n + self.ps, len(key) + 1, self.ps):
            self.slots_of[tuple(key[:end])] = slots[end - self.ps:end].tolist()

    @rule(key=keys)
    def match(self, key):
        m = self.cache.match_prefix(key)
        key = self.aligned(key)
        n = self.longest_cached(key)
        assert m.indices.tolist() == self.model_indices(key, n)
        assert self.path(m.last_node) == key[:n]

    @rule(key=keys)
    def lock(self, key):
        m = self.cache.match_prefix(key)
        self.cache.inc_lock_ref(m.last_node)
        self.locks.append((m.last_node, tuple(key[:len(m.indices)])))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        node, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.dec_lock_ref(node)

    @rule(num_tokens=st.integers(0, CAPACITY))
    def evict(self, num_tokens):
        evictable = self.cache.evictable_size()
        pinned = [tuple(self.path(node)) for node, _ in self.cache._pins.values()]
        freed = self.cache.evict(num_tokens)
        assert min(num_tokens, evictable) <= freed <= evictable
        assert self.cache.evictable_size() == evictable - freed
        before = len(self.slots_of)
        self.forget_evicted()
        assert (before - len(self.slots_of)) * self.ps == freed
        gone = [p for p in pinned if p not in self.slots_of]
        # A pinned leaf goes only when the policy has nothing left, so any unpinned leaf there now became one
        # when a pinned leaf under it went (its pin went with it).
        for leaf in self.unpinned_evictable_leaves() if gone else ():
            assert any(p[:len(leaf)] == leaf for p in gone), "a pinned prefix went while unpinned leaves were evictable"

    @rule(key=keys)
    def pin(self, key):
        tokens = self.cache.pin(key)
        assert tokens in (0, self.longest_cached(self.aligned(key)))
        assert self.cache.pinned_size() <= CAPACITY // 4

    @rule(key=keys)
    def unpin(self, key):
        assert self.cache.unpin(key) >= 0

    @precondition(lambda self: self.next_request < FUTURE)
    @rule()
    def queue_request(self):
        self.cache.request_waiting(self.next_request, self.trace[self.next_request])
        self.queued.append(self.next_request)
        self.next_request += 1

    @precondition(lambda self: self.queued)
    @rule(data=st.data())
    def admit_request(self, data):
        rid = self.queued.pop(data.draw(st.integers(0, len(self.queued) - 1)))
        self.match(self.trace[rid])
        self.cache.request_admitted(rid)

    @rule(data=st.data())
    def bad_input_changes_nothing(self, data):
        before = (self.tree_prefixes(), self.cache.evictable_size(), self.cache.protected_size(),
                  self.alloc.available_size())
        # Each bad call is built before pytest.raises, so that only the cache's own check can satisfy it.
        calls = {
            "evict": (lambda: self.cache.evict(-1), "num_tokens"),
            "empty": (lambda: self.cache.insert([], torch.empty(0, dtype=torch.int64)), "key is empty"),
            "length": (lambda: self.cache.insert([0] * self.ps, torch.zeros(2 * self.ps, dtype=torch.int64)),
                       r"shape \[len\(key\)\]"),
            "slot0": (lambda: self.cache.insert([9] * self.ps, torch.arange(self.ps, dtype=torch.int64)),
                      "the padding slot"),
        }
        node = self.unlocked_node()
        if node is not None:
            calls["unlocked"] = (lambda: self.cache.dec_lock_ref(node), "not locked")
        call, message = calls[data.draw(st.sampled_from(sorted(calls)))]
        with pytest.raises((ValueError, TypeError), match=message):
            call()
        assert before == (self.tree_prefixes(), self.cache.evictable_size(), self.cache.protected_size(),
                          self.alloc.available_size())

    # ---- checks -----------------------------------------------------------------------------------------
    def forget_evicted(self):
        now = self.tree_prefixes()
        assert set(now) <= set(self.slots_of), "the tree holds a prefix nobody inserted"
        assert all(now[p] == self.slots_of[p] for p in now), "a cached prefix changed slots"
        for _, prefix in self.locks:
            assert all(prefix[:end] in now for end in range(self.ps, len(prefix) + 1, self.ps)), \
                "a locked prefix was evicted"
        self.slots_of = {p: self.slots_of[p] for p in now}

    def path(self, node):
        parts = []
        while node is not self.cache.root_node:
            parts.append(node.token_ids())
            node = node.parent
        return [t for part in reversed(parts) for t in part]

    def unpinned_evictable_leaves(self) -> list[tuple]:
        out, stack = [], list(self.cache.root_node.children.values())
        while stack:
            node = stack.pop()
            if self.cache._is_evictable_leaf(node) and not node.pin:
                out.append(tuple(self.path(node)))
            stack.extend(node.children.values())
        return out

    def unlocked_node(self):
        """A node nobody locks, or None (dec_lock_ref on the root is a no-op, not an error)."""
        stack = list(self.cache.root_node.children.values())
        while stack:
            node = stack.pop()
            if node.lock_ref == 0:
                return node
            stack.extend(node.children.values())
        return None

    @invariant()
    def memory_adds_up(self):
        if not hasattr(self, "cache"):
            return
        cache = self.cache
        assert self.alloc.available_size() + cache.evictable_size() + cache.protected_size() == CAPACITY
        assert cache.total_size() == len(self.slots_of) * self.ps
        locked = {p[:end] for _, p in self.locks for end in range(self.ps, len(p) + 1, self.ps)}
        assert cache.protected_size() == len(locked) * self.ps
        cache.check_invariants()


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p if isinstance(p, str) else p.__name__)
def test_radix_cache_matches_the_model_under_every_policy(policy):
    run_state_machine_as_test(lambda: RadixCacheMachine(policy), settings=settings(
        max_examples=30, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]))
