"""What the benchmark scripts share: their command line, the SGLang peer run, and the JSON report.

Each benchmark times kvmem in this process, then re-runs itself with ``--peer sglang`` under the
python of a venv holding SGLang (../shared/peers/setup_sglang.sh makes one), so that one run
holds both sides and their ratio is taken on the same machine at the same time.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
from pathlib import Path
from types import ModuleType

DEFAULT_DRIVER = Path(__file__).resolve().parents[2] / "shared" / "peers" / "sglang_driver.py"


def parser(doc: str | None, quick_help: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sglang-python", default="/tmp/sglang-peer/bin/python",
                    help="python of a venv with SGLang installed (the SGLang side is skipped if missing)")
    ap.add_argument("--sglang-driver", default=str(DEFAULT_DRIVER),
                    help="the peer harness whose import_sglang() loads SGLang on the CPU")
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--out", help="also write the JSON report here")
    ap.add_argument("--peer", choices=["sglang"], help=argparse.SUPPRESS)
    return ap


def load_driver(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("sglang_driver", path)
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)
    return driver


def run_peer(script: str, args: argparse.Namespace, *extra: str) -> dict:
    """Run ``script`` as the SGLang side; its last stdout line is its JSON result."""
    if not os.path.exists(args.sglang_python):
        return {"error": f"{args.sglang_python} not found: SGLang side skipped"}
    cmd = [args.sglang_python, script, "--peer", "sglang", "--sglang-driver", args.sglang_driver, *extra]
    if args.quick:
        cmd.append("--quick")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": f"SGLang side failed (exit {proc.returncode}): {proc.stderr[-3000:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def emit(report: dict, out: str | None) -> None:
    text = json.dumps(report, indent=1)
    if out:
        Path(out).write_text(text + "\n")
    print(text)
