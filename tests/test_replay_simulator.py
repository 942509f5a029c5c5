"""The real replay on small handmade traces, whose hit rate, evictions, steps and clock are worked out by hand.

Every trace here gives its requests explicit output ids and (unless a test says otherwise) arrivals far apart,
so that each request runs alone and the tree's contents at each admission can be followed on paper. The cost
model is the default StepCost: a step costs 0.03 s plus 1 / 50,000 s per prefilled token.
"""

import pytest

from kvmem.eviction import KeyedPolicy
from kvmem.eviction.base import fifo
from kvmem.replay.config import ReplayConfig
from kvmem.replay.simulator import StepCost, build_scheduler, replay
from kvmem.replay.traces import TraceRequest

STEP_S, PREFILL_S = 0.03, 1 / 50_000
A = [1, 2, 3, 4, 5, 6, 7, 8]


def request(prompt, outputs, arrival_s=0.0):
    return TraceRequest(prompt, len(outputs), arrival_s, outputs)


def config(capacity, **kwargs):
    return ReplayConfig(**{"capacity_tokens": capacity, "max_context_len": 64, "schedule_policy": "fcfs",
                           "chunked_prefill_size": None, **kwargs})


def three_requests():
    """r0: A, two outputs; r1 shares A's first four tokens; r2 is A again (already wholly cached)."""
    return [request(A, [100, 101], 0.0), request([1, 2, 3, 4, 9, 10], [102], 10.0), request(A, [103], 20.0)]


def test_a_replay_counts_each_cached_prefix_once_and_samples_every_step():
    # r0 finds nothing, prefills 8 tokens, decodes once and caches A + its first output (9 tokens).
    # r1 finds [1, 2, 3, 4] and prefills 2. r2 is A again: its last token is always computed, so 7 of its 8
    # tokens are cached and it prefills 1. Hit rate (0 + 4 + 7) / (8 + 6 + 8) = 11 / 22.
    report = replay(three_requests(), config(64))
    summary = report.to_json()
    assert (summary["requests"], summary["prompt_tokens"], summary["cached_tokens"]) == (3, 22, 11)
    assert summary["hit_rate"] == 0.5 and summary["evicted_tokens"] == 0 and summary["retractions"] == 0
    assert summary["steps"] == 4 and summary["rejected"] == 0
    assert list(report.time_s) == pytest.approx([STEP_S + 8 * PREFILL_S, 2 * STEP_S + 8 * PREFILL_S,
                                                 10 + STEP_S + 2 * PREFILL_S, 20 + STEP_S + PREFILL_S])
    # Slots in use: r0's 8 prompt slots (locked), + its decode slot, + r1's 2 new ones; r2's duplicate slot
    # of token 8 goes back at once. Evictable: what no running request locks.
    assert list(report.tokens_used) == [8, 9, 11, 11]
    assert list(report.evictable_tokens) == [0, 9, 11, 11]
    assert list(report.running) == [1, 0, 0, 0]
    assert list(report.cumulative_hit_rate) == pytest.approx([0, 0, 4 / 14, 0.5])
    assert (report.peak_tokens_used, report.mean_tokens_used, report.peak_pinned_tokens) == (11, 9.75, 8)
    assert summary["mean_tokens_used"] == 9.8  # rounded to a tenth
    assert (summary["mean_evictable_tokens"], summary["mean_running"]) == (7.8, 0.25)  # 31 / 4 rounded; 1 / 4


def test_a_prompt_sent_twice_is_served_from_the_cache_the_second_time():
    report = replay([request(A, [100], 0.0), request(A, [100], 1.0)], config(64))
    assert (report.prompt_tokens, report.cached_tokens, len(report.time_s)) == (16, 7, 2)
    assert report.time_s[1] == pytest.approx(1 + STEP_S + PREFILL_S)  # one token prefilled, not eight


def test_a_wholly_cached_page_aligned_prompt_keeps_its_last_page_to_compute():
    # Page size 4: A is two whole pages. The second time only its first page can be a hit (the last token is
    # always computed, and the match is cut to whole pages).
    report = replay([request(A, [100], 0.0), request(A, [100], 1.0)], config(64, page_size=4))
    assert (report.prompt_tokens, report.cached_tokens) == (16, 4)
    assert report.time_s[1] == pytest.approx(1 + STEP_S + 4 * PREFILL_S)


def test_a_small_cache_evicts_what_the_next_request_needs_and_loses_the_hit():
    # Capacity 16: A (8 tokens, r0) is cached; r1 needs 10 slots with 8 free, so A's node (one 8-token leaf)
    # goes; r2 (A again) then finds nothing and r1's 10-token leaf goes for it. With room for all, r2 hits 7.
    trace = [request(A, [100], 0.0), request(list(range(20, 30)), [101], 1.0), request(A, [102], 2.0)]
    report = replay(trace, config(16))
    small = report.to_json()
    assert (small["cached_tokens"], small["evicted_tokens"], small["steps"]) == (0, 18, 3)
    assert list(report.tokens_used) == list(report.evictable_tokens) == [8, 10, 8]
    large = replay(trace, config(64)).to_json()
    assert (large["cached_tokens"], large["evicted_tokens"], large["steps"]) == (7, 0, 3)
    assert large["hit_rate"] == round(7 / 26, 6)


@pytest.mark.parametrize("cache_decode_pages, evicted", [(False, 5), (True, 4 + 5)])
def test_a_retracted_request_counts_once_with_its_first_admission(cache_decode_pages, evicted):
    # Capacity 16, both at time 0: two 4-token prompts with 6 outputs each are admitted together (8 slots),
    # decode four steps (16 slots), and the fifth decode finds no slot: r0 (first among equals) is retracted.
    # Without cache_decode_pages its 4 decoded slots are freed and r1 takes one; with it they stay cached as a
    # 4-token leaf under r0's prompt, which r1's decode then evicts. r1 finishes and caches its 5 decoded tokens
    # under its prompt; r0 comes back with 4 prompt + 5 output tokens, finds its prompt (4), evicts r1's 5-token
    # leaf (its only evictable leaf) to compute 5 with 3 slots free, and finishes. Its second admission's 4-token
    # hit is not counted: the hit rate stays 0 / 8.
    trace = [request([1, 2, 3, 4], list(range(100, 106))), request([5, 6, 7, 8], list(range(200, 206)))]
    report = replay(trace, config(16, honour_arrivals=False, cache_decode_pages=cache_decode_pages))
    summary = report.to_json()
    assert (summary["requests"], summary["prompt_tokens"], summary["cached_tokens"]) == (2, 8, 0)
    assert (summary["retractions"], summary["evicted_tokens"], summary["steps"]) == (1, evicted, 7)
    assert list(report.running) == [2, 2, 2, 2, 2, 0, 0]
    assert report.time_s[-1] == pytest.approx(7 * STEP_S + (8 + 5) * PREFILL_S)


def test_a_host_tier_keeps_what_the_device_evicts_and_loads_it_back():
    # Device 40, host 80, write-through. A (20 tokens) is cached and copied to the host; B (30) needs 30 slots
    # with 20 free, so A leaves the device (20 evicted) but stays on the host. A again matches 19 tokens on the
    # host only (>= the 16-token load-back threshold): B (30, its only device leaf) is evicted to make room,
    # 19 tokens are loaded back, and the last token computed revives A's host-only tail on the device.
    a, b = list(range(1, 21)), list(range(101, 131))
    trace = [request(a, [100], 0.0), request(b, [101], 1.0), request(a, [102], 2.0)]
    report = replay(trace, config(40, host_capacity_tokens=80))
    summary = report.to_json()
    assert (summary["prompt_tokens"], summary["cached_tokens"], summary["evicted_tokens"]) == (70, 19, 50)
    assert (summary["device_hit_rate"], summary["host_hit_rate"]) == (0.0, round(19 / 70, 6))
    assert (summary["loaded_tokens"], summary["backed_up_tokens"], summary["host_evicted_tokens"]) == (19, 50, 0)
    assert summary["host_capacity_tokens"] == 80 and "storage" not in summary
    # Llama-3-8B's 131,072 bytes a token over 50 GB/s each way: (19 + 50) tokens moved.
    assert summary["transfer_seconds"] == round(131072 * 69 / 50e9, 6)
    assert list(report.tokens_used) == list(report.evictable_tokens) == [20, 30, 20]
    assert replay(trace, config(40)).to_json()["cached_tokens"] == 0  # without the host tier: no hit


def test_arrivals_are_honoured_or_ignored_as_configured():
    # Queued at once, r2 is admitted with r0 and r1 in the first batch, before anything is cached.
    report = replay(three_requests(), config(64, honour_arrivals=False))
    assert (report.cached_tokens, len(report.time_s)) == (0, 2)
    assert report.time_s[-1] == pytest.approx(2 * STEP_S + 22 * PREFILL_S)


def test_an_idle_server_waits_for_the_next_arrival_in_arrival_order():
    # Listed out of order: the replay admits by arrival time, so the shorter prompt (arriving first) runs
    # first and A then finds its 5 tokens cached.
    trace = [request(A, [100], 5.0), request([1, 2, 3, 4, 5], [101], 2.0)]
    report = replay(trace, config(64))
    assert (report.cached_tokens, report.prompt_tokens) == (5, 13)
    assert list(report.time_s) == pytest.approx([2 + STEP_S + 5 * PREFILL_S, 5 + STEP_S + 3 * PREFILL_S])


def test_the_cost_model_sets_the_clock():
    cost = StepCost(decode_step_s=1.0, prefill_tokens_per_s=4.0)
    report = replay([request(A, [100, 101])], config(64), cost=cost)
    assert list(report.time_s) == [1.0 + 8 / 4.0, 2.0 + 8 / 4.0]
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        StepCost(prefill_tokens_per_s=0)


def test_a_request_that_can_never_run_is_rejected_and_the_replay_goes_on(capsys):
    trace = [request(list(range(1, 40)), [100]), request(A, [101], 1.0)]
    report = replay(trace, config(16))
    assert (report.rejected, report.requests, report.prompt_tokens) == (1, 1, 8)
    assert "request 0" in capsys.readouterr().err


def test_a_chunked_prompt_counts_the_match_before_its_first_chunk():
    # Chunks of 3: r1 (A again) matches 7 tokens and computes 1; r0 took ceil(8 / 3) = 3 extend steps.
    report = replay([request(A, [100], 0.0), request(A, [101], 1.0)], config(64, chunked_prefill_size=3))
    assert (report.prompt_tokens, report.cached_tokens, len(report.time_s)) == (16, 7, 4)


def test_the_scheduler_a_replay_builds_follows_the_config():
    sched = build_scheduler(config(100, page_size=8, max_running=3, schedule_policy="lpm", chunked_prefill_size=5))
    assert sched.token_allocator.size == 96 and sched.page_size == 8 and sched.max_running == 3
    assert sched.config.schedule_policy == "lpm" and sched.config.chunked_prefill_size == 5
    assert sched.req_to_token_pool.max_context_len == 64


def test_a_trace_object_replays_as_the_list_of_its_requests():
    # A Trace hands its arrival times over as one array; a list of TraceRequest holds them request by request.
    from kvmem.replay.synthetic import multi_turn_chat

    trace = multi_turn_chat(30, system_len=32, turns=(2, 3), user_len=(4, 8), output_len=(2, 4),
                            arrival_rate=50.0, seed=2)
    cfg = config(512, max_context_len=trace.max_context_len, schedule_policy="lpm")
    a, b = replay(trace, cfg).to_json(), replay(list(trace), cfg).to_json()
    for report in (a, b):
        for wall_clock in ("cache_op_seconds", "replay_seconds", "cache_op_breakdown_s"):
            report.pop(wall_clock)
    assert a == b and a["cached_tokens"] > 0


def test_progress_goes_to_a_bar_on_stderr_only_when_asked_and_changes_nothing(capsys):
    quiet = replay(three_requests(), config(64)).to_json()
    assert capsys.readouterr().err == ""
    # A request that can never run still advances the bar: 4 requests, 4 done.
    loud = replay([request(list(range(1, 80)), [1])] + three_requests(), config(64), progress=True).to_json()
    err = capsys.readouterr().err
    assert "4/4" in err and "req/s]" in err and "5/4" not in err
    for report in (quiet, loud):
        for wall_clock in ("cache_op_seconds", "replay_seconds", "cache_op_breakdown_s"):
            report.pop(wall_clock)
    quiet["rejected"] = 1
    assert quiet == loud


def test_requests_arriving_together_keep_their_trace_order():
    # 40 prompts of 1..40 tokens, all arriving at 1 s, one at a time: each step's clock advance says which ran.
    trace = [request(list(range(100 * i, 100 * i + i + 1)), [7], 1.0) for i in range(40)]
    report = replay(trace, config(64, max_running=1))
    steps = [b - a for a, b in zip([1.0] + list(report.time_s), report.time_s)]
    assert steps == pytest.approx([STEP_S + (i + 1) * PREFILL_S for i in range(40)])


def test_the_eviction_policy_of_the_config_is_the_tree_s():
    # Capacity 20: A, B, then A again (a hit that makes A recent), then C needs 4 more slots and A again. LRU evicts
    # B (8) for C and A hits; FIFO evicts A (inserted first, 8) for C, so A misses and B (8) goes for it.
    b, c = list(range(20, 28)), list(range(40, 48))
    trace = [request(A, [1], 0.0), request(b, [1], 1.0), request(A, [1], 2.0), request(c, [1], 3.0),
             request(A, [1], 4.0)]
    lru, fifo = (replay(trace, config(20, eviction_policy=p)).to_json() for p in ("lru", "fifo"))
    assert (lru["cached_tokens"], lru["evicted_tokens"]) == (14, 8)
    assert (fifo["cached_tokens"], fifo["evicted_tokens"]) == (7, 16)


def test_policy_objects_handed_to_a_replay_replace_the_configured_policy():
    # The trace above: a fifo object under an lru config replays as the fifo config does.
    b, c = list(range(20, 28)), list(range(40, 48))
    trace = [request(A, [1], 0.0), request(b, [1], 1.0), request(A, [1], 2.0), request(c, [1], 3.0),
             request(A, [1], 4.0)]
    handed = replay(trace, config(20), policies={"eviction_policy": KeyedPolicy(fifo)}).to_json()
    named = replay(trace, config(20, eviction_policy="fifo")).to_json()
    assert (handed["cached_tokens"], handed["evicted_tokens"]) == (named["cached_tokens"], named["evicted_tokens"])
    assert (handed["cached_tokens"], handed["evicted_tokens"]) == (7, 16)


def test_a_device_hit_under_a_host_tier_is_reported_as_such():
    # B shares A's first 5 tokens, still on the device: 5 of 15 prompt tokens, all of them device hits.
    trace = [request(A, [1], 0.0), request([1, 2, 3, 4, 5, 30, 31], [1], 1.0)]
    summary = replay(trace, config(40, host_capacity_tokens=80)).to_json()
    assert (summary["device_hit_rate"], summary["host_hit_rate"]) == (0.333333, 0.0)


def test_a_replay_at_page_size_2_with_a_host_tier_reports_the_host_in_tokens():
    report = replay([request(A, [1], 0.0), request(A, [1], 1.0)], config(16, page_size=2, host_capacity_tokens=33))
    summary = report.to_json()
    assert summary["host_capacity_tokens"] == 32 and summary["cached_tokens"] == 6  # 7 tokens, cut to 3 pages


def test_a_rejected_request_does_not_hold_back_those_arriving_with_it():
    trace = [request(A, [1]), request(list(range(1, 80)), [1]), request([9, 8, 7], [1])]
    report = replay(trace, config(64, honour_arrivals=False))
    assert (report.rejected, report.requests, len(report.time_s)) == (1, 2, 1)  # both served in one step


def test_rejections_are_counted_one_by_one():
    report = replay([request(list(range(1, 80)), [1]), request(list(range(1, 90)), [1]), request(A, [1])],
                    config(64))
    assert (report.rejected, report.requests) == (2, 1)


def test_the_replay_times_its_cache_calls_and_itself_with_the_clock(monkeypatch):
    # A clock that ticks once a reading: each timed cache call takes 1 s, the replay all readings. Each of the
    # four steps first asks pure_decode_steps (one call); three extend steps time two calls more each (step,
    # process_batch_result), and r0's one decode step runs as a decode run (one call). 11 calls, 22 readings
    # between the replay's first and last: 23 s.
    import kvmem.replay.simulator as simulator

    ticks = iter(range(1000))
    monkeypatch.setattr(simulator.time, "perf_counter", lambda: next(ticks) * 1.0000001)
    report = replay(three_requests(), config(64))
    assert (report.cache_op_seconds, report.replay_seconds) == pytest.approx((11.0000011, 23.0000023))
    summary = report.to_json()
    assert (summary["cache_op_seconds"], summary["replay_seconds"]) == (11.000001, 23.000002)  # to the microsecond


def test_the_cost_model_takes_free_decodes_and_slow_prefills_but_refuses_impossible_ones():
    assert StepCost(decode_step_s=0, prefill_tokens_per_s=0.5) and StepCost(decode_step_s=0.5)
    for kwargs in ({"decode_step_s": -1.0}, {"prefill_tokens_per_s": 0.0}):
        with pytest.raises(ValueError) as raised:
            StepCost(**kwargs)
        assert str(raised.value) == "need decode_step_s >= 0 and prefill_tokens_per_s > 0, got " \
            f"decode_step_s={kwargs.get('decode_step_s', 0.03)}, prefill_tokens_per_s=" \
            f"{kwargs.get('prefill_tokens_per_s', 50000.0)}"


def test_a_file_store_of_limited_capacity_keeps_the_leading_pages_of_what_it_cannot_hold(tmp_path):
    # A 20-token store takes the first 20 of the 36 pages written and refuses the rest (a write never deletes its
    # own chain's pages: the pages after a missing one would be unreachable), so the second replay prefetches
    # those 20. A replay's stored page is its header alone (the host tier holds no bytes).
    from kvmem.replay.simulator import open_storage
    from kvmem.storage.page_format import CHECKSUM_BYTES, HEADER_BYTES

    trace = [request(list(range(1, 17)) + list(range(100, 120)), [500], 0.0)]
    cfg = config(40, host_capacity_tokens=80, storage=f"file:{tmp_path}", storage_capacity_tokens=20)
    first = replay(trace, cfg).to_json()
    assert (first["stored_tokens"], first["storage_failed_ops"]) == (20, 1)
    second = replay(trace, cfg).to_json()
    assert (second["prefetched_tokens"], second["cached_tokens"]) == (20, 20)
    for page_size, tokens, pages in ((1, 20, 20), (2, 10, 5), (2, 1, 1)):
        store = open_storage(config(40, page_size=page_size, host_capacity_tokens=80, storage=f"file:{tmp_path}",
                                    storage_capacity_tokens=tokens))
        assert store.capacity_bytes == pages * (HEADER_BYTES + CHECKSUM_BYTES)
        store.close()
    assert open_storage(config(40)) is None


@pytest.mark.parametrize("capacity", [None, 100, 7])
def test_a_replay_over_a_simulated_store_reports_what_a_replay_over_a_file_store_does(tmp_path, capacity):
    # The simulated store is for planning: the figures a fresh file store gives, with no file written. A's pages
    # leave the 80-token host tier while B and C run, and come back from the store for A's second turn.
    a, b, c = list(range(1, 37)), list(range(100, 136)), list(range(200, 236))
    trace = [request(a, [500], 0.0), request(b, [501], 1.0), request(c, [502], 2.0), request(a + [7], [503], 3.0)]
    reports = {}
    for spec in ("sim", f"file:{tmp_path}"):
        cfg = config(40, host_capacity_tokens=80, storage=spec, storage_capacity_tokens=capacity)
        reports[spec[:4]] = replay(trace, cfg).to_json()
    strip = ("storage", "cache_op_seconds", "replay_seconds", "cache_op_breakdown_s")
    assert {k: v for k, v in reports["sim"].items() if k not in strip} == \
        {k: v for k, v in reports["file"].items() if k not in strip}
    assert reports["sim"]["storage"] == "sim" and reports["sim"]["stored_tokens"] > 0
    assert (reports["sim"]["storage_hit_rate"] > 0) == (capacity != 7)


def test_a_simulated_store_takes_its_capacity_from_its_spec_or_the_option_but_not_both():
    from kvmem.replay.simulator import open_storage

    for spec, capacity, tokens in (("sim", None, None), ("sim:4096", None, 4096), ("sim", 4096, 4096),
                                   ("sim:3", None, 4)):  # at least one page, as a file store
        store = open_storage(config(40, page_size=4, host_capacity_tokens=80, storage=spec,
                                    storage_capacity_tokens=capacity))
        assert store.capacity_tokens == tokens
    with pytest.raises(ValueError, match="give the simulated store's capacity once"):
        config(40, host_capacity_tokens=80, storage="sim:4096", storage_capacity_tokens=4096)


def test_a_replay_over_a_file_store_reports_what_it_stored_and_found(tmp_path):
    # Device 40, host 80, a file store under them. The first replay computes the 36-token prompt, backs it up to
    # the host and writes it to the store (36 each way). The second, over the same store, prefetches the 35
    # tokens its match asks for (the last is always computed) into the host, loads them back, computes one token,
    # and backs up and stores that one.
    trace = [request(list(range(1, 17)) + list(range(100, 120)), [500], 0.0)]
    cfg = config(40, host_capacity_tokens=80, storage=f"file:{tmp_path}")
    first = replay(trace, cfg).to_json()
    assert first["storage"] == f"file:{tmp_path}" and (first["stored_tokens"], first["backed_up_tokens"]) == (36, 36)
    assert (first["storage_hit_rate"], first["prefetched_tokens"], first["storage_failed_ops"]) == (0.0, 0, 0)
    assert first["transfer_seconds"] == round(131072 * (36 / 50e9 + 36 / 10e9), 6)
    second = replay(trace, cfg).to_json()
    assert (second["prefetched_tokens"], second["loaded_tokens"], second["cached_tokens"]) == (35, 35, 35)
    assert (second["backed_up_tokens"], second["stored_tokens"], second["storage_misses_corrupt"]) == (1, 1, 0)
    assert (second["storage_hit_rate"], second["host_hit_rate"], second["device_hit_rate"]) == \
        (round(35 / 36, 6), 0.0, 0.0)
    assert second["transfer_seconds"] == round(131072 * ((35 + 1) / 50e9 + (35 + 1) / 10e9), 6)
    moved = (35 / 50e9 + 1 / 50e9 + 36 / 10e9) * 131072
    assert replay(trace, cfg).transfer_seconds == pytest.approx(moved, rel=1e-12)
