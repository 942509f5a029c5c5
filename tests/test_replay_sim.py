"""The simulator (ReplicaSim and its decode runs), the cost models and the report's time figures."""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem.eviction import EVICTION_POLICIES
from kvmem.replay.config import ReplayConfig
from kvmem.replay.cost import RooflineCost, StepCost, cost_model
from kvmem.replay.decode_runs import ReplayScheduler
from kvmem.replay.report import ReplayReport, format_summary
from kvmem.replay.simulator import ReplicaSim, replay
from kvmem.replay.synthetic import multi_turn_chat
from kvmem.replay.traces import TraceRequest, default_trace_path, read_trace

TIMINGS = ("cache_op_seconds", "replay_seconds", "cache_op_breakdown_s")


def report_without_timings(report: ReplayReport) -> dict:
    return {k: v for k, v in report.to_json().items() if k not in TIMINGS}


def samples(report: ReplayReport) -> tuple:
    return (list(report.time_s), list(report.tokens_used), list(report.evictable_tokens), list(report.running),
            list(report.ttft_s))


# ---- decode runs change nothing but the time taken ------------------------------------------------------------

@pytest.mark.parametrize("extra", [{}, {"page_size": 16}, {"host_capacity_tokens": 40000},
                                   {"gpu": "H100", "model": "llama-3-70b", "tp": 8}])
def test_a_replay_with_decode_runs_reports_what_stepping_one_by_one_reports(monkeypatch, extra):
    trace = read_trace(default_trace_path(), limit=40)
    config = ReplayConfig(capacity_tokens=20000, max_context_len=trace.max_context_len, **extra)
    fast = replay(trace, config)
    monkeypatch.setattr(ReplayScheduler, "pure_decode_steps", lambda self: 0)
    slow = replay(trace, config)
    assert report_without_timings(fast) == report_without_timings(slow)
    assert samples(fast) == samples(slow)
    assert fast.evicted_tokens > 0 and fast.requests > 0


def test_a_chat_replay_with_decode_runs_matches_too(monkeypatch):
    trace = multi_turn_chat(80, system_len=64, turns=(2, 4), user_len=(16, 64), output_len=(8, 64),
                            arrival_rate=20.0, seed=3)
    config = ReplayConfig(capacity_tokens=3000, max_context_len=trace.max_context_len, page_size=4, max_running=8)
    fast = replay(trace, config)
    monkeypatch.setattr(ReplayScheduler, "pure_decode_steps", lambda self: 0)
    assert samples(replay(trace, config)) == samples(fast) and fast.hit_rate > 0


@settings(max_examples=60, deadline=None)  # two small replays each; a busy machine is not a failure
@given(chat=st.tuples(st.integers(30, 120), st.sampled_from([1, 64, 300]), st.sampled_from([2.0, 20.0, 200.0]),
                      st.integers(0, 2**16)),
       room=st.sampled_from([1.2, 2, 4, 10]), page_size=st.sampled_from([1, 4, 16]),
       policy=st.sampled_from(tuple(EVICTION_POLICIES)), schedule=st.sampled_from(["lpm", "fcfs"]),
       max_running=st.sampled_from([4, 16, 256]), chunk=st.sampled_from([None, 64, 8192]),
       flags=st.tuples(st.booleans(), st.booleans(), st.booleans()), tp=st.sampled_from([None, 1, 8]),
       pin=st.sampled_from([0, 16]), host=st.booleans())
def test_decode_runs_report_what_stepping_reports_under_any_replay_configuration(
        chat, room, page_size, policy, schedule, max_running, chunk, flags, tp, pin, host):
    """Runs go on while requests wait, through evictions, pins and a host tier: every configuration the replay
    takes must come out as stepping one by one (the hand-picked cases above are a few of these)."""
    n, system_len, rate, seed = chat
    trace = multi_turn_chat(n, system_len=system_len, turns=(1, 5), user_len=(8, 200), output_len=(1, 120),
                            arrival_rate=rate, seed=seed)
    need = trace.max_context_len
    honour, decode_pages, in_batch = flags
    capacity = max(need + 64, int(need * room))
    config = ReplayConfig(
        capacity_tokens=capacity, max_context_len=need, page_size=page_size,
        eviction_policy=policy, schedule_policy=schedule, max_running=max_running, chunked_prefill_size=chunk,
        honour_arrivals=honour, cache_decode_pages=decode_pages, in_batch_prefix_caching=in_batch,
        pin_prefix_tokens=pin, host_capacity_tokens=capacity * 3 if host and policy != "belady" else None,
        **({} if tp is None else {"gpu": "H100", "model": "llama-3-8b", "tp": tp}))
    fast = replay(trace, config)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ReplayScheduler, "pure_decode_steps", lambda self: 0)
        slow = replay(trace, config)
    assert report_without_timings(fast) == report_without_timings(slow)
    assert samples(fast) == samples(slow)


def test_a_decode_run_at_page_1_evicts_at_the_steps_stepping_does():
    # The case the property test above found (CI, cbfbf78): a run ranked its window with walks and tails that did not
    # see the output pages the run itself wrote, so a step's ranking took a running request's page (splitting a leaf)
    # where the run did not.
    trace = multi_turn_chat(52, system_len=300, turns=(1, 5), user_len=(8, 200), output_len=(1, 120),
                            arrival_rate=2.0, seed=0)
    need = trace.max_context_len
    config = ReplayConfig(capacity_tokens=max(need + 64, int(need * 1.2)), max_context_len=need, page_size=1,
                          max_running=16, chunked_prefill_size=None, honour_arrivals=False)
    fast = replay(trace, config)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ReplayScheduler, "pure_decode_steps", lambda self: 0)
        slow = replay(trace, config)
    assert samples(fast) == samples(slow)


# ---- ReplicaSim ---------------------------------------------------------------------------------------------

def test_run_until_stops_at_the_first_step_that_would_start_at_or_after_the_time():
    sim = ReplicaSim(ReplayConfig(capacity_tokens=4096, max_context_len=512))
    sim.add_request("a", TraceRequest(list(range(1, 101)), output_len=50))
    sim.run_until(0.5)  # prefill (30 ms + 100 / 50k s), then 30 ms decode steps
    assert 0.5 <= sim.clock < 0.53 and not sim.is_idle()
    sim.run_until(math.inf)
    report = sim.close()
    assert sim.is_idle() and report.output_tokens == 50 and len(report.ttft_s) == 1
    assert report.ttft_s[0] == pytest.approx(0.032)


def test_each_admitted_request_gets_one_time_to_first_token_from_its_arrival():
    trace = read_trace(default_trace_path(), limit=30)
    report = replay(trace, ReplayConfig(capacity_tokens=60000, max_context_len=trace.max_context_len))
    assert len(report.ttft_s) == report.requests == 30 - report.rejected
    assert min(report.ttft_s) > 0.03  # at least one step
    p = report.ttft_percentiles()
    assert p["p50"] <= p["p90"] <= p["p99"] <= max(report.ttft_s)


def test_requests_that_never_fit_are_counted_and_named_only_ten_times(capsys):
    sim = ReplicaSim(ReplayConfig(capacity_tokens=64, max_context_len=512))
    for i in range(14):
        assert not sim.add_request(i, TraceRequest(list(range(1, 101)), output_len=2))
    report = sim.close()
    err = capsys.readouterr().err
    assert report.rejected == 14 and err.count("skipped: request") == 10 and "skipped 4 more" in err


# ---- the cost models in a replay (their own tests: test_replay_cost.py) ----------------------------------------

def test_a_roofline_replay_reports_gpu_seconds_saved_and_throughput():
    trace = read_trace(default_trace_path(), limit=40)
    config = ReplayConfig(capacity_tokens=400000, max_context_len=trace.max_context_len, gpu="H100",
                          model="llama-3-70b", tp=8, kv_bytes_per_token=327680)
    report = replay(trace, config)
    out = report.to_json()
    assert out["cost_model"] == "roofline: llama-3-70b on 8 x H100" and report.num_gpus == 8
    assert out["prefill_gpu_seconds_saved"] == pytest.approx(8 * out["prefill_seconds_saved"], rel=1e-5)
    assert out["prefill_seconds_saved"] > 0 and out["output_tokens_per_s"] > 0
    assert out["ttft_p50_s"] <= out["ttft_p90_s"] <= out["ttft_p99_s"]


# ---- the report -------------------------------------------------------------------------------------------------

def test_record_steps_samples_a_run_like_record_step_one_by_one():
    one, many = ReplayReport(100), ReplayReport(100)
    for r in (one, many):
        r.record_admission(10, 5)
    for t, u, e, n in [(0.1, 50, 10, 2), (0.2, 52, 8, 2)]:
        one.record_step(t, u, e, n)
    many.record_steps([0.1, 0.2], np.array([50, 52]), np.array([10, 8]), np.array([2, 2]))
    assert samples(one) == samples(many) and list(one.cumulative_hit_rate) == list(many.cumulative_hit_rate)


def a_report(capacity, host=None):
    r = ReplayReport(capacity, host_capacity_tokens=host, cost_model="fixed", requests=0)
    r.record_admission(1000, 250, 100 if host else 0)
    r.record_step(2.0, capacity // 2, 10, 1)
    r.ttft_s.extend([0.5, 1.0, 4.0])
    r.output_tokens = 300
    r.prefill_seconds_saved = 0.005
    return r


def test_the_summary_of_one_replay_lists_hit_rates_ttft_memory_and_evictions():
    text = format_summary([a_report(4096, host=16384)], "trace.jsonl: 1 requests")
    assert text.splitlines()[0] == "trace.jsonl: 1 requests"
    for fragment in ("hit rate                0.250 (device 0.150, host 0.100)", "TTFT p50 / p90 / p99",
                     "1 s / 3.4 s / 3.94 s", "peak 2.05k of 4.1k tokens", "150 output tokens/s", "host tier"):
        assert fragment in text


def test_the_summary_of_a_sweep_is_a_table_with_a_row_per_replay():
    lines = format_summary([a_report(4096), a_report(8192, host=16384)], "t").splitlines()
    assert lines[2].split()[:5] == ["capacity", "host", "hit", "rate", "device"]
    assert lines[3].split()[:3] == ["4.1k", "-", "0.250"] and lines[4].split()[:2] == ["8.19k", "16.4k"]
    assert len({len(line) for line in lines[2:]}) == 1  # aligned columns


def test_a_config_names_a_known_gpu_and_model():
    base = ReplayConfig(capacity_tokens=10, max_context_len=10)
    for field, value, match in (("gpu", "TPU", "gpu must be one of"), ("model", "x", "model must be one of"),
                                ("tp", 0, "tp"), ("cache_decode_pages", "no", "cache_decode_pages")):
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(base, **{field: value})


def test_the_summary_of_one_replay_reads_in_full():
    tiered = a_report(4096, host=16384)
    tiered.storage, tiered.num_gpus, tiered.prefill_seconds_saved = "file:/tmp/kv", 8, 12.5
    tiered.loaded_tokens, tiered.backed_up_tokens, tiered.transfer_seconds = 2500, 70000, 1.25
    tiered.evicted_tokens, tiered.retractions = 1234567, 3
    # TTFT over 0.5, 1 and 4 s: p90 = 1 + 0.8 x 3, p99 = 1 + 0.98 x 3; 300 outputs over 2 s; 2048 tokens used
    # at the one step, 10 of them evictable.
    assert format_summary([tiered], "T").splitlines() == [
        "T",
        "clock: fixed",
        "  hit rate                0.250 (device 0.150, host 0.100, storage 0.000)",
        "  prompt tokens cached    250 of 1k (1 requests, 0 rejected)",
        "  prefill time saved      12.5 s (100 GPU-s)",
        "  TTFT p50 / p90 / p99    1 s / 3.4 s / 3.94 s",
        "  throughput              150 output tokens/s over 2 s simulated",
        "  KV memory               peak 2.05k of 4.1k tokens, mean 2.05k, pinned by requests at most 2.04k",
        "  host tier               16.4k tokens; loaded 2.5k, backed up 70k, 1.2 s of copies",
        "  evicted                 1.23M tokens, 3 retractions"]
    plain = format_summary([a_report(4096)], "T").splitlines()
    assert plain[2:5] == ["  hit rate                0.250",
                          "  prompt tokens cached    250 of 1k (1 requests, 0 rejected)",
                          "  prefill time saved      0.0 s"]
    assert plain[-1] == "  evicted                 0 tokens, 0 retractions" and len(plain) == 9


@pytest.mark.parametrize("phase, parts", [("rank", 0.5), ("match", 0.5), ("prepare_extend", 0.0),
                                          ("prepare_decode", 0.0), ("process", 0.0), ("decode_run", 0.0)])
def test_any_timed_scheduler_call_leaves_the_rest_of_the_cache_time_to_batch_work(phase, parts):
    from kvmem.timing import PhaseTimer

    timer = PhaseTimer()
    timer.add(phase, 0.5)
    report = ReplayReport(100)
    report.cache_op_seconds = 2.0
    report.record_cache_phases(timer)
    assert report.cache_phases["batch"] == 2.0 - parts and report.cache_phases["match"] == parts


def test_the_cache_time_breakdown_splits_the_timed_phases_and_leaves_the_rest_to_batch_work():
    from kvmem.timing import PhaseTimer

    timer = PhaseTimer()
    for phase, seconds in (("rank", 0.5), ("match", 1.0), ("alloc", 0.25), ("evict", 0.125), ("cache", 2.0)):
        timer.add(phase, seconds)
    report = ReplayReport(100)
    report.cache_op_seconds = 10.0
    report.record_cache_phases(timer)
    assert report.cache_phases == {"match": 1.5, "alloc": 0.25, "evict": 0.125, "insert_release": 2.0,
                                   "batch": 10.0 - 3.875}
    report.cache_op_seconds = 1.0  # less than the parts (another clock): the rest is none, not negative
    report.record_cache_phases(timer)
    assert report.cache_phases["batch"] == 0.0
    idle = ReplayReport(100)
    idle.cache_op_seconds = 1.0
    idle.record_cache_phases(PhaseTimer())  # nothing ran through the scheduler's timed calls
    assert idle.cache_phases == {"match": 0.0, "alloc": 0.0, "evict": 0.0, "insert_release": 0.0, "batch": 0.0}


def test_the_summary_of_a_sweep_reads_in_full():
    reports = []
    for capacity, saved, ttft in ((4096, 12.5, 0.004), (999_999, 20.0, 5000.0)):
        r = a_report(capacity, host=16384)
        r.storage, r.num_gpus, r.prefill_seconds_saved = "file:/tmp/kv", 8, saved
        r.ttft_s[:] = type(r.ttft_s)("d", [ttft])
        r.evicted_tokens, r.retractions = capacity * 3, 1234
        reports.append(r)
    assert format_summary(reports, "T").splitlines() == [
        "T",
        "clock: fixed",
        "  capacity   host  hit rate  device   host  storage  TTFT p50     p90     p99  GPU-s saved  pinned peak"
        "  evicted  retractions",
        "      4.1k  16.4k     0.250   0.150  0.100    0.000      4 ms    4 ms    4 ms          100          50%"
        "    12.3k        1,234",
        "        1M  16.4k     0.250   0.150  0.100    0.000    1.39 h  1.39 h  1.39 h          160          50%"
        "       3M        1,234"]
    plain = [a_report(100), a_report(200)]
    plain[1].ttft_s, plain[1].prefill_seconds_saved = type(plain[1].ttft_s)("d"), 10.0
    lines = format_summary(plain, "T").splitlines()
    # No host tier in the table: no tier columns. Running requests held 40 of 100 and 90 of 200 slots at most.
    assert lines[2].split() == ["capacity", "hit", "rate", "TTFT", "p50", "p90", "p99", "s", "saved", "pinned", "peak",
                                "evicted", "retractions"]
    assert lines[4].split() == ["200", "0.250", "-", "-", "-", "10", "45%", "0", "0"]


@pytest.mark.parametrize("seconds, text", [(0.004, "4 ms"), (0.00999, "9.99 ms"), (0.01, "0.01 s"),
                                           (99.94, "99.9 s"), (100, "100 s"), (3599, "3,599 s"),
                                           (3600, "1.00 h"), (3618.36, "1.01 h"), (9000, "2.50 h")])
def test_times_in_the_summary_read_in_ms_s_or_hours(seconds, text):
    r = a_report(4096)
    r.ttft_s = type(r.ttft_s)("d", [seconds])
    assert f"TTFT p50 / p90 / p99    {text} / {text} / {text}" in format_summary([r], "T")


@pytest.mark.parametrize("tokens, text", [(0, "0"), (999, "999"), (999.5, "1k"), (1000, "1k"), (999_499, "999k"),
                                          (999_500, "1M"), (999_999, "1M"), (1_500_000, "1.5M"),
                                          (999_500_000, "1G"), (999_999_999, "1G"), (2_500_000_000, "2.5G"),
                                          (999_500_000_000, "1T"), (10**12, "1T"), (3 * 10**15, "3e+03T")])
def test_token_counts_in_the_summary_take_the_largest_unit_that_leaves_at_least_one(tokens, text):
    r = a_report(4096)
    r.evicted_tokens = tokens
    assert format_summary([r], "T").splitlines()[-1] == f"  evicted                 {text} tokens, 0 retractions"


def test_the_summary_of_a_replay_that_ran_nothing_has_no_rates():
    report = ReplayReport(64, cost_model="fixed")
    lines = format_summary([report], "T").splitlines()
    assert lines[5:7] == ["  TTFT p50 / p90 / p99    - / - / -",
                          "  throughput              0 output tokens/s over 0 ms simulated"]
    out = report.to_json()
    assert (out["output_tokens_per_s"], out["requests_per_s"], out["mean_tokens_used"], out["mean_running"],
            out["mean_evictable_tokens"]) == (0.0, 0.0, 0.0, 0.0, 0.0)
    empty = ReplayReport(0, cost_model="fixed")  # no KV capacity at all: no share of it to show
    assert format_summary([empty, empty], "T").splitlines()[3].split()[-4:] == ["0", "-", "0", "0"]


def test_the_json_report_rounds_times_to_the_microsecond():
    r = a_report(4096)
    r.ttft_s = type(r.ttft_s)("d", [0.1234567891])
    r.prefill_seconds_saved, r.num_gpus = 1.23456789, 8
    r.record_step(3.0, 100, 10, 1)
    r.output_tokens = 301
    r.cache_phases = {"match": 0.1234567891}
    out = r.to_json()
    assert out["ttft_p50_s"] == out["ttft_p99_s"] == out["ttft_mean_s"] == 0.123457
    assert out["prefill_seconds_saved"] == 1.234568 and out["prefill_gpu_seconds_saved"] == 9.876543
    assert out["simulated_seconds"] == 3.0 and out["output_tokens_per_s"] == 100.333
    assert out["requests_per_s"] == 0.333333 and out["cache_op_breakdown_s"] == {"match": 0.123457}
    r.record_step(3.1234567, 100, 10, 0)
    out = r.to_json()
    assert out["simulated_seconds"] == 3.123457 and out["mean_running"] == 0.67  # 2 / 3, to two places


def test_record_steps_takes_samples_of_any_integer_dtype():
    one, many = ReplayReport(100), ReplayReport(100)
    for t, u, e, n in [(0.1, 50, 10, 2), (0.2, 52, 8, 1)]:
        one.record_step(t, u, e, n)
    many.record_steps([0.1, 0.2], np.array([50, 52], np.int32), np.array([10, 8], np.int16),
                      np.array([2, 1], np.uint8))
    assert samples(one) == samples(many)


def test_copies_between_tiers_are_priced_in_bytes_over_gigabytes_per_second():
    from types import SimpleNamespace as NS

    stats = NS(loaded_tokens=10**9, backed_up_tokens=4 * 10**9, host_evicted_tokens=7)
    link = NS(stats=NS(prefetched_tokens=3 * 10**9, stored_tokens=5 * 10**9),
              storage=NS(stats=NS(corrupt=1, failed_ops=2)))
    config = NS(host_links_gbps=(1.0, 2.0), storage_gbps=4.0, token_kv_bytes=2, storage="file:/x", gpu=None,
                model=None, tp=1)
    report = ReplayReport(100, host_capacity_tokens=10)
    report.record_tiers(NS(stats=stats, storage_link=None), config)
    assert report.transfer_seconds == 2 * (1.0 + 2.0) and report.storage is None
    report.record_tiers(NS(stats=stats, storage_link=link), config)
    assert report.transfer_seconds == 2 * (1.0 + 2.0 + 2.0)
    # On 16 GPUs each has its own host link, and llama-3-8b's 8 KV heads are kept twice: as the clock prices loads.
    report.record_tiers(NS(stats=stats, storage_link=link), NS(**{**vars(config), "gpu": "H100",
                                                                 "model": "llama-3-8b", "tp": 16}))
    assert report.transfer_seconds == pytest.approx(2 * 2 * ((1.0 + 2.0) / 16 + 2.0))
    assert (report.storage, report.prefetched_tokens, report.stored_tokens, report.storage_misses_corrupt,
            report.storage_failed_ops, report.host_evicted_tokens) == ("file:/x", 3 * 10**9, 5 * 10**9, 1, 2, 7)


# ---- ReplicaSim: what a step returns, what the cost model is told ------------------------------------------------

class RecordingCost(StepCost):
    """The fixed clock at exact binary step times, recording what each extend step loaded from the lower tiers."""

    def __init__(self) -> None:
        super().__init__(decode_step_s=0.25, prefill_tokens_per_s=256.0)
        self.loads: list[tuple[int, int]] = []

    def extend_seconds(self, prefix_lens, seq_lens, loaded_tokens=0, storage_tokens=0):
        self.loads.append((loaded_tokens, storage_tokens))
        return super().extend_seconds(prefix_lens, seq_lens)


def test_a_step_returns_the_requests_it_finished_and_those_it_finished_prefilling():
    sim = ReplicaSim(ReplayConfig(capacity_tokens=4096, max_context_len=512, chunked_prefill_size=96))
    assert sim.add_request("one", TraceRequest(list(range(1, 33)), output_len=1))
    assert sim.add_request("two", TraceRequest(list(range(100, 140)), output_len=3))
    assert sim.add_request("long", TraceRequest(list(range(200, 300)), output_len=2))
    first = sim.step()  # 32 + 40 tokens, then 24 of the long prompt's 100: a chunk
    assert [r.rid for r in first.finished] == ["one"] and [r.rid for r in first.prefilled] == ["one", "two"]
    second = sim.step()  # the rest of the long prompt
    assert second.finished == [] and [r.rid for r in second.prefilled] == ["long"]
    third = sim.step()  # a run of pure decode steps: "long" finishes after one, "two" goes on
    assert [r.rid for r in third.finished] == ["long"] and third.prefilled == []
    sim.run_until(math.inf)
    assert sim.is_idle() and sim.step() == ([], [])


def test_a_single_decode_step_prefilled_nothing(monkeypatch):
    monkeypatch.setattr(ReplayScheduler, "pure_decode_steps", lambda self: 0)  # every decode step on its own
    sim = ReplicaSim(ReplayConfig(capacity_tokens=4096, max_context_len=512))
    sim.add_request("a", TraceRequest(list(range(1, 33)), output_len=3))
    assert [r.rid for r in sim.step().prefilled] == ["a"]
    assert sim.step() == ([], [])
    last = sim.step()
    assert [r.rid for r in last.finished] == ["a"] and last.prefilled == []


def test_one_step_takes_a_whole_run_of_decode_steps_and_run_until_none_starting_at_the_time():
    sim = ReplicaSim(ReplayConfig(capacity_tokens=4096, max_context_len=512), RecordingCost())
    sim.add_request(0, TraceRequest(list(range(1, 65)), output_len=20))
    sim.step()  # 0.25 s + 64 tokens at 256/s
    assert sim.clock == 0.5
    sim.run_until(1.5)  # decode steps start at 0.5, 0.75, 1.0 and 1.25: not at 1.5
    assert sim.clock == 1.5
    outcome = sim.step()  # the 15 steps left at once
    assert sim.clock == 1.5 + 15 * 0.25 and [r.rid for r in outcome.finished] == [0]
    report = sim.close()
    assert list(report.ttft_s) == [0.5] and report.output_tokens == 20


def test_a_runs_steps_after_its_first_end_by_the_time_given():
    # A run's KV events are published when it ends: a cluster's router, reading them at the next arrival, must
    # see every step that ended by then, as it would from an engine publishing each step.
    sim = ReplicaSim(ReplayConfig(capacity_tokens=4096, max_context_len=512), RecordingCost())
    sim.add_request(0, TraceRequest(list(range(1, 65)), output_len=20))
    sim.step()
    assert sim.clock == 0.5
    sim.step(until=1.1)  # steps end at 0.75, 1.0; the one ending at 1.25 would pass 1.1
    assert sim.clock == 1.0
    sim.step(until=1.1)  # the first step of a run is taken whatever its end
    assert sim.clock == 1.25


def test_a_request_arriving_during_a_step_waits_from_its_arrival():
    # B arrives at 0.1 s while A's long prefill runs until 0.5 s: its time to first token counts from 0.1 s.
    trace = [TraceRequest(list(range(1, 65)), output_len=1, arrival_s=0.0),
             TraceRequest(list(range(100, 164)), output_len=1, arrival_s=0.1)]
    report = replay(trace, ReplayConfig(capacity_tokens=4096, max_context_len=512), cost=RecordingCost())
    assert list(report.ttft_s) == [0.5, 0.9]  # B's prefill runs from 0.5 to 1.0
    sim = ReplicaSim(ReplayConfig(capacity_tokens=4096, max_context_len=512))
    with pytest.raises(ValueError, match="arrival 1.0 is after the replica's clock 0.0"):
        sim.add_request("a", trace[0], 1.0)


def test_a_config_naming_a_model_and_gpu_prices_with_their_bytes_and_link():
    config = ReplayConfig(capacity_tokens=4096, max_context_len=512, gpu="A100", model="llama-3-70b", tp=8)
    assert (config.token_kv_bytes, config.host_links_gbps) == (327680, (25.0, 25.0))
    preset = RooflineCost("A100", "llama-3-70b", tp=8)
    assert cost_model(config).decode_seconds(64, 10**6) == preset.decode_seconds(64, 10**6)
    plain = ReplayConfig(capacity_tokens=4096, max_context_len=512, h2d_gbps=12.5)
    assert (plain.token_kv_bytes, plain.host_links_gbps) == (131072, (12.5, 12.5))
    # Derived, not stored: another model or GPU by dataclasses.replace derives them again.
    other = dataclasses.replace(config, model="llama-3-8b", gpu="H100")
    assert (other.token_kv_bytes, other.host_links_gbps) == (131072, (50.0, 50.0))
    assert dataclasses.replace(plain, h2d_gbps=40.0).host_links_gbps == (40.0, 40.0)


def test_throughput_is_over_the_time_from_the_first_arrival():
    # A trace of epoch timestamps: its clock starts at 1.7e9 s, and nothing was served before.
    trace = [TraceRequest(list(range(first, first + 64)), output_len=4, arrival_s=t)
             for first, t in ((1, 0.0), (100, 2.0))]
    late = [TraceRequest(r.input_ids, output_len=4, arrival_s=r.arrival_s + 1.7e9) for r in trace]
    config = ReplayConfig(capacity_tokens=4096, max_context_len=512)
    early, shifted = (replay(t, config, cost=RecordingCost()).to_json() for t in (trace, late))
    assert early["simulated_seconds"] == shifted["simulated_seconds"] == 2.0 + 0.5 + 3 * 0.25
    assert early["output_tokens_per_s"] == shifted["output_tokens_per_s"] == pytest.approx(8 / 3.25, abs=1e-3)


def test_times_to_first_token_count_from_each_arrival():
    sim = ReplicaSim(ReplayConfig(capacity_tokens=4096, max_context_len=512), RecordingCost())
    sim.add_request("a", TraceRequest(list(range(1, 65)), output_len=2))
    sim.run_until(1.0)
    sim.add_request("b", TraceRequest(list(range(100, 164)), output_len=3))
    sim.run_until(math.inf)
    report = sim.close()
    assert list(report.ttft_s) == [0.5, 0.5] and report.output_tokens == 5 and report.requests == 2


def test_the_cost_model_is_told_what_each_prefill_loads_from_the_host_and_from_storage(tmp_path):
    trace = multi_turn_chat(60, system_len=64, turns=(2, 3), user_len=(16, 32), output_len=(4, 8), seed=1)
    config = ReplayConfig(capacity_tokens=512, max_context_len=trace.max_context_len, page_size=4,
                          host_capacity_tokens=1024, storage=f"file:{tmp_path}", honour_arrivals=False,
                          max_running=8)
    replay(trace, config)  # fills the store
    cost = RecordingCost()
    report = replay(trace, config, cost=cost)
    loads = np.array(cost.loads)
    assert report.retractions == 0 and (loads[:, 0] > 0).sum() >= 2
    assert int(loads[:, 0].sum()) == report.host_cached_tokens + report.storage_cached_tokens
    assert int(loads[:, 1].sum()) == report.storage_cached_tokens > 0


def test_requests_arriving_together_are_served_in_trace_order(monkeypatch):
    requests = [TraceRequest(list(range(10 * i + 1, 10 * i + 9)), output_len=1, arrival_s=float(i % 2 == 0))
                for i in range(40)]
    sim_order, original = [], ReplicaSim.add_request

    def spy(self, rid, request, arrival=None):
        sim_order.append(rid)
        return original(self, rid, request, arrival)

    monkeypatch.setattr(ReplicaSim, "add_request", spy)
    report = replay(requests, ReplayConfig(capacity_tokens=4096, max_context_len=64), cost=RecordingCost())
    assert sim_order == list(range(1, 40, 2)) + list(range(0, 40, 2)) and report.requests == 40
    assert max(report.ttft_s) < 1.0  # the odd ones arrive at 0 and the even at 1 s: each served on arrival


def test_a_named_replica_names_itself_in_its_notes(capsys):
    for name, start in (("r1", "kvmem-replay: r1: skipped"), ("", "kvmem-replay: skipped"),
                        (None, "kvmem-replay: skipped")):
        named = {} if name is None else {"name": name}
        sim = ReplicaSim(ReplayConfig(capacity_tokens=64, max_context_len=512), **named)
        for i in range(11):
            sim.add_request(i, TraceRequest(list(range(1, 101)), output_len=2))
        sim.close()
        err = capsys.readouterr().err.splitlines()
        assert err[0].startswith(start) and len(err) == 11 and err[-1].endswith("skipped 1 more requests that "
                                                                                 "can never run here")
    sim = ReplicaSim(ReplayConfig(capacity_tokens=64, max_context_len=512))
    for i in range(10):
        sim.add_request(i, TraceRequest(list(range(1, 101)), output_len=2))
    sim.close()
    assert len(capsys.readouterr().err.splitlines()) == 10  # ten named, none left to count


def test_a_replica_builds_its_scheduler_from_its_config_and_reports_events_and_wall_time():
    import time

    events = []
    config = ReplayConfig(capacity_tokens=4096, max_context_len=512, max_running=3, schedule_policy="fcfs",
                          chunked_prefill_size=64, cache_decode_pages=False, in_batch_prefix_caching=True)
    t0 = time.perf_counter()
    sim = ReplicaSim(config, event_sink=events.append)
    sched = sim.sched
    assert (sched.max_running, sched.config.schedule_policy, sched.config.chunked_prefill_size,
            sched.config.cache_decode_pages, sched.config.in_batch_prefix_caching) == (3, "fcfs", 64, False, True)
    sim.add_request(0, TraceRequest(list(range(1, 101)), output_len=2))
    sim.run_until(math.inf)
    report = sim.close()
    assert events and 0 < report.replay_seconds <= time.perf_counter() - t0
    assert report.cache_phases["match"] > 0  # the scheduler ran with the replica's timer

def test_a_tiered_replica_builds_its_tiers_from_its_config(tmp_path):
    events = []
    config = ReplayConfig(capacity_tokens=4096, max_context_len=512, page_size=4, host_capacity_tokens=8192,
                          write_policy="write_back", eviction_policy="lfu", pin_budget=0.5,
                          storage=f"file:{tmp_path}")
    sim = ReplicaSim(config, event_sink=events.append)
    tree = sim.sched.tree_cache
    assert (tree.host_pool.size, tree.page_size, tree.write_policy, tree.eviction_policy, tree._pin_budget) == \
        (8192, 4, "write_back", "lfu", 2048)
    assert tree.storage_link.prefetch_policy == "wait_complete"
    sim.add_request(0, TraceRequest(list(range(1, 101)), output_len=2))
    sim.run_until(math.inf)
    assert events and sim.close().storage == f"file:{tmp_path}"


def test_a_stalled_scheduler_is_an_error_not_a_silent_end(monkeypatch):
    sim = ReplicaSim(ReplayConfig(capacity_tokens=4096, max_context_len=512))
    sim.add_request(0, TraceRequest(list(range(1, 33)), output_len=2))
    monkeypatch.setattr(sim.sched, "step", lambda: None)
    with pytest.raises(RuntimeError) as stalled:
        sim.step()
    assert str(stalled.value) == "scheduler stalled: requests wait but none can be admitted"


def test_the_cost_model_is_told_every_token_loaded_back_readmissions_after_a_retraction_included():
    # Some prompts that load from the host are also prefilled in chunks: their load is told once, with the first.
    trace = multi_turn_chat(40, system_len=64, turns=(3, 5), user_len=(16, 32), output_len=(16, 64), seed=1)
    config = ReplayConfig(capacity_tokens=480, max_context_len=trace.max_context_len, page_size=4,
                          host_capacity_tokens=2048, honour_arrivals=False, max_running=8, chunked_prefill_size=16)
    cost = RecordingCost()
    report = replay(trace, config, cost=cost)
    told = int(np.array(cost.loads)[:, 0].sum())
    assert report.retractions > 0 and told == report.loaded_tokens > report.host_cached_tokens


def test_a_replica_opens_its_store_with_the_configured_metadata_server_and_size(monkeypatch, tmp_path):
    import kvmem.replay.simulator as simulator
    from kvmem.storage.page_format import CHECKSUM_BYTES, HEADER_BYTES

    opened, real = [], simulator.open_store

    def spy(spec, **kwargs):
        opened.append((spec, kwargs))
        return real(spec, **kwargs)

    monkeypatch.setattr(simulator, "open_store", spy)
    page = HEADER_BYTES + CHECKSUM_BYTES  # a replay's stored page is its header: slots, not KV bytes
    for capacity, size in ((None, None), (4000, 1000 * page), (3, page)):  # at least one page
        ReplicaSim(ReplayConfig(capacity_tokens=4096, max_context_len=512, page_size=4, host_capacity_tokens=8192,
                                storage=f"file:{tmp_path}", storage_metadata="http://127.0.0.1:1/metadata",
                                storage_capacity_tokens=capacity))
        assert opened.pop() == (f"file:{tmp_path}", {"metadata_server": "http://127.0.0.1:1/metadata",
                                                      "capacity_bytes": size})
