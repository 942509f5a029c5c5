"""Belady's offline optimum in the replay: next uses from the trace, the eviction order they give, determinism,
and its refusal to run anywhere else."""

from types import SimpleNamespace

import numpy as np
import pytest

from kvmem import PagedTokenAllocator, ReqToTokenPool, TokenAllocator
from kvmem.radix_cache import RadixCache
from kvmem.replay.belady import NEVER, BeladyPolicy, FutureIndex
from kvmem.replay.config import ReplayConfig
from kvmem.replay.simulator import build_scheduler, replay
from kvmem.replay.synthetic import multi_turn_chat
from kvmem.replay.traces import TraceRequest
from tests.test_radix_cache import cached_sequences, put


def trace_of(*prompts):
    """A trace of these prompts (the match key is each prompt minus its last token), in arrival order."""
    return [SimpleNamespace(input_ids=np.array(p, dtype=np.int32)) for p in prompts]


def belady_cache(trace, order=None, page_size=1):
    index = FutureIndex(trace, range(len(trace)) if order is None else order)
    alloc = TokenAllocator(64) if page_size == 1 else PagedTokenAllocator(64, page_size)
    return RadixCache(ReqToTokenPool(4, 64), alloc, page_size=page_size, eviction_policy=BeladyPolicy(index)), index


def test_the_index_finds_the_first_request_to_come_whose_key_passes_a_prefix():
    index = FutureIndex(trace_of([1, 2, 3, 9], [1, 2, 4, 9], [1, 2, 3, 5, 9]), [0, 1, 2])
    at = index.advance((index.root, 0), np.array([1, 2, 3]))
    assert index.next_use(at) == 0
    index.admit(0)
    assert index.next_use(at) == 2
    assert index.next_use(index.advance((index.root, 0), np.array([1, 7]))) == NEVER


def test_arrival_order_not_trace_order_decides_which_use_comes_first():
    index = FutureIndex(trace_of([1, 2, 9], [1, 2, 9]), [1, 0])
    assert index.next_use(index.advance((index.root, 0), np.array([1, 2]))) == 0  # request 1 arrives first
    assert index.admit(0) == 1


def test_the_index_keys_a_request_by_its_prompt_minus_the_last_token_as_the_scheduler_matches():
    index = FutureIndex(trace_of([1, 2, 3, 4]), [0])
    root = (index.root, 0)
    assert index.next_use(index.advance(root, np.array([1, 2, 3]))) == 0
    assert index.next_use(index.advance(root, np.array([1, 2, 3, 4]))) == NEVER  # the last token is recomputed


def test_a_page_the_scheduler_cannot_match_is_no_future_use_at_page_size_four():
    # The prompt's 8 tokens are two pages, but its match key (7 tokens) covers only the first whole page: the
    # second page is never hit, so it goes first (the oldest of the leaves nobody needs).
    prompt = list(range(100, 108))
    cache, _ = belady_cache(trace_of(prompt), page_size=4)
    put(cache, prompt)
    put(cache, prompt[:4] + [200, 201, 202, 203])
    put(cache, [300, 301, 302, 303])
    cache.evict(4)
    assert cached_sequences(cache) == {(100, 101, 102, 103, 200, 201, 202, 203), (300, 301, 302, 303)}
    cache.check_invariants()


def test_belady_evicts_the_leaf_needed_last_and_what_nobody_needs_first():
    cache, _ = belady_cache(trace_of([20, 21, 22, 23, 9], [10, 11, 12, 13, 9]))
    put(cache, [0, 1, 2, 3])          # never used again
    put(cache, [10, 11, 12, 13])      # used by request 1
    put(cache, [20, 21, 22, 23])      # used by request 0, sooner
    cache.evict(1)
    assert cached_sequences(cache) == {(10, 11, 12, 13), (20, 21, 22, 23)}
    cache.evict(1)
    assert cached_sequences(cache) == {(20, 21, 22, 23)}
    cache.check_invariants()


def test_an_admitted_request_no_longer_counts_as_a_future_use():
    cache, _ = belady_cache(trace_of([10, 11, 12, 13, 9], [20, 21, 22, 23, 9], [10, 11, 12, 13, 9]))
    put(cache, [10, 11, 12, 13])  # used by requests 0 and 2
    put(cache, [20, 21, 22, 23])  # used by request 1
    cache.request_admitted(0)     # [10..13]'s next use is request 2 now, after request 1's
    cache.evict(1)
    assert cached_sequences(cache) == {(20, 21, 22, 23)}
    cache.check_invariants()


def test_a_retracted_request_queued_again_is_future_use_again():
    index = FutureIndex(trace_of([5, 9], [1, 2, 9], [7, 9]), [2, 1, 0])  # request 1 arrives second
    at = index.advance((index.root, 0), np.array([1, 2]))
    assert index.admit(1) == 1 and index.next_use(at) == NEVER
    assert index.readmit(1) is True and index.next_use(at) == 1
    assert index.readmit(1) is False  # it already was


def test_belady_reranks_a_prefix_whose_request_is_queued_again_and_keeps_no_state_for_what_went():
    cache, _ = belady_cache(trace_of([10, 11, 12, 13, 9]))
    put(cache, [10, 11, 12, 13])  # request 0's
    put(cache, [30, 31, 32, 33])  # nobody's, newer
    cache.request_admitted(0)     # both are no future use now: the older would go first ...
    cache.request_waiting(0, [10, 11, 12, 13])  # ... but request 0 was retracted and waits again
    cache.evict(4)
    assert cached_sequences(cache) == {(10, 11, 12, 13)}
    cache.request_admitted(0)
    cache.evict(4)
    cache.request_waiting(0, [10, 11, 12, 13])
    cache.request_admitted(0)  # its prefix was evicted meanwhile
    put(cache, [20, 21])
    put(cache, [20, 21, 22, 23])  # a leaf under a node: where the node's path ends in the trie is kept ...
    cache.evict(1000)             # ... until the node goes
    policy = cache._policy
    assert cache.total_size() == 0 and not policy._by_use and not policy._ends and not policy._entries
    cache.check_invariants()


def test_belady_is_deterministic_for_a_given_trace():
    trace = multi_turn_chat(60, seed=3)
    config = ReplayConfig(capacity_tokens=4000, max_context_len=trace.max_context_len, eviction_policy="belady")
    a, b = replay(trace, config), replay(trace, config)
    assert (a.hit_rate, a.evicted_tokens, a.to_json()["steps"]) == (b.hit_rate, b.evicted_tokens, b.to_json()["steps"])
    assert a.evicted_tokens > 0


def test_belady_keeps_part_of_a_loop_that_lru_thrashes_on():
    # Four 1000-token prefixes in a loop, one request at a time, in a cache that holds three: LRU always
    # evicts the prefix needed next; Belady keeps two of them.
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(0, 1 << 30, 1000) for _ in range(4)]
    trace = [TraceRequest(np.concatenate([prefixes[i % 4], rng.integers(0, 1 << 30, 8)]), 1, arrival_s=10.0 * i)
             for i in range(40)]
    hit = {p: replay(trace, ReplayConfig(capacity_tokens=3300, max_context_len=1100, eviction_policy=p)).hit_rate
           for p in ("lru", "belady")}
    assert hit["lru"] == 0 and hit["belady"] > 0.3


def test_a_replay_config_names_belady_but_only_the_replay_can_build_it():
    config = ReplayConfig(capacity_tokens=4096, max_context_len=64, eviction_policy="belady")
    with pytest.raises(ValueError, match="offline optimum"):
        build_scheduler(config)


# ---- bad input ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("index", [None, "trace", trace_of([1, 2])])
def test_a_belady_policy_without_its_future_index_is_refused_at_construction(index):
    with pytest.raises(TypeError, match="index must be the trace's FutureIndex"):
        BeladyPolicy(index)


@pytest.mark.parametrize("order, error", [
    ([0, 0, 1], ValueError), ([0, 1], ValueError), ([0, 1, 2, 3], ValueError), ([0, 1, 3], ValueError),
    ([-1, 0, 1], ValueError), ([[0, 1, 2]], TypeError), (["a", "b", "c"], TypeError), ([0.0, 1.0, 2.0], TypeError),
])
def test_the_future_index_refuses_an_order_that_is_not_a_permutation(order, error):
    with pytest.raises(error, match="order"):
        FutureIndex(trace_of([1, 9], [2, 9], [3, 9]), order)


def test_the_future_index_takes_any_permutation_as_a_list_range_or_array():
    trace = trace_of([1, 9], [1, 9])
    assert FutureIndex(trace, [1, 0]).rank.tolist() == [1, 0]
    assert FutureIndex(trace, np.array([1, 0], dtype=np.int32)).rank.tolist() == [1, 0]
    assert FutureIndex(trace, range(2)).rank.tolist() == [0, 1]
    assert FutureIndex([], []).rank.tolist() == []


@pytest.mark.parametrize("rid, error", [(-1, IndexError), (2, IndexError), ("0", TypeError), (True, TypeError)])
def test_a_request_id_outside_the_trace_is_refused_not_wrapped_to_another_request(rid, error):
    cache, index = belady_cache(trace_of([10, 11, 12, 13, 9], [20, 21, 22, 23, 9]))
    put(cache, [10, 11, 12, 13])
    put(cache, [20, 21, 22, 23])  # request 1's, the last request: -1 would have admitted it
    put(cache, [30, 31, 32, 33])  # nobody's
    with pytest.raises(error, match="request id"):
        cache.request_admitted(rid)
    with pytest.raises(error, match="request id"):
        index.readmit(rid)
    cache.evict(1)  # request 1's prefix is still needed: the one nobody needs goes
    assert cached_sequences(cache) == {(10, 11, 12, 13), (20, 21, 22, 23)}
    cache.check_invariants()


def test_no_request_of_an_empty_trace_is_future_use_from_the_root():
    index = FutureIndex([], [])
    assert index.next_use((index.root, 0)) == NEVER
    assert index.next_use(index.advance((index.root, 0), np.array([], dtype=np.int64))) == NEVER
