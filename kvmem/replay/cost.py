"""What a simulated step costs: a fixed step cost, or a roofline of a model on a GPU.

The replay's clock advances by the cost of each step it takes, so the cost model decides how many requests
overlap in time and what a time to first token (TTFT) is. Two models, both torch-free:

- `StepCost`: a fixed cost per forward plus prefill tokens at a throughput (the replay's original clock,
  kept so that results can be compared with earlier runs), and the loads from lower tiers, priced and
  overlapped with the prefill as the roofline's are.
- `RooflineCost`: a model preset (its KV shape from `kvmem.sizing`, its compute shape from `MODEL_COMPUTE`)
  on `tp` GPUs of a `GPUS` preset. A step takes the longer of its FLOPs at `mfu` of the GPUs' peak and its
  bytes at `mbu` of their memory bandwidth (a roofline): a prefill of many tokens is compute-bound, a decode
  step reads the weights and every running request's KV once and is bandwidth-bound. KV loaded back from the
  host (and read from a storage tier) for a prefill moves layer by layer while earlier layers compute, as
  HiCache's layer-wise loads do, so the step takes the longer of the two, not their sum.

KV under tensor parallelism: each GPU keeps its share of the KV heads, and a whole head where there are fewer
KV heads than GPUs (vLLM and SGLang replicate them); an MLA model's latent has no heads to split, so every GPU
keeps all of it. The cache's capacity, the KV bytes a step reads and the bytes a load moves count each copy.

FLOPs per step: 2 x active parameters per token through the weights, and 2 x (qk_head_dim + v_head_dim) x
query heads per (query, key) pair in each attention layer (QK^T and PV; in a full-attention layer the query at
position q, counted from 1, reads keys 1..q, so a causal prefill of tokens p..s-1 attends to p+1..s keys). A hybrid
model (kvmem.sizing.HYBRID_MODEL_CONFIGS) is priced by each layer's kind, the same whichever pools the replay sizes
(window-aware or full-attention ones: the pools change the capacity, not the work):

- sliding-window layer (window W): the query at q reads min(q, W) keys; a chunked layer (Llama 4, chunks of W) the
  keys of its chunk up to q. A step reads their KV for those keys only.
- linear-attention layer (gated DeltaNet): no (query, key) pairs, but per token about 7 x value heads x d_k x d_v
  FLOPs on the recurrent state (the gated delta rule, Yang et al., "Gated Delta Networks", ICLR 2025: decay the
  d_k x d_v state, S^T k, the rank-one update and S^T q) and 2 x channels x kernel for the short convolution; the
  projections are among the active parameters. A step reads each of its requests' recurrent state and writes it
  back (2 x kvmem.sizing.state_bytes; the chunked prefill kernel's per-chunk intermediate states are left out).

It is an upper bound on speed: tensor-parallel communication, kernel launches and scheduling are left out; `mfu`
and `mbu` (model FLOPs / bandwidth utilization) say how much of the peak the kernels reach.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from kvmem import sizing
from kvmem._checks import check_int, check_number

# Llama-3-8B's KV in bfloat16 (32 layers x 8 KV heads x (128 + 128) x 2 bytes): what a token weighs when
# the replay prices copies between tiers and no --model says otherwise.
DEFAULT_KV_BYTES_PER_TOKEN = 131072
# PCIe 5.0 x16 moves 64 GB/s per direction (32 GT/s x 16 lanes, 128b/130b encoding); copies of pinned host
# memory reach about 80% of it, and NVIDIA's H100 datasheet puts host-device bandwidth at 64 GB/s.
DEFAULT_PCIE_GBPS = 50.0
# A storage tier reached over a 100 Gb/s network (Mooncake's RDMA pools) or a striped NVMe array moves about
# 10 GB/s to a node.
DEFAULT_STORAGE_GBPS = 10.0
# What a read from the storage tier waits before its bytes flow: a NAND flash read takes about 100 us, and NVMe
# drives answer in 20-100 us end to end (Pure Storage, "What is NVMe?"); a distributed store's get adds a metadata
# round trip to its master, tens of us on a datacenter network. 100 us is the order of either.
DEFAULT_STORAGE_LATENCY_US = 100.0


@dataclass(frozen=True)
class StepCost:
    """Simulated seconds per step: a fixed part per forward plus prefill tokens at a throughput, and the loads
    from lower tiers.

    The defaults are of the order of one 8-GPU node serving a 70B-class model (tens of thousands of
    prefill tokens per second, tens of milliseconds per decode step); change them to model another
    server. It knows no GPU and saves no GPU-seconds, but it charges what a prefill loads from the host tier
    (`kv_bytes_per_token` a token over `h2d_gbps`) and reads from the storage tier (one `storage_latency_us`,
    then the bytes at `storage_gbps`), overlapped with the prefill as the roofline overlaps them: the step takes
    the longer of the two. Without tiers nothing loads, and a step costs what it always did.
    """

    decode_step_s: float = 0.03
    prefill_tokens_per_s: float = 50_000.0
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    h2d_gbps: float = DEFAULT_PCIE_GBPS
    storage_gbps: float = DEFAULT_STORAGE_GBPS
    storage_latency_us: float = DEFAULT_STORAGE_LATENCY_US

    def __post_init__(self) -> None:
        if not self.decode_step_s >= 0 or not self.prefill_tokens_per_s > 0:
            raise ValueError(f"need decode_step_s >= 0 and prefill_tokens_per_s > 0, got decode_step_s="
                             f"{self.decode_step_s!r}, prefill_tokens_per_s={self.prefill_tokens_per_s!r}")
        _check_links(self)
        object.__setattr__(self, "_kv_bytes", self.kv_bytes_per_token)
        object.__setattr__(self, "_links", 1)

    @property
    def name(self) -> str:
        return f"fixed: {self.decode_step_s * 1e3:g} ms a step + {self.prefill_tokens_per_s:,.0f} prefill tokens/s"

    @property
    def num_gpus(self) -> int | None:
        return None

    @property
    def window(self) -> None:
        """A fixed step knows no layers, so no window (see RooflineCost.window)."""
        return None

    def extend_seconds(self, prefix_lens: np.ndarray, seq_lens: np.ndarray, loaded_tokens: int = 0,
                       storage_tokens: int = 0) -> float:
        """A prefill step over tokens prefix_lens[i]..seq_lens[i]-1 of each request ([bs] int64 each), of which
        `loaded_tokens` of cached prefix were loaded back from the host (`storage_tokens` of them first read from
        the storage tier)."""
        compute = self.decode_step_s + int((seq_lens - prefix_lens).sum()) / self.prefill_tokens_per_s
        return max(compute, load_seconds(self, loaded_tokens, storage_tokens))

    def decode_seconds(self, batch_size: int, kv_tokens: int, window_tokens: int | None = None) -> float:
        """A decode step of `batch_size` requests attending to `kv_tokens` tokens in all (`window_tokens`: see
        RooflineCost.decode_seconds; a fixed step ignores both)."""
        return self.decode_step_s

    def prefill_seconds_saved(self, cached_tokens: int) -> float:
        """Server seconds a prefill did not spend on `cached_tokens` cached tokens at the head of its prompt."""
        return cached_tokens / self.prefill_tokens_per_s


def load_seconds(cost: StepCost | RooflineCost, loaded_tokens: int, storage_tokens: int) -> float:
    """What a prefill's loads take on either clock: `loaded_tokens` of KV over the host links (every GPU's copy over
    its own link), `storage_tokens` of them first read from the storage tier (one round trip of latency, then the
    bytes at its bandwidth)."""
    load = cost._kv_bytes * (loaded_tokens / (cost._links * cost.h2d_gbps * 1e9)
                             + storage_tokens / (cost.storage_gbps * 1e9))
    if storage_tokens:
        load += cost.storage_latency_us * 1e-6
    return load


def _check_links(cost: StepCost | RooflineCost) -> None:
    check_int("kv_bytes_per_token", cost.kv_bytes_per_token, minimum=1)
    check_number("h2d_gbps", cost.h2d_gbps, 0, allow_minimum=False)
    check_number("storage_gbps", cost.storage_gbps, 0, allow_minimum=False)
    check_number("storage_latency_us", cost.storage_latency_us, 0)


@dataclass(frozen=True)
class GPU:
    """The datasheet figures the roofline reads (dense, no sparsity)."""

    bf16_tflops: float   # peak dense BF16 tensor-core TFLOP/s
    memory_tbps: float   # memory bandwidth, TB/s
    memory_gb: float     # memory, GB (1e9 bytes)
    host_link_gbps: float  # what copies between host and device reach over its PCIe link, GB/s per direction


# Sources: NVIDIA's datasheets (SXM forms where there are several): "NVIDIA H100 Tensor Core GPU" datasheet
# (H100 SXM: BF16 1,979 TFLOPS with sparsity, so 989.5 dense; 3.35 TB/s HBM3; 80 GB; PCIe Gen5 128 GB/s),
# "NVIDIA H200 Tensor Core GPU" datasheet (H200 SXM: BF16 1,979 TFLOPS with sparsity; 4.8 TB/s HBM3e;
# 141 GB; PCIe Gen5 128 GB/s), "NVIDIA A100 Tensor Core GPU" datasheet (A100 80GB SXM: BF16 312 TFLOPS dense;
# 2,039 GB/s HBM2e; PCIe Gen4 64 GB/s), "NVIDIA L40S GPU" datasheet (BF16 362.05 TFLOPS dense, 733 with
# sparsity; 864 GB/s GDDR6; 48 GB; PCIe Gen4 x16 64 GB/s). The PCIe figures are both directions together;
# pinned-memory copies reach about 80% of one direction: 50 GB/s on Gen5, 25 GB/s on Gen4.
GPUS: MappingProxyType[str, GPU] = MappingProxyType({
    "H100": GPU(bf16_tflops=989.5, memory_tbps=3.35, memory_gb=80, host_link_gbps=50.0),
    "H200": GPU(bf16_tflops=989.5, memory_tbps=4.8, memory_gb=141, host_link_gbps=50.0),
    "A100": GPU(bf16_tflops=312.0, memory_tbps=2.039, memory_gb=80, host_link_gbps=25.0),
    "L40S": GPU(bf16_tflops=362.05, memory_tbps=0.864, memory_gb=48, host_link_gbps=25.0),
})


@dataclass(frozen=True)
class ModelCompute:
    """What a forward pass of a model costs, beside its KV shape (kvmem.sizing): parameters, the share a token
    goes through (all of them but for a mixture of experts), attention heads and head dims, bytes a weight."""

    params_b: float          # all weights, billions
    active_params_b: float   # the weights one token goes through, billions
    num_attention_heads: int
    qk_head_dim: int
    v_head_dim: int
    weight_bytes: float = 2.0  # bfloat16


# From each model's public config.json and model card: Llama-3-8B 8.03B parameters and 32 heads of 128;
# Llama-3-70B 70.6B and 64 heads; Qwen2.5-7B 7.61B and 28 heads; Mistral-7B-v0.1 7.24B and 32 heads;
# DeepSeek-V3 671B of which 37B active per token (its technical report), 128 heads with q/k head dim
# 128 + 64 (rope) and v head dim 128, weights in FP8. MLA's attention is counted as its decompressed form.
MODEL_COMPUTE: MappingProxyType[str, ModelCompute] = MappingProxyType({
    "llama-3-8b": ModelCompute(8.03, 8.03, 32, 128, 128),
    "llama-3-70b": ModelCompute(70.6, 70.6, 64, 128, 128),
    "qwen2.5-7b": ModelCompute(7.61, 7.61, 28, 128, 128),
    "mistral-7b": ModelCompute(7.24, 7.24, 32, 128, 128),
    "deepseek-v3": ModelCompute(671.0, 37.0, 128, 192, 128, weight_bytes=1.0),
    # Hybrid models (kvmem.sizing.HYBRID_MODEL_CONFIGS; their model cards): gpt-oss-20b 20.9B parameters, 3.6B
    # active, and gpt-oss-120b 116.8B, 5.1B active, 64 heads of 64, MoE weights in MXFP4 (4.25 bits, counted for
    # every weight); Gemma 3 27B 27.4B, 32 heads of 128; Llama 4 Scout 109B, 17B active, 40 heads of 128;
    # Qwen3-Next-80B-A3B 80B, 3B active, 16 heads of 256.
    "gpt-oss-20b": ModelCompute(20.9, 3.6, 64, 64, 64, weight_bytes=4.25 / 8),
    "gpt-oss-120b": ModelCompute(116.8, 5.1, 64, 64, 64, weight_bytes=4.25 / 8),
    "gemma-3-27b": ModelCompute(27.4, 27.4, 32, 128, 128),
    "llama-4-scout": ModelCompute(109.0, 17.0, 40, 128, 128),
    "qwen3-next-80b": ModelCompute(80.0, 3.0, 16, 256, 256),
})

# The share of GPU memory an engine takes for weights and KV cache (vLLM's gpu_memory_utilization default).
MEMORY_FRACTION = 0.9


@dataclass(frozen=True)
class RooflineCost:
    """A model preset (`model`, a kvmem.sizing name) on `tp` GPUs of a `GPUS` preset (`gpu`), tensor-parallel.

    mfu / mbu: the share of peak FLOP/s and of memory bandwidth the kernels reach (0.5 and 0.8 are what
    well-tuned prefill and decode kernels reach on these GPUs). kv_bytes_per_token: KV bytes a token weighs
    (default: the model's in its own dtype). h2d_gbps / storage_gbps: each GPU's host link and the storage
    tier's bandwidth, GB/s, for loads from those tiers (default: the GPU's link; 10 GB/s). storage_latency_us: what
    a step that reads from the storage tier waits before the first bytes arrive, once (its requests' reads are
    issued together), in microseconds (see DEFAULT_STORAGE_LATENCY_US).
    """

    gpu: str
    model: str
    tp: int = 1
    mfu: float = 0.5
    mbu: float = 0.8
    kv_bytes_per_token: int | None = None
    h2d_gbps: float | None = None
    storage_gbps: float = DEFAULT_STORAGE_GBPS
    storage_latency_us: float = DEFAULT_STORAGE_LATENCY_US

    def __post_init__(self) -> None:
        if self.gpu not in GPUS:
            raise ValueError(f"gpu must be one of {', '.join(GPUS)}, got {self.gpu!r}")
        if self.model not in MODEL_COMPUTE:
            raise ValueError(f"model must be one of {', '.join(MODEL_COMPUTE)}, got {self.model!r}")
        check_int("tp", self.tp, minimum=1)
        copies = kv_copies(self.model, self.tp)
        for name in ("mfu", "mbu"):
            if not 0 < check_number(name, getattr(self, name)) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        if self.kv_bytes_per_token is None:
            object.__setattr__(self, "kv_bytes_per_token", sizing.bytes_per_token(sizing.get_model_config(self.model)))
        if self.h2d_gbps is None:
            object.__setattr__(self, "h2d_gbps", GPUS[self.gpu].host_link_gbps)
        _check_links(self)
        spec, compute = GPUS[self.gpu], MODEL_COMPUTE[self.model]
        num_layers = sizing.get_model_config(self.model).num_layers
        hybrid = sizing.HYBRID_MODEL_CONFIGS.get(self.model)
        full = num_layers if hybrid is None else len(hybrid.full_layers)
        windowed = 0 if hybrid is None else len(hybrid.window_layers)
        kv_bytes = self.kv_bytes_per_token * copies  # a token's KV on all the GPUs, every layer as full attention
        # Per-step constants: FLOP/s and bytes/s the GPUs reach together, weights bytes, attention FLOPs a
        # (query, key) pair costs in the full-attention layers and in the window layers, linear FLOPs a token costs
        # through the weights and through the linear-attention layers' states, the KV bytes a token weighs in the
        # full-attention and in the window layers, the state bytes a request moves in a step.
        object.__setattr__(self, "_flops_per_s", self.tp * spec.bf16_tflops * 1e12 * self.mfu)
        object.__setattr__(self, "_bytes_per_s", self.tp * spec.memory_tbps * 1e12 * self.mbu)
        object.__setattr__(self, "_weight_bytes", compute.params_b * 1e9 * compute.weight_bytes)
        layer_pair_flops = 2.0 * (compute.qk_head_dim + compute.v_head_dim) * compute.num_attention_heads
        object.__setattr__(self, "_pair_flops", layer_pair_flops * full)
        object.__setattr__(self, "_window_pair_flops", layer_pair_flops * windowed)
        object.__setattr__(self, "_token_flops", 2.0 * compute.active_params_b * 1e9)
        object.__setattr__(self, "_linear_flops", 0.0 if hybrid is None else _linear_flops(hybrid))
        # An int for a model of one kind, so that its bytes stay the exact product they always were.
        object.__setattr__(self, "_full_kv_bytes", kv_bytes if full == num_layers else kv_bytes * full / num_layers)
        object.__setattr__(self, "_window_kv_bytes", kv_bytes * windowed / num_layers)
        # Read and written back: each linear layer's heads split over the GPUs, so one copy of the state in all.
        object.__setattr__(self, "_state_bytes", 0 if hybrid is None else 2 * sizing.state_bytes(hybrid))
        object.__setattr__(self, "_window", hybrid.sliding_window if windowed else None)
        object.__setattr__(self, "_chunked", windowed > 0 and "chunked_attention" in hybrid.layer_types)
        object.__setattr__(self, "_kv_bytes", kv_bytes)  # what a load from a lower tier moves a token
        object.__setattr__(self, "_links", self.tp)  # each GPU loads its copy over its own host link

    @property
    def name(self) -> str:
        return f"roofline: {self.model} on {self.tp} x {self.gpu}"

    @property
    def num_gpus(self) -> int:
        return self.tp

    @property
    def window(self) -> int | None:
        """The window (a chunked model: the chunk) of the model's sliding-window layers, in tokens; None without any."""
        return self._window

    def window_keys(self, seq_lens: np.ndarray) -> int:
        """The keys each window layer reads in a decode step of requests of `seq_lens` tokens ([bs] int64, the token
        decoded included), in all: min(s, window) a request (a chunked layer: its last chunk's, up to s); 0 without
        window layers. What `decode_seconds` takes as window_tokens."""
        if self._window is None:
            return 0
        return int(_window_reads(seq_lens - 1, seq_lens, self._window, self._chunked).sum())

    def kv_capacity_tokens(self, page_size: int = 1) -> int:
        """The KV tokens (whole pages) that fit beside the weights in MEMORY_FRACTION of the GPUs' memory;
        ValueError when the weights alone do not fit."""
        left = self.kv_budget_bytes(page_size)
        return int(left // (self._kv_bytes * page_size)) * page_size

    def kv_budget_bytes(self, page_size: int = 1) -> float:
        """The bytes MEMORY_FRACTION of the GPUs' memory leaves beside the weights, on all the GPUs together;
        ValueError when that is less than one page of KV."""
        total = self.tp * GPUS[self.gpu].memory_gb * 1e9 * MEMORY_FRACTION
        left = total - self._weight_bytes
        if left < self._kv_bytes * page_size:
            raise ValueError(f"{self.model}'s weights ({self._weight_bytes / 1e9:,.0f} GB) leave no room for a KV "
                             f"cache in {MEMORY_FRACTION:.0%} of {self.tp} x {self.gpu} "
                             f"({total / 1e9:,.0f} GB): raise --tp, or give --capacity-tokens")
        return left

    def extend_seconds(self, prefix_lens: np.ndarray, seq_lens: np.ndarray, loaded_tokens: int = 0,
                       storage_tokens: int = 0) -> float:
        """A prefill step over tokens prefix_lens[i]..seq_lens[i]-1 of each request ([bs] int64 each), of which
        `loaded_tokens` of cached prefix were loaded back from the host (`storage_tokens` of them first read
        from the storage tier: one round trip of latency, then the bytes at its bandwidth)."""
        new_tokens = int((seq_lens - prefix_lens).sum())
        window_pairs = window_reads = 0
        if self._window is not None:
            w, chunked = self._window, self._chunked
            window_pairs = int((_window_pairs(seq_lens, w, chunked) - _window_pairs(prefix_lens, w, chunked)).sum())
            window_reads = int(_window_reads(prefix_lens, seq_lens, w, chunked).sum())
        flops = (self._token_flops * new_tokens + self._pair_flops * float(_causal_pairs(prefix_lens, seq_lens))
                 + self._window_pair_flops * float(window_pairs) + self._linear_flops * new_tokens)
        moved = (self._weight_bytes + self._full_kv_bytes * float(seq_lens.sum())
                 + self._window_kv_bytes * float(window_reads) + self._state_bytes * len(seq_lens))
        compute = max(flops / self._flops_per_s, moved / self._bytes_per_s)
        return max(compute, load_seconds(self, loaded_tokens, storage_tokens))

    def decode_seconds(self, batch_size: int, kv_tokens: int, window_tokens: int | None = None) -> float:
        """A decode step of `batch_size` requests attending to `kv_tokens` tokens in all (the sum of their lengths):
        it reads the weights (every one: a batch of tens of requests routes through nearly every expert of a
        mixture), the full-attention layers' KV of those tokens, the window layers' KV of `window_tokens` keys
        (`window_keys` of the requests' lengths: ValueError naming window_tokens when it is missing for a model with
        window layers; a model without them reads none) and each request's linear-attention state."""
        if self._window is None:
            window_tokens = 0
        elif window_tokens is None:
            raise ValueError(f"window_tokens is needed: {self.model} has window layers ({self._window} tokens); "
                             f"give window_keys(seq_lens)")
        flops = (self._token_flops * batch_size + self._pair_flops * kv_tokens
                 + self._window_pair_flops * window_tokens + self._linear_flops * batch_size)
        moved = (self._weight_bytes + self._full_kv_bytes * kv_tokens + self._window_kv_bytes * window_tokens
                 + self._state_bytes * batch_size)
        return max(flops / self._flops_per_s, moved / self._bytes_per_s)

    def prefill_seconds_saved(self, cached_tokens: int) -> float:
        """Server seconds a prefill did not spend on `cached_tokens` cached tokens at the head of its prompt:
        their linear FLOPs and their causal attention among themselves (the rest of the prompt still attends
        to them), at `mfu` of the GPUs' peak."""
        c = cached_tokens
        window_pairs = 0 if self._window is None else int(_window_pairs(c, self._window, self._chunked))
        return (self._token_flops * c + self._pair_flops * c * (c + 1) / 2
                + self._window_pair_flops * float(window_pairs) + self._linear_flops * c) / self._flops_per_s


def kv_copies(model: str, tp: int) -> int:
    """How many copies of a token's KV `tp` tensor-parallel GPUs keep in all (1 when they split its heads);
    ValueError when `tp` cannot split the model's heads."""
    config, heads = sizing.get_model_config(model), MODEL_COMPUTE[model].num_attention_heads
    if heads % tp:
        raise ValueError(f"tp {tp} must divide {model}'s {heads} attention heads")
    if isinstance(config, sizing.MLAConfig):
        return tp  # one latent per token and layer, whole on every GPU
    kv_heads = config.num_kv_heads
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"tp {tp} must divide {model}'s {kv_heads} KV heads, or be a multiple of them")
    return max(1, tp // kv_heads)


def _causal_pairs(prefix_lens: np.ndarray, seq_lens: np.ndarray) -> int:
    """(query, key) pairs of a causal prefill of tokens p..s-1 over keys 1..s: sum of (s(s+1) - p(p+1)) / 2."""
    return int((seq_lens * (seq_lens + 1) - prefix_lens * (prefix_lens + 1)).sum()) // 2


def _window_pairs(n, window: int, chunked: bool):
    """(query, key) pairs among the first n tokens (an int or int64 array) in a window layer, where the query at
    position q (from 1) reads min(q, window) keys, or in a chunked one, the q - window x floor((q - 1) / window) keys
    of its chunk up to q."""
    if chunked:
        chunks, rest = np.divmod(n, window)
        return chunks * (window * (window + 1) // 2) + rest * (rest + 1) // 2
    return np.where(n <= window, n * (n + 1) // 2, window * (window + 1) // 2 + (n - window) * window)


def _window_reads(prefix_lens: np.ndarray, seq_lens: np.ndarray, window: int, chunked: bool) -> np.ndarray:
    """The keys a window layer reads for queries p+1..s ([bs] int64 each): from the first key of query p+1's window
    (or chunk) to s."""
    if chunked:
        return seq_lens - prefix_lens // window * window
    return seq_lens - np.maximum(prefix_lens + 1 - window, 0)


def _linear_flops(config: sizing.HybridConfig) -> float:
    """FLOPs a token costs in the linear-attention layers' recurrences (module docstring): 7 x the SSM state's
    elements (value heads x d_k x d_v) and 2 x the convolution's (channels x kernel), a layer."""
    if not config.linear_layers:
        return 0.0
    return float(len(config.linear_layers) * (7 * math.prod(config.ssm_state_shape)
                                              + 2 * math.prod(config.conv_state_shape)))


def cost_model(config) -> StepCost | RooflineCost:
    """The cost model of a ReplayConfig: the roofline of its model on its GPUs when it names a GPU, else the
    fixed StepCost."""
    if config.gpu is None:
        h2d, _ = config.host_links_gbps
        return StepCost(kv_bytes_per_token=config.token_kv_bytes, h2d_gbps=h2d, storage_gbps=config.storage_gbps,
                        storage_latency_us=config.storage_latency_us)
    return RooflineCost(config.gpu, config.model or DEFAULT_MODEL, config.tp,
                        kv_bytes_per_token=config.kv_bytes_per_token, h2d_gbps=config.h2d_gbps,
                        storage_gbps=config.storage_gbps, storage_latency_us=config.storage_latency_us)


DEFAULT_MODEL = "llama-3-8b"  # the model a --gpu prices without --model (DEFAULT_KV_BYTES_PER_TOKEN's)
