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

Hybrid models (`HybridConfig`: transformers' `layer_types`) keep three pools: the full-attention layers' KV for every
token, the sliding-window layers' KV for the tokens still inside a window, and a fixed recurrent state (conv + SSM)
per request or cached prefix for the linear-attention layers. `hybrid_capacity` splits a budget between them (the
window pool sized from concurrency, `window_pool_tokens`); `full_attention_config` is the model sized as if every
layer were full attention, for comparison.

>>> gpt = sizing.HYBRID_MODEL_CONFIGS["gpt-oss-120b"]
>>> sizing.full_bytes_per_token(gpt), sizing.bytes_per_token(sizing.full_attention_config(gpt))
(36864, 73728)
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple, Union

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
    """The preset called `name`: one of MODEL_CONFIGS, or a hybrid one (HYBRID_MODEL_CONFIGS) sized as if every layer
    were full attention (`full_attention_config`, what pools that ignore layer kinds reserve); raises ValueError
    listing the known names."""
    if isinstance(name, str) and name in HYBRID_MODEL_CONFIGS:
        return full_attention_config(HYBRID_MODEL_CONFIGS[name])
    try:
        return MODEL_CONFIGS[name]
    except (KeyError, TypeError):
        raise ValueError(f"name {name!r} is not a known model; known: "
                         f"{', '.join([*MODEL_CONFIGS, *HYBRID_MODEL_CONFIGS])}") from None


LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "linear_attention")
# A linear-attention state is kept only at positions on multiples of this (and of the page size): the chunked
# gated-delta kernel reproduces a prefill bitwise when it is cut there.
STATE_GRID = 64
# A decoding request frees the window slots its window left in runs of at least this many tokens.
WINDOW_FREE_INTERVAL = 64
# Window-aware pools keep room for the window tail of one cached prefix per this many windows of full-pool tokens
# (a cached prefix is matchable only while its tail has window KV): tails then cost 1/32 of the full pool's window
# KV, and a replay of the Mooncake conversation trace on gpt-oss-120b hits as often as with full-attention pools.
CACHED_WINDOW_SPACING = 32
WINDOW_LAYER_TYPES = ("sliding_attention", "chunked_attention")


@dataclass(frozen=True)
class HybridConfig:
    """A model whose layers are of several kinds, as transformers' `config.layer_types` names them.

    layer_types: one per layer: "full_attention" (KV of every token), "sliding_attention" (KV of the last
        `sliding_window` tokens: a query at position p reads keys p-W+1..p, HF's mask), "chunked_attention" (Llama 4:
        keys of the query's chunk of `sliding_window` tokens, served as a window of that size, a superset of what it
        reads) or "linear_attention" (a recurrent state per request: conv_state_shape + ssm_state_shape elements).
    num_kv_heads, head_dim, v_head_dim: every attention layer's KV shape. dtype: the model dtype (KV and conv states);
        ssm_dtype: the SSM state's (float32, as transformers keeps it). max_position_embeddings: the context, if known
        (a window longer than it is refused).
    At least one layer is full attention: its pool holds the tokens (its size is the model's token capacity).
    """

    layer_types: tuple[str, ...]
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    v_head_dim: int | None = None
    conv_state_shape: tuple[int, ...] = ()
    ssm_state_shape: tuple[int, ...] = ()
    dtype: str = "bfloat16"
    ssm_dtype: str = "float32"
    max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        kinds = self.layer_types
        if isinstance(kinds, (str, bytes)) or not isinstance(kinds, (list, tuple)):
            raise TypeError(f"layer_types must be a list of layer kinds, got {type(kinds).__name__}")
        object.__setattr__(self, "layer_types", tuple(kinds))
        bad = next((i for i, kind in enumerate(kinds) if kind not in LAYER_TYPES), None)
        if bad is not None:
            raise ValueError(f"layer_types[{bad}] is {kinds[bad]!r}, not one of {', '.join(LAYER_TYPES)}")
        if "full_attention" not in kinds:
            raise ValueError("layer_types has no full_attention layer: the full pool is what holds a request's tokens")
        MHAConfig(len(kinds), self.num_kv_heads, self.head_dim, self.v_head_dim, self.dtype)  # its checks
        _check_model_dtype(self.ssm_dtype)
        if self.max_position_embeddings is not None:
            check_int("max_position_embeddings", self.max_position_embeddings, minimum=1)
        windowed = any(kind in WINDOW_LAYER_TYPES for kind in kinds)
        if windowed != (self.sliding_window is not None):
            raise ValueError(f"sliding_window is {self.sliding_window!r}, but layer_types has "
                             f"{'a' if windowed else 'no'} sliding or chunked layer")
        if windowed:
            check_int("sliding_window", self.sliding_window, minimum=1)
            context = self.max_position_embeddings
            if context is not None and self.sliding_window > context:
                raise ValueError(f"sliding_window {self.sliding_window} is larger than the context "
                                 f"(max_position_embeddings {context})")
        linear = "linear_attention" in kinds
        for name in ("conv_state_shape", "ssm_state_shape"):
            shape = getattr(self, name)
            if not isinstance(shape, (list, tuple)):
                raise TypeError(f"{name} must be a tuple of ints, got {type(shape).__name__}")
            object.__setattr__(self, name, tuple(check_int(f"{name}[{i}]", d, minimum=1) for i, d in enumerate(shape)))
            if linear != bool(shape):
                raise ValueError(f"{name} is {tuple(shape)}, but layer_types has {'a' if linear else 'no'} "
                                 "linear_attention layer")

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "full_attention")

    @property
    def window_layers(self) -> tuple[int, ...]:
        """Indices of the sliding-window (and chunked) layers."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind in WINDOW_LAYER_TYPES)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Indices of the linear-attention layers."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "linear_attention")


def _pattern(num_layers: int, every: int, other: str) -> tuple[str, ...]:
    """Layer i full iff (i + 1) % every == 0, else `other` (Gemma 3, Llama 4, Qwen3-Next)."""
    return tuple("full_attention" if (i + 1) % every == 0 else other for i in range(num_layers))


# Shapes from each model's config.json on Hugging Face (openai/gpt-oss-20b, openai/gpt-oss-120b,
# google/gemma-3-27b-it text_config, meta-llama/Llama-4-Scout-17B-16E-Instruct text_config,
# Qwen/Qwen3-Next-80B-A3B-Instruct); fields a file leaves out take transformers' config defaults (Gemma 3's
# sliding_window_pattern 6, Llama 4's NoPE layer every 4th, Qwen3-Next's full_attention_interval 4).
HYBRID_MODEL_CONFIGS: MappingProxyType[str, HybridConfig] = MappingProxyType({
    "gpt-oss-20b": HybridConfig(("sliding_attention", "full_attention") * 12, 8, 64, sliding_window=128,
                                max_position_embeddings=131072),
    "gpt-oss-120b": HybridConfig(("sliding_attention", "full_attention") * 18, 8, 64, sliding_window=128,
                                 max_position_embeddings=131072),
    "gemma-3-27b": HybridConfig(_pattern(62, 6, "sliding_attention"), 16, 128, sliding_window=1024,
                                max_position_embeddings=131072),
    "llama-4-scout": HybridConfig(_pattern(48, 4, "chunked_attention"), 8, 128, sliding_window=8192,
                                  max_position_embeddings=10485760),
    # Linear layers: conv over q, k, v (2 x 16 key heads x 128 + 32 value heads x 128 channels), transformers keeping
    # the last 4 (conv kernel) columns; SSM state 32 value heads x 128 x 128 in float32.
    "qwen3-next-80b": HybridConfig(_pattern(48, 4, "linear_attention"), 2, 256, conv_state_shape=(8192, 4),
                                   ssm_state_shape=(32, 128, 128), max_position_embeddings=262144),
})


def get_hybrid_model_config(name: str) -> HybridConfig:
    """The hybrid preset called `name` (see HYBRID_MODEL_CONFIGS); raises ValueError listing the known names."""
    try:
        return HYBRID_MODEL_CONFIGS[name]
    except (KeyError, TypeError):
        raise ValueError(f"name {name!r} is not a known hybrid model; known: {', '.join(HYBRID_MODEL_CONFIGS)}") \
            from None


def hybrid_config_from_hf(config, dtype: str = "bfloat16") -> HybridConfig:
    """The `HybridConfig` of a transformers config (its text config for a multimodal one) that lists `layer_types`:
    Gemma 3, gpt-oss, Llama 4, Qwen3-Next. Raises ValueError when the config has no layer_types."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = getattr(text, "layer_types", None)
    if not kinds:
        raise ValueError(f"config ({type(config).__name__}) lists no layer_types")
    heads = text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    window = None
    if "chunked_attention" in kinds:
        window = text.attention_chunk_size
    elif "sliding_attention" in kinds:
        window = text.sliding_window
    conv = ssm = ()
    if "linear_attention" in kinds:
        k_heads, v_heads = text.linear_num_key_heads, text.linear_num_value_heads
        k_dim, v_dim = text.linear_key_head_dim, text.linear_value_head_dim
        conv = (2 * k_heads * k_dim + v_heads * v_dim, text.linear_conv_kernel_dim)
        ssm = (v_heads, k_dim, v_dim)
    context = getattr(text, "max_position_embeddings", None)
    return HybridConfig(tuple(kinds), heads, head_dim, sliding_window=window, conv_state_shape=conv,
                        ssm_state_shape=ssm, dtype=dtype, max_position_embeddings=context)


def full_attention_config(config: HybridConfig) -> MHAConfig:
    """`config` sized as if every layer (linear ones included) were full attention: what an engine that ignores
    layer kinds reserves per token."""
    _check_hybrid(config)
    return MHAConfig(len(config.layer_types), config.num_kv_heads, config.head_dim, config.v_head_dim, config.dtype)


def full_bytes_per_token(config: HybridConfig, kv_cache_dtype: str = "auto", quant_group: int | None = None) -> int:
    """KV bytes of one token in the full-attention layers (the full pool's `bytes_per_token`)."""
    _check_hybrid(config)
    return _layers_bytes(config, len(config.full_layers), kv_cache_dtype, quant_group)


def window_bytes_per_token(config: HybridConfig, kv_cache_dtype: str = "auto", quant_group: int | None = None) -> int:
    """KV bytes of one token in the sliding-window layers (the window pool's `bytes_per_token`; 0 without any)."""
    _check_hybrid(config)
    return _layers_bytes(config, len(config.window_layers), kv_cache_dtype, quant_group)


def state_bytes(config: HybridConfig) -> int:
    """Bytes of one request's recurrent state over the linear-attention layers (conv + SSM; 0 without any)."""
    _check_hybrid(config)
    conv = math.prod(config.conv_state_shape) * MODEL_DTYPE_BYTES[config.dtype]
    ssm = math.prod(config.ssm_state_shape) * MODEL_DTYPE_BYTES[config.ssm_dtype]
    return len(config.linear_layers) * (conv + ssm)


def window_pool_tokens(config: HybridConfig, page_size: int, max_running_requests: int,
                       chunked_prefill_size: int, cached_windows: int | None = None) -> int:
    """The window pool a hybrid model needs (tokens, whole pages; 0 without window layers): each running request's
    window (W - 1 previous tokens in whole pages, the free interval and two pages being written and freed), one
    prefill chunk, and the window tails of `cached_windows` cached prefixes (default: as many as the running
    requests), each the last W - 1 tokens and a page, without which a cached prefix cannot be matched."""
    _check_hybrid(config)
    page_size = check_int("page_size", page_size, minimum=1)
    running = check_int("max_running_requests", max_running_requests, minimum=1)
    chunk = check_int("chunked_prefill_size", chunked_prefill_size, minimum=1)
    cached = running if cached_windows is None else check_int("cached_windows", cached_windows, minimum=0)
    if not config.window_layers:
        return 0
    tail = -(-max(config.sliding_window - 1, page_size) // page_size) * page_size
    interval = -(-WINDOW_FREE_INTERVAL // page_size) * page_size
    tokens = running * (tail + interval + 2 * page_size) + cached * (tail + page_size) + chunk
    return -(-tokens // page_size) * page_size


class HybridCapacity(NamedTuple):
    """How `hybrid_capacity` splits a budget: the full pool's tokens (the model's token capacity), the window pool's
    tokens, the state slots, and the bytes they allocate (padding page and padding state slot included)."""

    full_tokens: int
    window_tokens: int
    state_slots: int
    bytes: int


def hybrid_capacity(config: HybridConfig, mem_bytes: int | None = None, *, gpu_mem_gb: float | None = None,
                    kv_cache_dtype: str = "auto", page_size: int = 1, max_running_requests: int,
                    chunked_prefill_size: int = 8192, cached_windows: int | None = None,
                    state_slots: int | None = None) -> HybridCapacity:
    """Window-aware pools for a budget: the window pool from `window_pool_tokens`, `state_slots` states (default: two
    per running request, its own and a cached one it matched), and the rest to the full pool (whole pages; a window
    pool never larger than it). cached_windows: the cached prefixes' window tails the window pool keeps room for
    (default: one per CACHED_WINDOW_SPACING windows of the full pool's tokens, at least max_running_requests). All
    zero when the window pool and the states alone exceed the budget. Give exactly one of mem_bytes or gpu_mem_gb
    (GiB), as for `tokens_for_budget`.

    >>> cap = hybrid_capacity(HYBRID_MODEL_CONFIGS["gpt-oss-120b"], gpu_mem_gb=40, page_size=16,
    ...                       max_running_requests=64)
    >>> cap.full_tokens, cap.window_tokens, tokens_for_budget(full_attention_config(
    ...     HYBRID_MODEL_CONFIGS["gpt-oss-120b"]), gpu_mem_gb=40, page_size=16)
    (1103712, 61264, 582512)
    """
    mem_bytes = _budget_bytes(mem_bytes, gpu_mem_gb)
    running = check_int("max_running_requests", max_running_requests, minimum=1)
    window = window_pool_tokens(config, page_size, running, chunked_prefill_size,
                                running if cached_windows is None else cached_windows)
    states = 0
    if config.linear_layers:
        states = 2 * max_running_requests if state_slots is None else check_int("state_slots", state_slots, minimum=1)
    full_b, window_b = full_bytes_per_token(config, kv_cache_dtype), window_bytes_per_token(config, kv_cache_dtype)
    state_b = state_bytes(config)
    fixed = (window + page_size) * window_b if window else 0
    fixed += (states + 1) * state_b if states else 0
    full = max((mem_bytes - fixed) // (full_b * page_size) - 1, 0) * page_size
    if window and cached_windows is None:  # more tails for a larger full pool: its tokens pay for them
        tail = -(-max(config.sliding_window - 1, page_size) // page_size) * page_size + page_size
        spacing = CACHED_WINDOW_SPACING * config.sliding_window
        extra = tail * window_b / spacing  # window bytes a full token adds for the tails beyond the first `running`
        grown = max(int((mem_bytes - fixed + running * spacing * extra) // ((full_b + extra) * page_size)) - 1, 0)
        grown *= page_size
        if grown // spacing > running:
            full = grown
            window = window_pool_tokens(config, page_size, running, chunked_prefill_size, full // spacing)
    if window > full:  # a window pool larger than the full one holds nothing more: share what is left evenly
        left = mem_bytes - ((states + 1) * state_b if states else 0)
        full = window = max(left // ((full_b + window_b) * page_size) - 1, 0) * page_size
    if full == 0:
        return HybridCapacity(0, 0, 0, 0)
    used = (full + page_size) * full_b + ((window + page_size) * window_b if window else 0)
    return HybridCapacity(full, window, states, used + ((states + 1) * state_b if states else 0))


def _check_hybrid(config) -> None:
    if not isinstance(config, HybridConfig):
        raise TypeError(f"config must be a HybridConfig, got {type(config).__name__}")


def _layers_bytes(config: HybridConfig, num_layers: int, kv_cache_dtype: str, quant_group: int | None) -> int:
    if num_layers == 0:
        _check_kv_cache_dtype(kv_cache_dtype)
        return 0
    return bytes_per_token(MHAConfig(num_layers, config.num_kv_heads, config.head_dim, config.v_head_dim,
                                     config.dtype), kv_cache_dtype, quant_group)


def _budget_bytes(mem_bytes: int | None, gpu_mem_gb: float | None) -> int:
    """The budget in bytes: exactly one of mem_bytes or gpu_mem_gb (GiB) given."""
    if (mem_bytes is None) == (gpu_mem_gb is None):
        raise ValueError(f"give exactly one of mem_bytes ({mem_bytes!r}) and gpu_mem_gb ({gpu_mem_gb!r})")
    if mem_bytes is None:
        mem_gb = check_number("gpu_mem_gb", gpu_mem_gb, 0)
        if mem_gb * GIB >= 2**63:
            raise ValueError(f"gpu_mem_gb {gpu_mem_gb!r} is beyond any memory (8 EiB and more)")
        return int(mem_gb * GIB)
    return check_int("mem_bytes", mem_bytes, minimum=0)


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
    mem_bytes = _budget_bytes(mem_bytes, gpu_mem_gb)
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
    parser.add_argument("model", choices=[*MODEL_CONFIGS, *HYBRID_MODEL_CONFIGS])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument("--quant-group", type=positive_int_arg, default=None)
    parser.add_argument("--gpu-mem-gb", type=positive_float_arg, default=None)
    parser.add_argument("--page-size", type=positive_int_arg, default=None,
                        help="rounds --gpu-mem-gb's tokens down to whole pages (default 1)")
    parser.add_argument("--max-running", type=positive_int_arg, default=256,
                        help="a hybrid model's running requests, which size its window pool and states (default 256)")
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
        hybrid = HYBRID_MODEL_CONFIGS.get(args.model)
        if hybrid is not None:  # the figures above size every layer as full attention
            report["window_aware"] = _window_aware_report(hybrid, args)
    except (ValueError, TypeError) as e:  # a combination the model or dtype cannot take: the library says why
        parser.error(str(e))
    print(json.dumps(report))


def _window_aware_report(config: HybridConfig, args: argparse.Namespace) -> dict:
    """kvmem-sizing's figures for a hybrid model's window-aware pools."""
    dtype = args.kv_cache_dtype
    out = {"full_bytes_per_token": full_bytes_per_token(config, dtype, args.quant_group),
           "window_bytes_per_token": window_bytes_per_token(config, dtype, args.quant_group),
           "state_bytes": state_bytes(config)}
    if args.gpu_mem_gb is not None:
        out.update(hybrid_capacity(config, gpu_mem_gb=args.gpu_mem_gb, kv_cache_dtype=dtype,
                                   page_size=args.page_size or 1, max_running_requests=args.max_running)._asdict())
    return out


if __name__ == "__main__":
    main()
