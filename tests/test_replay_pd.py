"""The disaggregated (P:D) replay: kvmem.replay.pd, its link, its latency figures and its command line."""

import json
import math

import pytest

from kvmem.replay.cli import main
from kvmem.replay.cluster import replay_cluster
from kvmem.replay.config import ReplayConfig
from kvmem.replay.kv_link import KVLink
from kvmem.replay.latency import SLO, RequestTimes
from kvmem.replay.pd import PDReplay, replay_pd
from kvmem.replay.synthetic import shared_system_prompts
from kvmem.replay.traces import TraceRequest

TRACE = shared_system_prompts(60, num_prompts=3, prompt_len=256, arrival_rate=4.0)


def config_for(trace, capacity=4096, **kw):
    longest = max(len(r.input_ids) + r.output_len for r in trace)
    return ReplayConfig(capacity_tokens=capacity, max_context_len=longest, **kw)


class CheckedPDReplay(PDReplay):
    """Checks both sides' invariants after every step and every boundary."""

    checks = 0

    def _prefill_step(self, prefill, until):
        super()._prefill_step(prefill, until)
        self._check()

    def _decode_step(self, decode, until):
        super()._decode_step(decode, until)
        self._check()

    def _route(self, rid, arrival):
        super()._route(rid, arrival)
        self._check()

    def _check(self):
        self.check_invariants()
        self.checks += 1


# ---- the flow ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preallocate", ["arrival", "prefilled"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("decode_prefix_cache", [True, False])
def test_both_sides_invariants_hold_after_every_event_and_no_memory_is_left_outside(page_size, decode_prefix_cache,
                                                                                     preallocate):
    sim = CheckedPDReplay(TRACE, config_for(TRACE, page_size=page_size, chunked_prefill_size=128), 2, 2,
                          decode_prefix_cache=decode_prefix_cache, preallocate=preallocate)
    report = sim.run()
    assert sim.checks > 2 * len(TRACE)
    assert report.requests == len(TRACE) and report.rejected == 0
    for replica in sim.replicas():
        assert not replica.sim.outside and replica.sim.is_idle()
    assert not any(r.sending for r in sim.prefill.replicas)
    assert not any(r.pending or r.landing for r in sim.decode.replicas)
    # every output token was decoded on the decode side, none on the prefill side
    assert report.decode.total().output_tokens == sum(r.output_len for r in TRACE)
    assert report.prefill.total().output_tokens == 0


@pytest.mark.parametrize("preallocate", ["arrival", "prefilled"])
def test_a_small_decode_pool_makes_requests_wait_for_pages_and_a_busy_link_makes_prefill_wait_for_memory(preallocate):
    trace = shared_system_prompts(30, num_prompts=2, prompt_len=300, arrival_rate=50.0)
    sim = CheckedPDReplay(trace, config_for(trace, capacity=1200, page_size=4), 1, 1,
                          link=KVLink(gbps=0.05, num_layers=4), preallocate=preallocate)
    report = sim.run()
    assert report.requests == 30 and report.transfer.exposed_seconds > 1.0


def test_the_decode_side_asks_only_for_the_pages_beyond_what_it_caches():
    shared = list(range(1, 129))
    requests = [TraceRequest(shared + [500, 501], 4, 0.0), TraceRequest(shared + [600, 601, 602], 4, 10.0)]
    config = config_for(requests, page_size=16)
    report = replay_pd(requests, config, 1, 2)
    token_bytes = config.token_kv_bytes
    assert report.transfer.bytes == (130 + (131 - 128)) * token_bytes
    assert report.transfer.whole_prompt_bytes == (130 + 131) * token_bytes
    # cache-aware routing sent the second turn to the decode replica holding the first
    assert sorted(report.decode.routed) == [0, 2]
    whole = replay_pd(requests, config, 1, 2, decode_prefix_cache=False)
    assert whole.transfer.bytes == whole.transfer.whole_prompt_bytes == report.transfer.whole_prompt_bytes


def test_bytes_sent_with_the_decode_prefix_cache_are_at_most_those_without_it():
    config = config_for(TRACE, page_size=16)
    cached = replay_pd(TRACE, config, 1, 2)
    whole = replay_pd(TRACE, config, 1, 2, decode_prefix_cache=False)
    assert cached.transfer.whole_prompt_bytes == whole.transfer.whole_prompt_bytes
    assert whole.transfer.bytes == whole.transfer.whole_prompt_bytes and whole.kv_bytes_saved_fraction == 0.0
    assert cached.transfer.bytes < whole.transfer.bytes and cached.kv_bytes_saved_fraction > 0.5
    assert cached.to_json()["decode_hit_rate"] == pytest.approx(cached.kv_bytes_saved_fraction, abs=1e-6)


def test_a_requests_ttft_includes_its_transfer():
    prompt = list(range(1, 1025))
    requests = [TraceRequest(prompt, 3, 0.0)]
    config = config_for(requests)
    fast = replay_pd(requests, config, 1, 1, link=KVLink(gbps=1e6, latency_us=0.0))
    slow = replay_pd(requests, config, 1, 1, link=KVLink(gbps=1.0, latency_us=500.0))
    nbytes = 1024 * config.token_kv_bytes
    # one prefill step either way; the slow link leaves its transfer (less the first layer's compute) exposed
    assert slow.transfer.bytes == fast.transfer.bytes == nbytes
    wire = nbytes * 8 / 1e9
    ttft_fast, ttft_slow = fast.latency["ttft_p50_s"], slow.latency["ttft_p50_s"]
    assert ttft_slow >= wire + 500e-6 and ttft_slow - ttft_fast >= wire - ttft_fast
    assert slow.transfer.exposed_seconds == pytest.approx(ttft_slow - ttft_fast + fast.transfer.exposed_seconds,
                                                          abs=1e-5)


def test_pages_given_once_prefilled_leave_the_whole_transfer_after_the_prefill():
    requests = [TraceRequest(list(range(1, 1025)), 3, 0.0)]
    link = KVLink(gbps=1.0, latency_us=0.0, num_layers=32)
    overlapped = replay_pd(requests, config_for(requests), 1, 1, link=link)
    after = replay_pd(requests, config_for(requests), 1, 1, link=link, preallocate="prefilled")
    wire = 1024 * config_for(requests).token_kv_bytes * 8 / 1e9
    assert after.transfer.exposed_seconds == pytest.approx(wire)
    assert overlapped.transfer.exposed_seconds < after.transfer.exposed_seconds
    assert after.to_json()["decode_preallocate"] == "prefilled"


def test_the_decode_router_is_a_policy_of_its_own():
    config = config_for(TRACE, page_size=16)
    rr = replay_pd(TRACE, config, 1, 3, decode_router="round-robin")
    aware = replay_pd(TRACE, config, 1, 3, decode_router="cache-aware")
    assert rr.decode.routed == [20, 20, 20]
    assert aware.transfer.bytes < rr.transfer.bytes


# ---- the link ---------------------------------------------------------------------------------------------------
def test_a_link_faster_than_the_prefill_exposes_only_the_last_layer_and_the_latency():
    link = KVLink(gbps=8.0, latency_us=10.0, num_layers=4)  # 1 GB/s
    busy, landed = link.send(4_000_000, step_start=0.0, step_end=1.0, ready=0.0)  # 1 ms a layer, 250 ms of compute
    assert busy == pytest.approx(1.001) and landed == pytest.approx(1.001 + 10e-6)


def test_a_link_slower_than_the_prefill_is_bound_by_its_bandwidth_and_waits_for_the_link_to_be_free():
    link = KVLink(gbps=8.0, latency_us=0.0, num_layers=4)
    busy, landed = link.send(4_000_000_000, step_start=0.0, step_end=1.0, ready=0.0)  # 4 s on the wire
    assert busy == landed == pytest.approx(0.25 + 4.0)
    busy, _ = link.send(4_000_000_000, step_start=0.0, step_end=1.0, ready=3.0)
    assert busy == pytest.approx(7.0)
    assert KVLink(gbps=8.0, nics=2).bytes_per_s == 2e9


def test_a_transfer_of_no_bytes_still_lands_one_latency_after_the_prefill():
    assert KVLink(latency_us=10.0).send(0, 0.0, 1.0, 0.5) == (0.5, pytest.approx(1.00001))


# ---- latency and goodput ----------------------------------------------------------------------------------------
def test_goodput_counts_the_requests_that_meet_both_slos_per_second_of_the_replay():
    times = RequestTimes()
    for rid, (first, last, tokens) in enumerate([(1.0, 2.0, 11),    # TTFT 1.0, TBT 0.1: meets both
                                                 (3.0, 4.0, 11),    # TTFT 3.0: too late
                                                 (1.0, 6.0, 11),    # TBT 0.5: too slow
                                                 (0.5, 0.5, 1)]):   # one token: its TTFT alone decides
        times.arrived(rid, 0.0)
        times.first_token(rid, first)
        times.finished(rid, last, tokens)
    times.arrived(4, 0.0)  # never ran
    slo = SLO(ttft_s=2.0, tbt_s=0.2)
    assert times.slo_met(slo) == 2 and times.span_s() == 6.0
    out = times.to_json(slo)
    assert out["goodput_rps"] == pytest.approx(2 / 6) and out["slo_met_fraction"] == pytest.approx(2 / 5)
    assert times.tbt() == {0: pytest.approx(0.1), 1: pytest.approx(0.1), 2: pytest.approx(0.5)}


def test_a_retracted_requests_first_token_stays_its_first():
    times = RequestTimes()
    times.arrived(0, 0.0)
    times.first_token(0, 1.0)
    times.first_token(0, 5.0)
    assert times.ttft().tolist() == [1.0]


def test_the_colocated_cluster_report_has_the_same_latency_figures():
    slo = SLO(ttft_s=1.0, tbt_s=0.1)
    out = replay_cluster(TRACE, config_for(TRACE), 2, "cache-aware", slo=slo).to_json()
    assert out["slo_met"] <= len(TRACE) and out["goodput_rps"] > 0
    assert {"ttft_p99_s", "tbt_p50_s", "tbt_p90_s", "tbt_p99_s", "slo_ttft_s"} <= out.keys()
    pd = replay_pd(TRACE, config_for(TRACE), 1, 1, slo=slo).to_json()
    assert {"goodput_rps", "slo_met", "tbt_p99_s", "kv_transfer_seconds", "busy_seconds"} <= pd.keys()
    assert pd["busy_seconds"]["prefill"] > 0 and pd["busy_seconds"]["decode"] > 0


# ---- bad input --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, kwargs, error, match", [
    ((0, 1), {}, ValueError, "prefill_replicas"),
    ((1, 0), {}, ValueError, "decode_replicas"),
    ((1, 1), {"prefill_router": "fastest"}, ValueError, r"unknown routing policy 'fastest' \(prefill_router\)"),
    ((1, 1), {"decode_router": "x"}, ValueError, r"\(decode_router\)"),
    ((1, 1), {"link": "fast"}, TypeError, "link"),
    ((1, 1), {"slo": (1, 2)}, TypeError, "slo"),
    ((1, 1), {"preallocate": "later"}, ValueError, "preallocate must be one of arrival, prefilled"),
])
def test_bad_arguments_are_refused_before_any_replica_is_built(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        PDReplay(TRACE, config_for(TRACE), *args, **kwargs)


@pytest.mark.parametrize("kwargs, match", [({"gbps": 0.0}, "kv_link_gbps"), ({"gbps": -1.0}, "kv_link_gbps"),
                                           ({"gbps": math.inf}, "kv_link_gbps"), ({"latency_us": -1.0}, "latency")])
def test_a_link_without_bandwidth_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KVLink(**kwargs)


def test_a_decode_pool_too_small_for_any_request_is_refused_with_the_sizes():
    with pytest.raises(ValueError, match=r"decode replicas' KV capacity \(128 tokens\) holds no request"):
        PDReplay(TRACE, config_for(TRACE, capacity=128), 1, 1)


def test_a_request_too_large_for_the_pools_is_rejected_whole_and_counted():
    requests = [TraceRequest(list(range(1, 60)), 4, 0.0), TraceRequest(list(range(1, 600)), 4, 1.0)]
    report = replay_pd(requests, ReplayConfig(capacity_tokens=256, max_context_len=1024), 1, 1,
                       slo=SLO(10.0, 10.0))
    assert report.rejected == 1 and report.requests == 1 and report.latency["slo_met"] == 1
    assert report.latency["slo_met_fraction"] == 0.5


@pytest.mark.parametrize("extra, match", [
    ({"host_capacity_tokens": 1024}, "host tier"),
    ({"eviction_policy": "belady"}, "belady"),
])
def test_tiers_and_the_oracle_are_not_modelled_and_are_refused(extra, match):
    with pytest.raises(ValueError, match=match):
        PDReplay(TRACE, config_for(TRACE, **extra), 1, 1)


# ---- the command line -------------------------------------------------------------------------------------------
def run_cli(capsys, *args):
    status = main(["--format", "synthetic-system", "--limit", "40", "--no-progress", *args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_the_cli_replays_a_pd_fleet_and_reports_transfer_latency_and_goodput(capsys, tmp_path):
    trace = tmp_path / "trace.jsonl"  # Mooncake lines a second apart, sharing their first 512-token block
    trace.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 1024, "output_length": 8,
                                         "hash_ids": [0, i + 1]}) + "\n" for i in range(20)))
    status = main([str(trace), "--no-progress", "--prefill-replicas", "1", "--decode-replicas", "2", "--page-size",
                   "16", "--slo-ttft-s", "2", "--slo-tbt-s", "0.1", "--engine", "native"])
    out, err = capsys.readouterr()
    assert status == 0
    report = json.loads(out)
    assert report["prefill_replicas"] == 1 and report["decode_replicas"] == 2 and report["requests"] == 20
    assert 0 < report["kv_transfer_bytes"] < report["kv_transfer_bytes_whole_prompts"]
    assert report["goodput_rps"] > 0 and report["kv_link_gbps"] == 400.0
    assert err.count("the Python engine replays the P:D fleet") == 1


def test_the_cli_sweeps_colocated_against_every_pd_split(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    status, out, err = run_cli(capsys, "--pd-sweep", "3", "--slo-ttft-s", "2", "--slo-tbt-s", "0.1",
                               "--plot", str(tmp_path), "--engine", "python")
    assert status == 0
    rows = json.loads(out)["pd_sweep"]
    assert [r["layout"] for r in rows] == ["colocated", "1P:2D", "2P:1D"]
    assert all("goodput_rps" in r for r in rows)
    assert "colocated vs P:D, 3 replicas" in err and (tmp_path / "goodput_vs_pd_ratio.png").stat().st_size > 0


@pytest.mark.parametrize("args, message", [
    (["--prefill-replicas", "0", "--decode-replicas", "1"], "argument --prefill-replicas: "),
    (["--prefill-replicas", "1"], "--decode-replicas is needed too"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--kv-link-gbps", "0"], "argument --kv-link-gbps: "),
    (["--kv-link-gbps", "100"], "--kv-link-gbps needs --prefill-replicas and --decode-replicas"),
    (["--no-decode-prefix-cache"], "--no-decode-prefix-cache needs --prefill-replicas"),
    (["--decode-preallocate", "prefilled"], "--decode-preallocate needs --prefill-replicas"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--replicas", "2"], "--replicas does not go with"),
    (["--pd-sweep", "4"], "give --slo-ttft-s and --slo-tbt-s"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--plot", "out"], "one P:D replay has no plot"),
    (["--pd-sweep", "1", "--slo-ttft-s", "1", "--slo-tbt-s", "1"], "at least 2 replicas"),
    (["--slo-ttft-s", "1"], "--slo-ttft-s and --slo-tbt-s go together"),
    (["--slo-ttft-s", "1", "--slo-tbt-s", "1"], "give --replicas, --prefill-replicas or --pd-sweep"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--prefill-router", "all"], "expected one routing policy"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--capacity-tokens", "64"], "holds no request"),
])
def test_the_cli_refuses_bad_pd_options_in_one_line_naming_the_option(capsys, args, message):
    status, out, err = run_cli(capsys, *args)
    assert status == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1


def test_a_colocated_cluster_with_slos_reports_goodput_from_the_python_engine_saying_so(capsys):
    status, out, err = run_cli(capsys, "--replicas", "2", "--slo-ttft-s", "2", "--slo-tbt-s", "0.1",
                               "--engine", "native", "--json-only")
    assert status == 0
    report = json.loads(out)
    assert report["goodput_rps"] > 0 and "tbt_p90_s" in report
    assert err.count("does not time requests (--slo-ttft-s) yet: the Python engine replays the cluster") == 1
