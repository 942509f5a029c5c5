"""`kvmem-replay`: replay a trace through kvmem's scheduler and radix cache, print a JSON report.

The JSON report is the last thing written to stdout; warnings and the progress bar go to stderr. Every
user error (bad option, unreadable or malformed trace, unknown model) is one line on stderr and exit
status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from kvmem.replay.compare import DEFAULT_POLICIES
from kvmem.replay.config import (
    DEFAULT_PCIE_GBPS,
    DEFAULT_STORAGE_GBPS,
    EVICTION_POLICIES,
    SCHEDULE_POLICIES,
    WRITE_POLICIES,
    ReplayConfig,
)
from kvmem.replay.report import require_matplotlib, write_sweep_plot
from kvmem.replay.traces import Trace, TraceError, default_trace_path, read_trace

PROG = "kvmem-replay"
DEFAULT_CAPACITY_TOKENS = 1 << 18  # 262,144: e.g. Llama-3-8B's bf16 KV in 32 GiB
SWEEP_FACTORS = (1 / 8, 1 / 4, 1 / 2, 1, 2, 4)  # --sweep without a list: these multiples of the capacity
SYNTHETIC_FORMATS = ("synthetic-system", "synthetic-chat", "synthetic-agent")
MAX_WARNINGS = 20  # skipped-line warnings printed one by one; the rest are counted


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of argparse's usage block
        raise _UsageError(message)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative int, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative int, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def _policy_list(text: str) -> list[str]:
    names = [part.strip().lower() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in EVICTION_POLICIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated eviction policies of {', '.join(EVICTION_POLICIES)}"
                                         f", got {text!r}")
    return names


def _capacity_list(text: str) -> list[int]:
    try:
        return [_positive_int(part) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive token counts, got {text!r} "
                                         "(a TRACE goes before --sweep)") from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Replay an LLM request trace through kvmem's scheduler and radix "
                "cache and report hit rate, evictions, memory use and cache-operation time as JSON.")
    p.add_argument("trace", nargs="?", metavar="TRACE",
                   help="trace file (Mooncake or kvmem JSONL); default: the embedded Mooncake excerpt")
    p.add_argument("--format", default="auto", choices=("auto", "mooncake", "jsonl") + SYNTHETIC_FORMATS,
                   help="trace format, or a built-in synthetic workload (no TRACE then); default auto")
    cap = p.add_mutually_exclusive_group()
    cap.add_argument("--capacity-tokens", type=_positive_int, metavar="N",
                     help=f"KV-cache capacity in tokens (default {DEFAULT_CAPACITY_TOKENS})")
    cap.add_argument("--gpu-mem-gb", type=_positive_float, metavar="G",
                     help="KV-cache memory in GiB; needs --model")
    p.add_argument("--model", metavar="CONFIG", help="model preset (see kvmem.sizing): sizes --gpu-mem-gb and "
                   "--host-mem-gb, and prices copies between tiers (default: llama-3-8b's bytes per token)")
    p.add_argument("--kv-cache-dtype", metavar="DTYPE", help="KV storage dtype for --gpu-mem-gb (default auto)")
    p.add_argument("--page-size", type=_positive_int, default=1, metavar="P", help="tokens per page (default 1)")
    host = p.add_mutually_exclusive_group()
    host.add_argument("--host-capacity-tokens", type=_positive_int, metavar="N",
                      help="a host-memory tier of N tokens under the device cache (HiCache-style)")
    host.add_argument("--host-mem-gb", type=_positive_float, metavar="G", help="the host tier in GiB; needs --model")
    p.add_argument("--write-policy", default="write_through", choices=WRITE_POLICIES,
                   help="when the host tier copies device pages (default write_through)")
    p.add_argument("--h2d-gbps", type=_positive_float, default=DEFAULT_PCIE_GBPS, metavar="B",
                   help=f"host-to-device copy bandwidth, GB/s (default {DEFAULT_PCIE_GBPS:g}, PCIe 5 x16)")
    p.add_argument("--d2h-gbps", type=_positive_float, default=DEFAULT_PCIE_GBPS, metavar="B",
                   help=f"device-to-host copy bandwidth, GB/s (default {DEFAULT_PCIE_GBPS:g})")
    p.add_argument("--storage", metavar="SPEC", help="a storage tier under the host tier: file:DIR (a directory, "
                   "kept across runs) or mooncake:HOST:PORT (a Mooncake master; see kvmem.storage.mooncake_server)")
    p.add_argument("--storage-metadata", default="P2PHANDSHAKE", metavar="URL",
                   help="the Mooncake metadata server (default P2PHANDSHAKE: none)")
    p.add_argument("--storage-capacity-tokens", type=_positive_int, metavar="N",
                   help="what a file store may hold, in tokens (default: unbounded)")
    p.add_argument("--storage-gbps", type=_positive_float, default=DEFAULT_STORAGE_GBPS, metavar="B",
                   help=f"storage bandwidth, GB/s (default {DEFAULT_STORAGE_GBPS:g})")
    p.add_argument("--eviction-policy", default="lru", choices=EVICTION_POLICIES,
                   help="which cached prefixes go first (default lru; belady: the offline optimum)")
    p.add_argument("--compare-policies", nargs="?", const=list(DEFAULT_POLICIES), type=_policy_list,
                   metavar="POLICIES", help="replay under several eviction policies (comma-separated; default: "
                   f"{','.join(DEFAULT_POLICIES)}; lru and belady always run), print a table on stderr, and with "
                   "--plot a hit-rate-by-policy chart")
    p.add_argument("--jobs", type=_positive_int, default=os.cpu_count() or 1, metavar="J",
                   help="replays run at once by --compare-policies (processes; default: the CPU count)")
    p.add_argument("--pin-prefix-tokens", type=_non_negative_int, default=0, metavar="N",
                   help="pin the first N tokens of each finished request's prompt (a system prompt; default 0: none)")
    p.add_argument("--pin-budget", type=_fraction, default=0.2, metavar="F",
                   help="share of the capacity pins may hold; older pins past it degrade (default 0.2)")
    p.add_argument("--schedule-policy", default="lpm", choices=SCHEDULE_POLICIES)
    p.add_argument("--max-running", type=_positive_int, default=256, metavar="R",
                   help="most requests running at once (default 256)")
    p.add_argument("--chunked-prefill-size", type=int, default=8192, metavar="C",
                   help="prompt tokens per prefill step; 0 or less: no chunking (default 8192)")
    p.add_argument("--arrivals", default="honour", choices=("honour", "all-at-once"),
                   help="honour the trace's arrival times, or queue everything at time 0 (default honour)")
    p.add_argument("--limit", type=_positive_int, metavar="N",
                   help="replay only the first N requests (synthetic: generate N; default 1000)")
    p.add_argument("--on-error", default="stop", choices=("stop", "skip"),
                   help="at a malformed trace line: stop with its line number, or skip it (default stop)")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR (needs matplotlib)")
    p.add_argument("--sweep", nargs="?", const=[], type=_capacity_list, metavar="CAPACITIES",
                   help="replay at several capacities (comma-separated tokens; default: the capacity "
                        "x 1/8, 1/4, 1/2, 1, 2, 4) and report the hit-rate curve")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--seed", type=_non_negative_int, default=0, help="seed for synthetic workloads and the simulator")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (0 ok, 2 user error, 130 interrupted)."""
    try:
        args = build_parser().parse_args(argv)
    except _UsageError as e:
        return _error(str(e))
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    try:
        return _run(args)
    except KeyboardInterrupt:
        return _error("interrupted", 130)


def _run(args: argparse.Namespace) -> int:
    try:
        if args.plot:
            require_matplotlib()
            _make_plot_dir(args.plot)
        trace = _load_trace(args)
        config = _replay_config(args, trace)
        capacities = _sweep_capacities(args, config.capacity_tokens)
        for capacity in capacities or [config.capacity_tokens]:
            dataclasses.replace(config, capacity_tokens=capacity).check_host_memory()
        _check_storage(config)
    except TraceError as e:
        hint = " (--on-error skip skips malformed lines)" if e.line is not None and args.on_error == "stop" else ""
        return _error(f"{e}{hint}")
    except (ValueError, RuntimeError) as e:
        return _error(str(e))
    _warn_skipped(trace)

    from kvmem.replay.simulator import replay  # imports torch: only once the arguments are good

    progress = not args.no_progress
    trace_format = args.format if args.format in SYNTHETIC_FORMATS else trace.format
    out = {"trace": trace.name, "format": trace_format, "skipped_lines": len(trace.skipped),
           "config": dataclasses.asdict(config)}
    if args.compare_policies:
        return _compare(args, trace, config, capacities, out)
    if capacities is None:
        reports = [replay(trace, config, progress=progress)]
        out.update(reports[0].to_json())
    else:
        reports = [replay(trace, dataclasses.replace(config, capacity_tokens=c), progress=progress)
                   for c in capacities]
        out["sweep"] = [r.to_json() for r in reports]
    if args.plot:
        try:
            plots = reports[0].write_plots(args.plot) if capacities is None else [write_sweep_plot(reports, args.plot)]
        except OSError as e:
            return _error(f"cannot write plots to {args.plot}: {e.strerror or e}")
        out["plots"] = [str(p) for p in plots]
    sys.stdout.write(json.dumps(out, indent=2) + "\n")
    sys.stdout.flush()
    return 0


def _compare(args: argparse.Namespace, trace: Trace, config: ReplayConfig, capacities: list[int] | None,
             out: dict) -> int:
    from kvmem.replay.compare import compare_policies, format_table, write_policy_plot

    result = compare_policies(trace, config, args.compare_policies, capacities or [config.capacity_tokens], args.jobs,
                              functools.partial(_load_trace, args))
    print(format_table(result), file=sys.stderr)
    out["compare"] = result
    if args.plot:
        try:
            out["plots"] = [str(write_policy_plot(result, args.plot))]
        except OSError as e:
            return _error(f"cannot write plots to {args.plot}: {e.strerror or e}")
    sys.stdout.write(json.dumps(out, indent=2) + "\n")
    sys.stdout.flush()
    return 0


def _error(message: str, status: int = 2) -> int:
    print(f"{PROG}: error: {message.splitlines()[0] if message else 'failed'}", file=sys.stderr)
    return status


def _make_plot_dir(directory: str) -> None:
    """Creates --plot DIR before the replay, so that a bad DIR fails before minutes of work, not after."""
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RuntimeError(f"cannot write plots to {directory}: {e.strerror or e}") from None


def _load_trace(args: argparse.Namespace) -> Trace:
    if args.format in SYNTHETIC_FORMATS:
        if args.trace is not None:
            raise ValueError(f"--format {args.format} generates its workload; drop TRACE ({args.trace})")
        from kvmem.replay.synthetic import GENERATORS
        return GENERATORS[args.format](args.limit or 1000, seed=args.seed)
    if args.trace is None and args.format == "jsonl":
        raise ValueError("--format jsonl needs a TRACE file (the embedded default is Mooncake)")
    path = args.trace if args.trace is not None else default_trace_path()
    return read_trace(path, args.format, limit=args.limit, on_error=args.on_error)


def _replay_config(args: argparse.Namespace, trace: Trace) -> ReplayConfig:
    if args.kv_cache_dtype is not None and args.gpu_mem_gb is None and args.host_mem_gb is None:
        raise ValueError("--kv-cache-dtype only sizes the cache together with --gpu-mem-gb or --host-mem-gb")
    tiers = {}
    if args.model is not None or args.gpu_mem_gb is not None or args.host_mem_gb is not None:
        model_bytes = _bytes_per_token(args)
        tiers["kv_bytes_per_token"] = model_bytes
    capacity = (_tokens_in(args.gpu_mem_gb, "--gpu-mem-gb", args) if args.gpu_mem_gb is not None
                else args.capacity_tokens or DEFAULT_CAPACITY_TOKENS)
    if args.host_mem_gb is not None:
        tiers["host_capacity_tokens"] = _tokens_in(args.host_mem_gb, "--host-mem-gb", args)
    elif args.host_capacity_tokens is not None:
        tiers["host_capacity_tokens"] = args.host_capacity_tokens
    return ReplayConfig(
        capacity_tokens=capacity, max_context_len=trace.max_context_len, page_size=args.page_size,
        eviction_policy=args.eviction_policy, schedule_policy=args.schedule_policy,
        max_running=args.max_running,
        chunked_prefill_size=args.chunked_prefill_size if args.chunked_prefill_size > 0 else None,
        honour_arrivals=args.arrivals == "honour", seed=args.seed, write_policy=args.write_policy,
        h2d_gbps=args.h2d_gbps, d2h_gbps=args.d2h_gbps, storage=args.storage, storage_metadata=args.storage_metadata,
        storage_capacity_tokens=args.storage_capacity_tokens, storage_gbps=args.storage_gbps,
        pin_prefix_tokens=args.pin_prefix_tokens, pin_budget=args.pin_budget, **tiers)


def _check_storage(config: ReplayConfig) -> None:
    """Opens the storage tier once before the replay, so that an unreachable store is a one-line error."""
    if config.storage is None:
        return
    from kvmem.storage import open_store

    try:
        open_store(config.storage, metadata_server=config.storage_metadata).close()
    except OSError as e:
        raise RuntimeError(f"--storage {config.storage}: {e.strerror or e}") from None


def _model(args: argparse.Namespace):
    from kvmem import sizing

    if args.model is None:
        option = "--gpu-mem-gb" if args.gpu_mem_gb is not None else "--host-mem-gb"
        raise ValueError(f"{option} needs --model to know the bytes per token")
    try:
        return sizing.get_model_config(args.model)
    except ValueError as e:
        raise ValueError(f"--model: {e}") from None


def _bytes_per_token(args: argparse.Namespace) -> int:
    from kvmem import sizing

    return sizing.bytes_per_token(_model(args), args.kv_cache_dtype or "auto")


def _tokens_in(mem_gb: float, option: str, args: argparse.Namespace) -> int:
    from kvmem import sizing

    tokens = sizing.tokens_for_budget(_model(args), gpu_mem_gb=mem_gb, page_size=args.page_size,
                                      kv_cache_dtype=args.kv_cache_dtype or "auto")
    if tokens <= 0:
        raise ValueError(f"{option} {mem_gb} holds no {args.page_size}-token page of {args.model}'s KV cache")
    return tokens


def _sweep_capacities(args: argparse.Namespace, capacity: int) -> list[int] | None:
    if args.sweep is None:
        return None
    capacities = args.sweep or [max(int(capacity * f), args.page_size) for f in SWEEP_FACTORS]
    for c in capacities:
        if c < args.page_size:
            raise ValueError(f"--sweep capacity {c} is less than one page (--page-size {args.page_size})")
    return sorted(set(capacities))


def _warn_skipped(trace: Trace) -> None:
    for err in trace.skipped[:MAX_WARNINGS]:
        print(f"{PROG}: warning: {err} (skipped)", file=sys.stderr)
    if len(trace.skipped) > MAX_WARNINGS:
        print(f"{PROG}: warning: {len(trace.skipped) - MAX_WARNINGS} more malformed lines skipped",
              file=sys.stderr)
