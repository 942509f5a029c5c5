"""What scripts/generate.py and scripts/bench_engine.py share: loading a model by preset or path, and the
engine's options on the command line."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvmem._checks import positive_int_arg
from kvmem._torch import torch
from kvmem.engine.attention import ATTENTION_BACKENDS
from kvmem.engine.engine import Engine
from kvmem.engine.presets import PRESETS, build_model
from kvmem.sizing import KV_CACHE_DTYPES

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--capacity-tokens", type=positive_int_arg, default=4096,
                        help="KV slots in the pool (default 4096)")
    parser.add_argument("--page-size", type=positive_int_arg, default=1)
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    parser.add_argument("--chunked-prefill-size", type=positive_int_arg, default=None)
    parser.add_argument("--max-running-requests", type=positive_int_arg, default=None)
    parser.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto")


def load_model(name: str, *, dtype: torch.dtype, device: str, seed: int = 0):
    """A preset (random weights drawn under `seed`) or a local Hugging Face checkpoint directory; nothing is
    downloaded."""
    if name in PRESETS:
        return build_model(name, seed=seed, dtype=dtype, device=device)
    check_model_name(name)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype, local_files_only=True).to(device).eval()


def check_model_name(name: str) -> None:
    """Raises ValueError unless `name` is a preset or a directory (a checkpoint is never downloaded)."""
    if name not in PRESETS and not Path(name).is_dir():
        raise ValueError(f"--model {name!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a directory")


def make_engine(model, args: argparse.Namespace) -> Engine:
    return Engine(model, capacity_tokens=args.capacity_tokens, page_size=args.page_size,
                  kv_cache_dtype=args.kv_cache_dtype, chunked_prefill_size=args.chunked_prefill_size,
                  max_running_requests=args.max_running_requests, attention_backend=args.attention_backend)
