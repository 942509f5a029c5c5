"""Model adapters: a transformers causal LM's own modules (embeddings, norms, projections, MLP / MoE, LM head)
run token-major over a flat batch, with attention replaced by kvmem's pools and paged attention.

Supported `config.model_type`s: "llama", "mistral", "qwen2" (multi-head / grouped-query attention: K and V per
KV head in an `MHAKVPool`), "deepseek_v2", "deepseek_v3" (multi-head latent attention: one latent row per
token in an `MLAKVPool`), and the hybrid "gemma3_text", "gpt_oss", "qwen3_next" (`kvmem.engine.hybrid`). A batch
is [num_tokens] rows of all its requests' new tokens; positions come from each request's row (prefix_len.. for an
extend, kv_len - 1 for a decode), so RoPE needs no per-request state. Mistral's and Qwen2's optional sliding
window is not implemented: such a model serves contexts up to its window, where it equals full attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmem._torch import torch
from kvmem.kv_pool import MHAKVPool, MLAKVPool

MHA_ARCHITECTURES = ("llama", "mistral", "qwen2")
MLA_ARCHITECTURES = ("deepseek_v2", "deepseek_v3")
HYBRID_ARCHITECTURES = ("gemma3_text", "gpt_oss", "qwen3_next")  # kvmem.engine.hybrid
SUPPORTED_ARCHITECTURES = MHA_ARCHITECTURES + MLA_ARCHITECTURES + HYBRID_ARCHITECTURES


@dataclass(frozen=True)
class ForwardBatch:
    """One step's model inputs, on the model's device.

    input_ids, positions, out_cache_loc: [num_tokens] int64, request-major (a request's new tokens are
    contiguous, in order). logit_rows: [bs] int64, the row of each request's last token, whose next-token
    logits the step samples.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    logit_rows: torch.Tensor


class _Adapter:
    """What every supported architecture shares: embeddings, pre-norm decoder layers, final norm, LM head."""

    def __init__(self, model) -> None:
        self.model = model
        self.config = model.config
        inner = model.model
        self.layers = inner.layers
        self.embed_tokens = inner.embed_tokens
        self.norm = inner.norm
        self.rotary_emb = inner.rotary_emb
        self.lm_head = model.lm_head
        self.vocab_size = self.embed_tokens.num_embeddings
        self.num_layers = len(self.layers)
        self.num_heads = self.config.num_attention_heads
        self.dtype = self.embed_tokens.weight.dtype

    def context_len(self) -> int:
        """Longest prompt + output this model serves: max_position_embeddings, capped at a sliding window."""
        return int(self.config.max_position_embeddings)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, pool, attention) -> torch.Tensor:
        """Runs every layer, writing each token's K/V (or latent) into `pool` at batch.out_cache_loc, and
        returns the next-token logits [bs, vocab_size] float32 of the batch's logit_rows."""
        h = self.embed_tokens(batch.input_ids)
        cos, sin = self._rope_tables(h, batch.positions)
        for layer_id, layer in enumerate(self.layers):
            h = h + self._attention(layer_id, layer.self_attn, layer.input_layernorm(h), cos, sin, batch, pool,
                                    attention)
            # MLP / MoE get the [batch, seq, hidden] shape they were written for (some MoE gates unpack it).
            h = h + layer.mlp(layer.post_attention_layernorm(h)[None])[0]
        return self.lm_head(self.norm(h[batch.logit_rows])).float()

    def _rope_tables(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [num_tokens, rotary_dim] from the model's own rotary module, so that its RoPE scaling
        (llama3, yarn, dynamic...) and attention factor apply as in the model. A module that returns complex
        frequencies (transformers' DeepSeek-V2) gives [num_tokens, rotary_dim / 2] halves, doubled here."""
        out = self.rotary_emb(h[None], positions[None])
        if isinstance(out, torch.Tensor):  # complex e^{i theta}
            half_cos, half_sin = out[0].real.to(h.dtype), out[0].imag.to(h.dtype)
            return torch.cat((half_cos, half_cos), -1), torch.cat((half_sin, half_sin), -1)
        cos, sin = out
        return cos[0], sin[0]

    def _attention(self, layer_id, attn, x, cos, sin, batch, pool, attention) -> torch.Tensor:
        raise NotImplementedError


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on halves (dims i and i + D/2 rotate together): x [T, H, D], cos/sin [T, D]."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on adjacent pairs (dims 2i and 2i + 1), DeepSeek's layout: x [T, H, D], cos/sin [T, D] (halves
    repeated). The rotated pairs come out de-interleaved (evens then odds); queries and keys get the same
    permutation, so their dot products are those of the interleaved layout."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * c - odd * s, odd * c + even * s), dim=-1)


class MHAAdapter(_Adapter):
    """Llama, Mistral, Qwen2: q/k/v projections (Qwen2's carry a bias), RoPE on halves, GQA over an MHAKVPool."""

    def __init__(self, model) -> None:
        super().__init__(model)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_kv_heads = self.config.num_key_value_heads

    def context_len(self) -> int:
        windows = [w for layer in self.layers if (w := getattr(layer.self_attn, "sliding_window", None))]
        if self.config.model_type == "mistral" and getattr(self.config, "sliding_window", None):
            windows.append(self.config.sliding_window)
        return min([super().context_len(), *windows])

    def make_pool(self, size: int, page_size: int, kv_cache_dtype: str, device: torch.device) -> MHAKVPool:
        return MHAKVPool(size, page_size, self.dtype, self.num_kv_heads, self.head_dim, self.num_layers, device=device,
                         kv_cache_dtype=kv_cache_dtype)

    def _attention(self, layer_id, attn, x, cos, sin, batch, pool, attention) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        q = rope_neox(attn.q_proj(x).view(n, -1, d), cos, sin)
        k = rope_neox(attn.k_proj(x).view(n, -1, d), cos, sin)
        pool.set_kv_buffer(layer_id, batch.out_cache_loc, k, attn.v_proj(x).view(n, -1, d))
        out = attention.mha(pool, layer_id, q, attn.scaling)
        return attn.o_proj(out.reshape(n, -1))


class MLAAdapter(_Adapter):
    """DeepSeek-V2/V3: low-rank queries and latent KV. The pool caches per token the normalized latent ckv
    [kv_lora_rank] and the rotated shared key kpe [qk_rope_head_dim]; attention runs absorbed (see
    kvmem.engine.attention), with kv_b_proj split per head into W_UK [H, qk_nope_head_dim, kv_lora_rank] and
    W_UV [H, v_head_dim, kv_lora_rank]."""

    def __init__(self, model) -> None:
        super().__init__(model)
        cfg = self.config
        self.kv_lora_rank = cfg.kv_lora_rank
        self.qk_nope_head_dim = cfg.qk_nope_head_dim
        self.qk_rope_head_dim = cfg.qk_rope_head_dim
        self.v_head_dim = cfg.v_head_dim
        interleaved = cfg.model_type == "deepseek_v2" or getattr(cfg, "rope_interleave", False)
        self._rope = rope_interleaved if interleaved else rope_neox
        self._w_uk, self._w_uv = [], []
        for layer in self.layers:
            w = layer.self_attn.kv_b_proj.weight.view(self.num_heads, -1, self.kv_lora_rank)
            self._w_uk.append(w[:, :self.qk_nope_head_dim])
            self._w_uv.append(w[:, self.qk_nope_head_dim:])

    def make_pool(self, size: int, page_size: int, kv_cache_dtype: str, device: torch.device) -> MLAKVPool:
        return MLAKVPool(size, page_size, self.dtype, self.kv_lora_rank, self.qk_rope_head_dim, self.num_layers,
                         device=device, kv_cache_dtype=kv_cache_dtype)

    def _attention(self, layer_id, attn, x, cos, sin, batch, pool, attention) -> torch.Tensor:
        n = x.shape[0]
        q_proj = getattr(attn, "q_proj", None)  # transformers 4.x drops the attribute when q_lora_rank is set
        q = q_proj(x) if q_proj is not None else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
        q_nope, q_pe = q.view(n, self.num_heads, -1).split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        ckv, k_pe = attn.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        q_pe = self._rope(q_pe, cos, sin)
        k_pe = self._rope(k_pe[:, None], cos, sin)
        pool.set_mla_kv_buffer(layer_id, batch.out_cache_loc, attn.kv_a_layernorm(ckv)[:, None], k_pe)
        q_latent = torch.bmm(q_nope.transpose(0, 1), self._w_uk[layer_id]).transpose(0, 1)
        out_latent = attention.mla(pool, layer_id, q_latent, q_pe, attn.scaling)
        out = torch.bmm(out_latent.transpose(0, 1), self._w_uv[layer_id].transpose(1, 2)).transpose(0, 1)
        return attn.o_proj(out.reshape(n, -1))


def adapter_for(model) -> _Adapter:
    """The adapter for `model`'s architecture; ValueError naming it when it is not supported."""
    from kvmem.engine.hybrid import HYBRID_ADAPTERS  # built on this module's adapters

    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in HYBRID_ADAPTERS:
        return HYBRID_ADAPTERS[model_type](model)
    if model_type in MHA_ARCHITECTURES:
        return MHAAdapter(model)
    if model_type in MLA_ARCHITECTURES:
        return MLAAdapter(model)
    raise ValueError(f"unsupported architecture {model_type!r} ({type(model).__name__}): kvmem.engine runs "
                     f"{', '.join(SUPPORTED_ARCHITECTURES)}")
