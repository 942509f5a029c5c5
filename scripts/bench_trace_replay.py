#!/usr/bin/env python3
"""kvmem-replay's engines beside NVIDIA Dynamo's offline trace replay, in one run: wall, peak RSS and hit rate of
each side, per trace and page size, as JSON.

Every run is a process of its own, timed from its start to its exit, its peak RSS read from the kernel (wait4):

    native           kvmem-replay --engine native, as a user runs it (the command imports torch today, through
                     kvmem/__init__.py: seconds of its wall and most of its memory; issue 35's light install drops it)
    native-no-torch  the same replay in a process where torch cannot be imported: kvmem.replay.native_replay, the
                     package entered without its __init__, as the numpy-only install will run it
    python           kvmem-replay --engine python, the reference
    dynamo           ../shared/peers/dynamo_replay.sh at the same capacity and block size (its vLLM mock engine; at
                     page 1, which that engine refuses, its SGLang one); "skipped" where its venv is missing
                     (bash ../shared/peers/dynamo_replay.sh setup)

Hit rates are kvmem's hit_rate and Dynamo's first_admission_prefix_cache_reused_ratio, counted alike (whole blocks,
at first admission); the clocks differ (kvmem's fixed StepCost, Dynamo's own timing model), so they agree only
roughly. `ratios`: each kvmem side's wall over Dynamo's (below 1: kvmem is faster).

    python scripts/bench_trace_replay.py [--traces conversation,synthetic] [--page-sizes 512,16,1]
        [--capacity-tokens 3000000] [--sides native,native-no-torch,python,dynamo] [--limit N] [--shared DIR]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvmem._checks import output_file_arg, positive_int_arg

import _peer  # scripts/_peer.py: the script's own folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
TRACES = {"conversation": "conversation_trace.jsonl", "synthetic": "synthetic_trace.jsonl"}
SIDES = ("native", "native-no-torch", "python", "dynamo")
DYNAMO_VENV = Path(os.environ.get("DYNAMO_PEER_VENV", "/tmp/dynamo-peer"))

LAUNCHER = """
import os, sys, time
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(f"{time.perf_counter() - t0} {usage.ru_maxrss} {os.waitstatus_to_exitcode(status)}")
"""
# The replay the CLI would run with these options, in a process where torch cannot be imported.
NO_TORCH = """
import json, sys, types
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "triton"):
            raise ImportError("torch is not installed here")
sys.meta_path.insert(0, NoTorch())
package = types.ModuleType("kvmem")
package.__path__ = [sys.argv[1]]
sys.modules["kvmem"] = package
from kvmem.replay import native_replay
from kvmem.replay.traces import read_trace
trace, capacity, page_size = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
trace = read_trace(trace, limit=int(sys.argv[5]) if len(sys.argv) > 5 else None)
config = types.SimpleNamespace(capacity_tokens=capacity, max_context_len=trace.max_context_len, page_size=page_size,
    eviction_policy="lru", schedule_policy="lpm", max_running=256, chunked_prefill_size=8192, honour_arrivals=True,
    host_capacity_tokens=None, cache_decode_pages=True, in_batch_prefix_caching=False, pin_prefix_tokens=0,
    pin_budget=0.2, gpu=None, context_len=min(trace.max_context_len, capacity // page_size * page_size))
print(json.dumps(native_replay.replay(trace, config).to_json()))
assert "torch" not in sys.modules
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", type=_peer.list_arg(_peer.choice_arg(tuple(TRACES))), default="conversation,synthetic",
                    help="Mooncake traces of ../shared/traces/mooncake, comma-separated")
    ap.add_argument("--page-sizes", type=_peer.list_arg(positive_int_arg), default="512,16,1",
                    help="page (block) sizes, comma-separated")
    ap.add_argument("--capacity-tokens", type=positive_int_arg, default=3_000_000, help="KV tokens of the one engine")
    ap.add_argument("--sides", type=_peer.list_arg(_peer.choice_arg(SIDES)), default=",".join(SIDES),
                    help="what to run, comma-separated")
    ap.add_argument("--limit", type=positive_int_arg, help="replay only each trace's first N requests")
    ap.add_argument("--shared", default=str(SHARED),
                    help=f"the folder with traces/mooncake and peers/ (default {SHARED})")
    ap.add_argument("--out", type=output_file_arg, help="also write the JSON report here")
    args = ap.parse_args(argv)
    for name in args.traces:
        if not (Path(args.shared) / "traces" / "mooncake" / TRACES[name]).is_file():
            ap.error(f"argument --traces: {Path(args.shared) / 'traces' / 'mooncake' / TRACES[name]} not found (see "
                     f"--shared)")
    return args


def timed(cmd: list[str]) -> dict:
    """Runs `cmd` to its end: wall seconds, peak RSS (MB), exit status, and its stdout and stderr. A small launcher
    forks it and reads its usage: a process forked from this one (torch imported) would count this one's memory as
    its own, the kernel keeping the high-water mark of the address space it execs away from."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err, \
            tempfile.NamedTemporaryFile("r") as usage:
        subprocess.run([sys.executable, "-S", "-c", LAUNCHER, usage.name, *cmd], stdout=out, stderr=err, text=True)
        wall, rss_kb, status = usage.read().split()
        out.seek(0)
        err.seek(0)
        return {"wall_s": round(float(wall), 3), "peak_rss_mb": round(int(rss_kb) / 1024, 1), "status": int(status),
                "stdout": out.read(), "stderr": err.read()}


def last_json(text: str) -> dict:
    return json.loads(text[text.index("{"):])


def kvmem_side(side: str, trace: Path, page_size: int, args: argparse.Namespace) -> dict:
    limit = [] if args.limit is None else [str(args.limit)]
    if side == "native-no-torch":
        cmd = [sys.executable, "-c", NO_TORCH, str(ROOT / "kvmem"), str(trace), str(args.capacity_tokens),
               str(page_size), *limit]
    else:
        cmd = [sys.executable, "-m", "kvmem.replay.cli", str(trace), "--capacity-tokens", str(args.capacity_tokens),
               "--page-size", str(page_size), "--engine", side.split("-")[0], "--json-only", "--no-progress",
               *(["--limit", *limit] if limit else [])]
    run = timed(cmd)
    if run["status"] != 0:
        return {"error": f"exit {run['status']}: {run['stderr'][-2000:]}"}
    report = last_json(run["stdout"])
    return {"wall_s": run["wall_s"], "peak_rss_mb": run["peak_rss_mb"], "replay_seconds": report["replay_seconds"],
            "hit_rate": report["hit_rate"], "requests": report["requests"], "steps": report["steps"],
            "notes": run["stderr"].strip() or None}


def dynamo_side(trace: Path, page_size: int, args: argparse.Namespace) -> dict:
    script = Path(args.shared) / "peers" / "dynamo_replay.sh"
    if not (DYNAMO_VENV / "bin" / "python").exists():
        return {"skipped": f"no Dynamo venv at {DYNAMO_VENV} (bash {script} setup)"}
    backend = "sglang" if page_size == 1 else "vllm"  # its vLLM engine refuses blocks of one token
    cmd = ["bash", str(script), str(trace), str(args.capacity_tokens), "--block-size", str(page_size),
           "--backend", backend, *(["--limit", str(args.limit)] if args.limit else [])]
    run = timed(cmd)
    if run["status"] != 0:
        return {"error": f"exit {run['status']}: {run['stderr'][-2000:]}"}
    summary = last_json(run["stdout"])["summary"]
    return {"wall_s": run["wall_s"], "peak_rss_mb": run["peak_rss_mb"], "backend": backend,
            "replay_seconds": round(summary["wall_time_ms"] / 1e3, 3),
            "hit_rate": round(summary["first_admission_prefix_cache_reused_ratio"], 6),
            "requests": summary["completed_requests"]}


def row(name: str, page_size: int, args: argparse.Namespace) -> dict:
    trace = Path(args.shared) / "traces" / "mooncake" / TRACES[name]
    sides = {side: dynamo_side(trace, page_size, args) if side == "dynamo" else kvmem_side(side, trace, page_size, args)
             for side in args.sides}
    dynamo = sides.get("dynamo", {})
    ratios = {f"{side}_wall_over_dynamo": round(r["wall_s"] / dynamo["wall_s"], 3)
              for side, r in sides.items() if side != "dynamo" and "wall_s" in r and "wall_s" in dynamo}
    return {"trace": name, "page_size": page_size, "capacity_tokens": args.capacity_tokens, **sides, "ratios": ratios}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    rows = []
    for name in args.traces:
        for page_size in args.page_sizes:
            rows.append(row(name, page_size, args))
            print(json.dumps({k: rows[-1][k] for k in ("trace", "page_size", "ratios")}), file=sys.stderr)
    _peer.emit({"rows": rows, "meta": {"cpus": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2),
                                       "python": platform.python_version(), "limit": args.limit,
                                       "wall_s": round(time.perf_counter() - t0, 1)}}, args.out)


if __name__ == "__main__":
    main()
