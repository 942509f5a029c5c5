"""kvmem-replay on hybrid models: window-aware pools sized from a memory budget, the report's per-component fields,
the Python engine standing in for the native one, and the pools' invariants through a whole replay."""

import dataclasses
import json

import pytest

from kvmem import sizing
from kvmem.hybrid import HybridRadixCache
from kvmem.replay.cli import main
from kvmem.replay.config import ReplayConfig
from kvmem.replay.simulator import ReplicaSim, replay
from kvmem.replay.synthetic import multi_turn_chat


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def chat(n=60):
    return multi_turn_chat(n, system_len=256, seed=3)


def config_for(model, trace, **kwargs):
    return ReplayConfig(capacity_tokens=kwargs.pop("capacity_tokens", 1 << 15), max_context_len=trace.max_context_len,
                        model=model, **kwargs)


# ---- capacity ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model, gain", [("gpt-oss-120b", 1.9), ("gemma-3-27b", 3.0)])
def test_window_aware_pools_hold_more_tokens_than_full_attention_pools_on_8_h100(capsys, model, gain):
    common = ["--model", model, "--gpu", "H100", "--tp", "8", "--limit", "4", "--no-progress", "--engine", "python"]
    code, out, _ = run(capsys, *common)
    assert code == 0
    hybrid = json.loads(out)
    code, out, _ = run(capsys, *common, "--full-attention-pools")
    assert code == 0
    full = json.loads(out)
    assert hybrid["capacity_tokens"] >= gain * full["capacity_tokens"]
    assert "hybrid" in hybrid and "hybrid" not in full
    assert hybrid["config"]["window_tokens"] == hybrid["hybrid"]["window_capacity_tokens"]


def test_gpu_mem_gb_splits_the_budget_as_hybrid_capacity_does(capsys):
    code, out, _ = run(capsys, "--model", "gpt-oss-20b", "--gpu-mem-gb", "8", "--page-size", "16", "--limit", "3",
                       "--no-progress", "--engine", "python")
    assert code == 0
    report = json.loads(out)
    cap = sizing.hybrid_capacity(sizing.HYBRID_MODEL_CONFIGS["gpt-oss-20b"], gpu_mem_gb=8, page_size=16,
                                 max_running_requests=256)
    assert report["capacity_tokens"] == cap.full_tokens and report["config"]["window_tokens"] == cap.window_tokens


def test_the_native_engine_hands_a_hybrid_replay_to_python_with_a_note(capsys):
    code, out, err = run(capsys, "--model", "qwen3-next-80b", "--gpu-mem-gb", "80", "--limit", "20", "--no-progress",
                         "--engine", "native", "--json-only")
    assert code == 0
    assert err.count("\n") == 1 and "does not cover a hybrid model's window-aware pools" in err
    assert "the Python engine replays it" in err
    assert json.loads(out)["hybrid"]["state_slots"] == 512


# ---- the report ----------------------------------------------------------------------------------------

def test_a_windowed_replay_reports_window_frees_evictions_and_peaks():
    trace = chat()
    report = replay(trace, config_for("gpt-oss-20b", trace, window_tokens=4096, max_running=8)).to_json()
    part = report["hybrid"]
    assert part["window"] == 128 and part["window_capacity_tokens"] == 4096 and part["state_slots"] == 0
    assert 0 < part["peak_window_tokens_used"] <= 4096
    assert part["window_slots_freed"] > 0 and part["window_evicted_tokens"] > 0  # the chats outgrow 4,096 slots
    assert part["state_copies"] == 0 and report["hit_rate"] > 0


def test_a_linear_attention_replay_copies_states_on_hits():
    trace = chat()
    report = replay(trace, config_for("qwen3-next-80b", trace, state_slots=6, max_running=3)).to_json()
    part = report["hybrid"]
    assert part["window"] is None and part["state_slots"] == 6 and 0 < part["peak_states_used"] <= 6
    assert part["state_copies"] > 0 and report["hit_rate"] > 0


@pytest.mark.parametrize("model, kwargs", [
    ("gpt-oss-20b", dict(window_tokens=2048, max_running=6, page_size=4)),
    ("gemma-3-27b", dict(window_tokens=6144, max_running=4, capacity_tokens=1 << 14)),
    ("qwen3-next-80b", dict(state_slots=4, max_running=2, capacity_tokens=1 << 14))])
def test_every_component_adds_up_after_every_step_of_a_tight_replay(model, kwargs):
    trace = chat(40)
    sim = ReplicaSim(config_for(model, trace, **kwargs))
    assert isinstance(sim.sched.tree_cache, HybridRadixCache)
    for i, req in enumerate(trace):
        sim.add_request(i, req)
    steps = 0
    while not sim.is_idle():
        sim.step()
        sim.sched.check_invariants()  # free + evictable + protected + held == total: full, window and state
        steps += 1
    assert steps > 0 and sim.close().requests == 40


def test_decode_runs_give_the_report_steps_one_by_one_give(monkeypatch):
    trace = chat(40)
    config = config_for("gpt-oss-20b", trace, window_tokens=2048, max_running=6)
    fast = replay(trace, config).to_json()
    from kvmem.replay.decode_runs import ReplayScheduler

    monkeypatch.setattr(ReplayScheduler, "pure_decode_steps", lambda self: 0)
    slow = replay(trace, config).to_json()
    for key in ("hit_rate", "cached_tokens", "evicted_tokens", "retractions", "hybrid"):
        assert fast[key] == slow[key], key


# ---- bad input -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(model="llama-3-8b", window_tokens=512), "window_tokens is for the window-aware pools of a hybrid model"),
    (dict(model="gpt-oss-20b", full_attention_pools=True, state_slots=4), "state_slots is for the window-aware"),
    (dict(model="gpt-oss-20b", window_tokens=0), "window_tokens must be a positive int"),
    (dict(model="gpt-oss-20b", window_tokens=100, page_size=16), "window_tokens 100 must be a multiple of page_size"),
    (dict(model="gpt-oss-20b", window_tokens=1 << 20), "window_tokens 1048576 exceeds capacity_tokens"),
    (dict(model="qwen3-next-80b", state_slots=1), "state_slots must be an int >= 2"),
    (dict(model="qwen3-next-80b", window_tokens=512), "qwen3-next-80b has no sliding-window layer"),
    (dict(model="gpt-oss-20b", state_slots=4), "gpt-oss-20b has no linear-attention layer"),
    (dict(model="gpt-oss-20b", host_capacity_tokens=1 << 16), "device-only"),
    (dict(model="gemma-3-27b", full_attention_pools="yes"), "full_attention_pools must be a bool"),
])
def test_a_bad_hybrid_replay_config_names_its_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ReplayConfig(capacity_tokens=1 << 15, max_context_len=4096, **kwargs)


def test_full_attention_pools_without_a_hybrid_model_is_a_one_line_error(capsys):
    code, out, err = run(capsys, "--model", "llama-3-8b", "--gpu-mem-gb", "4", "--full-attention-pools")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "--full-attention-pools compares a hybrid --model's pools" in err


def test_a_cluster_replay_of_window_aware_pools_is_a_one_line_error(capsys):
    code, out, err = run(capsys, "--model", "gpt-oss-20b", "--gpu-mem-gb", "8", "--replicas", "2", "--limit", "3")
    assert code == 2 and out == "" and err.count("\n") == 1 and "give --full-attention-pools" in err


def test_a_policy_comparison_of_window_aware_pools_is_a_one_line_error(capsys):
    code, out, err = run(capsys, "--model", "gpt-oss-20b", "--gpu-mem-gb", "8", "--compare-policies", "lru,lfu")
    assert code == 2 and out == "" and err.count("\n") == 1 and "its ceiling, belady" in err


def test_a_sweep_of_window_aware_pools_shrinks_the_window_pool_with_the_full_one(capsys):
    code, out, _ = run(capsys, "--model", "gpt-oss-20b", "--gpu-mem-gb", "8", "--sweep", "--limit", "3", "--jobs",
                       "1", "--no-progress", "--json-only", "--engine", "python")
    assert code == 0
    sweep = json.loads(out)["sweep"]
    assert len(sweep) == 6
    assert all(r["hybrid"]["window_capacity_tokens"] <= r["capacity_tokens"] for r in sweep)
    assert sweep[-1]["hybrid"]["window_capacity_tokens"] < sweep[-1]["capacity_tokens"]


def test_a_budget_too_small_for_the_window_aware_pools_is_a_one_line_error(capsys):
    code, out, err = run(capsys, "--model", "qwen3-next-80b", "--gpu-mem-gb", "1", "--limit", "2")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "--gpu-mem-gb 1.0 holds no window-aware pools of qwen3-next-80b" in err


def test_a_hybrid_config_replaced_with_full_attention_pools_drops_its_window():
    trace = chat(4)
    config = config_for("gpt-oss-20b", trace)
    assert config.hybrid is sizing.HYBRID_MODEL_CONFIGS["gpt-oss-20b"] and config.hybrid_window_tokens > 0
    plain = dataclasses.replace(config, full_attention_pools=True)
    assert plain.hybrid is None and plain.hybrid_window_tokens == 0
