"""The native engine's cluster replay against the Python reference (kvmem.replay.cluster.ClusterReplay): the same
report, field for field (timings aside), for every router.

The native router names a replica's pages by the token prefixes its events reported (kvmem/replay/native/view.h)
where the Python one keeps their 64-bit page hashes (kvmem.page_hash); equal reports (the requests routed to each
replica, the prefix each index showed there, the events counted) are what shows the two give the same routing
decisions. The per-step samples of each replica, its start, busy and prefill seconds are compared too: a step's
results reach the router when it ends, a run of decode steps handing them over at its end, so the steps' bounds
must be the Python engine's. Skipped, with the reason, where the native module is not built.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmem.replay import native_cluster
from kvmem.replay.cluster import replay_cluster as python_replay_cluster
from kvmem.replay.config import WRITE_POLICIES, ReplayConfig
from kvmem.replay.synthetic import shared_system_prompts
from kvmem.replay.traces import read_trace
from kvmem.router import POLICIES
from tests.test_native_engine import HEAD, NATIVE, SAMPLES, block_traces, configs, token_traces

pytestmark = pytest.mark.skipif(isinstance(NATIVE, ImportError),
                                reason=f"the native replay engine is not built ({NATIVE})")
TIMINGS = {"cache_op_seconds", "replay_seconds", "cache_op_breakdown_s", "routing_seconds"}


def without_timings(value):
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if k not in TIMINGS}
    return [without_timings(v) for v in value] if isinstance(value, list) else value


def cluster_fields(report) -> dict:
    """A cluster report's JSON but its timings, and each replica's unrounded seconds, start and samples."""
    out = without_timings(report.to_json())
    out.update(busy_seconds=report.busy_seconds, prefill_seconds=report.prefill_seconds,
               makespan_seconds=report.makespan_seconds,
               replicas=[{"start_s": r.start_s, **{name: list(getattr(r, name)) for name in SAMPLES}}
                         for r in report.reports])
    return out


def assert_same_cluster(requests, config: ReplayConfig, replicas: int, policy: str) -> dict:
    native = cluster_fields(native_cluster.replay_cluster(requests, config, replicas, policy))
    assert native == cluster_fields(python_replay_cluster(requests, config, replicas, policy))
    return native


@st.composite
def maybe_tiered(draw, config: ReplayConfig) -> ReplayConfig:
    if not draw(st.booleans()):
        return config
    ps = config.page_size
    capacity = config.capacity_tokens // ps * ps
    return dataclasses.replace(config, host_capacity_tokens=capacity + draw(st.sampled_from([ps, capacity])),
                               write_policy=draw(st.sampled_from(WRITE_POLICIES)))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_token_traces_replay_the_same_cluster_on_both_engines(data):
    requests = data.draw(token_traces())
    config = data.draw(maybe_tiered(data.draw(configs(requests, st.sampled_from([1, 1, 2, 4, 16]),
                                                      st.integers(1, 40)))))
    assert_same_cluster(requests, config, data.draw(st.integers(1, 4)), data.draw(st.sampled_from(POLICIES)))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_mooncake_block_traces_replay_the_same_cluster_on_both_engines(data):
    trace = data.draw(block_traces())
    config = data.draw(configs([trace[i] for i in range(len(trace))], st.sampled_from([1, 16, 512]),
                               st.integers(100, 1500)))
    assert_same_cluster(trace, config, data.draw(st.integers(2, 3)), data.draw(st.sampled_from(POLICIES)))


@pytest.mark.parametrize("policy", POLICIES)
def test_the_conversation_trace_head_replays_the_same_cluster_on_both_engines(policy):
    trace = read_trace(HEAD, limit=200)
    config = ReplayConfig(capacity_tokens=200_000, max_context_len=trace.max_context_len, page_size=16)
    report = assert_same_cluster(trace, config, 3, policy)
    assert report["events"]["batches"] > 0 and report["events"]["removed_blocks"] > 0
    assert min(r["routed"] for r in report["per_replica"]) > 0


def test_shared_system_prompts_on_a_tiered_cluster_replay_the_same_on_both_engines():
    trace = shared_system_prompts(150, num_prompts=6, prompt_len=600, arrival_rate=20.0, seed=4)
    config = ReplayConfig(capacity_tokens=3_000, max_context_len=trace.max_context_len, page_size=4,
                          host_capacity_tokens=6_000, write_policy="write_back")
    report = assert_same_cluster(trace, config, 4, "cache-aware")
    assert report["loaded_tokens"] > 0 and report["index_hit_rate"] > 0


def test_a_cluster_the_native_engine_does_not_cover_is_refused():
    trace = read_trace(HEAD, limit=5)
    config = ReplayConfig(capacity_tokens=100_000, max_context_len=trace.max_context_len, eviction_policy="arc")
    with pytest.raises(ValueError, match="does not cover arc eviction"):
        native_cluster.replay_cluster(trace, config, 2, "round-robin")
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        native_cluster.replay_cluster(trace, dataclasses.replace(config, eviction_policy="lru"), 2, "random")
