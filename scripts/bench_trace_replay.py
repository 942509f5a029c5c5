#!/usr/bin/env python3
"""kvmem-replay's engines beside NVIDIA Dynamo's offline trace replay, in one run: wall, peak RSS and hit rate of
each side, per trace and page size, for one engine and for clusters of --replicas engines behind a router, plus
kvmem-replay's --sweep and the compiled engine's extra build time, as JSON.

Every run is a process of its own, timed from its start to its exit, its peak RSS read from the kernel (wait4):

    native           kvmem-replay --engine native, as a user runs it (it imports no torch, installed or not)
    native-no-torch  the same command in a process where torch cannot be imported, as the planner's install (no
                     torch extra) runs it
    python           kvmem-replay --engine python, the reference
    dynamo           ../shared/peers/dynamo_replay.sh at the same capacity and block size (its vLLM mock engine; at
                     page 1, which that engine refuses, its SGLang one); "skipped" where its venv is missing
                     (bash ../shared/peers/dynamo_replay.sh setup)

A cluster row (`clusters`) replays the conversation trace on --replicas engines of --capacity-tokens each: kvmem's
--router round-robin and kv-overlap beside Dynamo's --workers with its round_robin and kv_router (--cluster-sides;
the Python engine's 10 x 3M replays take minutes, so it is left out unless asked for). `sweep`: the wall and peak
RSS of `kvmem-replay TRACE --sweep` (6 capacities around --capacity-tokens, --jobs 2) on the native engine. `build`:
`pip wheel --no-deps --no-build-isolation .` of this checkout with and without a working C++ compiler, and their
difference, the engine's extra build time.

Hit rates are kvmem's hit_rate and Dynamo's first_admission_prefix_cache_reused_ratio, counted alike (whole blocks,
at first admission); the clocks differ (kvmem's fixed StepCost, Dynamo's own timing model), so they agree only
roughly. `ratios`: each kvmem side's wall and peak RSS over Dynamo's (below 1: kvmem is faster, or smaller).

    python scripts/bench_trace_replay.py [--traces conversation,synthetic] [--page-sizes 512,16,1]
        [--capacity-tokens 3000000] [--sides native,native-no-torch,python,dynamo] [--replicas 10]
        [--cluster-page-sizes 512,1] [--routers round-robin,kv-overlap] [--cluster-sides native,native-no-torch,dynamo]
        [--no-clusters] [--no-sweep] [--no-build] [--limit N] [--shared DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
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
ROUTERS = {"round-robin": "round_robin", "kv-overlap": "kv_router"}  # kvmem's router -> Dynamo's
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
# kvmem-replay in a process where torch cannot be imported (None in sys.modules), as a planner's install runs it.
NO_TORCH = """
import sys
sys.modules["torch"] = sys.modules["triton"] = None
from kvmem.replay.cli import main
status = main(sys.argv[1:])
assert sys.modules["torch"] is None, "the replay imported torch"
sys.exit(status)
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
    ap.add_argument("--replicas", type=positive_int_arg, default=10, help="engines of a cluster row")
    ap.add_argument("--cluster-page-sizes", type=_peer.list_arg(positive_int_arg), default="512,1",
                    help="page sizes of the cluster rows, comma-separated")
    ap.add_argument("--no-clusters", action="store_true", help="skip the cluster rows")
    ap.add_argument("--routers", type=_peer.list_arg(_peer.choice_arg(tuple(ROUTERS))), default=",".join(ROUTERS),
                    help="kvmem routers of the cluster rows, each beside its Dynamo counterpart")
    ap.add_argument("--cluster-sides", type=_peer.list_arg(_peer.choice_arg(SIDES)),
                    default="native,native-no-torch,dynamo", help="what to run for a cluster row, comma-separated")
    ap.add_argument("--no-sweep", action="store_true", help="skip the --sweep row")
    ap.add_argument("--no-build", action="store_true", help="skip the build-time row")
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


def kvmem_side(side: str, trace: Path, page_size: int, args: argparse.Namespace, router: str | None = None) -> dict:
    """One kvmem replay of `trace` (a cluster of args.replicas behind `router` when given)."""
    limit = [] if args.limit is None else [str(args.limit)]
    entry = ["-c", NO_TORCH] if side == "native-no-torch" else ["-m", "kvmem.replay.cli"]
    cluster = [] if router is None else ["--replicas", str(args.replicas), "--router", router]
    cmd = [sys.executable, *entry, str(trace), "--capacity-tokens", str(args.capacity_tokens), "--page-size",
           str(page_size), "--engine", side.split("-")[0], "--json-only", "--no-progress",
           *(["--limit", *limit] if limit else []), *cluster]
    run = timed(cmd)
    if run["status"] != 0:
        return {"error": f"exit {run['status']}: {run['stderr'][-2000:]}"}
    report = last_json(run["stdout"])
    out = {"wall_s": run["wall_s"], "peak_rss_mb": run["peak_rss_mb"], "replay_seconds": report["replay_seconds"],
           "hit_rate": report["hit_rate"], "requests": report["requests"]}
    out.update({"steps": report["steps"]} if router is None else {"makespan_s": report["makespan_seconds"]})
    return {**out, "notes": run["stderr"].strip() or None}


def dynamo_side(trace: Path, page_size: int, args: argparse.Namespace, router: str | None = None) -> dict:
    script = Path(args.shared) / "peers" / "dynamo_replay.sh"
    if not (DYNAMO_VENV / "bin" / "python").exists():
        return {"skipped": f"no Dynamo venv at {DYNAMO_VENV} (bash {script} setup)"}
    backend = "sglang" if page_size == 1 else "vllm"  # its vLLM engine refuses blocks of one token
    cluster = [] if router is None else ["--workers", str(args.replicas), "--router", ROUTERS[router]]
    cmd = ["bash", str(script), str(trace), str(args.capacity_tokens), "--block-size", str(page_size),
           "--backend", backend, *(["--limit", str(args.limit)] if args.limit else []), *cluster]
    run = timed(cmd)
    if run["status"] != 0:
        return {"error": f"exit {run['status']}: {run['stderr'][-2000:]}"}
    summary = last_json(run["stdout"])["summary"]
    return {"wall_s": run["wall_s"], "peak_rss_mb": run["peak_rss_mb"], "backend": backend,
            "replay_seconds": round(summary["wall_time_ms"] / 1e3, 3),
            "hit_rate": round(summary["first_admission_prefix_cache_reused_ratio"], 6),
            "requests": summary["completed_requests"]}


def with_ratios(sides: dict) -> dict:
    dynamo = sides.get("dynamo", {})
    ratios = {}
    for side, r in sides.items():
        for what, key in (("wall", "wall_s"), ("rss", "peak_rss_mb")):
            if side != "dynamo" and key in r and key in dynamo:
                ratios[f"{side}_{what}_over_dynamo"] = round(r[key] / dynamo[key], 3)
    return {**sides, "ratios": ratios}


def row(name: str, page_size: int, args: argparse.Namespace, router: str | None = None) -> dict:
    trace = Path(args.shared) / "traces" / "mooncake" / TRACES[name]
    sides = {side: dynamo_side(trace, page_size, args, router) if side == "dynamo"
             else kvmem_side(side, trace, page_size, args, router)
             for side in (args.sides if router is None else args.cluster_sides)}
    cluster = {} if router is None else {"replicas": args.replicas, "router": router}
    return {"trace": name, "page_size": page_size, "capacity_tokens": args.capacity_tokens, **cluster,
            **with_ratios(sides)}


def sweep_row(args: argparse.Namespace) -> dict:
    """kvmem-replay --sweep on the conversation trace: 6 capacities from 1/8 to 4 times --capacity-tokens."""
    trace = Path(args.shared) / "traces" / "mooncake" / TRACES["conversation"]
    run = timed([sys.executable, "-m", "kvmem.replay.cli", str(trace), "--sweep", "--capacity-tokens",
                 str(args.capacity_tokens), "--jobs", "2", "--json-only", "--no-progress",
                 *(["--limit", str(args.limit)] if args.limit else [])])
    if run["status"] != 0:
        return {"error": f"exit {run['status']}: {run['stderr'][-2000:]}"}
    points = last_json(run["stdout"])["sweep"]
    return {"trace": "conversation", "wall_s": run["wall_s"], "peak_rss_mb": run["peak_rss_mb"],
            "capacities": [p["capacity_tokens"] for p in points], "hit_rates": [p["hit_rate"] for p in points],
            "notes": run["stderr"].strip() or None}


def build_row() -> dict:
    """`pip wheel` of this checkout's files (git ls-files) with and without a working C++ compiler."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        for name in filter(None, files.decode().split("\0")):
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
        for label, env in (("with_compiler_s", {}), ("without_compiler_s", {"CXX": "/bin/false", "CC": "/bin/false"})):
            shutil.rmtree(src / "build", ignore_errors=True)
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                                   "-w", str(Path(tmp) / label), str(src)], env={**os.environ, **env},
                                  capture_output=True, text=True)
            out[label] = round(time.perf_counter() - t0, 1)
            if done.returncode != 0:
                return {"error": f"{label}: exit {done.returncode}: {done.stderr[-2000:]}"}
            out[label.replace("_s", "_native_built")] = any("_native" in n for w in (Path(tmp) / label).iterdir()
                                                            for n in _wheel_names(w))
    out["extra_build_s"] = round(out["with_compiler_s"] - out["without_compiler_s"], 1)
    return out


def _wheel_names(wheel: Path) -> list[str]:
    import zipfile
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    loads = [os.getloadavg()[0]]
    rows, clusters = [], []
    for name in args.traces:
        for page_size in args.page_sizes:
            rows.append(row(name, page_size, args))
            loads.append(os.getloadavg()[0])
            print(json.dumps({k: rows[-1][k] for k in ("trace", "page_size", "ratios")}), file=sys.stderr)
    for page_size in [] if args.no_clusters else args.cluster_page_sizes:
        for router in args.routers:
            clusters.append(row("conversation", page_size, args, router))
            loads.append(os.getloadavg()[0])
            print(json.dumps({k: clusters[-1][k] for k in ("router", "page_size", "ratios")}), file=sys.stderr)
    out = {"rows": rows, "clusters": clusters}
    if not args.no_sweep:
        out["sweep"] = sweep_row(args)
        loads.append(os.getloadavg()[0])
    if not args.no_build:
        out["build"] = build_row()
        loads.append(os.getloadavg()[0])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    out["meta"] = {"commit": commit.strip(), "cpus": os.cpu_count(), "loadavg_1m": [round(x, 1) for x in loads],
                   "python": platform.python_version(), "limit": args.limit,
                   "wall_s": round(time.perf_counter() - t0, 1)}
    _peer.emit(out, args.out)


if __name__ == "__main__":
    main()
