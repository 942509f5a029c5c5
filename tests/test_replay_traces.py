import hashlib
import importlib.util
import json
import random
from array import array
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem.replay.synthetic import agentic_tool_loops, multi_turn_chat, shared_system_prompts
from kvmem.replay.traces import (
    BLOCK_SIZE,
    OUTPUT_ID_HIGH,
    OUTPUT_ID_LOW,
    TOKEN_ID_BOUND,
    MooncakeTrace,
    TokenTrace,
    TraceError,
    TraceRequest,
    block_token_ids,
    default_trace_path,
    detect_format,
    read_trace,
    synthetic_output_ids,
    write_jsonl,
)

PEER_DRIVER = Path(__file__).resolve().parents[2] / "shared" / "peers" / "sglang_driver.py"


def write_lines(tmp_path, lines, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def mooncake_row(hash_ids, input_length, output_length=8, timestamp=0):
    return {"timestamp": timestamp, "input_length": input_length, "output_length": output_length,
            "hash_ids": hash_ids}


# ---- Mooncake ---------------------------------------------------------------------------------------------

def test_mooncake_reader_keeps_lengths_arrivals_and_order(tmp_path):
    path = write_lines(tmp_path, [mooncake_row([0, 1], 700, 5, 0), mooncake_row([0, 2, 3], 1500, 9, 2500)])
    trace = read_trace(path)
    assert isinstance(trace, MooncakeTrace) and len(trace) == 2
    a, b = trace
    assert (a.input_ids.size, a.output_len, a.arrival_s) == (700, 5, 0.0)
    assert (b.input_ids.size, b.output_len, b.arrival_s) == (1500, 9, 2.5)
    assert trace.prompt_tokens == 2200 and trace.max_context_len == 1509
    assert a.input_ids.dtype == np.int32 and a.output_ids is None and a.output_tokens().size == 5


def test_mooncake_outputs_are_a_function_of_the_prompt_drawn_like_synthetic_outputs(tmp_path):
    rows = [mooncake_row([0, 1], 700, 40), mooncake_row([0, 1], 700, 60), mooncake_row([0, 1], 699, 40),
            mooncake_row([0, 2], 700, 40)]
    a, longer, shorter_prompt, other = (r.output_tokens() for r in read_trace(write_lines(tmp_path, rows)))
    assert np.array_equal(longer[:40], a)  # prefix-consistent, as synthetic_output_ids
    assert (a != shorter_prompt).sum() > 30 and (a != other).sum() > 30
    assert a.dtype == np.int32 and a.min() >= OUTPUT_ID_LOW and a.max() < OUTPUT_ID_HIGH
    assert np.array_equal(read_trace(write_lines(tmp_path, rows))[0].output_tokens(), a)


def test_equal_leading_hash_ids_share_exactly_those_tokens(tmp_path):
    path = write_lines(tmp_path, [mooncake_row([7, 8, 9], 1536), mooncake_row([7, 8, 10], 1536)])
    a, b = read_trace(path)
    shared = 2 * BLOCK_SIZE
    assert np.array_equal(a.input_ids[:shared], b.input_ids[:shared])
    assert a.input_ids[shared] != b.input_ids[shared]
    assert (a.input_ids[shared:] == b.input_ids[shared:]).sum() <= 2  # chance equality only


def test_block_tokens_depend_only_on_the_hash_id():
    rows = block_token_ids([5, 3, 5])
    assert rows.shape == (3, BLOCK_SIZE) and rows.dtype == np.int32
    assert np.array_equal(rows[0], rows[2]) and np.array_equal(rows[1], block_token_ids([3])[0])
    assert (rows[0] == rows[1]).sum() <= 2
    assert rows.min() >= 0


def test_block_tokens_of_many_ids_stay_in_range_and_rows_differ():
    ids = np.concatenate([np.arange(4096), [2**62, 2**63 - 1]])
    rows = block_token_ids(ids)
    assert rows.min() >= 0 and rows.max() < TOKEN_ID_BOUND
    assert len(np.unique(rows[:, :2], axis=0)) == len(ids)  # distinct ids part at their first two tokens
    assert min(len(np.unique(row)) for row in rows[:64]) >= BLOCK_SIZE - 2  # a row's own tokens differ too


def test_a_hash_id_of_any_non_negative_int64_is_read(tmp_path):
    path = write_lines(tmp_path, [mooncake_row([2**62, 2**63 - 1], 600)])
    trace = read_trace(path)
    assert len(trace[0].input_ids) == 600 and trace[0].input_ids.min() >= 0


def test_last_partial_block_is_a_prefix_of_the_full_block_with_the_same_id(tmp_path):
    path = write_lines(tmp_path, [mooncake_row([1, 2], 600), mooncake_row([1, 2], 1024)])
    short, full = read_trace(path)
    assert short.input_ids.size == 600
    assert np.array_equal(short.input_ids, full.input_ids[:600])


def test_mooncake_expansion_is_the_same_on_every_access(tmp_path):
    path = write_lines(tmp_path, [mooncake_row([4, 5, 6], 1200)])
    trace = read_trace(path)
    assert np.array_equal(trace[0].input_ids, trace[0].input_ids)
    assert np.array_equal(trace[0].input_ids, read_trace(path)[-1].input_ids)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=4), min_size=2, max_size=2))
def test_token_prefix_shared_equals_leading_hash_ids_shared(tmp_path_factory, id_lists):
    path = tmp_path_factory.mktemp("p") / "t.jsonl"
    path.write_text("".join(json.dumps(mooncake_row(ids, len(ids) * BLOCK_SIZE)) + "\n" for ids in id_lists))
    a, b = read_trace(path)
    blocks = next((i for i, (x, y) in enumerate(zip(*id_lists)) if x != y), min(map(len, id_lists)))
    n = min(a.input_ids.size, b.input_ids.size)
    mismatch = np.flatnonzero(a.input_ids[:n] != b.input_ids[:n])
    tokens = int(mismatch[0]) if mismatch.size else n
    assert blocks * BLOCK_SIZE <= tokens < blocks * BLOCK_SIZE + 3  # + chance equal tokens


# ---- kvmem JSONL ------------------------------------------------------------------------------------------

def test_jsonl_reader_keeps_token_ids_output_ids_and_arrivals(tmp_path):
    path = write_lines(tmp_path, [
        {"input_ids": [1, 2, 3], "output_len": 2},
        {"input_ids": [1, 2, 4], "output_len": 2, "output_ids": [9, 8], "timestamp": 1500},
        {"input_ids": [5], "output_ids": [7], "arrival_s": 3.0},
    ])
    trace = read_trace(path)
    assert isinstance(trace, TokenTrace) and len(trace) == 3
    a, b, c = trace
    assert a.input_ids.tolist() == [1, 2, 3] and a.output_ids is None and a.arrival_s == 0.0
    assert b.output_ids.tolist() == [9, 8] and b.arrival_s == 1.5
    assert c.output_len == 1 and c.arrival_s == 3.0
    assert a.output_tokens().tolist() == synthetic_output_ids([1, 2, 3], 2).tolist()
    assert b.output_tokens().tolist() == [9, 8]


def test_write_jsonl_round_trips_with_the_outputs_a_replay_generates(tmp_path):
    reqs = [TraceRequest([3, 1, 4], 3, 0.5), TraceRequest((1, 5), 2, 1.0, output_ids=[9, 2])]
    path = tmp_path / "w.jsonl"
    assert write_jsonl(reqs, path) == 2
    back = read_trace(path)
    for orig, got in zip(reqs, back):
        assert np.array_equal(orig.input_ids, got.input_ids)
        assert np.array_equal(orig.output_tokens(), got.output_ids)
        assert (orig.output_len, orig.arrival_s) == (got.output_len, got.arrival_s)


# ---- format detection, limits, scaling ---------------------------------------------------------------------

def test_auto_detects_the_format_from_the_first_valid_line(tmp_path):
    moon = write_lines(tmp_path, ["", "{not json", mooncake_row([0], 10)], "m.jsonl")
    kv = write_lines(tmp_path, [{"input_ids": [1], "output_len": 1}], "k.jsonl")
    assert detect_format(moon) == "mooncake" and detect_format(kv) == "jsonl"
    assert len(read_trace(moon, on_error="skip")) == 1


def test_a_file_of_neither_format_is_an_unknown_format(tmp_path):
    path = write_lines(tmp_path, ['{"prompt": "hi"}'])
    with pytest.raises(TraceError, match=r"t.jsonl:1: unknown trace format"):
        read_trace(path)
    csv = write_lines(tmp_path, ["TIMESTAMP,ContextTokens", "2023-11-16 18:17:03,12"], "a.csv")
    with pytest.raises(TraceError, match="unknown trace format"):
        read_trace(csv)


def test_a_missing_file_is_a_one_line_trace_error(tmp_path):
    with pytest.raises(TraceError) as info:
        read_trace(tmp_path / "nope.jsonl")
    assert "nope.jsonl" in str(info.value) and "\n" not in str(info.value)


def test_limit_keeps_the_first_valid_requests_and_time_scale_stretches_arrivals(tmp_path):
    path = write_lines(tmp_path, [mooncake_row([i], 100, timestamp=1000 * i) for i in range(5)])
    trace = read_trace(path, limit=3, time_scale=0.5)
    assert len(trace) == 3
    assert trace.arrival_s.tolist() == [0.0, 0.5, 1.0]


@pytest.mark.parametrize("kwargs", [{"format": "csv"}, {"on_error": "ignore"}, {"limit": 0}, {"time_scale": 0}])
def test_bad_reader_arguments_raise_value_error(tmp_path, kwargs):
    path = write_lines(tmp_path, [mooncake_row([0], 10)])
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        read_trace(path, **kwargs)


# ---- malformed lines --------------------------------------------------------------------------------------

BAD_MOONCAKE_LINES = [
    ('{"timestamp": 0, "input_length": 10', "not JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "missing field 'hash_ids'"),
    ('{"timestamp": 0, "input_length": "10", "output_length": 1, "hash_ids": [0]}', "input_length must be an int"),
    ('{"timestamp": 0, "input_length": 10, "output_length": -1, "hash_ids": [0]}', "output_length must be >= 1"),
    ('{"timestamp": -5, "input_length": 10, "output_length": 1, "hash_ids": [0]}', "timestamp must be"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0]}', "needs ceil"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0.5]}', "list of ints"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length must be >= 1"),
    ('{"timestamp": 1e999, "input_length": 1, "output_length": 1, "hash_ids": [0]}', "timestamp must be"),
    ('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [-1]}', "non-negative"),
    ('{"timestamp": 0, "input_length": 1, "output_length": 99999999999999999999, "hash_ids": [0]}', "int"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, true]}',
     "hash_ids must be a list of ints, got a bool"),  # numpy would read it as [1, 1]
]


@pytest.mark.parametrize("bad, reason", BAD_MOONCAKE_LINES)
def test_a_malformed_mooncake_line_stops_the_read_naming_file_and_line(tmp_path, bad, reason):
    path = write_lines(tmp_path, [mooncake_row([0], 10), bad, mooncake_row([1], 10)])
    with pytest.raises(TraceError) as info:
        read_trace(path, "mooncake")
    assert info.value.line == 2 and str(info.value).startswith(f"{path}:2: ")
    assert reason in str(info.value)


BAD_JSONL_LINES = [
    ('{"input_ids": [], "output_len": 1}', "input_ids is empty"),
    ('{"input_ids": [1, -2], "output_len": 1}', "non-negative"),
    ('{"input_ids": [1, "a"], "output_len": 1}', "list of ints"),
    ('{"input_ids": "12", "output_len": 1}', "list of ints"),
    ('{"input_ids": [1], "output_len": 0}', "output_len must be >= 1"),
    ('{"input_ids": [1]}', "missing field 'output_len'"),
    ('{"input_ids": [1], "output_len": 2, "output_ids": [3]}', "output_ids has 1 tokens"),
    ('{"input_ids": [4294967296], "output_len": 1}', "2**31"),
    ('{"input_ids": [1], "output_len": 1, "timestamp": 1, "arrival_s": 1}', "not both"),
    ('{"input_ids": [5, false], "output_len": 1}', "input_ids must be a list of ints, got a bool"),
    ('{"input_ids": [5], "output_len": 1, "output_ids": [true]}', "output_ids must be a list of ints, got a bool"),
]


@pytest.mark.parametrize("bad, reason", BAD_JSONL_LINES)
def test_a_malformed_jsonl_line_stops_the_read_naming_file_and_line(tmp_path, bad, reason):
    path = write_lines(tmp_path, [{"input_ids": [1], "output_len": 1}, "", bad])
    with pytest.raises(TraceError) as info:
        read_trace(path, "jsonl")
    assert info.value.line == 3 and reason in str(info.value)


def test_skip_mode_skips_and_lists_each_bad_line(tmp_path):
    lines = [mooncake_row([0], 10), BAD_MOONCAKE_LINES[0][0], mooncake_row([1], 10), BAD_MOONCAKE_LINES[6][0]]
    trace = read_trace(write_lines(tmp_path, lines), on_error="skip")
    assert len(trace) == 2
    assert [e.line for e in trace.skipped] == [2, 4]


def test_a_trace_with_no_valid_request_is_an_error_even_when_skipping(tmp_path):
    path = write_lines(tmp_path, [mooncake_row([0], 10), '{"timestamp": 0}'])
    with pytest.raises(TraceError, match="no valid mooncake requests"):
        read_trace(write_lines(tmp_path, ['{"timestamp": 0}', '{"hash_ids": 1}'], "x.jsonl"), "mooncake",
                   on_error="skip")
    assert len(read_trace(path, on_error="skip")) == 1


# ---- the request record -----------------------------------------------------------------------------------

def test_trace_request_holds_a_read_only_int32_prompt():
    req = TraceRequest((5, 6, 7), 2)
    assert req.input_ids.dtype == np.int32 and req.input_ids.tolist() == [5, 6, 7]
    with pytest.raises(ValueError):
        req.input_ids[0] = 1
    source = np.array([1, 2], dtype=np.int32)
    TraceRequest(source, 1)
    assert source.flags.writeable  # the caller's array is not frozen


@pytest.mark.parametrize("args, match", [(([], 1), "input_ids is empty"), (([1], 0), "output_len"),
                                         (([1.5], 1), "ints"), (([-1], 1), r"\[0, 2\*\*31\)"),
                                         (([1], 1, -1.0), "arrival_s"), (([1], 2, 0.0, [3]), "output_ids")])
def test_trace_request_rejects_bad_fields(args, match):
    with pytest.raises((ValueError, TypeError), match=match):
        TraceRequest(*args)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**64 - 1), st.integers(0, 3000), st.integers(1, 40), st.integers(1, 2000))
def test_bulk_draws_are_randrange_draws(seed, n, low, width):
    from kvmem.replay.traces import _randrange_bulk

    rng = random.Random(seed)
    expected = [rng.randrange(low, low + width) for _ in range(n)]
    assert _randrange_bulk(random.Random(seed), low, low + width, n).tolist() == expected


def test_synthetic_outputs_are_the_peers_drivers_outputs():
    prompt = [5, 70000, 3, 2**31 - 1]
    seed = int.from_bytes(hashlib.blake2b(array("q", prompt).tobytes(), digest_size=8).digest(), "little")
    rng = random.Random(seed)
    assert synthetic_output_ids(prompt, 40).tolist() == [rng.randrange(10, 32000) for _ in range(40)]


@pytest.mark.skipif(not PEER_DRIVER.exists(), reason="../shared/peers is not beside the checkout")
def test_a_jsonl_workload_generates_what_the_sglang_driver_generates():
    spec = importlib.util.spec_from_file_location("sglang_driver", PEER_DRIVER)
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)  # its module level imports only the standard library
    for prompt, n in (([1, 2, 3], 8), (list(range(10, 600)), 64), ([31999], 1)):
        assert synthetic_output_ids(prompt, n).tolist() == driver._synthetic_output(prompt, n)


def test_synthetic_outputs_depend_only_on_the_prompt_and_extend_consistently():
    a = synthetic_output_ids([1, 2, 3], 6)
    assert a.dtype == np.int32 and a.size == 6
    assert np.array_equal(a, synthetic_output_ids(np.array([1, 2, 3], dtype=np.int64), 6))
    assert np.array_equal(synthetic_output_ids([1, 2, 3], 3), a[:3])
    assert (synthetic_output_ids([1, 2, 4], 6) == a).sum() <= 1
    assert synthetic_output_ids([1], 0).size == 0


# ---- the embedded default ---------------------------------------------------------------------------------

def test_the_embedded_default_is_a_small_verbatim_mooncake_excerpt():
    path = default_trace_path()
    assert path.stat().st_size < 200_000
    assert (path.parent / "ATTRIBUTION.md").exists()
    first = json.loads(path.read_text().splitlines()[0])
    assert first == {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": list(range(14))}
    trace = read_trace(path)
    assert isinstance(trace, MooncakeTrace) and len(trace) == 400


# ---- synthetic generators ---------------------------------------------------------------------------------

GENERATORS = [(shared_system_prompts, {}), (multi_turn_chat, {}), (agentic_tool_loops, {"system_len": 256})]


@pytest.mark.parametrize("gen, kwargs", GENERATORS)
def test_generators_are_deterministic_by_seed(gen, kwargs):
    a, b, c = (gen(40, seed=s, **kwargs) for s in (1, 1, 2))
    assert len(a) == 40
    assert np.array_equal(a.token_ids, b.token_ids) and np.array_equal(a.output_lens, b.output_lens)
    assert not np.array_equal(a.token_ids[:100], c.token_ids[:100])


def test_shared_system_prompts_share_one_of_the_prompts_then_diverge():
    trace = shared_system_prompts(30, num_prompts=2, prompt_len=64, seed=3)
    heads = {tuple(r.input_ids[:64]) for r in trace}
    assert len(heads) == 2
    suffixes = {tuple(r.input_ids[64:]) for r in trace}
    assert len(suffixes) == 30


def _predecessor_index(trace, i):
    """The latest earlier request whose prompt + output is a prefix of request i's prompt."""
    ids = trace[i].input_ids
    for j in range(i - 1, -1, -1):
        prev = trace[j]
        full = np.concatenate([prev.input_ids, prev.output_tokens()])
        if full.size < ids.size and np.array_equal(ids[:full.size], full):
            return j
    return None


@pytest.mark.parametrize("gen, kwargs", [(multi_turn_chat, {"turns": (3, 3), "concurrent_sessions": 4}),
                                         (agentic_tool_loops, {"system_len": 128, "steps": (3, 3),
                                                               "concurrent_sessions": 4})])
def test_follow_up_turns_extend_the_previous_prompt_and_its_generated_output(gen, kwargs):
    trace = gen(30, seed=5, **kwargs)
    preds = [_predecessor_index(trace, i) for i in range(len(trace))]
    followed = [p for p in preds if p is not None]
    assert len(set(followed)) == len(followed)  # sessions are chains: each turn is continued once at most
    depth = [0] * len(trace)
    for i, p in enumerate(preds):
        depth[i] = 1 if p is None else depth[p] + 1
    assert max(depth) == 3
    # 3-turn sessions, 4 live at a time: 10 complete ones, plus at most 4 cut short at the end
    assert 10 <= preds.count(None) <= 14


def test_agent_sessions_share_the_agent_system_prompt():
    trace = agentic_tool_loops(20, num_agents=1, system_len=500, seed=0)
    heads = {tuple(r.input_ids[:500]) for r in trace}
    assert len(heads) == 1


def test_poisson_arrivals_are_increasing_and_default_arrivals_are_zero():
    timed = multi_turn_chat(50, arrival_rate=10.0, seed=0)
    assert np.all(np.diff(timed.arrival_s) > 0) and 1.0 < timed.arrival_s[-1] < 20.0
    assert not multi_turn_chat(10).arrival_s.any()


@pytest.mark.parametrize("kwargs", [{"user_len": (5, 2)}, {"num_prompts": 0}, {"arrival_rate": -1.0}])
def test_generators_reject_bad_parameters(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        shared_system_prompts(10, **kwargs)


def test_a_trace_whose_lines_end_in_a_bare_cr_is_refused_saying_so(tmp_path):
    path = tmp_path / "cr.jsonl"
    path.write_bytes(b'{"input_ids": [1], "output_len": 1}\r{"input_ids": [2], "output_len": 1}\r')
    for fmt in ("auto", "jsonl"):
        with pytest.raises(TraceError, match="its lines end in a bare CR: convert them to LF"):
            read_trace(path, fmt)
