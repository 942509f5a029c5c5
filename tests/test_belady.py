"""Belady's offline optimum in the replay: next uses from the trace, the eviction order they give, determinism,
and its refusal to run anywhere else."""

from types import SimpleNamespace

import numpy as np
import pytest

from kvmem import ReqToTokenPool, TokenAllocator
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


def belady_cache(trace, order=None):
    index = FutureIndex(trace, range(len(trace)) if order is None else order)
    return RadixCache(ReqToTokenPool(4, 64), TokenAllocator(64), eviction_policy=BeladyPolicy(index)), index


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
