"""The cluster replay: replicas behind a router fed only by their KV events and their loads."""

import dataclasses
from collections import deque

import pytest

from kvmem.events import MEDIUM_CPU_PINNED, MEDIUM_GPU
from kvmem.page_hash import event_hashes
from kvmem.replay.cluster import ClusterReplay, replay_cluster
from kvmem.replay.config import ReplayConfig
from kvmem.replay.cost import StepCost
from kvmem.replay.simulator import replay
from kvmem.replay.synthetic import multi_turn_chat, shared_system_prompts
from kvmem.replay.traces import TraceRequest
from kvmem.router import POLICIES, ReplicaLoad


def config_for(trace, capacity=4096, **kw):
    return ReplayConfig(capacity_tokens=capacity, max_context_len=trace.max_context_len, **kw)


def cached_pages(tree) -> tuple[set[int], set[int]]:
    """(pages on device, pages with a completed host copy) as the tree holds them."""
    device, host, stack = set(), set(), list(tree._roots.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.parent is None:
            continue
        hashes = event_hashes(node.page_digests)
        if len(node.value):
            device.update(hashes)
        if getattr(node, "host_value", None) is not None and node.backup is None:
            host.update(hashes)
    return device, host


CHAT = multi_turn_chat(80, system_len=128, user_len=(8, 64), output_len=(4, 24), arrival_rate=40.0, seed=3)


# ---- one replica is a single replay ----------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("tiers", [{"page_size": 1}, {"page_size": 4, "host_capacity_tokens": 8192}])
def test_one_replica_replays_exactly_as_a_single_replay(policy, tiers):
    config = config_for(CHAT, capacity=2048, **tiers)
    single = replay(CHAT, config).to_json()
    cluster = replay_cluster(CHAT, config, 1, policy).to_json()
    (replica,) = cluster["per_replica"]
    for key in ("requests", "prompt_tokens", "cached_tokens", "evicted_tokens", "retractions", "steps",
                "peak_tokens_used", "mean_tokens_used", "peak_pinned_tokens", "mean_evictable_tokens", "mean_running"):
        assert replica[key] == single[key], key
    per_step = ("peak_tokens_used", "mean_tokens_used", "peak_pinned_tokens", "mean_evictable_tokens", "mean_running")
    assert not set(per_step) & set(cluster)  # per-step samples of one replica: not summed over the cluster
    timings = ("cache_op_seconds", "replay_seconds", "cache_op_breakdown_s")
    # Every other field of a single replay, the time figures of its cost model included, is the cluster's.
    assert {k: v for k, v in cluster.items() if k in single and k not in timings} == \
        {k: v for k, v in single.items() if k not in per_step + timings}
    assert single["output_tokens"] > 0 and single["ttft_p50_s"] > 0 and single["requests_per_s"] > 0
    assert set(cluster["cache_op_breakdown_s"]) == set(single["cache_op_breakdown_s"]) == \
        {"match", "alloc", "evict", "insert_release", "batch"}
    assert cluster["load_imbalance"] == 1.0


def test_a_clusters_time_figures_cover_every_replica():
    config = config_for(CHAT, capacity=2048, gpu="H100", model="llama-3-8b")
    report = replay_cluster(CHAT, config, 2, "round-robin")
    cluster, replicas = report.to_json(), [r.to_json() for r in report.reports]
    assert cluster["output_tokens"] == sum(r["output_tokens"] for r in replicas) > 0
    assert cluster["prefill_seconds_saved"] == pytest.approx(sum(r["prefill_seconds_saved"] for r in replicas),
                                                             abs=2e-6)
    # From the first arrival at any replica to the latest replica's last step.
    start, end = min(r.start_s for r in report.reports), max(r.time_s[-1] for r in report.reports)
    assert cluster["simulated_seconds"] == pytest.approx(end - start, abs=1e-6)
    assert cluster["simulated_seconds"] >= max(r["simulated_seconds"] for r in replicas)
    assert cluster["requests_per_s"] == pytest.approx(cluster["requests"] / cluster["simulated_seconds"], rel=1e-5)
    ttft = sorted(t for r in report.reports for t in r.ttft_s)
    assert len(ttft) == cluster["requests"] and ttft[0] <= cluster["ttft_p50_s"] <= ttft[-1]
    assert cluster["cost_model"] == replicas[0]["cost_model"] and "prefill_gpu_seconds_saved" in cluster


# ---- the index is the replicas' caches, as their events tell it ----------------------------------------
class CheckedClusterReplay(ClusterReplay):
    """Checks, each time the router catches up with a replica, that its index holds exactly the pages that
    replica's tree held after the last step the router has seen (the replica may be steps ahead)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.snapshots = [deque() for _ in self.replicas]
        self.checks = 0
        for replica in self.replicas:
            replica.step = self._snapshotting(replica, replica.step)

    def _snapshotting(self, replica, step):
        def snapshot_after_step(until):
            finished = step(until)
            self.snapshots[replica.rank].append(cached_pages(replica.sim.sched.tree_cache))
            return finished
        return snapshot_after_step

    def _deliver(self, now):
        pending = [len(r.results) for r in self.replicas]
        super()._deliver(now)
        for replica, before in zip(self.replicas, pending):
            seen = [self.snapshots[replica.rank].popleft() for _ in range(before - len(replica.results))]
            if seen:
                device, host = seen[-1]
                assert self.router.index.blocks(replica.rank, MEDIUM_GPU) == device
                assert self.router.index.blocks(replica.rank, MEDIUM_CPU_PINNED) == host
                self.checks += 1


@pytest.mark.parametrize("policy", ["cache-aware", "kv-overlap", "round-robin"])
@pytest.mark.parametrize("tiers", [{"page_size": 2}, {"page_size": 4, "host_capacity_tokens": 4096}])
def test_the_routers_index_holds_what_each_replica_cached_as_of_the_last_step_it_has_seen(policy, tiers):
    sim = CheckedClusterReplay(CHAT, config_for(CHAT, capacity=1024, **tiers), 3, policy)
    report = sim.run()
    assert sim.checks > len(CHAT) and report.events.removed_blocks > 0  # evictions were reported too
    for replica in sim.replicas:  # at the end the router has seen every step
        assert sim.router.index.blocks(replica.rank) == cached_pages(replica.sim.sched.tree_cache)[0]


# ---- routing -----------------------------------------------------------------------------------------------
def test_prefix_aware_policies_find_more_hits_than_round_robin_on_shared_prompts():
    trace = shared_system_prompts(240, num_prompts=8, prompt_len=512, user_len=(16, 64), output_len=(4, 16),
                                  arrival_rate=20.0, seed=1)
    config = config_for(trace, capacity=1600, page_size=16)  # about two prompts per replica
    hit = {p: replay_cluster(trace, config, 4, p).hit_rate for p in POLICIES}
    assert hit["cache-aware"] > hit["round-robin"] + 0.2
    assert hit["kv-overlap"] > hit["round-robin"] + 0.15


def test_the_router_sees_each_request_prefilled_and_each_replica_its_prefill_time():
    sim = ClusterReplay(CHAT, config_for(CHAT, capacity=1024, chunked_prefill_size=48), 3, "kv-overlap")
    report = sim.run()
    assert sim.fleet._prefill_tokens == [0, 0, 0] and not sim.fleet._queued_prefill  # every routed prompt was prefilled
    for busy, prefill, routed in zip(report.busy_seconds, report.prefill_seconds, report.routed):
        assert 0 < prefill < busy and routed > 0


def loads_seen(sim):
    """Records the loads the router of `sim` is handed at each routing, in order."""
    seen, route = [], sim.router.route
    sim.router.route = lambda hashes, loads, num_tokens: seen.append(loads) or route(hashes, loads, num_tokens)
    return seen


def test_the_router_sees_each_replicas_running_requests_active_blocks_and_queued_prefill_in_their_fields():
    # At page 16 the fields differ in kind (requests, pages, tokens); at page 1 with kv-overlap's default weight,
    # active blocks and prefill tokens swapped would cost the same.
    z, a, b, c = (list(range(1000 * k, 1000 * k + 64)) for k in (1, 2, 3, 4))
    requests = [TraceRequest(z, 2, 0.0), TraceRequest(a, 200, 0.5), TraceRequest(b, 4, 1.0), TraceRequest(c, 4, 1.0)]
    sim = ClusterReplay(requests, ReplayConfig(capacity_tokens=1024, max_context_len=512, page_size=16), 2,
                        "kv-overlap")
    seen = loads_seen(sim)
    assert sim.run().routed == [2, 2]
    assert seen[1] == [ReplicaLoad(), ReplicaLoad()]  # z finished on replica 0: its pages are cached, not pinned
    # b at 1 s: a (on replica 0) was prefilled and has decoded for a while (at most 17 steps of 30 ms): it pins its
    # pages, and only those (z's are evictable), and queues no prefill.
    running, active, prefill = seen[2][0]
    assert (running, prefill) == (1, 0) and 64 // 16 < active <= (64 + 17) // 16 + 1 and seen[2][1] == ReplicaLoad()
    # c at the same instant: b went to replica 1, whose step has not run: 64 prompt tokens queued, no page pinned.
    assert seen[3] == [seen[2][0], ReplicaLoad(running_requests=1, active_blocks=0, prefill_tokens=64)]


def test_a_step_that_ends_as_a_request_arrives_is_seen_by_the_router_and_the_request_joins_the_next_step():
    # Exact binary times: a's prefill takes 0.25 + 64 / 256 = 0.5 s, decode steps 0.25 s; b arrives at 0.5 s.
    cost = StepCost(decode_step_s=0.25, prefill_tokens_per_s=256.0)
    a, b = list(range(1000, 1064)), list(range(2000, 2064))
    config = ReplayConfig(capacity_tokens=1024, max_context_len=512, page_size=16)
    for a_tokens, loads in ((1, ReplicaLoad()), (3, ReplicaLoad(running_requests=1, active_blocks=4))):
        requests = [TraceRequest(a, a_tokens, 0.0), TraceRequest(b, 2, 0.5)]
        sim = ClusterReplay(requests, config, 1, "kv-overlap", cost=cost)
        seen = loads_seen(sim)
        cluster = sim.run()
        assert seen[1] == [loads]  # a's step ended at 0.5 s: finished, or pinning its prompt's 4 pages
        single = replay(requests, config, cost=cost)
        assert list(cluster.reports[0].ttft_s) == list(single.ttft_s) == [0.5, 0.5]  # b prefilled at once


def test_the_router_counts_as_cached_the_whole_pages_before_a_prompts_last_token_as_a_replica_matches():
    prompt = list(range(1000, 1064))  # 4 pages: a replica matches 63 tokens, 3 whole pages
    other = list(range(5000, 5064))
    requests = [TraceRequest(prompt, 2, 0.0), TraceRequest(prompt, 2, 100.0), TraceRequest(other, 2, 100.0)]
    sim = ClusterReplay(requests, ReplayConfig(capacity_tokens=1024, max_context_len=512, page_size=16), 2,
                        "cache-aware")
    seen = loads_seen(sim)
    report = sim.run()
    assert report.routed == [2, 1] and report.index_cached_tokens == report.to_json()["cached_tokens"] == 48
    assert seen[1] == [ReplicaLoad(), ReplicaLoad()]
    assert seen[2] == [ReplicaLoad(running_requests=1, prefill_tokens=64 - 48), ReplicaLoad()]  # what is left


def test_round_robin_takes_replicas_in_turn_and_reports_the_imbalance():
    report = replay_cluster([CHAT[i] for i in range(3)], config_for(CHAT), 5, "round-robin")
    assert report.routed == [1, 1, 1, 0, 0]
    assert report.load_imbalance == pytest.approx(1 / (3 / 5))
    out = report.to_json()
    assert [r["requests"] for r in out["per_replica"]] == [1, 1, 1, 0, 0]
    assert out["per_replica"][4]["hit_rate"] == 0.0 and out["per_replica"][4]["busy_seconds"] == 0.0


def test_least_load_spreads_a_burst_by_the_requests_it_has_routed():
    config = config_for(CHAT, honour_arrivals=False)  # everything arrives at once: no step ends in between
    report = replay_cluster(CHAT, config, 4, "least-load")
    assert report.routed == [20, 20, 20, 20] and report.load_imbalance == 1.0


def test_the_report_sums_the_replicas_and_lists_each():
    report = replay_cluster(CHAT, config_for(CHAT, capacity=1024, page_size=2), 3, "cache-aware")
    out = report.to_json()
    per = out["per_replica"]
    for key in ("requests", "prompt_tokens", "cached_tokens", "evicted_tokens", "steps"):
        assert out[key] == sum(r[key] for r in per), key
    assert out["hit_rate"] == pytest.approx(out["cached_tokens"] / out["prompt_tokens"], abs=1e-6)
    counts = [r["requests"] for r in per]
    assert out["load_imbalance"] == pytest.approx(max(counts) / (sum(counts) / 3), abs=1e-6)
    assert out["replicas"] == 3 and out["router"] == "cache-aware" and out["capacity_tokens"] == 3 * 1024
    assert 0 < out["index_hit_rate"] <= 1 and out["events"]["batches"] > 0
    assert all(0 <= r["prefill_seconds"] <= r["busy_seconds"] <= out["makespan_seconds"] for r in per)
    assert "index_hit_rate" not in replay_cluster(CHAT, config_for(CHAT), 2, "least-load").to_json()


# ---- a shared storage tier ---------------------------------------------------------------------------------
def test_a_shared_storage_tier_serves_the_pages_one_replica_wrote_to_another(tmp_path):
    prompt = list(range(1000, 1256))
    requests = [TraceRequest(prompt + [1], 4, 0.0), TraceRequest(prompt + [2], 4, 100.0)]
    config = ReplayConfig(capacity_tokens=1024, max_context_len=512, page_size=16, host_capacity_tokens=2048)
    local = replay_cluster(requests, config, 2, "round-robin")
    shared = replay_cluster(requests, dataclasses.replace(config, storage=f"file:{tmp_path}"), 2, "round-robin")
    assert local.routed == shared.routed == [1, 1] and local.hit_rate == 0.0
    assert shared.reports[1].storage_cached_tokens == 256 and shared.reports[1].cached_tokens == 256
    assert shared.to_json()["storage_hit_rate"] == pytest.approx(256 / 514, abs=1e-6)


def test_replicas_share_one_simulated_store_as_they_share_a_file_store(tmp_path):
    prompt = list(range(1000, 1256))
    requests = [TraceRequest(prompt + [1], 4, 0.0), TraceRequest(prompt + [2], 4, 100.0)]
    config = ReplayConfig(capacity_tokens=1024, max_context_len=512, page_size=16, host_capacity_tokens=2048)
    files = replay_cluster(requests, dataclasses.replace(config, storage=f"file:{tmp_path}"), 2, "round-robin")
    sim = replay_cluster(requests, dataclasses.replace(config, storage="sim"), 2, "round-robin")
    assert sim.reports[1].storage_cached_tokens == 256
    timings = ("storage", "cache_op_seconds", "replay_seconds", "routing_seconds", "cache_op_breakdown_s",
               "per_replica")
    assert {k: v for k, v in sim.to_json().items() if k not in timings} == \
        {k: v for k, v in files.to_json().items() if k not in timings}


# ---- bad input ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("replicas, policy, error, match", [
    (0, "round-robin", ValueError, "replicas must be a positive int"),
    (-3, "cache-aware", ValueError, "replicas"),
    (2.0, "cache-aware", TypeError, "replicas"),
    (2, "random", ValueError, "unknown routing policy 'random'"),
    (2, None, ValueError, "unknown routing policy"),
])
def test_bad_cluster_arguments_raise_naming_them_before_anything_is_built(tmp_path, replicas, policy, error, match):
    store = tmp_path / "store"
    config = ReplayConfig(capacity_tokens=1024, max_context_len=64, host_capacity_tokens=2048,
                          storage=f"file:{store}")
    with pytest.raises(error, match=match):
        ClusterReplay(CHAT, config, replicas, policy)
    assert not store.exists()  # no replica opened the store


def test_a_config_that_is_not_a_replay_config_or_a_bad_router_parameter_is_refused():
    with pytest.raises(TypeError, match="config must be a ReplayConfig"):
        ClusterReplay(CHAT, {"capacity_tokens": 10}, 2, "round-robin")
    with pytest.raises(TypeError, match="routing policy 'kv-overlap'"):
        ClusterReplay(CHAT, config_for(CHAT), 2, "kv-overlap", cache_threshold=0.5)
    with pytest.raises(ValueError, match="cache_threshold"):
        ClusterReplay(CHAT, config_for(CHAT), 2, "cache-aware", cache_threshold=2.0)


def test_a_cluster_replay_runs_once():
    sim = ClusterReplay([CHAT[0]], config_for(CHAT), 2, "round-robin")
    assert sim.run().routed == [1, 0]
    with pytest.raises(RuntimeError, match="has run"):
        sim.run()


def test_replicas_that_would_not_fit_this_machines_memory_are_refused():
    config = ReplayConfig(capacity_tokens=2**34, max_context_len=64)
    with pytest.raises(ValueError, match="1000 replicas of a replay"):
        ClusterReplay(CHAT, config, 1000, "round-robin")


def test_a_request_no_replica_can_hold_is_counted_as_rejected_and_the_replay_goes_on(capsys):
    requests = [TraceRequest(list(range(1, 100)), 4, 0.0), TraceRequest([1, 2, 3], 2, 1.0)]
    report = replay_cluster(requests, ReplayConfig(capacity_tokens=64, max_context_len=128), 2, "round-robin")
    out = report.to_json()
    assert (out["rejected"], out["requests"]) == (1, 1)
    assert "replica 0: skipped: request 0" in capsys.readouterr().err
