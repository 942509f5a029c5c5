"""The benchmark scripts run end to end in their short mode and print the JSON they document.

The SGLang side is pointed at a python that does not exist, so each report must say it was skipped
rather than fail; timing figures are not checked here (they belong to the scripts' own runs).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
NO_PEER = ["--sglang-python", "/nonexistent/python"]


def run_script(name: str, *args: str) -> dict:
    # Without the interpreter flag conftest sets, the scripts take the torch fallbacks on the CPU as a
    # user's run would; under the interpreter the scheduler benchmark alone takes minutes.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPTS / name), *args], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("name", ["bench_allocator.py", "bench_radix_cache.py", "bench_scheduler.py"])
def test_peer_benchmark_without_sglang(name, tmp_path):
    out = tmp_path / "report.json"
    report = run_script(name, "--quick", "--out", str(out), *NO_PEER)
    assert json.loads(out.read_text()) == report
    assert report["rows"] and all(row["kvmem_us"] > 0 for row in report["rows"])
    assert "not found: SGLang side skipped" in report["raw"]["sglang"]["error"]
    assert not any("sglang_us" in row for row in report["rows"])


def test_kv_indices_benchmark_on_cpu():
    report = run_script("bench_kv_indices.py", "--device", "cpu", "--quick")
    shapes = {(r["bs"], r["tokens_per_request"]) for r in report["results"]}
    assert shapes == {(1, 1024), (1, 8192), (64, 1024), (64, 8192)}
    assert all(r["torch_fallback_us"] > 0 for r in report["results"])


def test_event_benchmark_reports_throughput_and_bytes_per_event():
    report = run_script("bench_events.py", "--quick")
    assert {(r["workload"], r["page_size"], r["wire_format"]) for r in report["rows"]} == {
        (w, p, f) for w in ("cache", "one_page") for p in (16, 1) for f in ("map", "array")}
    for row in report["rows"]:
        assert row["events"] > 0 and row["bytes_per_event"] > 0 and row["one_page_event_bytes"] > 0
        if row["wire_format"] == "map":  # --quick measures throughput in the map form only
            assert row["publish_events_per_s"] > 0 and row["dropped"] == 0
    assert {r["page_size"] for r in report["cache_hook"]} == {16, 1}
