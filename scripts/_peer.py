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
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
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


def parse_sides(ap: argparse.ArgumentParser, argv: list[str] | None,
                sglang_main: Callable[[argparse.Namespace], object]) -> argparse.Namespace | None:
    """Parses the command line. Run as the SGLang side (``--peer sglang``), runs `sglang_main` and returns None; else
    puts this checkout's kvmem first on sys.path, checks the shared options (`check_args`) and returns the args."""
    args = ap.parse_args(argv)
    if args.peer == "sglang":
        sglang_main(args)
        return None
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    check_args(ap, args)
    return args


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The kvmem side's checks of the shared options, as usage errors before its first row: a --sglang-python that
    is there but cannot run, the --sglang-driver that python would run missing, an --out that could not be written
    at the end, and a negative --seed where the script has one (numpy's generators refuse it). A --sglang-python
    that does not exist still skips the SGLang side. Not argparse types: the SGLang side parses the same command
    line under a python without kvmem, and is handed one the kvmem side checked."""
    from kvmem._checks import non_negative_int_arg, output_file_arg

    check_python(ap, "--sglang-python", args.sglang_python)
    if os.path.exists(args.sglang_python) and not os.path.isfile(args.sglang_driver):
        ap.error(f"argument --sglang-driver: {args.sglang_driver} not found (the SGLang side at --sglang-python "
                 f"{args.sglang_python} runs it)")
    check_value(ap, "--out", args.out, output_file_arg)
    check_value(ap, "--seed", getattr(args, "seed", None), non_negative_int_arg)


def check_value(ap: argparse.ArgumentParser, option: str, value, arg_type: Callable[[str], object]) -> None:
    """A usage error unless `value` (an option's parsed value; None when not given) passes the argparse type
    `arg_type`: a kvmem._checks type applied after parsing, where the peer's side parses without kvmem."""
    if value is not None:
        try:
            arg_type(str(value))
        except argparse.ArgumentTypeError as e:
            ap.error(f"argument {option}: {e}")


def check_python(ap: argparse.ArgumentParser, option: str, python: str) -> None:
    """A peer's python that is there but is not an executable file is a usage error (one that is not there skips
    that peer): running it would fail only after the kvmem side's work."""
    if os.path.exists(python) and not (os.path.isfile(python) and os.access(python, os.X_OK)):
        ap.error(f"argument {option}: {python} is not an executable file")


def list_arg(item: Callable[[str], object]) -> Callable[[str], list]:
    """An argparse type: a comma-separated list, one item at least, each parsed by the argparse type `item`."""
    def parse(text: str) -> list:
        parts = text.split(",")
        if not all(part.strip() for part in parts):
            what = "a comma-separated list" + (" without empty items" if text.strip() else "")
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        try:
            return [item(part) for part in parts]
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e} (in {text!r})" if len(parts) > 1 else str(e)) from None
    return parse


def choice_arg(choices: Sequence[str]) -> Callable[[str], str]:
    """An argparse type: one of `choices`, as given (for the items of a `list_arg`)."""
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(choices)}, got {text!r}")
        return text
    return parse


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


def hybrid_rounds(full: Callable[[], dict], hybrid: Callable[[], dict], rounds: int,
                  first: dict) -> list[tuple[dict, dict]]:
    """`rounds` rounds of (full(), hybrid()) results, full first in even rounds and hybrid first in odd ones; round
    0's full result is `first`, timed already."""
    out = [(first, hybrid())]
    for i in range(1, rounds):
        if i % 2:
            hy, kv = hybrid(), full()
        else:
            kv, hy = full(), hybrid()
        out.append((kv, hy))
    return out


def hybrid_rows(rounds: list[tuple[dict, dict]], works: Callable[[str], list[tuple]], goal: float) -> dict:
    """The hybrid report of a benchmark timed in rounds of (full-attention, hybrid) row medians in microseconds
    ({row: us}), run full then hybrid in even rounds and hybrid then full in odd ones, so that a drift of the machine
    favours neither side. Each row: both sides' mean, and where both did the same work in every round (`works(row)`:
    each round's (full, hybrid) work) each round's ratio (hybrid / full) and their median (`ratio`: a burst of noise
    on a shared machine spoils one round, not the row); else each round's work. Rows over `goal` are listed."""
    rows, over = [], []
    for name in rounds[0][1]:
        full = [kv[name] for kv, _ in rounds]
        hybrid = [hy[name] for _, hy in rounds]
        row = {"row": name, "kvmem_us": round(sum(full) / len(full), 2),
               "hybrid_us": round(sum(hybrid) / len(hybrid), 2)}
        work = works(name)
        if all(mine == theirs for mine, theirs in work):
            ratios = [h / f for f, h in zip(full, hybrid)]
            row["round_ratios"] = [round(r, 2) for r in ratios]
            row["ratio"] = round(statistics.median(ratios), 2)
            if row["ratio"] > goal:
                over.append(name)
        else:
            row["unequal_work"] = [{"kvmem": mine, "hybrid": theirs} for mine, theirs in work]
        rows.append(row)
    return {"rows": rows, "rounds": len(rounds),
            "goal": {f"within_{goal}x_on_every_row": not over and all("ratio" in r for r in rows), "rows_over": over}}


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
