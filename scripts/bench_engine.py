"""Tokens/s of kvmem.engine, printed as one JSON object.

    python scripts/bench_engine.py --device cpu [--quick]
        The tiny presets on the CPU: a workload whose prompts share prefixes ("prefix_reuse": one of 4 system
        prompts each) against the same prompt lengths with every prefix made unique ("no_reuse"), so that only
        the radix cache's hits differ; a quarter of the requests run at a time.
    python scripts/bench_engine.py --device cuda [--model qwen2-0.5b] [--batch 32] [--quick]
        A 0.5B-class random-weight model (Qwen2-0.5B's shapes, float16): decode tokens/s of the engine with
        FlashInfer against transformers' own generate on the same GPU and the same prompts.

Decode tokens/s is measured the same way for both sides: the wall time of generating N new tokens minus
that of generating 1 (the prefill), over batch x (N - 1) tokens, CUDA synchronized, best of --repeats runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time

import torch

from kvmem._checks import positive_int_arg
from kvmem.engine import Engine, build_model
from kvmem.engine.presets import PRESETS

CPU_PRESETS = ("llama-tiny", "qwen2-tiny", "deepseek-v2-tiny")


def shared_prefix_prompts(n: int, prefix: int, suffix: int, vocab: int, seed: int, unique: bool) -> list[list[int]]:
    """n prompts of prefix + suffix tokens: the prefix is one of 4 system prompts, or unique to each."""
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(prefix)] for _ in range(4)]
    prompts = []
    for i in range(n):
        head = [rng.randrange(vocab) for _ in range(prefix)] if unique else systems[i % 4]
        prompts.append(head + [rng.randrange(vocab) for _ in range(suffix)])
    return prompts


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def cpu_sizes(quick: bool) -> tuple[int, int, int, int]:
    """The CPU rows' requests, prefix, suffix and new tokens."""
    return (8, 32, 4, 4) if quick else (32, 192, 16, 16)


def cpu_engine(model, args) -> Engine:
    # A quarter of the requests run at a time, so later waves find earlier prompts cached (requests admitted in
    # one batch never share: none of them is cached yet).
    return Engine(model, capacity_tokens=args.capacity_tokens, page_size=args.page_size,
                  chunked_prefill_size=args.chunked_prefill_size, max_running_requests=cpu_sizes(args.quick)[0] // 4)


def bench_cpu(args) -> dict:
    rows = []
    n, prefix, suffix, new = cpu_sizes(args.quick)
    for preset in CPU_PRESETS:
        model = build_model(preset)
        vocab = model.config.vocab_size
        for mode in ("prefix_reuse", "no_reuse"):
            prompts = shared_prefix_prompts(n, prefix, suffix, vocab, seed=1, unique=mode == "no_reuse")
            best = None
            for _ in range(args.repeats):
                engine = cpu_engine(model, args)
                seconds = timed(lambda: engine.generate(prompts, new), engine.device)
                best = seconds if best is None else min(best, seconds)
            s = engine.stats
            rows.append({"model": preset, "workload": mode, "requests": n, "prompt_tokens": s.prompt_tokens,
                         "output_tokens": s.output_tokens, "hit_rate": round(s.hit_rate, 4),
                         "seconds": round(best, 3), "output_tokens_per_s": round(s.output_tokens / best, 1),
                         "tokens_per_s": round((s.prompt_tokens + s.output_tokens) / best, 1)})
    return {"rows": rows}


def cuda_sizes(args) -> tuple[int, int, int, int]:
    """The CUDA rows' batch, prompt and new tokens, and the KV capacity they need."""
    batch, prompt_len, new = (4, 64, 16) if args.quick else (args.batch, args.prompt_len, args.new_tokens)
    return batch, prompt_len, new, batch * (prompt_len + new + 16)


def bench_cuda(args) -> dict:
    device = torch.device("cuda")
    model = build_model(args.model, dtype=torch.float16, device=device)
    vocab = model.config.vocab_size
    batch, prompt_len, new, capacity = cuda_sizes(args)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=g)
    engine_kwargs = dict(capacity_tokens=capacity - capacity % args.page_size, page_size=args.page_size,
                         attention_backend="flashinfer")

    def engine_run(n):
        engine = Engine(model, **engine_kwargs)  # a fresh cache each run: no prefix hits between runs
        return lambda: engine.generate(prompts.tolist(), n)

    def hf_run(n):
        ids = prompts.to(device)
        return lambda: model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n)

    result = {"model": args.model, "dtype": "float16", "batch": batch, "prompt_len": prompt_len, "new_tokens": new,
              "device_name": torch.cuda.get_device_name()}
    with torch.no_grad():
        for name, make in (("kvmem_flashinfer", engine_run), ("transformers_generate", hf_run)):
            timed(make(new), device)  # warm-up (kernels, FlashInfer JIT, allocator)
            full = min(timed(make(new), device) for _ in range(args.repeats))
            prefill = min(timed(make(1), device) for _ in range(args.repeats))
            result[name] = {"seconds_total": round(full, 4), "seconds_prefill": round(prefill, 4),
                            "decode_tokens_per_s": round(batch * (new - 1) / (full - prefill), 1)}
    result["speedup"] = round(result["kvmem_flashinfer"]["decode_tokens_per_s"]
                              / result["transformers_generate"]["decode_tokens_per_s"], 3)
    return result


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses, as usage errors before the first row, what the engine or the timing would refuse later."""
    if args.model not in PRESETS:
        parser.error(f"argument --model: expected a preset ({', '.join(sorted(PRESETS))}), got {args.model!r}")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("argument --device: cuda needs a CUDA GPU")
        if not args.quick and args.new_tokens < 2:  # decode tokens/s: the time of N new tokens less that of 1
            parser.error(f"argument --new-tokens: expected at least 2, got {args.new_tokens}")
        capacity = cuda_sizes(args)[3]
        if args.page_size > capacity:
            parser.error(f"argument --page-size: {args.page_size} is more than the {capacity} tokens of KV the CUDA "
                         "rows hold")
        return
    if args.capacity_tokens % args.page_size:
        parser.error(f"argument --page-size: {args.page_size} does not divide --capacity-tokens {args.capacity_tokens}")
    for preset in CPU_PRESETS:  # an engine of each preset, as the rows build it: its pools past this machine's memory
        try:
            cpu_engine(build_model(preset), args)
        except ValueError as e:
            parser.error(f"argument --capacity-tokens: {e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    parser.add_argument("--repeats", type=positive_int_arg, default=3)
    parser.add_argument("--threads", type=positive_int_arg, default=1, help="torch CPU threads (CPU runs; default 1)")
    parser.add_argument("--capacity-tokens", type=positive_int_arg, default=4096, help="CPU runs")
    parser.add_argument("--page-size", type=positive_int_arg, default=1)
    parser.add_argument("--chunked-prefill-size", type=positive_int_arg, default=None, help="CPU runs")
    parser.add_argument("--model", default="qwen2-0.5b", help="CUDA runs: a preset")
    parser.add_argument("--batch", type=positive_int_arg, default=32, help="CUDA runs")
    parser.add_argument("--prompt-len", type=positive_int_arg, default=128, help="CUDA runs")
    parser.add_argument("--new-tokens", type=positive_int_arg, default=128, help="CUDA runs")
    args = parser.parse_args(argv)
    check_args(parser, args)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
        report = bench_cpu(args)
    else:
        report = bench_cuda(args)
    report["machine"] = {"platform": platform.platform(), "torch": torch.__version__,
                         "threads": torch.get_num_threads()}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
