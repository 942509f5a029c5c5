"""kvmem's event bytes against vLLM's own msgspec classes, both ways (scripts/check_vllm_events.py).

Needs the vLLM peer venv (../shared/peers/setup_vllm.sh makes it; KVMEM_VLLM_PYTHON points elsewhere);
without it the test is skipped, saying so.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_vllm_events.py"
VLLM_PYTHON = os.environ.get("KVMEM_VLLM_PYTHON", "/tmp/vllm-peer/bin/python")


@pytest.mark.skipif(not os.path.exists(VLLM_PYTHON),
                    reason=f"no vLLM peer venv at {VLLM_PYTHON} (make it with ../shared/peers/setup_vllm.sh, or "
                           "set KVMEM_VLLM_PYTHON)")
def test_vllm_decodes_kvmems_events_and_kvmem_decodes_vllms():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--vllm-python", VLLM_PYTHON], capture_output=True,
                          text=True, timeout=600)
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["status"] == "ok" and report["skipped"] == [], report
    checks, n = report["vllm"], report["batches"]
    for name in ("vllm_decodes_kvmem_map", "vllm_decodes_kvmem_array", "vllm_decodes_kvmem_array_first_6_fields",
                 "vllm_extra_fields_at_default", "kvmem_decodes_vllm", "identical_bytes_once_repacked"):
        assert checks[name] == n, name


def test_a_check_whose_peer_is_missing_reports_it_skipped_not_ok(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--vllm-python", str(tmp_path / "no-python")],
                          capture_output=True, text=True, timeout=300)
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["status"] == "skipped" and report["skipped"] == ["vllm"], report
    assert "not found" in report["vllm"]["skipped"]
