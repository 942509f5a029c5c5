#!/usr/bin/env python3
"""Cascade attention on real decode batches: KV read, metadata build time, and (on CUDA) attention time.

Each workload is replayed through kvmem's Scheduler and RadixCache (as kvmem.replay.simulator does: a fake
model hands back output tokens, a simulated clock admits arrivals); once `--warmup` decode steps have run,
every `--every`-th decode batch of at least `--min-batch` requests is snapshotted, up to `--snapshots`. For each
snapshot, nothing changed in the scheduler:

  flat_kv_tokens     sum of seq_lens: what flat paged attention (BatchDecode) reads per layer
  cascade_kv_tokens  the KV tokens of every level entry of build_cascade_metadata(batch, tree): what the
                     cascade wrapper reads per layer (each shared segment once per level entry)
  kv_read_ratio      cascade / flat (below 1: cascade reads less); per workload the token-weighted ratio
                     over its snapshots, and the same for other max_levels in `kv_read_ratio_by_max_levels`
  kv_gb_per_step_*   those tokens in GB per decode step for --model's KV (all layers, kvmem.sizing)
  flat_build_us      build_decode_metadata(req_to_token, rows, seq_lens, page_size): median (and _min) of
                     --repeats calls
  cascade_build_us   build_cascade_metadata(batch, tree, ...) on the same batch, likewise; per workload the
                     medians over snapshots and build_time_ratio = cascade / flat (_min: of the fastest calls,
                     which a busy shared machine inflates least)
Both builders run on the CPU tensors the scheduler keeps (the torch fallback of the kv_indices gather; run
without TRITON_INTERPRET).

--device cuda adds, per snapshot, FlashInfer's BatchDecode (plan_decode) against its
MultiLevelCascadeAttentionWrapper (plan_cascade, q permuted in and out included) through
kvmem.attention.FlashInferAttention, on random fp16 K/V for every slot of the pool with --model's heads
(num_qo_heads = 4 x KV heads): median microseconds of one layer's run (CUDA events), the plan times, and
the largest difference between the two outputs.

Workloads: mooncake-conversation and mooncake-synthetic (../shared/traces/mooncake/*_trace.jsonl, first
--limit requests, arrivals honoured at --time-scale), synthetic-system / -chat / -agent
(kvmem.replay.synthetic, --limit requests arriving at --arrival-rate per second). A workload that does not run (its
trace missing from --traces, or a Mooncake one under --quick) is named on stderr and in `skipped`, with why.

    python scripts/bench_cascade.py [--quick] [--device cpu|cuda] [--page-size 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kvmem._checks import non_negative_int_arg, output_file_arg, positive_float_arg, positive_int_arg
from kvmem.attention import (
    CascadeMetadata,
    PagedKVMetadata,
    build_cascade_metadata,
    build_decode_metadata,
)
from kvmem.batch import ForwardMode, Req
from kvmem.replay.config import ReplayConfig
from kvmem.replay.simulator import StepCost, build_scheduler, requests_arrival
from kvmem.replay.synthetic import GENERATORS
from kvmem.replay.traces import TraceError, read_trace
from kvmem.sizing import bytes_per_token, get_model_config

import _peer  # scripts/_peer.py: the script's own folder is on sys.path

# ../shared beside the main checkout (or beside a worktree's parent folder).
TRACES = next((p / "shared" / "traces" / "mooncake" for p in Path(__file__).resolve().parents[1:4]
               if (p / "shared" / "traces" / "mooncake").is_dir()),
              Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake")
WORKLOADS = ("mooncake-conversation", "mooncake-synthetic", "synthetic-system", "synthetic-chat", "synthetic-agent")
MAX_LEVELS_SWEEP = (2, 3, 4, 6)


def workload_list(text: str) -> str:
    """--workloads: every name checked, the text kept as given (the report repeats the arguments)."""
    _peer.list_arg(_peer.choice_arg(WORKLOADS))(text)
    return text


def folder_arg(text: str) -> str:
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a folder")
    return text


def trace_file(name: str, args: argparse.Namespace) -> Path:
    return Path(args.traces) / f"{name.removeprefix('mooncake-')}_trace.jsonl"


def load_workload(name: str, args: argparse.Namespace):
    if name.startswith("mooncake-"):
        return read_trace(trace_file(name, args), "mooncake", limit=args.limit, time_scale=args.time_scale)
    return GENERATORS[name](num_requests=args.limit, arrival_rate=args.arrival_rate, seed=args.seed)


def replay_config(trace, args: argparse.Namespace) -> ReplayConfig:
    return ReplayConfig(capacity_tokens=args.capacity_tokens, max_context_len=trace.max_context_len,
                        page_size=args.page_size, max_running=args.max_running)


def decode_snapshots(trace, args: argparse.Namespace):
    """Replays `trace` and yields (scheduler, decode batch) for the snapshots, before each batch's result is
    processed; stops after `args.snapshots` of them or at the trace's end."""
    sched = build_scheduler(replay_config(trace, args))
    cost = StepCost()
    order = np.argsort(np.array([requests_arrival(trace, i) for i in range(len(trace))]), kind="stable")
    outputs: dict[int, np.ndarray] = {}
    clock, nxt, decode_steps, taken = 0.0, 0, 0, 0
    while taken < args.snapshots and (nxt < len(order) or not sched.is_idle()):
        if sched.is_idle():
            clock = max(clock, requests_arrival(trace, int(order[nxt])))
        while nxt < len(order) and requests_arrival(trace, int(order[nxt])) <= clock:
            i = int(order[nxt])
            nxt += 1
            tr = trace[i]
            try:
                sched.add_request(Req(i, tr.input_ids.tolist(), tr.output_len))
            except ValueError:  # longer than the pool: the replay skips it too
                continue
            outputs[i] = tr.output_tokens()
        batch = sched.step()
        if batch is None:
            continue
        if batch.forward_mode is ForwardMode.EXTEND:
            clock += cost.decode_step_s + int(batch.extend_lens.sum()) / cost.prefill_tokens_per_s
        else:
            clock += cost.decode_step_s
            decode_steps += 1
            if (decode_steps > args.warmup and decode_steps % args.every == 0
                    and batch.batch_size() >= args.min_batch):
                taken += 1
                yield sched, batch
        tokens = [int(outputs[r.rid][len(r.output_ids)]) for r in batch.reqs]
        for req in sched.process_batch_result(batch, tokens):
            del outputs[req.rid]


def kv_tokens(md: PagedKVMetadata) -> int:
    """KV tokens one pass over `md` reads: every entry's (pages - 1) * page_size + kv_last_page_len."""
    pages = torch.diff(md.kv_indptr).long()
    return int(torch.where(pages > 0, (pages - 1) * md.page_size + md.kv_last_page_len.long(), 0).sum())


def cpu_us(fn, repeats: int) -> tuple[float, float]:
    """(median, min) microseconds of `repeats` calls after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6, min(samples) * 1e6


def to_device(md, device):
    if isinstance(md, CascadeMetadata):
        return CascadeMetadata(tuple(to_device(m, device) for m in md.levels), md.request_order.to(device),
                               md.qo_order.to(device))
    return PagedKVMetadata(md.qo_indptr.to(device), md.kv_indptr.to(device), md.kv_indices.to(device),
                           md.kv_last_page_len.to(device), md.page_size)


class GpuAttention:
    """FlashInfer decode against cascade on one layer of random fp16 K/V over the whole pool."""

    def __init__(self, sched, model, page_size: int) -> None:
        from kvmem.attention import FlashInferAttention

        self.num_kv_heads, self.head_dim = model.num_kv_heads, model.head_dim
        self.num_qo_heads = 4 * model.num_kv_heads
        num_pages = sched.token_allocator.size // page_size + 1
        shape = (num_pages, page_size, self.num_kv_heads, self.head_dim)
        self.kv_cache = tuple(torch.empty(shape, dtype=torch.float16, device="cuda").normal_() for _ in range(2))
        self.attention = FlashInferAttention(self.num_qo_heads, self.num_kv_heads, self.head_dim)

    def compare(self, flat: PagedKVMetadata, cascade: CascadeMetadata, repeats: int) -> dict:
        flat, cascade = to_device(flat, "cuda"), to_device(cascade, "cuda")
        q = torch.randn(len(cascade.qo_order), self.num_qo_heads, self.head_dim, dtype=torch.float16,
                        device="cuda")
        row = {}
        outs = []
        for name, plan, md in (("decode", self.attention.plan_decode, flat),
                               ("cascade", self.attention.plan_cascade, cascade)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            plan(md, q_dtype=torch.float16)
            torch.cuda.synchronize()
            row[f"{name}_plan_us"] = (time.perf_counter() - t0) * 1e6
            row[f"{name}_run_us"] = self._run_us(q, repeats)
            outs.append(self.attention.run(q, self.kv_cache).float())
        row["cascade_speedup"] = row["decode_run_us"] / row["cascade_run_us"]
        row["max_abs_diff"] = float((outs[0] - outs[1]).abs().max())
        return row

    def _run_us(self, q, repeats: int) -> float:
        for _ in range(3):
            self.attention.run(q, self.kv_cache)
        samples = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.attention.run(q, self.kv_cache)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        return statistics.median(samples)


def load_workloads(ap: argparse.ArgumentParser, args: argparse.Namespace, workloads: list[str]) -> dict:
    """Each workload's trace, read (or drawn) and its replay sized before any replay runs: a trace that cannot be
    read, or a replay past this machine's memory, is a usage error rather than a traceback between workloads."""
    traces = {}
    for name in workloads:
        try:
            traces[name] = load_workload(name, args)
        except TraceError as e:
            ap.error(f"argument --traces: {e}")
        try:
            replay_config(traces[name], args).check_host_memory()
        except ValueError as e:
            ap.error(f"argument --capacity-tokens: {e}")
    return traces


def bench_workload(name: str, args: argparse.Namespace, model, trace) -> dict:
    token_bytes = bytes_per_token(model)
    snapshots = []
    sums = {"flat": 0, "cascade": 0, **{m: 0 for m in MAX_LEVELS_SWEEP}}
    gpu = None
    t0 = time.perf_counter()
    for sched, batch in decode_snapshots(trace, args):
        tree, table = sched.tree_cache, sched.req_to_token_pool.req_to_token
        rows, seq, ps = batch.req_pool_indices, batch.seq_lens, batch.page_size
        flat = build_decode_metadata(table, rows, seq, ps)
        cascade = build_cascade_metadata(batch, tree, min_shared_tokens=args.min_shared_tokens,
                                         max_levels=args.max_levels)
        flat_tokens = kv_tokens(flat)
        cascade_tokens = sum(kv_tokens(m) for m in cascade.levels)
        sums["flat"] += flat_tokens
        sums["cascade"] += cascade_tokens
        for m in MAX_LEVELS_SWEEP:
            md = build_cascade_metadata(batch, tree, min_shared_tokens=args.min_shared_tokens, max_levels=m)
            sums[m] += sum(kv_tokens(level) for level in md.levels)
        flat_us = cpu_us(lambda: build_decode_metadata(table, rows, seq, ps), args.repeats)
        cascade_us = cpu_us(lambda: build_cascade_metadata(
            batch, tree, min_shared_tokens=args.min_shared_tokens, max_levels=args.max_levels), args.repeats)
        row = {
            "batch_size": batch.batch_size(),
            "levels": cascade.num_levels,
            "entries_per_level": [len(m.kv_last_page_len) for m in cascade.levels],
            "flat_kv_tokens": flat_tokens,
            "cascade_kv_tokens": cascade_tokens,
            "kv_read_ratio": cascade_tokens / flat_tokens,
            "flat_build_us": flat_us[0],
            "flat_build_us_min": flat_us[1],
            "cascade_build_us": cascade_us[0],
            "cascade_build_us_min": cascade_us[1],
        }
        if args.device == "cuda":
            gpu = gpu or GpuAttention(sched, model, ps)
            row.update(gpu.compare(flat, cascade, args.repeats))
        snapshots.append(row)
    result = {
        "workload": name,
        "requests_in_trace": len(trace),
        "snapshots": len(snapshots),
        "replay_seconds": round(time.perf_counter() - t0, 2),
    }
    if snapshots:
        result.update({
            "mean_batch_size": statistics.mean(r["batch_size"] for r in snapshots),
            "kv_read_ratio": sums["cascade"] / sums["flat"],
            "kv_read_ratio_by_max_levels": {str(m): sums[m] / sums["flat"] for m in MAX_LEVELS_SWEEP},
            "kv_gb_per_step_flat": sums["flat"] * token_bytes / len(snapshots) / 1e9,
            "kv_gb_per_step_cascade": sums["cascade"] * token_bytes / len(snapshots) / 1e9,
        })
        for key in ("flat_build_us", "flat_build_us_min", "cascade_build_us", "cascade_build_us_min"):
            result[f"{key}_median"] = statistics.median(r[key] for r in snapshots)
        result["build_time_ratio"] = result["cascade_build_us_median"] / result["flat_build_us_median"]
        result["build_time_ratio_min"] = result["cascade_build_us_min_median"] / result["flat_build_us_min_median"]
        if args.device == "cuda":
            for key in ("decode_run_us", "cascade_run_us", "cascade_speedup"):
                result[f"{key}_median"] = statistics.median(r[key] for r in snapshots)
        result["rows"] = snapshots
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", type=workload_list, default=",".join(WORKLOADS),
                    help="comma-separated, from: " + ", ".join(WORKLOADS))
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--quick", action="store_true", help="synthetic workloads only, small, 2 snapshots each")
    ap.add_argument("--traces", type=folder_arg, help="folder of Mooncake's *_trace.jsonl")
    ap.add_argument("--limit", type=positive_int_arg, default=3000, help="requests per workload")
    ap.add_argument("--time-scale", type=positive_float_arg, default=0.25, help="Mooncake arrival times x this")
    ap.add_argument("--arrival-rate", type=positive_float_arg, default=20.0, help="synthetic arrivals per second")
    ap.add_argument("--page-size", type=positive_int_arg, default=16)
    ap.add_argument("--capacity-tokens", type=positive_int_arg, default=2_000_000)
    ap.add_argument("--max-running", type=positive_int_arg, default=256)
    ap.add_argument("--min-shared-tokens", type=non_negative_int_arg, default=256)
    ap.add_argument("--max-levels", type=positive_int_arg, default=3)
    ap.add_argument("--warmup", type=non_negative_int_arg, default=200, help="decode steps before the first snapshot")
    ap.add_argument("--every", type=positive_int_arg, default=50, help="decode steps between snapshots")
    ap.add_argument("--min-batch", type=positive_int_arg, default=16, help="smallest batch worth a snapshot")
    ap.add_argument("--snapshots", type=positive_int_arg, default=8, help="per workload")
    ap.add_argument("--repeats", type=positive_int_arg, default=20)
    ap.add_argument("--model", default="llama-3-8b", help="KV shape for bytes (and the GPU run): kvmem.sizing")
    ap.add_argument("--seed", type=non_negative_int_arg, default=0)
    ap.add_argument("--out", type=output_file_arg, help="also write the JSON report here")
    args = ap.parse_args(argv)
    if args.traces is None:  # the default is not checked: a checkout without ../shared skips the Mooncake traces
        args.traces = str(TRACES)
    workloads = args.workloads.split(",")
    skipped = {w: "--quick runs the synthetic workloads only" for w in workloads
               if args.quick and not w.startswith("synthetic-")}
    skipped.update({w: f"{trace_file(w, args)} not found" for w in workloads
                    if w not in skipped and w.startswith("mooncake-") and not trace_file(w, args).exists()})
    for name, why in skipped.items():
        print(f"bench_cascade: {name} skipped: {why}", file=sys.stderr)
    workloads = [w for w in workloads if w not in skipped]
    if args.quick:
        args.limit, args.warmup, args.every, args.snapshots, args.repeats = 300, 20, 10, 2, 3
        args.min_batch, args.capacity_tokens = 4, 400_000
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a CUDA device")
    try:
        model = get_model_config(args.model)
    except ValueError as e:
        ap.error(f"argument --model: {e}")
    torch.set_num_threads(1)  # small host tensors: a thread pool only adds noise on a shared machine
    traces = load_workloads(ap, args, workloads)
    report = {
        "machine": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "bytes_per_token": bytes_per_token(model),
        "workloads": [bench_workload(w, args, model, traces.get(w)) for w in workloads],
        "skipped": skipped,  # workload -> why it did not run
    }
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
