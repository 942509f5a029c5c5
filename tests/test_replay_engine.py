"""Which engine replays: `kvmem-replay --engine`, $KVMEM_ENGINE, the fallback to the Python engine with one line
on stderr where the native engine is not built or lacks what a configuration needs, and the native path's
freedom from torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmem.replay import engine, native_replay
from kvmem.replay.cli import main
from kvmem.replay.config import ReplayConfig

REPO = Path(__file__).resolve().parents[1]
NATIVE = native_replay.load_native()
needs_native = pytest.mark.skipif(isinstance(NATIVE, ImportError),
                                  reason=f"the native replay engine is not built ({NATIVE})")
TIMINGS = {"cache_op_seconds", "replay_seconds", "cache_op_breakdown_s", "routing_seconds"}
FEW = ["--limit", "60", "--no-progress", "--json-only"]
SMALL = [*FEW, "--capacity-tokens", "200000"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def without_timings(out: str) -> dict:
    """A JSON report without its wall-clock fields, at any depth."""
    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in TIMINGS}
        return [strip(v) for v in value] if isinstance(value, list) else value
    return strip(json.loads(out))


def test_the_flag_then_the_environment_then_native_pick_the_engine(monkeypatch):
    monkeypatch.delenv(engine.ENV, raising=False)
    assert engine.requested_engine() == "native" and engine.requested_engine("python") == "python"
    monkeypatch.setenv(engine.ENV, "python")
    assert engine.requested_engine() == "python" and engine.requested_engine("native") == "native"
    monkeypatch.setenv(engine.ENV, "rust")
    with pytest.raises(ValueError, match="KVMEM_ENGINE must be one of native, python, got 'rust'"):
        engine.requested_engine()


def test_an_unknown_engine_in_the_environment_is_a_one_line_usage_error(capsys, monkeypatch):
    monkeypatch.setenv(engine.ENV, "rust")
    code, out, err = run(capsys, *SMALL)
    assert code == 2 and out == "" and err == "kvmem-replay: error: KVMEM_ENGINE must be one of native, python, " \
                                               "got 'rust'\n"


@needs_native
def test_both_engines_print_the_same_report(capsys):
    reports = []
    for name in engine.ENGINES:
        code, out, err = run(capsys, *SMALL, "--page-size", "16", "--engine", name)
        assert code == 0 and err == ""  # nothing falls back, so nothing is said
        reports.append(without_timings(out))
    assert reports[0] == reports[1] and reports[0]["requests"] == 60


@needs_native
@pytest.mark.parametrize("options", [["--router", "kv-overlap", "--page-size", "16"],
                                     ["--router", "round-robin,least-load", "--host-capacity-tokens", "400000"]])
def test_both_engines_print_the_same_cluster_report(capsys, options):
    reports = []
    for name in engine.ENGINES:
        code, out, err = run(capsys, *SMALL, "--replicas", "3", *options, "--engine", name)
        assert code == 0 and err == ""
        reports.append(without_timings(out))
    assert reports[0] == reports[1]


@needs_native
def test_what_the_native_engine_lacks_runs_on_the_python_engine_with_one_line_saying_so(capsys, tmp_path):
    code, out, err = run(capsys, *SMALL, "--host-capacity-tokens", "400000", "--storage", f"file:{tmp_path}")
    assert code == 0 and json.loads(out)["storage"] == f"file:{tmp_path}"
    assert err == "kvmem-replay: the native engine does not cover a file store yet: the Python engine replays it\n"
    code, out, err = run(capsys, *FEW, "--sweep", "100000,200000", "--eviction-policy", "s3fifo", "--jobs", "1")
    assert code == 0 and err.startswith("kvmem-replay: the native engine does not cover s3fifo eviction yet: the "
                                        "Python engine replays them\n")
    code, out, err = run(capsys, *SMALL, "--replicas", "2", "--eviction-policy", "s3fifo")
    assert code == 0 and err == ("kvmem-replay: the native engine does not cover s3fifo eviction yet: the Python "
                                 "engine replays the cluster\n")
    code, out, err = run(capsys, *SMALL, "--engine", "python", "--host-capacity-tokens", "400000", "--storage",
                         f"file:{tmp_path}")
    assert code == 0 and err == ""  # asked for: nothing to say


@needs_native
def test_a_simulated_storage_tier_replays_the_same_on_both_engines(capsys):
    reports = []
    for name in ("native", "python"):
        code, out, err = run(capsys, *SMALL, "--host-capacity-tokens", "400000", "--storage", "sim", "--engine", name)
        assert code == 0 and err == ""
        reports.append(without_timings(out))
    assert reports[0] == reports[1] and reports[0]["storage"] == "sim"


def test_without_the_native_module_the_python_engine_replays_with_one_line_saying_so(capsys, monkeypatch):
    monkeypatch.setattr(native_replay, "load_native", lambda: ImportError("No module named 'kvmem.replay._native'"))
    code, out, err = run(capsys, *SMALL)
    assert code == 0 and json.loads(out)["requests"] == 60
    assert err == ("kvmem-replay: the native engine is not built (No module named 'kvmem.replay._native'): the "
                   "Python engine replays it\n")
    config = ReplayConfig(capacity_tokens=1000, max_context_len=100)
    with pytest.raises(RuntimeError, match="the native replay engine is not built"):
        native_replay.replay([], config)


@needs_native
def test_a_native_sweep_replays_in_this_process_and_a_python_one_in_workers(capsys, monkeypatch):
    from kvmem.replay import workers

    started = []
    real = workers.ProcessPoolExecutor
    monkeypatch.setattr(workers, "ProcessPoolExecutor", lambda *a, **k: started.append(a) or real(*a, **k))
    reports = []
    for name in ("native", "python"):
        code, out, err = run(capsys, *FEW, "--sweep", "100000,200000", "--jobs", "2", "--engine", name)
        assert code == 0 and err == "" and len(started) == (name == "python")
        reports.append(without_timings(out))
    assert reports[0] == reports[1]


@needs_native
def test_a_policy_comparison_replays_what_it_can_on_the_native_engine(capsys):
    code, out, err = run(capsys, *SMALL, "--compare-policies", "fifo,s3fifo", "--jobs", "1")
    assert code == 0
    assert err.splitlines()[0] == ("kvmem-replay: the native engine does not cover s3fifo eviction, belady eviction "
                                   "yet: the Python engine replays those 2 of the 4 replays")


@needs_native
@needs_native
def test_the_replay_on_the_native_engine_runs_where_torch_cannot_be_imported():
    # None in sys.modules: `import torch` raises ModuleNotFoundError and importlib finds no torch, as on an install
    # without the torch extra.
    code = """
import json, sys
sys.modules["torch"] = sys.modules["triton"] = None
from kvmem.replay.cli import main
assert main(["--limit", "40", "--page-size", "16", "--capacity-tokens", "300000", "--no-progress"]) == 0
assert sys.modules["torch"] is None
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["requests"] == 40 and "hit rate" in done.stderr


def test_a_cluster_asked_of_the_python_engine_never_runs_natively(monkeypatch):
    from kvmem.replay import engine, native_cluster
    from kvmem.replay.config import ReplayConfig
    from kvmem.replay.traces import default_trace_path, read_trace

    def refuse(*args, **kwargs):
        raise AssertionError("the native engine replayed a cluster asked of the Python engine")

    monkeypatch.setattr(native_cluster, "replay_cluster", refuse)
    trace = read_trace(default_trace_path(), limit=8)
    config = ReplayConfig(capacity_tokens=300000, max_context_len=trace.max_context_len, page_size=16)
    assert engine.replay_cluster(trace, config, 2, "round-robin", engine="python").to_json()["requests"] == 8
