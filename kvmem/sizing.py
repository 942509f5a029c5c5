"""How many KV-cache bytes one token costs, and how many tokens fit a memory budget.

Pure Python (no torch), so a scheduler or a command line can size a pool before any tensor exists:

    $ kvmem-sizing llama-3-70b --kv-cache-dtype int8 --gpu-mem-gb 40
    {"model": "llama-3-70b", "kv_cache_dtype": "int8", "bytes_per_token": 168960, ...}

>>> from kvmem import sizing
>>> llama = sizing.get_model_config("llama-3-70b")
>>> sizing.bytes_per_token(llama)                        # 80 layers x 8 KV heads x (128 + 128) x 2 bytes
327680
>>> sizing.bytes_per_token(llama, "int8", include_scales=False)
163840
>>> sizing.tokens_for_budget(llama, gpu_mem_gb=40, page_size=16)   # whole pages, padding page paid
131056

Storage per token, the same numbers `MHAKVPool` / `MLAKVPool` allocate (their `bytes_per_token`):
- MHA/GQA: num_layers x num_kv_heads x (head_dim + v_head_dim) x element bytes, where an element is the
  model dtype for "auto", 1 byte for fp8 and int8, half a byte for int4; int8/int4 add one float32 scale
  per (layer, kv head, K or V, group of `quant_group` elements).
- MLA: num_layers x (kv_lora_rank + qk_rope_head_dim) x element bytes (one shared latent, no V).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from types import MappingProxyType
from typing import Union

from kvmem._checks import check_int, check_number, positive_float_arg, positive_int_arg

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
MODEL_DTYPE_BYTES = MappingProxyType({"float16": 2, "bfloat16": 2, "float32": 4})
SCALE_BYTES = 4  # int8/int4 scales are float32; kv_pool.py says why
GIB = 1 << 30

# Element width in bits, so that int4's half byte stays integer arithmetic.
_QUANT_BITS = {"fp8_e4m3": 8, "fp8_e5m2": 8, "int8": 8, "int4": 4}


def _check_model_dtype(dtype: str) -> None:
    if not isinstance(dtype, str) or dtype not in MODEL_DTYPE_BYTES:  # a list would not even hash
        raise ValueError(f"dtype must be one of {', '.join(MODEL_DTYPE_BYTES)}, got {dtype!r}")


def _check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")


@dataclass(frozen=True)
class MHAConfig:
    """KV shape of a multi-head / grouped-query attention model; v_head_dim defaults to head_dim."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        check_int("num_layers", self.num_layers, minimum=1)
        check_int("num_kv_heads", self.num_kv_heads, minimum=1)
        check_int("head_dim", self.head_dim, minimum=1)
        if self.v_head_dim is not None:
            check_int("v_head_dim", self.v_head_dim, minimum=1)
        _check_model_dtype(self.dtype)


@dataclass(frozen=True)
class MLAConfig:
    """KV shape of a multi-head latent attention model: one [kv_lora_rank + qk_rope_head_dim] row per layer."""

    num_layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        check_int("num_layers", self.num_layers, minimum=1)
        check_int("kv_lora_rank", self.kv_lora_rank, minimum=1)
        check_int("qk_rope_head_dim", self.qk_rope_head_dim, minimum=1)
        _check_model_dtype(self.dtype)


ModelConfig = Union[MHAConfig, MLAConfig]

# Numbers from each model's public config.json (num_hidden_layers, num_key_value_heads, head_dim).
MODEL_CONFIGS: MappingProxyType[str, ModelConfig] = MappingProxyType({
    "llama-3-8b": MHAConfig(num_layers=32, num_kv_heads=8, head_dim=128),
    "llama-3-70b": MHAConfig(num_layers=80, num_kv_heads=8, head_dim=128),
    "qwen2.5-7b": MHAConfig(num_layers=28, num_kv_heads=4, head_dim=128),
    "mistral-7b": MHAConfig(num_layers=32, num_kv_heads=8, head_dim=128),
    "deepseek-v3": MLAConfig(num_layers=61, kv_lora_rank=512, qk_rope_head_dim=64),
})


def get_model_config(name: str) -> ModelConfig:
    """The preset called `name` (see MODEL_CONFIGS); raises ValueError listing the known names."""
    try:
        return MODEL_CONFIGS[name]
    except (KeyError, TypeError):
        raise ValueError(f"name {name!r} is not a known model; known: {', '.join(MODEL_CONFIGS)}") from None


def bytes_per_token(config: ModelConfig, kv_cache_dtype: str = "auto", quant_group: int | None = None,
                    include_scales: bool = True) -> int:
    """KV-cache bytes one token occupies across all layers (K and V, or the MLA latent).

    kv_cache_dtype: "auto" (the model dtype), "fp8_e4m3", "fp8_e5m2", "int8" or "int4" (MHA only).
    quant_group: elements per int8/int4 scale group; None = one group per head (head_dim for K,
    v_head_dim for V). include_scales=False leaves out the float32 scales, the way back-of-envelope
    sizing usually counts (Llama-3-70B int8: 163840 bytes without scales, 168960 with).
    """
    _check_kv_cache_dtype(kv_cache_dtype)
    if not isinstance(include_scales, bool):  # "no" would count the scales
        raise TypeError(f"include_scales must be a bool, got {type(include_scales).__name__}")
    if isinstance(config, MLAConfig):
        if kv_cache_dtype in ("int8", "int4"):
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported for MLA; use auto or fp8")
        if quant_group is not None:
            raise ValueError(f"quant_group must be None for MLA, got {quant_group!r}")
        width = config.kv_lora_rank + config.qk_rope_head_dim
        return config.num_layers * width * _element_bits(config, kv_cache_dtype) // 8
    if not isinstance(config, MHAConfig):
        raise TypeError(f"config must be an MHAConfig or MLAConfig, got {type(config).__name__}")
    v_head_dim = config.v_head_dim or config.head_dim
    groups = quant_groups(kv_cache_dtype, config.head_dim, v_head_dim, quant_group)
    if kv_cache_dtype == "int4" and (config.head_dim % 2 or v_head_dim % 2):
        # Two int4 values share a byte within one head row.
        raise ValueError(f"int4 needs even head dims, got head_dim {config.head_dim}, v_head_dim {v_head_dim}")
    per_head = (config.head_dim + v_head_dim) * _element_bits(config, kv_cache_dtype) // 8
    if include_scales:
        per_head += SCALE_BYTES * sum(groups)
    return config.num_layers * config.num_kv_heads * per_head


def tokens_for_budget(config: ModelConfig, mem_bytes: int | None = None, *, gpu_mem_gb: float | None = None,
                      kv_cache_dtype: str = "auto", page_size: int = 1, quant_group: int | None = None) -> int:
    """The largest pool `size` (usable tokens) whose KV buffers fit the budget; 0 when not even one page fits.

    Give exactly one of mem_bytes or gpu_mem_gb (GiB, 2**30 bytes). The result is a whole number of
    pages and already pays for the pool's padding page, so `MHAKVPool(size=tokens_for_budget(...), ...)`
    allocates (size + page_size) x bytes_per_token <= the budget. Scales are included.
    """
    if (mem_bytes is None) == (gpu_mem_gb is None):
        raise ValueError(f"give exactly one of mem_bytes ({mem_bytes!r}) and gpu_mem_gb ({gpu_mem_gb!r})")
    if mem_bytes is None:
        mem_gb = check_number("gpu_mem_gb", gpu_mem_gb, 0)
        if mem_gb * GIB >= 2**63:
            raise ValueError(f"gpu_mem_gb {gpu_mem_gb!r} is beyond any memory (8 EiB and more)")
        mem_bytes = int(mem_gb * GIB)
    else:
        mem_bytes = check_int("mem_bytes", mem_bytes, minimum=0)
    check_int("page_size", page_size, minimum=1)
    per_token = bytes_per_token(config, kv_cache_dtype, quant_group)
    pages = mem_bytes // (per_token * page_size)
    return max(pages - 1, 0) * page_size


def quant_groups(kv_cache_dtype: str, head_dim: int, v_head_dim: int, quant_group: int | None) -> tuple[int, int]:
    """(K groups, V groups) per head: scales per head for int8/int4, (0, 0) for other dtypes.

    Raises ValueError when quant_group is given for a dtype without scales or does not divide a head dim.
    """
    if kv_cache_dtype not in ("int8", "int4"):
        if quant_group is not None:
            raise ValueError(f"quant_group applies to int8/int4 only, got {quant_group!r} with {kv_cache_dtype!r}")
        return 0, 0
    if quant_group is None:
        return 1, 1
    check_int("quant_group", quant_group, minimum=1)
    for name, dim in (("head_dim", head_dim), ("v_head_dim", v_head_dim)):
        if dim % quant_group:
            raise ValueError(f"quant_group {quant_group} must divide {name} {dim}")
    return head_dim // quant_group, v_head_dim // quant_group


def _element_bits(config: ModelConfig, kv_cache_dtype: str) -> int:
    if kv_cache_dtype == "auto":
        return 8 * MODEL_DTYPE_BYTES[config.dtype]
    return _QUANT_BITS[kv_cache_dtype]


def main(argv: list[str] | None = None) -> None:
    """`kvmem-sizing MODEL [--kv-cache-dtype D] [--gpu-mem-gb G] [--page-size P]`: prints JSON."""
    parser = argparse.ArgumentParser(prog="kvmem-sizing", description=main.__doc__)
    parser.add_argument("model", choices=list(MODEL_CONFIGS))
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument("--quant-group", type=positive_int_arg, default=None)
    parser.add_argument("--gpu-mem-gb", type=positive_float_arg, default=None)
    parser.add_argument("--page-size", type=positive_int_arg, default=None,
                        help="rounds --gpu-mem-gb's tokens down to whole pages (default 1)")
    args = parser.parse_args(argv)
    if args.page_size is not None and args.gpu_mem_gb is None:
        parser.error("argument --page-size: it rounds --gpu-mem-gb's tokens to whole pages; give --gpu-mem-gb")
    config = get_model_config(args.model)
    try:
        report = {
            "model": args.model,
            "kv_cache_dtype": args.kv_cache_dtype,
            "bytes_per_token": bytes_per_token(config, args.kv_cache_dtype, args.quant_group),
            "bytes_per_token_without_scales": bytes_per_token(config, args.kv_cache_dtype, args.quant_group,
                                                              include_scales=False),
        }
        if args.gpu_mem_gb is not None:
            report["gpu_mem_gb"] = args.gpu_mem_gb
            report["tokens"] = tokens_for_budget(config, gpu_mem_gb=args.gpu_mem_gb,
                                                 kv_cache_dtype=args.kv_cache_dtype, page_size=args.page_size or 1,
                                                 quant_group=args.quant_group)
    except (ValueError, TypeError) as e:  # a combination the model or dtype cannot take: the library says why
        parser.error(str(e))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
