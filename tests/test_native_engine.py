"""The native replay engine against the Python reference: the same report, field for field (timings aside), on
random small traces and on fixed configurations of real and synthetic traces.

The reference is kvmem.replay.simulator.replay, whose decode runs (ReplayScheduler.run_decode) stand for decode steps
taken one by one; the random traces also replay with the runs turned off, so that all three agree. They are
small on purpose: capacities of a few pages force evictions, retractions and rejections, a few tokens' alphabet
makes different pages share first tokens, and follow-up prompts that quote a request's output hit its decode
pages. Skipped, with the reason, where the native module is not built.
"""

from __future__ import annotations

import dataclasses
import json
import math
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmem.replay import native_replay
from kvmem.replay.config import ReplayConfig
from kvmem.replay.cost import StepCost
from kvmem.replay.decode_runs import ReplayScheduler
from kvmem.replay.simulator import replay as python_replay
from kvmem.replay.synthetic import GENERATORS
from kvmem.replay.traces import (
    BLOCK_SIZE,
    MooncakeTrace,
    TraceRequest,
    _output_draws,
    default_trace_path,
    read_trace,
    write_jsonl,
)
from kvmem.scheduler import SchedulerConfig

NATIVE = native_replay.load_native()
pytestmark = pytest.mark.skipif(isinstance(NATIVE, ImportError),
                                reason=f"the native replay engine is not built ({NATIVE})")
TIMINGS = {"cache_op_seconds", "replay_seconds", "cache_op_breakdown_s"}
SAMPLES = ("time_s", "tokens_used", "evictable_tokens", "running", "cumulative_hit_rate", "ttft_s")


def fields(report) -> dict:
    """Everything a report holds but its timings: the summary, every sample, and the unrounded counters."""
    out = {k: v for k, v in report.to_json().items() if k not in TIMINGS}
    out.update({name: list(getattr(report, name)) for name in SAMPLES})
    out.update(start_s=report.start_s, prefill_seconds_saved=report.prefill_seconds_saved,
               phases=sorted(report.cache_phases))
    return out


def assert_same_report(requests, config: ReplayConfig, *, one_by_one: bool = False) -> dict:
    native = fields(native_replay.replay(requests, config))
    assert native == fields(python_replay(requests, config))
    if one_by_one:  # the reference without its decode runs: every step through Scheduler.step
        with mock.patch.object(ReplayScheduler, "pure_decode_steps", lambda self: 0):
            assert native == fields(python_replay(requests, config))
    return native


# ---- random traces ---------------------------------------------------------------------------------------------

@st.composite
def token_traces(draw):
    """Requests over a tiny alphabet: a few shared heads, unique tails, some outputs explicit and some drawn, and
    follow-ups that quote an earlier request's prompt and output (a conversation's next turn)."""
    alphabet = draw(st.integers(1, 5))
    tokens = st.lists(st.integers(0, alphabet - 1), max_size=24)
    heads = draw(st.lists(tokens, min_size=1, max_size=3))
    n = draw(st.integers(1, 10))
    long_outputs = draw(st.booleans())  # outputs that outgrow what admission kept for them: retractions
    requests, arrival = [], 0.0
    for _ in range(n):
        if requests and draw(st.integers(0, 3)) == 0:  # a follow-up turn
            prev = requests[draw(st.integers(0, len(requests) - 1))]
            prompt = list(prev.input_ids) + prev.output_tokens().tolist() + draw(tokens)
        else:
            prompt = draw(st.sampled_from(heads)) + draw(tokens)
        prompt = prompt or [0]
        output_len = draw(st.integers(20, 80) if long_outputs else st.integers(1, 20))
        outputs = draw(st.one_of(st.none(), st.lists(st.integers(0, alphabet), min_size=output_len,
                                                     max_size=output_len)))
        arrival += draw(st.sampled_from([0.0, 0.0, 0.01, 0.05, 0.5]))
        requests.append(TraceRequest(prompt, output_len, arrival, outputs))
    if draw(st.booleans()):  # arrivals out of trace order
        order = draw(st.permutations(range(n)))
        requests = [dataclasses.replace(r, arrival_s=requests[j].arrival_s) for r, j in zip(requests, order)]
    return requests


@st.composite
def block_traces(draw):
    """A Mooncake trace over a few hash ids: shared blocks, partial last blocks, and blocks that differ."""
    n = draw(st.integers(1, 6))
    ids, offsets, input_lens, output_lens, arrivals = [], [0], [], [], []
    for i in range(n):
        blocks = draw(st.lists(st.integers(0, 4), min_size=1, max_size=3))
        ids += blocks
        offsets.append(len(ids))
        input_lens.append(draw(st.integers((len(blocks) - 1) * BLOCK_SIZE + 1, len(blocks) * BLOCK_SIZE)))
        output_lens.append(draw(st.integers(1, 300)))
        arrivals.append(draw(st.sampled_from([0.0, 0.02, 0.2])) * i)
    i64 = [np.array(a, dtype=np.int64) for a in (ids, offsets, input_lens, output_lens)]
    return MooncakeTrace("blocks", *i64, np.array(arrivals, dtype=np.float64))


@st.composite
def configs(draw, requests, page_sizes, chunks):
    """A replay of `requests` on a KV cache from the longest request (a page less now and then: rejections) to four
    times it, so that memory runs short; now and then of a hybrid model on full-attention pools (the roofline prices
    its layer kinds)."""
    longest = max(len(r.input_ids) + r.output_len for r in requests)
    page_size = draw(page_sizes)
    model = draw(st.sampled_from([None] * 4 + ["gpt-oss-20b", "gemma-3-27b", "llama-4-scout", "qwen3-next-80b"]))
    fits = -(-longest // page_size) * page_size
    capacity = max(page_size, draw(st.integers(fits, 4 * fits)) - draw(st.sampled_from([0] * 9 + [page_size])))
    return draw(st.builds(
        ReplayConfig, capacity_tokens=st.just(capacity),
        max_context_len=st.sampled_from([longest] * 9 + [max(1, longest - 5)]), page_size=st.just(page_size),
        eviction_policy=st.sampled_from(native_replay.NATIVE_POLICIES),
        schedule_policy=st.sampled_from(["lpm", "fcfs"]), max_running=st.integers(1, 8),
        chunked_prefill_size=st.one_of(st.none(), chunks), honour_arrivals=st.booleans(),
        cache_decode_pages=st.booleans(), in_batch_prefix_caching=st.booleans(),
        pin_prefix_tokens=st.sampled_from([0, 0, 3, 16, 600]), pin_budget=st.sampled_from([0.2, 0.6, 1.0]),
        gpu=st.sampled_from([None, None, "H100"]), tp=st.sampled_from([1, 2]), model=st.just(model),
        full_attention_pools=st.just(model is not None)))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_token_traces_replay_the_same_on_both_engines(data):
    requests = data.draw(token_traces())
    config = data.draw(configs(requests, st.sampled_from([1, 1, 2, 3, 4, 8, 16]), st.integers(1, 40)))
    assert_same_report(requests, config, one_by_one=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_mooncake_block_traces_replay_the_same_on_both_engines(data):
    trace = data.draw(block_traces())
    requests = [trace[i] for i in range(len(trace))]
    config = data.draw(configs(requests, st.sampled_from([1, 16, 64, 512]), st.integers(100, 1500)))
    assert_same_report(trace, config, one_by_one=True)


# ---- fixed configurations --------------------------------------------------------------------------------------

HEAD = default_trace_path()  # the first 400 requests of Mooncake's conversation trace
FIXED = {
    "conversation head, page 1": (HEAD, 400, dict(capacity_tokens=600_000)),
    "page 16, lfu": (HEAD, 400, dict(capacity_tokens=400_000, page_size=16, eviction_policy="lfu")),
    "page 512": (HEAD, 120, dict(capacity_tokens=400_000, page_size=512)),
    "fcfs, page 512, all at once, retractions": (HEAD, 200, dict(capacity_tokens=120_000, page_size=512,
                                                                 schedule_policy="fcfs", honour_arrivals=False,
                                                                 max_running=512)),
    "chunked 2048, fifo, roofline": (HEAD, 300, dict(capacity_tokens=500_000, chunked_prefill_size=2048,
                                                     eviction_policy="fifo", gpu="H100", tp=8)),
    "no chunking, pins, priority": (HEAD, 300, dict(capacity_tokens=300_000, chunked_prefill_size=None,
                                                    pin_prefix_tokens=2048, eviction_policy="priority")),
    # Hybrid models on full-attention pools, their layers priced by kind: sliding windows, chunks, linear states.
    "gpt-oss-120b, roofline": (HEAD, 200, dict(capacity_tokens=400_000, gpu="H100", tp=8, model="gpt-oss-120b",
                                               full_attention_pools=True)),
    "llama-4-scout, chunked 2048, roofline": (HEAD, 200, dict(capacity_tokens=400_000, chunked_prefill_size=2048,
                                                              gpu="H100", tp=8, model="llama-4-scout",
                                                              full_attention_pools=True)),
    "qwen3-next-80b, page 16, roofline": (HEAD, 200, dict(capacity_tokens=400_000, page_size=16, gpu="H100", tp=8,
                                                          model="qwen3-next-80b", full_attention_pools=True)),
}


@pytest.mark.parametrize("name", list(FIXED))
def test_the_conversation_trace_head_replays_the_same_on_both_engines(name):
    path, limit, options = FIXED[name]
    trace = read_trace(path, limit=limit)
    report = assert_same_report(trace, ReplayConfig(max_context_len=trace.max_context_len, **options))
    assert report["requests"] > 0 and report["cached_tokens"] > 0


@pytest.mark.parametrize("generator", list(GENERATORS))
@pytest.mark.parametrize("options", [dict(capacity_tokens=30_000), dict(capacity_tokens=8_000, page_size=4,
                                     in_batch_prefix_caching=True, cache_decode_pages=False)])
def test_synthetic_workloads_replay_the_same_on_both_engines(generator, options):
    trace = GENERATORS[generator](300, seed=3, arrival_rate=20.0)
    assert_same_report(trace, ReplayConfig(max_context_len=trace.max_context_len, **options))


def test_a_kvmem_jsonl_trace_with_and_without_output_ids_replays_the_same_on_both_engines(tmp_path):
    trace = GENERATORS["synthetic-chat"](150, seed=7, arrival_rate=10.0)
    path = tmp_path / "t.jsonl"
    write_jsonl([trace[i] for i in range(len(trace))], path)  # every output explicit
    lines = path.read_text().splitlines()
    for k in range(0, len(lines), 3):  # every third drawn again from its prompt, as kvmem and the peers draw it
        record = json.loads(lines[k])
        del record["output_ids"]
        lines[k] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    jsonl = read_trace(path)
    assert jsonl.output_token_ids is not None
    assert_same_report(jsonl, ReplayConfig(capacity_tokens=12_000, max_context_len=jsonl.max_context_len, page_size=2))


def test_retractions_and_rejections_replay_the_same_on_both_engines(capsys):
    trace = GENERATORS["synthetic-chat"](60, seed=5)
    config = ReplayConfig(capacity_tokens=1_200, max_context_len=trace.max_context_len, max_running=64,
                          honour_arrivals=False)
    native = native_replay.replay(trace, config)
    native_notes = capsys.readouterr().err
    python = python_replay(trace, config)
    assert fields(native) == fields(python) and native_notes == capsys.readouterr().err
    assert native.retractions > 0 and native.rejected > 10  # each of the first ten named, the rest counted
    assert "skipped: request" in native_notes and "more requests that can never run here" in native_notes


# ---- the engine's parts ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2**32 - 1, 2**32, 2**63 + 12345, 2**64 - 1])
def test_the_native_output_draws_are_python_s(seed):
    assert NATIVE.draw_outputs(seed, 700).tolist() == _output_draws(seed, 700).tolist()


def test_the_native_trace_reads_the_tokens_a_trace_request_holds():
    trace = read_trace(HEAD, limit=30)
    native = native_replay.native_trace(NATIVE, trace)
    for i in (0, 7, 29):
        request = trace[i]
        n = len(request.input_ids)
        assert [native.token(i, p) for p in range(0, n, 97)] == request.input_ids[::97].tolist()
        assert native.token(i, n - 1) == request.input_ids[-1]
        assert native.output(i).tolist() == request.output_tokens().tolist()


def test_the_output_seeds_of_a_mooncake_trace_are_the_trace_s():
    trace = read_trace(HEAD, limit=50)
    assert native_replay._mooncake_seeds(trace).tolist() == [trace._output_seed(i) for i in range(len(trace))]


def test_a_replica_driven_from_python_replays_as_the_single_replay():
    # A cluster drives its replicas this way (run_until the next arrival, then route it): one replica must give the
    # single replay's report.
    trace = GENERATORS["synthetic-agent"](120, seed=2, arrival_rate=4.0)
    config = ReplayConfig(capacity_tokens=20_000, max_context_len=trace.max_context_len, page_size=4)
    native_trace = native_replay.native_trace(NATIVE, trace)
    replica = NATIVE.Replica(native_replay._engine_config(config, StepCost()), native_trace)
    order, arrivals = native_replay._arrival_order(trace, True)
    for i, arrival in zip(order.tolist(), arrivals.tolist()):
        replica.run_until(arrival)
        replica.clock = max(replica.clock, arrival)
        assert replica.add_request(i, arrival) == ""
    replica.run_until(math.inf)
    assert replica.is_idle()
    stepped, whole = replica.report(), native_replay.replay(trace, config)
    assert stepped["requests"] == whole.requests and stepped["cached_tokens"] == whole.cached_tokens
    assert stepped["time_s"].tolist() == list(whole.time_s) and stepped["ttft_s"].tolist() == list(whole.ttft_s)


def test_the_admission_constants_are_the_scheduler_s():
    defaults = SchedulerConfig()
    assert native_replay.ADMISSION == {name: getattr(defaults, name) for name in native_replay.ADMISSION}


def test_the_native_engine_refuses_what_it_does_not_cover():
    trace = read_trace(HEAD, limit=5)
    for options, what in ((dict(host_capacity_tokens=2_000_000, storage="file:/nonexistent/kvmem"), "a file store"),
                          (dict(eviction_policy="s3fifo"), "s3fifo eviction")):
        config = ReplayConfig(capacity_tokens=1_000_000, max_context_len=trace.max_context_len, **options)
        assert native_replay.unsupported(config) == what
        with pytest.raises(ValueError, match=what):
            native_replay.replay(trace, config)
