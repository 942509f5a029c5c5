"""Greedy generation with kvmem.engine: one JSON line per prompt, then a JSON summary as the last line.

    python scripts/generate.py --model llama-tiny --prompts prompts.jsonl
    python scripts/generate.py --model /path/to/hf-checkpoint --prompts prompts.jsonl --dtype bfloat16 --device cuda

--model: a preset (kvmem.engine.PRESETS, seeded random weights) or a local Hugging Face checkpoint directory.
--prompts: JSONL, one prompt a line: {"input_ids": [...]} or {"text": "..."} (tokenized with the checkpoint's
tokenizer), optionally with "output_len" (new tokens for that prompt; kvmem's replay format). A prompt the
engine refuses (a token outside the vocabulary, too long for the context or the pool) gets an "error" line
naming it, and the others are served.

Per prompt: {"index", "output_ids"[, "text"]} or {"index", "error"}. Summary: requests, prompt_tokens,
cached_tokens, hit_rate (token-weighted prefix-cache hits at first admission), output_tokens, retractions,
evicted_tokens, seconds (wall, loading excluded), output_tokens_per_s, tokens_per_s ((prompt + output) / s).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from kvmem._checks import positive_int_arg
from kvmem._device import check_device
from kvmem.engine.cli import DTYPES, add_engine_args, check_model_name, load_model, make_engine
from kvmem.engine.presets import PRESETS


def read_prompts(path: str, tokenizer) -> list[dict]:
    """The prompts of `path`; OSError when it cannot be read, ValueError naming a bad prompt's line (or the file,
    when it holds no prompt)."""
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            if not isinstance(row, dict) or ("input_ids" not in row and "text" not in row):
                raise ValueError(f"{path}:{n}: a prompt needs 'input_ids' or 'text'")
            if "input_ids" not in row:
                if tokenizer is None:
                    raise ValueError(f"{path}:{n}: a 'text' prompt needs a checkpoint with a tokenizer")
                row["input_ids"] = tokenizer(row["text"])["input_ids"]
            prompts.append(row)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def load_tokenizer(model_name: str):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_name, local_files_only=True)
    except (OSError, ValueError):
        return None


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses, as usage errors, the options the model's loading or the engine would refuse with a traceback
    once the model has loaded."""
    if args.capacity_tokens % args.page_size:
        parser.error(f"argument --page-size: {args.page_size} does not divide --capacity-tokens {args.capacity_tokens}")
    try:
        check_model_name(args.model)
    except ValueError as e:
        parser.error(f"argument {e}")
    try:
        device = check_device(args.device)
    except ValueError as e:
        parser.error(f"argument --device: {e}")
    if args.attention_backend == "flashinfer" and device.type != "cuda":
        parser.error("argument --attention-backend: flashinfer needs a CUDA --device")
    try:
        torch.Generator().manual_seed(args.seed)
    except (RuntimeError, ValueError) as e:
        parser.error(f"argument --seed: {args.seed} is not a seed torch takes ({e})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--max-new-tokens", type=positive_int_arg, default=32)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0, help="weights seed of a preset")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    check_args(parser, args)
    tokenizer = None if args.model in PRESETS else load_tokenizer(args.model)
    try:
        prompts = read_prompts(args.prompts, tokenizer)
    except (OSError, ValueError) as e:
        parser.error(f"argument --prompts: {e}")
    try:
        model = load_model(args.model, dtype=DTYPES[args.dtype], device=args.device, seed=args.seed)
    except (OSError, ValueError) as e:  # a folder transformers cannot load a checkpoint from
        parser.error(f"argument --model: {e}")
    try:
        engine = make_engine(model, args)
    except (ValueError, RuntimeError) as e:  # what only the loaded model tells: its architecture, its pool's bytes
        parser.error(f"--model {args.model}: {e}")
    start = time.perf_counter()
    index_of, lines = {}, {}
    for i, row in enumerate(prompts):
        try:
            rid = engine.add_request(row["input_ids"], row.get("output_len", args.max_new_tokens))
        except (ValueError, TypeError) as e:
            lines[i] = {"index": i, "error": str(e)}
            continue
        index_of[rid] = i
    while not engine.is_idle():
        for out in engine.step():
            i = index_of[out.rid]
            lines[i] = {"index": i, "output_ids": out.output_ids}
            if tokenizer is not None:
                lines[i]["text"] = tokenizer.decode(out.output_ids)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    for i in sorted(lines):
        print(json.dumps(lines[i]))
    s = engine.stats
    print(json.dumps({
        "model": args.model, "requests": s.requests, "rejected": len(prompts) - len(index_of),
        "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens, "hit_rate": round(s.hit_rate, 4),
        "output_tokens": s.output_tokens, "retractions": s.retractions, "evicted_tokens": s.evicted_tokens,
        "seconds": round(seconds, 3), "output_tokens_per_s": round(s.output_tokens / seconds, 1),
        "tokens_per_s": round((s.prompt_tokens + s.output_tokens) / seconds, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
