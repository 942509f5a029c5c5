#!/usr/bin/env python3
"""What a replay's storage tier costs the machine: files, bytes and wall time of `kvmem-replay --storage`.

Runs `kvmem-replay TRACE --storage SPEC --no-progress --json-only [REPLAY OPTIONS]` once per store of --stores, in
a subprocess (its wall time and peak memory are its own): "file" is a file store in a fresh folder under --dir,
removed afterwards; "sim" or "sim:N" a simulated store. A row per store: the command, the files and bytes the store
left (apparent and allocated), the replay's wall time and peak RSS, and its report's storage figures. A replay
past --timeout-s is stopped and its row says so, with what the store held by then.

    python scripts/storage_footprint.py TRACE --stores file,sim -- --limit 500 --host-capacity-tokens 2000000

Prints one JSON object: {"trace", "rows"}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from kvmem._checks import positive_float_arg

REPORT_FIELDS = ("requests", "hit_rate", "storage_hit_rate", "stored_tokens", "prefetched_tokens",
                 "storage_failed_ops", "replay_seconds")


def store_spec(name: str) -> str:
    if name == "file" or name == "sim" or (name.startswith("sim:") and name[4:].isdigit()):
        return name
    raise argparse.ArgumentTypeError(f"a store must be file, sim or sim:CAPACITY_TOKENS, got {name!r}")


def footprint(folder: str) -> dict:
    """Files, apparent bytes and allocated bytes under `folder`."""
    files = size = allocated = 0
    for root, _, names in os.walk(folder):
        for name in names:
            st = os.lstat(os.path.join(root, name))
            files, size, allocated = files + 1, size + st.st_size, allocated + st.st_blocks * 512
    return {"files": files, "bytes": size, "disk_bytes": allocated}


def run_store(trace: str, store: str, replay_args: list[str], parent: str, timeout_s: float) -> dict:
    folder = tempfile.mkdtemp(prefix="kvmem-footprint-", dir=parent) if store == "file" else None
    spec = f"file:{folder}" if folder else store
    cmd = [sys.executable, "-m", "kvmem.replay.cli", trace, "--storage", spec, "--no-progress", "--json-only",
           *replay_args]
    row = {"command": " ".join(["kvmem-replay", *cmd[3:]]).replace(folder or "\0", "DIR"), "store": store}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        timer = threading.Timer(timeout_s, proc.kill)  # the replay's own usage comes from wait4: no communicate()
        timer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        timer.cancel()
        row["wall_s"] = round(time.perf_counter() - start, 1)
        row["max_rss_mb"] = round(usage.ru_maxrss / 1024)
        code = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        report = json.loads(out.read()) if code == 0 else {}
        row["exit"] = code if code >= 0 else "stopped after --timeout-s"
        if code > 0:
            row["error"] = err.read().decode(errors="replace").strip().splitlines()[-1:]
    if folder:
        row.update(footprint(folder))
        shutil.rmtree(folder, ignore_errors=True)
    else:
        row.update(files=0, bytes=0, disk_bytes=0)
    row.update({field: report.get(field) for field in REPORT_FIELDS})
    return row


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, replay_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--stores", type=lambda text: [store_spec(s) for s in text.split(",")], default=["file", "sim"],
                    help="comma-separated: file, sim, sim:CAPACITY_TOKENS (default file,sim)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where file stores are made (default: the temp dir)")
    ap.add_argument("--timeout-s", type=positive_float_arg, default=3600.0, help="stop a replay after this long")
    args = ap.parse_args(ours)
    if not os.path.isdir(args.dir):
        ap.error(f"--dir {args.dir!r} is not a directory")
    rows = []
    for store in args.stores:
        rows.append(run_store(args.trace, store, replay_args, args.dir, args.timeout_s))
        print(json.dumps(rows[-1]), file=sys.stderr)
    print(json.dumps({"trace": args.trace, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
