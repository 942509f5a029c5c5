"""`kvmem-replay`: replay a trace through kvmem's scheduler and radix cache, print a JSON report.

The JSON report is the last thing written to stdout; warnings, the progress bar and a short human summary
(a table; `--json-only` leaves it out) go to stderr. Every user error (bad option, unreadable or malformed
trace, unknown model) is one line on stderr and exit status 2, never a traceback. With no arguments at all it
tours what kvmem is for: the embedded trace on a small GPU server at a few KV capacities, without and with
a host tier (`TOUR_ARGS`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import signal
import stat
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from kvmem._checks import (
    fraction_arg,
    non_negative_float_arg,
    non_negative_int_arg,
    positive_float_arg,
    positive_int_arg,
)
from kvmem._extras import INSTALL_TORCH, torch_available
from kvmem.replay.capacity import (
    Size,
    gpu_fit,
    gpus_needed,
    kv_gib,
    parse_gib_sizes,
    parse_token_sizes,
    tokens_in_gib,
)
from kvmem.replay.cluster_cli import add_cluster_arguments, cluster_runs, run_cluster
from kvmem.replay.compare import DEFAULT_POLICIES
from kvmem.replay.config import (
    DEFAULT_PCIE_GBPS,
    DEFAULT_STORAGE_GBPS,
    EVICTION_POLICIES,
    SCHEDULE_POLICIES,
    WRITE_POLICIES,
    ReplayConfig,
)
from kvmem.replay.cost import DEFAULT_MODEL, DEFAULT_STORAGE_LATENCY_US, GPUS, RooflineCost
from kvmem.replay.engine import (
    ENGINES,
    cluster_fallback_reason,
    engine_for,
    fallback_note,
    fallback_reason,
    requested_engine,
)
from kvmem.replay.pd_cli import add_pd_arguments, pd_runs, run_pd, slo_of
from kvmem.replay.report import format_summary, format_tokens, require_matplotlib, write_sweep_plots
from kvmem.replay.reuse import reuse_ceiling
from kvmem.replay.traces import Trace, TraceError, default_trace_path, read_trace
from kvmem.replay.workers import kill_workers, replay_all

PROG = "kvmem-replay"
DEFAULT_CAPACITY_TOKENS = 1 << 18  # 262,144: e.g. Llama-3-8B's bf16 KV in 32 GiB
SWEEP_FACTORS = (1 / 8, 1 / 4, 1 / 2, 1, 2, 4)  # --sweep without a list: these multiples of the capacity
SYNTHETIC_FORMATS = ("synthetic-system", "synthetic-chat", "synthetic-agent")
MAX_WARNINGS = 20  # skipped-line warnings printed one by one; the rest are counted
# `kvmem-replay` with no arguments: the embedded trace on 2 x H100 serving Llama-3-8B (busy enough at the
# trace's arrival rate for the cache to show in TTFT), at TOUR_FACTORS of the KV capacity their memory leaves,
# each without and with a host tier TOUR_HOST_FACTOR times the device's.
TOUR_ARGS = ("--gpu", "H100", "--tp", "2", "--model", DEFAULT_MODEL)
TOUR_FACTORS = (1 / 4, 1)
TOUR_HOST_FACTOR = 4


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of argparse's usage block
        raise _UsageError(message)


def _policy_list(text: str) -> list[str]:
    names = [part.strip().lower() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in EVICTION_POLICIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated eviction policies of {', '.join(EVICTION_POLICIES)}"
                                         f", got {text!r}")
    return names


def _target_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a share of the achievable hit rate in (0, 1], got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Replay an LLM request trace through kvmem's scheduler and radix "
                "cache and report hit rate, evictions, memory use and cache-operation time as JSON.")
    p.add_argument("trace", nargs="?", metavar="TRACE",
                   help="trace file (Mooncake or kvmem JSONL); default: the embedded Mooncake excerpt")
    p.add_argument("--format", default="auto", choices=("auto", "mooncake", "jsonl") + SYNTHETIC_FORMATS,
                   help="trace format, or a built-in synthetic workload (no TRACE then); default auto")
    cap = p.add_mutually_exclusive_group()
    cap.add_argument("--capacity-tokens", type=positive_int_arg, metavar="N",
                     help=f"KV-cache capacity in tokens (default {DEFAULT_CAPACITY_TOKENS})")
    cap.add_argument("--gpu-mem-gb", type=positive_float_arg, metavar="G",
                     help="KV-cache memory in GiB; needs --model")
    p.add_argument("--model", metavar="CONFIG", help="model preset (see kvmem.sizing): sizes --gpu-mem-gb and "
                   "--host-mem-gb, and prices copies between tiers (default: llama-3-8b's bytes per token)")
    p.add_argument("--kv-cache-dtype", metavar="DTYPE", help="KV storage dtype for --gpu-mem-gb (default auto)")
    p.add_argument("--full-attention-pools", action="store_true",
                   help="a hybrid --model (gpt-oss, Gemma 3, Llama 4, Qwen3-Next) on one pool sized as if every layer "
                        "were full attention, for comparison (default: window-aware pools, see docs/hybrid.md)")
    p.add_argument("--page-size", type=positive_int_arg, default=1, metavar="P", help="tokens per page (default 1)")
    host = p.add_mutually_exclusive_group()
    host.add_argument("--host-capacity-tokens", type=positive_int_arg, metavar="N",
                      help="a host-memory tier of N tokens under the device cache (HiCache-style)")
    host.add_argument("--host-mem-gb", type=positive_float_arg, metavar="G", help="the host tier in GiB; needs --model")
    p.add_argument("--write-policy", choices=WRITE_POLICIES,
                   help="when the host tier copies device pages (default write_through)")
    p.add_argument("--h2d-gbps", type=positive_float_arg, metavar="B",
                   help=f"host-to-device copy bandwidth, GB/s (default: the --gpu's host link, else "
                        f"{DEFAULT_PCIE_GBPS:g}, PCIe 5 x16)")
    p.add_argument("--d2h-gbps", type=positive_float_arg, metavar="B",
                   help=f"device-to-host copy bandwidth, GB/s (default: as --h2d-gbps, {DEFAULT_PCIE_GBPS:g})")
    p.add_argument("--storage", metavar="SPEC", help="a storage tier under the host tier: sim[:CAPACITY_TOKENS] (a "
                   "simulated store: its pages' keys, capacity and LRU eviction, no bytes written; for planning), "
                   "file:DIR (a directory of segment files, kept across runs) or mooncake:HOST:PORT (a Mooncake "
                   "master; see kvmem.storage.mooncake_server)")
    p.add_argument("--storage-metadata", metavar="URL",
                   help="the Mooncake metadata server (default P2PHANDSHAKE: none)")
    p.add_argument("--storage-capacity-tokens", type=positive_int_arg, metavar="N",
                   help="what a simulated or file store may hold, in tokens (default: unbounded)")
    p.add_argument("--storage-gbps", type=positive_float_arg, metavar="B",
                   help=f"storage bandwidth, GB/s (default {DEFAULT_STORAGE_GBPS:g})")
    p.add_argument("--storage-latency-us", type=non_negative_float_arg, metavar="US",
                   help=f"what a prefill reading from storage waits before its bytes flow, microseconds (default "
                        f"{DEFAULT_STORAGE_LATENCY_US:g}; the --gpu clock charges it)")
    p.add_argument("--eviction-policy", choices=EVICTION_POLICIES,
                   help="which cached prefixes go first (default lru; belady: the offline optimum)")
    p.add_argument("--compare-policies", nargs="?", const=list(DEFAULT_POLICIES), type=_policy_list,
                   metavar="POLICIES", help="replay under several eviction policies (comma-separated; default: "
                   f"{','.join(DEFAULT_POLICIES)}; lru and belady always run), print a table on stderr, and with "
                   "--plot a hit-rate-by-policy chart")
    p.add_argument("--pin-prefix-tokens", type=non_negative_int_arg, default=0, metavar="N",
                   help="pin the first N tokens of each finished request's prompt (a system prompt; default 0: none)")
    p.add_argument("--pin-budget", type=fraction_arg, default=0.2, metavar="F",
                   help="share of the capacity pins may hold; older pins past it degrade (default 0.2)")
    p.add_argument("--schedule-policy", default="lpm", choices=SCHEDULE_POLICIES)
    p.add_argument("--max-running", type=positive_int_arg, default=256, metavar="R",
                   help="most requests running at once (default 256)")
    p.add_argument("--chunked-prefill-size", type=int, default=8192, metavar="C",
                   help="prompt tokens per prefill step; 0 or less: no chunking (default 8192)")
    p.add_argument("--arrivals", default="honour", choices=("honour", "all-at-once"),
                   help="honour the trace's arrival times, or queue everything at time 0 (default honour)")
    p.add_argument("--limit", type=positive_int_arg, metavar="N",
                   help="replay only the first N requests (synthetic: generate N; default 1000)")
    p.add_argument("--on-error", default="stop", choices=("stop", "skip"),
                   help="at a malformed trace line: stop with its line number, or skip it (default stop)")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR (needs matplotlib)")
    p.add_argument("--sweep", nargs="?", const=[], type=parse_token_sizes, metavar="CAPACITIES",
                   help="replay at several capacities (comma-separated tokens, 1M or 500k; default: the capacity "
                        "x 1/8, 1/4, 1/2, 1, 2, 4) and report the hit-rate and TTFT curves")
    p.add_argument("--sweep-gb", type=parse_gib_sizes, metavar="GIBS",
                   help="as --sweep, in GiB of --model's KV (comma-separated)")
    p.add_argument("--sweep-host", type=parse_token_sizes, metavar="CAPACITIES",
                   help="compare host tiers of these sizes (tokens, 1M or 500k) with none: a row each, and what each "
                        "buys in hit rate and TTFT (with --storage sim, each also with the storage tier)")
    p.add_argument("--sweep-host-gb", type=parse_gib_sizes, metavar="GIBS",
                   help="as --sweep-host, in GiB of --model's KV")
    p.add_argument("--target-hit-fraction", type=_target_fraction, metavar="F",
                   help="find the KV capacity that reaches F (e.g. 0.9) of the hit rate this server reaches with "
                        "unbounded KV, by replays in parallel; answers in tokens, GiB of KV and, with --gpu, GPUs")
    p.add_argument("--cache-decode-pages", action=argparse.BooleanOptionalAction, default=True,
                   help="cache each full page of output as soon as it is written, as vLLM does (default); "
                        "--no-cache-decode-pages caches output when the request finishes, as SGLang does")
    p.add_argument("--in-batch-prefix-caching", action="store_true",
                   help="a request whose next uncached page another request of its prefill batch computes waits "
                        "a step and finds it cached (SGLang's in-batch prefix caching; vLLM's hits)")
    p.add_argument("--gpu", choices=tuple(GPUS), help="price steps with a roofline of --model on --tp of these "
                   "GPUs (TTFT, prefill GPU-seconds saved, throughput); without --capacity-tokens or "
                   "--gpu-mem-gb, the KV capacity is what their memory leaves beside the weights. Default: a "
                   "fixed 30 ms a step + 50k prefill tokens/s")
    p.add_argument("--tp", type=positive_int_arg, default=1, metavar="N",
                   help="GPUs per replica, tensor-parallel (with --gpu; default 1)")
    p.add_argument("--jobs", type=positive_int_arg, metavar="J",
                   help="Python-engine replays run at once by --sweep and --compare-policies, in separate processes "
                        "(default: the cores)")
    p.add_argument("--engine", choices=ENGINES,
                   help="native: the compiled engine (the default where it is built and covers the configuration; "
                        "else the Python engine runs, saying why); python: the reference (kvmem's Scheduler and "
                        "RadixCache). Both give the same report. Default: $KVMEM_ENGINE, else native")
    p.add_argument("--json-only", action="store_true", help="no human summary on stderr, only the JSON report")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--seed", type=non_negative_int_arg, default=0,
                   help="seed for synthetic workloads and the simulator")
    add_cluster_arguments(p)
    add_pd_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (0 ok, 2 user error, 130 interrupted). No arguments
    at all (argv empty) runs the tour."""
    argv = sys.argv[1:] if argv is None else list(argv)
    tour = not argv
    try:
        args = build_parser().parse_args(list(TOUR_ARGS) if tour else argv)
    except _UsageError as e:
        return _error(str(e))
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    on_main_thread = threading.current_thread() is threading.main_thread()
    if on_main_thread:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _run(args, tour)
    except KeyboardInterrupt:
        return _error("interrupted", 130)
    except _Terminated:
        return _error("terminated", 128 + signal.SIGTERM)
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)


class _Terminated(BaseException):
    """SIGTERM, raised where the main process is, once its worker processes are gone."""


def _on_sigterm(signum, frame) -> None:
    # A SIGTERM reaches only this process, and a pool waits for its workers.
    kill_workers()
    raise _Terminated


def _run(args: argparse.Namespace, tour: bool = False) -> int:
    try:
        if args.plot:
            require_matplotlib()
        engine = requested_engine(args.engine)
        trace = _load_trace(args)
        config = _replay_config(args, trace)
        slo = slo_of(args)
        splits = None if tour else pd_runs(args, config, trace)
        runs = None if tour or splits is not None else cluster_runs(args, config)
        if (runs is not None or splits is not None) and config.hybrid is not None:
            raise ValueError("a fleet's replay routes on KV events, which window-aware pools do not publish: give "
                             "--full-attention-pools")
        if slo is not None and runs is None and splits is None:
            raise ValueError("--slo-ttft-s and --slo-tbt-s price a fleet's goodput: give --replicas, "
                             "--prefill-replicas or --pd-sweep")
        _check_plan(args)
        labels, host_labels = None, {}
        if runs is not None or splits is not None or args.target_hit_fraction is not None:
            points = None
        elif tour:
            points = _tour_points(config)
        else:
            points, labels = _sweep_points(args, config)
            host_labels = _host_labels(args)
        if tour and not torch_available():
            points = _native_tour(points, engine)
        for point in points or [config]:
            point.check_host_memory()
        _check_torch(args, engine, config, points, runs, splits)
        _check_combinations(args, config, points)
        _check_storage(config)
        if args.plot:
            _make_plot_dir(args.plot)
    except TraceError as e:
        hint = " (--on-error skip skips malformed lines)" if e.line is not None and args.on_error == "stop" else ""
        return _error(f"{e}{hint}")
    except (ValueError, RuntimeError) as e:
        return _error(str(e))
    _warn_skipped(trace)

    progress = not args.no_progress
    trace_format = args.format if args.format in SYNTHETIC_FORMATS else trace.format
    out = {"trace": trace.name, "format": trace_format, "skipped_lines": len(trace.skipped),
           "config": dataclasses.asdict(config)}
    title = _title(trace, trace_format, config, tour)
    if args.compare_policies:
        return _compare(args, trace, config, [p.capacity_tokens for p in points] if points else None, out, engine)
    if args.target_hit_fraction is not None:
        return _plan(args, trace, config, out, engine, title)
    if splits is not None:  # a disaggregated replay
        if engine == "native":
            reason = fallback_reason(engine, config) or "the native engine does not cover P:D fleets yet"
            print(f"{PROG}: {reason}: the Python engine replays the P:D fleet", file=sys.stderr)
        try:
            out = run_pd(args, trace, config, splits, out)
        except (ValueError, RuntimeError) as e:
            return _error(str(e))
    elif runs is not None:  # a cluster replay
        reason = cluster_fallback_reason(engine, config)
        if reason is None and slo is not None and engine == "native":
            reason = "the native engine does not time requests (--slo-ttft-s) yet"
        if reason is not None:
            print(f"{PROG}: {reason}: the Python engine replays the cluster{'s' if len(runs) > 1 else ''}",
                  file=sys.stderr)
        try:
            out = run_cluster(args, trace, config, runs, out, title, engine if slo is None else "python", slo)
        except RuntimeError as e:
            return _error(str(e))
    else:
        note = fallback_note(engine, points or [config])
        if note is not None:
            print(f"{PROG}: {note}", file=sys.stderr)
        reports = replay_all(trace, points or [config], 1 if points is None else args.jobs or default_jobs(),
                             progress, engine)
        labels = labels or [format_tokens(r.capacity_tokens) for r in reports]
        fit = _gpu_fit(args, config)
        ceilings = None
        if points is None:
            out.update(reports[0].to_json())
        else:
            out["sweep"] = [_sweep_json(r, label, fit, host_labels) for r, label in zip(reports, labels)]
            ceiling = reuse_ceiling(trace)  # a sweep's curve reads against it
            if ceiling is not None:
                out["trace_ceiling"] = round(ceiling, 6)
                ceilings = {"the trace's reuse ceiling": ceiling}
                head, _, rest = title.partition("\n")  # under the trace's line, above the tour's
                title = "\n".join([head, f"the trace's reuse ceiling (what an unbounded cache would serve): "
                                          f"{ceiling:.3f}"] + ([rest] if rest else []))
        if not args.json_only:
            print(format_summary(reports, title, labels, fit, host_labels), file=sys.stderr)
        if args.plot:
            try:
                plots = reports[0].write_plots(args.plot) if points is None else \
                    write_sweep_plots(reports, args.plot, labels, ceilings=ceilings, host_labels=host_labels, fit=fit)
            except OSError as e:
                return _report_then_error(out, f"cannot write plots to {args.plot}: {e.strerror or e}")
            out["plots"] = [str(p) for p in plots]
        if points is None and reports[0].rejected and not reports[0].requests:
            return _report_then_error(out, f"all {reports[0].rejected:,} requests were rejected: none fits in the KV "
                                           f"cache's {config.capacity_tokens:,} tokens")
    _write_json(out)
    return 0


def _write_json(out: dict) -> None:
    sys.stdout.write(json.dumps(out, indent=2) + "\n")
    sys.stdout.flush()


def _gpu_fit(args: argparse.Namespace, config: ReplayConfig) -> tuple[int, str] | None:
    """With --gpu: the KV tokens those GPUs hold beside the weights, and what they are (None without --gpu)."""
    if args.gpu is None:
        return None
    fit = gpu_fit(args.gpu, config.model or DEFAULT_MODEL, args.tp, config.token_kv_bytes, config.page_size)
    return fit, f"{args.tp} x {args.gpu}"


def _sweep_json(report, label: str, fit: tuple[int, str] | None, host_labels: dict[int, str] | None = None) -> dict:
    """A sweep replay's report, with its capacity (and host tier) as typed and, with --gpu, whether those GPUs hold
    it."""
    out = {"label": label, **report.to_json()}
    if report.host_capacity_tokens in (host_labels or {}):
        out["host_label"] = host_labels[report.host_capacity_tokens]
    if fit is not None:
        out["fits_gpus"] = report.capacity_tokens <= fit[0]
    return out


def _plan(args: argparse.Namespace, trace: Trace, config: ReplayConfig, out: dict, engine: str, title: str) -> int:
    """--target-hit-fraction: the capacity search (kvmem.replay.planner), its answer and the curve it measured."""
    from kvmem.replay.planner import plan_capacity
    from kvmem.replay.workers import ReplayPool

    jobs = args.jobs or default_jobs()
    note = fallback_note(engine, [config])
    if note is not None:
        print(f"{PROG}: {note}", file=sys.stderr)

    def run(configs):
        reports = pool.run(configs)
        if not args.no_progress:
            print(f"{PROG}: " + ", ".join(f"{format_tokens(r.capacity_tokens)} tokens: hit rate {r.hit_rate:.4f}"
                                         for r in reports), file=sys.stderr)
        return reports

    with ReplayPool(trace, jobs, engine) as pool:
        plan = plan_capacity(trace, config, args.target_hit_fraction, run, jobs)
    fit = _gpu_fit(args, config)
    out["sweep"] = [_sweep_json(r, format_tokens(r.capacity_tokens), fit) for r in plan.curve]
    out["capacity_plan"] = _plan_json(args, config, plan)
    if not args.json_only:
        print(_plan_summary(args, config, plan, title, fit), file=sys.stderr)
    if args.plot:
        ceilings = {"this server, unbounded KV": plan.achievable, f"target ({plan.fraction:g} x)": plan.target}
        if plan.trace_ceiling is not None:
            ceilings = {"the trace's reuse ceiling": plan.trace_ceiling, **ceilings}
        try:
            out["plots"] = [str(p) for p in write_sweep_plots(plan.curve, args.plot, ceilings=ceilings,
                                                              answer=plan.tokens, fit=fit)]
        except OSError as e:
            return _report_then_error(out, f"cannot write plots to {args.plot}: {e.strerror or e}")
    _write_json(out)
    return 0


def _plan_json(args: argparse.Namespace, config: ReplayConfig, plan) -> dict:
    out = {"target_hit_fraction": plan.fraction,
           "trace_ceiling": None if plan.trace_ceiling is None else round(plan.trace_ceiling, 6),
           "achievable_hit_rate": round(plan.achievable, 6), "unbounded_tokens": plan.unbounded_tokens,
           "target_hit_rate": round(plan.target, 6), "tokens": plan.tokens,
           "kv_bytes_per_token": config.token_kv_bytes,
           "kv_gib": round(kv_gib(plan.tokens, config.token_kv_bytes), 3), "replays": len(plan.curve),
           "rounds": plan.rounds}
    if args.gpu is not None:
        count = gpus_needed(plan.tokens, args.gpu, config.model or DEFAULT_MODEL, config.token_kv_bytes,
                            config.page_size)
        out["gpus"] = {"gpu": count.gpu, "tp": count.tp, "holds_tokens": count.largest,
                       "largest_tp": count.largest_tp}
    return out


def _plan_summary(args: argparse.Namespace, config: ReplayConfig, plan, title: str, fit) -> str:
    answer = next(r for r in plan.curve if r.capacity_tokens == plan.tokens)
    ceiling = "" if plan.trace_ceiling is None else \
        f"the trace's reuse ceiling (what an unbounded cache would serve): {plan.trace_ceiling:.3f}\n"
    table = format_summary(plan.curve, title, [("> " if r is answer else "") + format_tokens(r.capacity_tokens)
                                               for r in plan.curve], fit)
    head, _, rest = table.partition("\n")
    model = config.model or DEFAULT_MODEL if args.gpu is not None or config.model else "llama-3-8b (default)"
    lines = [head, f"{ceiling}this server with unbounded KV ({format_tokens(plan.unbounded_tokens)} tokens): hit rate "
                   f"{plan.achievable:.3f}; target {plan.fraction:g} x {plan.achievable:.3f} = {plan.target:.3f}",
             rest,
             f"answer (>): {plan.tokens:,} tokens ({format_tokens(plan.tokens)}) reach hit rate {answer.hit_rate:.3f}, "
             f"{plan.rounds} rounds of replays; that is {kv_gib(plan.tokens, config.token_kv_bytes):,.1f} GiB of "
             f"{model}'s KV at {config.token_kv_bytes:,} bytes a token"]
    if args.gpu is not None:
        count = gpus_needed(plan.tokens, args.gpu, config.model or DEFAULT_MODEL, config.token_kv_bytes,
                            config.page_size)
        lines.append(f"GPUs: {count.tp} x {args.gpu} (tensor-parallel) hold it beside the weights" if count.tp else
                     f"GPUs: no tensor-parallel group of {args.gpu}s holds it beside the weights (the most: "
                     f"{format_tokens(count.largest)} tokens on {count.largest_tp}); replicas split the trace "
                     f"(--replicas)")
        lines.append(f"(TTFT as priced on {args.tp} x {args.gpu}: the clock of --tp)")
    return "\n".join(lines)


def _report_then_error(out: dict, message: str) -> int:
    """The replay's report on stdout all the same (it may have taken hours), then the error."""
    sys.stdout.write(json.dumps(out, indent=2) + "\n")
    sys.stdout.flush()
    return _error(message)


def default_jobs() -> int:
    """--jobs without a value: one replay per core."""
    return os.cpu_count() or 1


def _title(trace: Trace, trace_format: str, config: ReplayConfig, tour: bool) -> str:
    head = f"{Path(trace.name).name} ({trace_format}): {len(trace):,} requests, {trace.prompt_tokens:,} prompt tokens"
    if not tour:
        return head
    return (f"{head}\nThe tour (kvmem-replay with no arguments): {config.model} on {config.tp} x {config.gpu}, at "
            f"{' and '.join(f'{f:g}' for f in TOUR_FACTORS)} x the {config.capacity_tokens:,} KV tokens their memory "
            f"leaves, without and with a host tier {TOUR_HOST_FACTOR}x the device's.\n"
            f"Next: kvmem-replay TRACE --gpu H100 --model llama-3-8b --tp 4 --host-mem-gb 512 (see --help)")


def _compare(args: argparse.Namespace, trace: Trace, config: ReplayConfig, capacities: list[int] | None,
             out: dict, engine: str) -> int:
    from kvmem.replay.compare import compare_policies, format_table, write_policy_plot

    result = compare_policies(trace, config, args.compare_policies, capacities or [config.capacity_tokens],
                              args.jobs or default_jobs(),
                              functools.partial(_load_trace, args), engine)
    if not args.json_only:
        print(format_table(result), file=sys.stderr)
    out["compare"] = result
    if args.plot:
        try:
            out["plots"] = [str(write_policy_plot(result, args.plot))]
        except OSError as e:
            return _report_then_error(out, f"cannot write plots to {args.plot}: {e.strerror or e}")
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
    if os.path.exists(path) and not os.path.isdir(path) and not _is_regular_file(path):  # a pipe reads once
        if args.format == "auto":
            raise ValueError(f"TRACE {path} is not a regular file: give its --format (finding it out would use up "
                             f"the first line of a pipe)")
        if args.compare_policies and (args.jobs or default_jobs()) > 1:
            raise ValueError(f"--compare-policies with --jobs > 1 reads TRACE in every worker, and {path} is not a "
                             f"regular file (a pipe can be read once): use --jobs 1")
    return read_trace(path, args.format, limit=args.limit, on_error=args.on_error)


def _replay_config(args: argparse.Namespace, trace: Trace) -> ReplayConfig:
    _check_tier_options(args)
    if args.kv_cache_dtype is not None and args.gpu is None and args.gpu_mem_gb is None and args.host_mem_gb is None:
        raise ValueError("--kv-cache-dtype only sizes the cache together with --gpu, --gpu-mem-gb or --host-mem-gb")
    if args.tp != 1 and args.gpu is None:
        raise ValueError("--tp needs --gpu (the GPUs the roofline prices)")
    tiers = {}
    if args.model is not None or args.gpu is not None or args.gpu_mem_gb is not None or args.host_mem_gb is not None:
        model_bytes = _bytes_per_token(args)
        tiers["kv_bytes_per_token"] = model_bytes
    hybrid = _hybrid_model(args)
    if hybrid is not None and (args.gpu_mem_gb is not None or args.capacity_tokens is None and args.gpu is not None):
        tiers.update(_hybrid_pools(args, hybrid, model_bytes))
        capacity = tiers.pop("capacity_tokens")
    elif args.gpu_mem_gb is not None:
        capacity = _tokens_in(args.gpu_mem_gb, "--gpu-mem-gb", args)
    elif args.capacity_tokens is None and args.gpu is not None:
        capacity = RooflineCost(args.gpu, _model_name(args), args.tp,
                                kv_bytes_per_token=model_bytes).kv_capacity_tokens(args.page_size)
    else:
        capacity = args.capacity_tokens or DEFAULT_CAPACITY_TOKENS
    link = GPUS[args.gpu].host_link_gbps if args.gpu is not None else DEFAULT_PCIE_GBPS
    h2d = args.h2d_gbps or link
    if args.host_mem_gb is not None:
        tiers["host_capacity_tokens"] = _tokens_in(args.host_mem_gb, "--host-mem-gb", args)
    elif args.host_capacity_tokens is not None:
        tiers["host_capacity_tokens"] = args.host_capacity_tokens
    elif args.storage is not None and (args.sweep_host or args.sweep_host_gb):
        # --sweep-host's largest size stands in, so that the config (storage needs a host tier) holds together;
        # the sweep sets each point's host tier
        largest = max(args.sweep_host or args.sweep_host_gb, key=lambda s: s.tokens or s.gib)
        tiers["host_capacity_tokens"] = _size_tokens(largest, "--sweep-host-gb", args)
    return ReplayConfig(
        capacity_tokens=capacity, max_context_len=trace.max_context_len, page_size=args.page_size,
        eviction_policy=args.eviction_policy or "lru", schedule_policy=args.schedule_policy,
        max_running=args.max_running,
        chunked_prefill_size=args.chunked_prefill_size if args.chunked_prefill_size > 0 else None,
        honour_arrivals=args.arrivals == "honour", seed=args.seed, write_policy=args.write_policy or "write_through",
        h2d_gbps=h2d, d2h_gbps=args.d2h_gbps or h2d, storage=args.storage,
        storage_metadata=args.storage_metadata or "P2PHANDSHAKE", storage_capacity_tokens=args.storage_capacity_tokens,
        storage_gbps=args.storage_gbps or DEFAULT_STORAGE_GBPS,
        storage_latency_us=DEFAULT_STORAGE_LATENCY_US if args.storage_latency_us is None else args.storage_latency_us,
        cache_decode_pages=args.cache_decode_pages, in_batch_prefix_caching=args.in_batch_prefix_caching,
        gpu=args.gpu, model=_model_name(args, None), tp=args.tp, pin_prefix_tokens=args.pin_prefix_tokens,
        pin_budget=args.pin_budget, full_attention_pools=args.full_attention_pools, **tiers)


def _hybrid_model(args: argparse.Namespace):
    """The HybridConfig whose window-aware pools the replay sizes (None: one pool); --full-attention-pools needs a
    hybrid --model."""
    from kvmem import sizing

    hybrid = sizing.HYBRID_MODEL_CONFIGS.get(args.model)
    if args.full_attention_pools and hybrid is None:
        raise ValueError(f"--full-attention-pools compares a hybrid --model's pools (one of "
                         f"{', '.join(sizing.HYBRID_MODEL_CONFIGS)}), got {args.model!r}")
    return None if args.full_attention_pools else hybrid


def _hybrid_pools(args: argparse.Namespace, hybrid, model_bytes: int) -> dict:
    """capacity_tokens, window_tokens and state_slots of window-aware pools in --gpu-mem-gb, or in what --gpu's
    memory leaves beside the weights (divided among the copies tensor parallelism keeps of a token's KV)."""
    from kvmem import sizing
    from kvmem.replay.cost import kv_copies

    if args.gpu_mem_gb is not None:
        budget, option = {"gpu_mem_gb": args.gpu_mem_gb}, f"--gpu-mem-gb {args.gpu_mem_gb}"
    else:
        cost = RooflineCost(args.gpu, args.model, args.tp, kv_bytes_per_token=model_bytes)
        budget = {"mem_bytes": int(cost.kv_budget_bytes(args.page_size) // kv_copies(args.model, args.tp))}
        option = f"--gpu {args.gpu}"
    cap = sizing.hybrid_capacity(hybrid, **budget, kv_cache_dtype=args.kv_cache_dtype or "auto",
                                 page_size=args.page_size, max_running_requests=args.max_running,
                                 chunked_prefill_size=args.chunked_prefill_size if args.chunked_prefill_size > 0
                                 else 8192)
    if cap.full_tokens == 0:
        raise ValueError(f"{option} holds no window-aware pools of {args.model} (try --full-attention-pools)")
    return {"capacity_tokens": cap.full_tokens, "window_tokens": cap.window_tokens or None,
            "state_slots": cap.state_slots or None}


def _check_tier_options(args: argparse.Namespace) -> None:
    """A tier's options without the tier would be ignored: a planner who forgot the tier would read its
    figures as the tier's."""
    given = [(option, value) for option, value in (
        ("--write-policy", args.write_policy), ("--h2d-gbps", args.h2d_gbps), ("--d2h-gbps", args.d2h_gbps))
        if value is not None]
    host_sweep = args.sweep_host is not None or args.sweep_host_gb is not None
    if given and args.host_capacity_tokens is None and args.host_mem_gb is None and not host_sweep:
        raise ValueError(f"{given[0][0]} needs a host tier (--host-capacity-tokens, --host-mem-gb or --sweep-host)")
    if host_sweep and (args.host_capacity_tokens is not None or args.host_mem_gb is not None):
        raise ValueError("--sweep-host sets the host tiers' sizes: drop --host-capacity-tokens and --host-mem-gb")
    if args.sweep_host is not None and args.sweep_host_gb is not None:
        raise ValueError("--sweep-host and --sweep-host-gb: give the host sizes once")
    if args.sweep is not None and args.sweep_gb is not None:
        raise ValueError("--sweep and --sweep-gb: give the capacities once")
    for option, value in (("--storage-metadata", args.storage_metadata), ("--storage-gbps", args.storage_gbps),
                          ("--storage-capacity-tokens", args.storage_capacity_tokens),
                          ("--storage-latency-us", args.storage_latency_us)):
        if value is not None and args.storage is None:
            raise ValueError(f"{option} needs a storage tier (--storage)")


def _check_combinations(args: argparse.Namespace, config: ReplayConfig, points: list | None) -> None:
    """Options another one overrides, and replays that would depend on each other."""
    if args.compare_policies and config.hybrid is not None:
        raise ValueError("--compare-policies with a hybrid --model's window-aware pools: its ceiling, belady, ranks "
                         "the full pool alone (give --full-attention-pools)")
    if args.compare_policies and args.eviction_policy is not None:
        raise ValueError("--eviction-policy with --compare-policies: name the policies in --compare-policies' list")
    if (args.sweep or args.sweep_gb) and (args.capacity_tokens is not None or args.gpu_mem_gb is not None):
        raise ValueError("--capacity-tokens or --gpu-mem-gb with --sweep CAPACITIES: the list sets the capacities "
                         "(--sweep without a list sweeps around --capacity-tokens)")
    if config.storage is not None and (points is not None or args.compare_policies) and not is_simulated(config):
        raise ValueError("--storage with --sweep or --compare-policies: each replay would find the pages the ones "
                         "before it stored; replay each configuration against its own --storage, or plan with "
                         "--storage sim (a store of its own for each replay)")


def _check_plan(args: argparse.Namespace) -> None:
    """--target-hit-fraction searches the device capacity: options that set it, or that another replay mode
    reads, do not go with it."""
    if args.target_hit_fraction is None:
        return
    for option, value in (("--capacity-tokens", args.capacity_tokens), ("--gpu-mem-gb", args.gpu_mem_gb),
                          ("--sweep", args.sweep), ("--sweep-gb", args.sweep_gb),
                          ("--sweep-host", args.sweep_host), ("--sweep-host-gb", args.sweep_host_gb),
                          ("--compare-policies", args.compare_policies), ("--replicas", args.replicas),
                          ("--host-capacity-tokens", args.host_capacity_tokens), ("--host-mem-gb", args.host_mem_gb),
                          ("--storage", args.storage)):
        if value is not None:
            raise ValueError(f"{option} with --target-hit-fraction: the search sets the device's KV capacity "
                             f"itself, without lower tiers; drop {option}")


def _check_torch(args: argparse.Namespace, engine: str, config: ReplayConfig, points: list | None,
                 runs: list | None, splits: list | None = None) -> None:
    """RuntimeError (one line) when a replay of this command needs the Python engine and torch is missing."""
    if torch_available():
        return
    if splits is not None:
        what = "a P:D replay (--prefill-replicas, --pd-sweep)"
    elif runs is not None and slo_of(args) is not None:
        what = "a cluster replay with SLOs (--slo-ttft-s, --slo-tbt-s: the native engine does not time requests)"
    elif runs is not None and cluster_fallback_reason(engine, config) is not None:
        what = cluster_fallback_reason(engine, config)
    elif args.compare_policies:
        what = "--compare-policies (belady, the ceiling, always)"
    else:
        python = [c for c in points or [config] if engine_for(engine, c) == "python"]
        if not python:
            return
        what = "--engine python" if engine == "python" else fallback_reason(engine, python[0])
    raise RuntimeError(f"{what}: the Python engine would replay it, and it needs torch: {INSTALL_TORCH}")


def _native_tour(points: list[ReplayConfig], engine: str) -> list[ReplayConfig]:
    """The tour's replays the native engine covers, with a line on stderr for those left out (torch missing)."""
    native = [p for p in points if engine_for(engine, p) == "native"]
    if len(native) < len(points):
        print(f"{PROG}: the tour's {len(points) - len(native)} replays with a host tier need the Python engine, which "
              f"needs torch: replaying the other {len(native)}; for all of them, {INSTALL_TORCH}", file=sys.stderr)
    return native


def _is_regular_file(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def is_simulated(config: ReplayConfig) -> bool:
    """Whether config's storage tier is a simulated store (kvmem.replay.simulator.is_simulated, without torch)."""
    from kvmem.storage import parse_store_spec

    return config.storage is not None and parse_store_spec(config.storage)[0] == "sim"


def _check_storage(config: ReplayConfig) -> None:
    """Opens the storage tier once before the replay, as the replay will, so that an unreachable store, or a cap its
    disk cannot hold, is a one-line error."""
    if config.storage is None:
        return
    from kvmem.replay.simulator import open_storage

    try:
        open_storage(config).close()
    except OSError as e:
        raise RuntimeError(f"--storage {config.storage}: {e.strerror or e}") from None


def _model_name(args: argparse.Namespace, otherwise: str | None = DEFAULT_MODEL) -> str | None:
    """--model, or with --gpu the model it prices by default."""
    return args.model or (DEFAULT_MODEL if args.gpu is not None else otherwise)


def _model(args: argparse.Namespace):
    from kvmem import sizing

    name = _model_name(args, None)
    if name is None:
        option = "--gpu-mem-gb" if args.gpu_mem_gb is not None else "--host-mem-gb"
        raise ValueError(f"{option} needs --model to know the bytes per token")
    try:
        return sizing.get_model_config(name)
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
        raise ValueError(f"{option} {mem_gb} holds no {args.page_size}-token page of {_model_name(args)}'s KV cache")
    return tokens


def _sweep_points(args: argparse.Namespace, config: ReplayConfig) -> tuple[list[ReplayConfig] | None, list | None]:
    """The sweep's configs and their labels (the capacities as typed), by capacity and then host tier; (None,
    None) without a sweep. A sweep over host sizes has a row without the host tier (and with --storage sim, a row
    with and one without the storage tier) for each."""
    sizes = args.sweep if args.sweep is not None else args.sweep_gb
    hosts = args.sweep_host if args.sweep_host is not None else args.sweep_host_gb
    if sizes is None and hosts is None:
        return None, None
    if sizes is None:
        device = [Size(format_tokens(config.capacity_tokens), tokens=config.capacity_tokens)]
    elif not sizes:  # --sweep alone
        device = [Size(format_tokens(t), tokens=t) for t in
                  (max(int(config.capacity_tokens * f), args.page_size) for f in SWEEP_FACTORS)]
    else:
        device = [Size(s.label, tokens=_size_tokens(s, "--sweep-gb", args)) for s in sizes]
    for s in device:
        if s.tokens < args.page_size:
            raise ValueError(f"--sweep capacity {s.label} is less than one page (--page-size {args.page_size})")
    device = sorted({s.tokens: s for s in reversed(device)}.values(), key=lambda s: s.tokens)
    host_tokens = sorted({_size_tokens(h, "--sweep-host-gb", args) for h in hosts}) if hosts else [None]
    points, labels = [], []
    for s in device:
        for host in ([None] if hosts else []) + host_tokens:
            stores = [None] if host is None else [None, config.storage] if config.storage and hosts else \
                [config.storage]
            for store in dict.fromkeys(stores):
                points.append(config.at_capacity(s.tokens, host_capacity_tokens=host, storage=store))
                labels.append(s.label)
    return points, labels


def _host_labels(args: argparse.Namespace) -> dict[int, str]:
    """--sweep-host's sizes as typed, by their tokens."""
    hosts = args.sweep_host if args.sweep_host is not None else args.sweep_host_gb
    return {_size_tokens(h, "--sweep-host-gb", args): h.label for h in hosts or []}


def _size_tokens(size: Size, option: str, args: argparse.Namespace) -> int:
    """A typed size in tokens: as given, or its GiB of the model's KV (whole pages)."""
    if size.tokens is not None:
        return size.tokens
    tokens = tokens_in_gib(size.gib, _model_name(args, None) or _missing_model(option), args.kv_cache_dtype or "auto",
                           args.page_size)
    if tokens <= 0:
        raise ValueError(f"{option} {size.label} holds no {args.page_size}-token page of {_model_name(args)}'s KV")
    return tokens


def _missing_model(option: str) -> str:
    raise ValueError(f"{option} needs --model to know the bytes per token")


def _tour_points(config: ReplayConfig) -> list[ReplayConfig]:
    points = []
    for factor in TOUR_FACTORS:
        capacity = max(int(config.capacity_tokens * factor) // config.page_size * config.page_size, config.page_size)
        for host in (None, TOUR_HOST_FACTOR * capacity):
            points.append(config.at_capacity(capacity, host_capacity_tokens=host))
    return points


def _warn_skipped(trace: Trace) -> None:
    for err in trace.skipped[:MAX_WARNINGS]:
        print(f"{PROG}: warning: {err} (skipped)", file=sys.stderr)
    if len(trace.skipped) > MAX_WARNINGS:
        print(f"{PROG}: warning: {len(trace.skipped) - MAX_WARNINGS} more malformed lines skipped",
              file=sys.stderr)


if __name__ == "__main__":  # python -m kvmem.replay.cli, as kvmem-replay
    sys.exit(main())
