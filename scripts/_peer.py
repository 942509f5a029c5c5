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


def check_points(requests, trace: str, points: list[list[str]], out: str | None, *, cluster: bool = False) -> None:
    """Parses each point's kvmem-replay options and builds its config (and, for a cluster, its runs) before any
    replay starts, and checks --out's folder: a bad option is then a one-line error at once (`usage_errors`),
    not a traceback after the work. Raises ValueError or the replay CLI's usage error."""
    from kvmem.replay.cli import _replay_config, build_parser
    from kvmem.replay.cluster_cli import cluster_runs

    if not points:
        raise ValueError("nothing to replay: the lists of points are empty")
    if out and not Path(out).resolve().parent.is_dir():
        raise ValueError(f"--out {out}: its folder does not exist")
    for argv in points:
        args = build_parser().parse_args([trace, *argv])
        config = _replay_config(args, requests)
        config.check_host_memory()
        if cluster:
            cluster_runs(args, config)


def usage_errors() -> tuple[type[Exception], ...]:
    """What check_points and reading a trace raise for bad input."""
    from kvmem.replay.cli import _UsageError
    from kvmem.replay.traces import TraceError

    return ValueError, RuntimeError, TraceError, _UsageError
