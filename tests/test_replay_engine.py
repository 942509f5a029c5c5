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
TIMINGS = {"cache_op_seconds", "replay_seconds", "cache_op_breakdown_s"}
FEW = ["--limit", "60", "--no-progress", "--json-only"]
SMALL = [*FEW, "--capacity-tokens", "200000"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def without_timings(out: str) -> dict:
    return {k: v for k, v in json.loads(out).items() if k not in TIMINGS}


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
def test_what_the_native_engine_lacks_runs_on_the_python_engine_with_one_line_saying_so(capsys):
    code, out, err = run(capsys, *SMALL, "--host-capacity-tokens", "400000")
    assert code == 0 and json.loads(out)["host_capacity_tokens"] == 400000
    assert err == "kvmem-replay: the native engine does not cover a host tier yet: the Python engine replays it\n"
    code, out, err = run(capsys, *FEW, "--sweep", "100000,200000", "--eviction-policy", "s3fifo", "--jobs", "1")
    assert code == 0 and err.startswith("kvmem-replay: the native engine does not cover s3fifo eviction yet: the "
                                        "Python engine replays them\n")
    code, out, err = run(capsys, *SMALL, "--replicas", "2")
    assert code == 0 and err.startswith("kvmem-replay: the native engine does not cover --replicas yet: the Python "
                                        "engine replays the cluster\n")
    code, out, err = run(capsys, *SMALL, "--engine", "python", "--host-capacity-tokens", "400000")
    assert code == 0 and err == ""  # asked for: nothing to say


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
def test_a_policy_comparison_replays_what_it_can_on_the_native_engine(capsys):
    code, out, err = run(capsys, *SMALL, "--compare-policies", "fifo,s3fifo", "--jobs", "1")
    assert code == 0
    assert err.splitlines()[0] == ("kvmem-replay: the native engine does not cover s3fifo eviction, belady eviction "
                                   "yet: the Python engine replays those 2 of the 4 replays")


@needs_native
def test_the_native_path_imports_no_torch():
    # kvmem/__init__.py and kvmem.replay.config import torch today (issue 35): the package is entered without its
    # __init__, and the configuration is a plain namespace with ReplayConfig's fields.
    code = f"""
import sys, types
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "triton"):
            raise ImportError("torch is not installed here")
sys.meta_path.insert(0, NoTorch())
package = types.ModuleType("kvmem")
package.__path__ = [{str(REPO / "kvmem")!r}]
sys.modules["kvmem"] = package
from kvmem.replay import native_replay
from kvmem.replay.traces import read_trace, default_trace_path
trace = read_trace(default_trace_path(), limit=40)
config = types.SimpleNamespace(capacity_tokens=300000, max_context_len=trace.max_context_len, page_size=16,
    eviction_policy="lru", schedule_policy="lpm", max_running=256, chunked_prefill_size=8192, honour_arrivals=True,
    host_capacity_tokens=None, cache_decode_pages=True, in_batch_prefix_caching=False, pin_prefix_tokens=0,
    pin_budget=0.2, gpu=None, context_len=trace.max_context_len, hybrid=None)
report = native_replay.replay(trace, config)
assert "torch" not in sys.modules and report.requests == 40, report
print("ok", report.hit_rate)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert done.returncode == 0 and done.stdout.startswith("ok "), done.stderr[-2000:]
