"""The native engine's host tier, and a simulated storage tier under it, against the Python reference
(kvmem.tiers.HiRadixCache over a HostSlotPool, with a StorageLink to a SimStore, under kvmem's Scheduler): the same
report, field for field (timings aside), the tiers' counters included.

Random traces share long heads (a load-back needs at least SchedulerConfig.load_back_threshold host-only tokens),
device capacities of one to two requests evict them to the host, and host capacities from a page more than the
device to three times it make the host tier evict too. Skipped, with the reason, where the native module is not
built.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmem.replay import native_replay
from kvmem.replay.config import WRITE_POLICIES, ReplayConfig
from kvmem.replay.traces import TraceRequest, read_trace
from kvmem.router import POLICIES
from tests.test_native_cluster import assert_same_cluster
from tests.test_native_engine import HEAD, NATIVE, assert_same_report, block_traces

pytestmark = pytest.mark.skipif(isinstance(NATIVE, ImportError),
                                reason=f"the native replay engine is not built ({NATIVE})")
TIER_FIELDS = ("loaded_tokens", "backed_up_tokens", "host_evicted_tokens", "host_hit_rate", "transfer_seconds")
STORES = ["sim", "sim:64", "sim:200"]  # unbounded, and small enough to evict


@st.composite
def shared_head_traces(draw):
    """Requests that open with one of a few long heads over a tiny alphabet, then a tail of their own; some are a
    conversation's next turn (an earlier request's prompt and output, then more)."""
    alphabet = draw(st.integers(1, 4))
    heads = draw(st.lists(st.lists(st.integers(0, alphabet - 1), min_size=16, max_size=48), min_size=2, max_size=6))
    requests, arrival = [], 0.0
    for _ in range(draw(st.integers(2, 14))):
        if requests and draw(st.integers(0, 3)) == 0:
            prev = requests[draw(st.integers(0, len(requests) - 1))]
            prompt = list(prev.input_ids) + prev.output_tokens().tolist()
            prompt += draw(st.lists(st.integers(0, alphabet), max_size=8))
        else:
            prompt = draw(st.sampled_from(heads)) + draw(st.lists(st.integers(0, alphabet), max_size=20))
        arrival += draw(st.sampled_from([0.0, 0.01, 0.05, 0.3]))
        requests.append(TraceRequest(prompt, draw(st.integers(1, 24)), arrival))
    return requests


@st.composite
def tiered_configs(draw, requests, page_sizes):
    longest = max(len(r.input_ids) + r.output_len for r in requests)
    ps = draw(page_sizes)
    fits = -(-longest // ps) * ps
    capacity = draw(st.integers(fits, 2 * fits)) // ps * ps
    host = capacity + draw(st.sampled_from([ps, 2 * ps, capacity // 2 // ps * ps + ps, capacity, 3 * capacity]))
    return ReplayConfig(
        capacity_tokens=capacity, max_context_len=longest, page_size=ps, host_capacity_tokens=host,
        write_policy=draw(st.sampled_from(WRITE_POLICIES)),
        eviction_policy=draw(st.sampled_from(native_replay.NATIVE_POLICIES)),
        schedule_policy=draw(st.sampled_from(["lpm", "fcfs"])), max_running=draw(st.integers(1, 6)),
        chunked_prefill_size=draw(st.one_of(st.none(), st.integers(4, 40))), honour_arrivals=draw(st.booleans()),
        cache_decode_pages=draw(st.booleans()), in_batch_prefix_caching=draw(st.booleans()),
        pin_prefix_tokens=draw(st.sampled_from([0, 0, 16])), gpu=draw(st.sampled_from([None, "H100"])))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_traces_with_a_host_tier_replay_the_same_on_both_engines(data):
    requests = data.draw(shared_head_traces())
    config = data.draw(tiered_configs(requests, st.sampled_from([1, 1, 2, 4, 8, 16])))
    assert_same_report(requests, config, one_by_one=True)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_mooncake_block_traces_with_a_host_tier_replay_the_same_on_both_engines(data):
    trace = data.draw(block_traces())
    config = data.draw(tiered_configs([trace[i] for i in range(len(trace))], st.sampled_from([1, 16, 64, 512])))
    assert_same_report(trace, config)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_traces_with_a_simulated_storage_tier_replay_the_same_on_both_engines(data):
    requests = data.draw(shared_head_traces())
    config = data.draw(tiered_configs(requests, st.sampled_from([1, 1, 2, 4, 8, 16])))
    assert_same_report(requests, dataclasses.replace(config, storage=data.draw(st.sampled_from(STORES))))


@pytest.mark.xfail(strict=False, reason="some clusters sharing a simulated store differ between the engines on a first "
                   "replay in a process (the native store counts failed writes the Python one does not; a second "
                   "replay of the same case agrees): kvmem-replay runs such clusters on the Python engine")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_traces_on_a_cluster_sharing_a_simulated_store_replay_the_same_on_both_engines(data):
    requests = data.draw(shared_head_traces())
    config = data.draw(tiered_configs(requests, st.sampled_from([1, 2, 4, 16])))
    config = dataclasses.replace(config, storage=data.draw(st.sampled_from(STORES)))
    assert_same_cluster(requests, config, data.draw(st.integers(1, 4)), data.draw(st.sampled_from(POLICIES)))


@pytest.mark.parametrize("options", [
    dict(capacity_tokens=100_000, host_capacity_tokens=130_000, storage="sim"),
    dict(capacity_tokens=150_000, host_capacity_tokens=200_000, page_size=16, storage="sim:100000",
         write_policy="write_back"),
])
def test_the_conversation_trace_head_with_a_simulated_store_replays_the_same_on_both_engines(options):
    trace = read_trace(HEAD, limit=250)
    report = assert_same_report(trace, ReplayConfig(max_context_len=trace.max_context_len, **options))
    assert report["stored_tokens"] > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_the_conversation_trace_head_on_a_cluster_sharing_a_simulated_store_replays_the_same_on_both_engines(policy):
    trace = read_trace(HEAD, limit=200)
    config = ReplayConfig(capacity_tokens=100_000, host_capacity_tokens=130_000, storage="sim", page_size=16,
                          max_context_len=trace.max_context_len)
    report = assert_same_cluster(trace, config, 3, policy)
    assert report["prefetched_tokens"] > 0 and report["storage_hit_rate"] > 0


@pytest.mark.parametrize("options", [
    dict(capacity_tokens=150_000, host_capacity_tokens=300_000),
    dict(capacity_tokens=150_000, host_capacity_tokens=200_000, page_size=16, write_policy="write_back",
         eviction_policy="lfu"),
    dict(capacity_tokens=200_000, host_capacity_tokens=260_000, page_size=64, write_policy="write_through_selective",
         gpu="H100", tp=2, chunked_prefill_size=2048),
])
def test_the_conversation_trace_head_with_a_host_tier_replays_the_same_on_both_engines(options):
    trace = read_trace(HEAD, limit=250)
    report = assert_same_report(trace, ReplayConfig(max_context_len=trace.max_context_len, **options))
    assert report["backed_up_tokens"] > 0 and set(TIER_FIELDS) <= set(report)
    if options.get("write_policy") != "write_through_selective":
        assert report["loaded_tokens"] > 0 and report["host_evicted_tokens"] > 0
