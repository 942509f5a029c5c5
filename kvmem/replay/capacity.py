"""KV capacities as a planner types them and reads them: token counts with a suffix (1M, 500k), GiB of a model's
KV, and what GPUs of a kind hold.

`parse_sizes("1M,3M,10M")` keeps each size's text as its label, so that tables and plots say what was typed;
`gpu_fit` says how many KV tokens `tp` GPUs of a kind leave beside the model's weights, and `gpus_needed` the
smallest tensor-parallel group of them that holds a capacity.
"""

from __future__ import annotations

import argparse
import re
from typing import NamedTuple

from kvmem import sizing
from kvmem.replay.cost import MODEL_COMPUTE, RooflineCost, kv_copies

_SUFFIXES = {"": 1, "k": 1_000, "m": 1_000_000}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(k|m|)\s*$", re.IGNORECASE)


class Size(NamedTuple):
    """A capacity as typed: its label, and its tokens or its GiB (the other None until a model sizes it)."""

    label: str
    tokens: int | None = None
    gib: float | None = None


def parse_token_sizes(text: str) -> list[Size]:
    """Comma-separated positive token counts, each a number with an optional k or M suffix ("1M", "500k",
    "3000000"); argparse.ArgumentTypeError otherwise."""
    sizes = []
    for part in text.split(","):
        match = _SIZE.match(part)
        tokens = round(float(match[1]) * _SUFFIXES[match[2].lower()]) if match else 0
        if tokens <= 0:
            raise argparse.ArgumentTypeError(f"expected comma-separated positive token counts (1M, 500k or "
                                             f"3000000), got {text!r} (a TRACE goes before the option)")
        sizes.append(Size(part.strip(), tokens=tokens))
    return sizes


def parse_gib_sizes(text: str) -> list[Size]:
    """Comma-separated positive GiB ("40,80"); argparse.ArgumentTypeError otherwise."""
    sizes = []
    for part in text.split(","):
        try:
            gib = float(part)
        except ValueError:
            gib = 0.0
        if not 0 < gib < float("inf"):
            raise argparse.ArgumentTypeError(f"expected comma-separated positive GiB, got {text!r}")
        sizes.append(Size(f"{part.strip()} GiB", gib=gib))
    return sizes


def tokens_in_gib(gib: float, model: str, kv_cache_dtype: str, page_size: int) -> int:
    """The KV tokens (whole pages) `gib` GiB of `model`'s KV cache holds (kvmem.sizing); 0 when not a page."""
    return sizing.tokens_for_budget(sizing.get_model_config(model), gpu_mem_gb=gib, page_size=page_size,
                                    kv_cache_dtype=kv_cache_dtype)


def kv_gib(tokens: int, kv_bytes_per_token: int) -> float:
    """The GiB `tokens` of KV weigh (one copy)."""
    return tokens * kv_bytes_per_token / 2**30


def gpu_fit(gpu: str, model: str, tp: int, kv_bytes_per_token: int, page_size: int) -> int:
    """The KV tokens (whole pages) `tp` GPUs of kind `gpu` leave beside `model`'s weights; 0 when none."""
    try:
        return RooflineCost(gpu, model, tp, kv_bytes_per_token=kv_bytes_per_token).kv_capacity_tokens(page_size)
    except ValueError:
        return 0


class GpuCount(NamedTuple):
    """The smallest tensor-parallel group of `gpu`s that holds a capacity (tp None: none does; `largest` is then
    what the largest group holds)."""

    gpu: str
    tp: int | None
    largest: int
    largest_tp: int


def gpus_needed(tokens: int, gpu: str, model: str, kv_bytes_per_token: int, page_size: int) -> GpuCount:
    """The fewest GPUs of kind `gpu`, tensor-parallel, whose memory holds `tokens` of KV beside `model`'s weights.
    Only group sizes that split the model's attention heads count, and past its KV heads a group keeps copies of
    them (kvmem.replay.cost.kv_copies), so more GPUs may hold no more."""
    largest = largest_tp = 0
    for tp in _tensor_parallel_sizes(model):
        fit = gpu_fit(gpu, model, tp, kv_bytes_per_token, page_size)
        if fit >= tokens:
            return GpuCount(gpu, tp, fit, tp)
        if fit > largest:
            largest, largest_tp = fit, tp
    return GpuCount(gpu, None, largest, largest_tp)


def _tensor_parallel_sizes(model: str) -> list[int]:
    heads = MODEL_COMPUTE[model].num_attention_heads
    sizes = []
    for tp in range(1, heads + 1):
        if heads % tp == 0:
            try:
                kv_copies(model, tp)
            except ValueError:
                continue
            sizes.append(tp)
    return sizes
