"""Hybrid models' adapters: Gemma 3 (local sliding-window and global layers), gpt-oss (alternating sliding-window
and full layers, attention sinks, MoE) and Qwen3-Next (gated DeltaNet linear attention and gated full attention,
MoE), running transformers' own modules token-major over kvmem's pools.

Each layer has a kind, from `config.layer_types`: "full_attention" layers keep K/V of every token in the full
pool; "sliding_attention" layers keep K/V in the window pool and a query at position p reads keys p - W + 1 .. p
(W = config.sliding_window); "linear_attention" layers keep one fixed-size state per request in the state pool.
The pools are kvmem.hybrid's (`HybridKVPool`); what the layers read for each request of a step is a `RequestSpan`,
built by the runner from the request's req_to_token row (full slots, translated to window slots through the
`HybridTokenAllocator`'s pairing) and the state slot the `HybridRadixCache` gave it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvmem.engine.gated_delta import gated_delta_net
from kvmem.engine.models import _Adapter, rope_neox
from kvmem.engine.window_attention import window_attention
from kvmem.hybrid import HybridKVPool, StatePool
from kvmem.kv_pool import MHAKVPool

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
LAYER_KINDS = (FULL, SLIDING, LINEAR)


class RequestSpan(NamedTuple):
    """One request's part of a step: its new tokens are batch rows start..end-1 at positions prefix_len..; the
    layers read keys of positions 0.. from full slots `full_kv` and of positions window_start.. from window slots
    `window_kv` (both through the step's new tokens), and its state from slot `state_slot` (0: none). fresh: it
    has no state yet (prefix_len == 0)."""

    start: int
    end: int
    prefix_len: int
    full_kv: torch.Tensor
    window_start: int
    window_kv: torch.Tensor
    state_slot: int

    @property
    def fresh(self) -> bool:
        return self.prefix_len == 0


@dataclass(frozen=True)
class HybridForwardBatch:
    """One step's inputs for a hybrid model: input_ids, positions [num_tokens] int64 (request-major), logit_rows
    [bs] int64, full_loc / window_loc [num_tokens] int64 (where the new tokens' K/V go in the full and window
    pools; empty for a model without such layers) and one RequestSpan per request."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    logit_rows: torch.Tensor
    full_loc: torch.Tensor
    window_loc: torch.Tensor
    spans: tuple[RequestSpan, ...]


def layer_kinds(config) -> tuple[str, ...]:
    """The kind of each layer (`config.layer_types`), checked: one per layer, each of LAYER_KINDS, at least one full
    layer (the full pool holds a request's tokens), and a window of 1 .. max_position_embeddings tokens when some
    layer slides."""
    kinds = tuple(getattr(config, "layer_types", None) or ())
    if len(kinds) != config.num_hidden_layers:
        raise ValueError(f"config.layer_types lists {len(kinds)} kinds for {config.num_hidden_layers} layers")
    unknown = sorted(set(kinds) - set(LAYER_KINDS))
    if unknown:
        raise ValueError(f"config.layer_types holds {unknown[0]!r}; kvmem.engine runs {', '.join(LAYER_KINDS)}")
    if FULL not in kinds:
        raise ValueError("config.layer_types has no full_attention layer: kvmem.engine needs one")
    if SLIDING in kinds:
        window = getattr(config, "sliding_window", None)
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"config.sliding_window must be a positive int for sliding layers, got {window!r}")
        if window > config.max_position_embeddings:
            raise ValueError(f"config.sliding_window {window} exceeds the model's context of "
                             f"{config.max_position_embeddings} tokens")
    return kinds


class HybridAdapter(_Adapter):
    """What the three families share: layer kinds, the index of each layer in its pool, attention over the pools
    for one request at a time, and a final norm and LM head."""

    def __init__(self, model) -> None:
        super().__init__(model)
        cfg = self.config
        self.kinds = layer_kinds(cfg)
        self.window = cfg.sliding_window if SLIDING in self.kinds else None
        attn_layer = next((layer.self_attn for layer in self.layers if hasattr(layer, "self_attn")), None)
        self.head_dim = attn_layer.head_dim if attn_layer is not None else None
        self.num_kv_heads = cfg.num_key_value_heads
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)

    def num_layers_of(self, kind: str) -> int:
        return self.kinds.count(kind)

    def make_pools(self, size: int, window_size: int | None, state_slots: int | None, page_size: int,
                   kv_cache_dtype: str, device: torch.device) -> HybridKVPool:
        """The model's pools: full KV for `size` tokens, window KV for `window_size` tokens (sliding layers) and
        `state_slots` request states (linear layers)."""
        def kv_pool(tokens, kind):
            return MHAKVPool(tokens, page_size, self.dtype, self.num_kv_heads, self.head_dim, self.num_layers_of(kind),
                             device=device, kv_cache_dtype=kv_cache_dtype)

        window = kv_pool(window_size, SLIDING) if self.window is not None else None
        states = self._state_pool(state_slots, device) if LINEAR in self.kinds else None
        return HybridKVPool(self.kinds, kv_pool(size, FULL), window, states)

    def _state_pool(self, slots: int, device: torch.device) -> StatePool:
        raise NotImplementedError

    @torch.no_grad()
    def forward(self, batch: HybridForwardBatch, pools) -> torch.Tensor:
        """Runs every layer over `pools` (a kvmem.hybrid.HybridKVPool) and returns the next-token logits
        [bs, vocab_size] float32 of the batch's logit_rows."""
        h = self.embed_tokens(batch.input_ids)
        tables = self._rope(h, batch.positions)
        for layer_id, layer in enumerate(self.layers):
            h = self._layer(layer_id, layer, h, tables, batch, pools)
        logits = self.lm_head(self.norm(h[batch.logit_rows])).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def _rope(self, h: torch.Tensor, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) [num_tokens, rotary_dim] per attention layer kind: one table for all by default."""
        table = self._rope_tables(h, positions)
        return {FULL: table, SLIDING: table}

    def _layer(self, layer_id, layer, h, tables, batch, pools) -> torch.Tensor:
        raise NotImplementedError

    def _mlp(self, layer, x: torch.Tensor) -> torch.Tensor:
        """The layer's MLP or MoE block on [num_tokens, hidden] (given the [1, tokens, hidden] shape it was written
        for; some return (out, router scores))."""
        out = layer.mlp(x[None])
        return (out[0] if isinstance(out, tuple) else out)[0]

    def _attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: HybridForwardBatch,
                pools, scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Writes the new tokens' k/v [num_tokens, Hkv, D] into the layer's pool and attends each request's queries
        q [num_tokens, Hq, D] over its keys there: all of them for a full layer, the window for a sliding one.
        Returns [num_tokens, Hq * Dv]."""
        sliding = self.kinds[layer_id] == SLIDING
        _, pool, index = pools.layer(layer_id)
        pool.set_kv_buffer(index, batch.window_loc if sliding else batch.full_loc, k, v)
        out = []
        for s in batch.spans:
            slots = s.window_kv if sliding else s.full_kv
            keys, values = pool.read_kv(index, slots)
            out.append(window_attention(q[s.start:s.end], keys, values, q_start=s.prefix_len,
                                        kv_start=s.window_start if sliding else 0, scale=scale,
                                        window=self.window if sliding else None, softcap=softcap, sinks=sinks))
        return torch.cat(out).flatten(1)


class GptOssAdapter(HybridAdapter):
    """gpt-oss: q/k/v/o with biases, RoPE on halves (YaRN-scaled tables shared by all layers), a learned sink
    logit per head in every layer, and a top-k MoE after each attention."""

    def _rope(self, h, positions):
        cos, sin = self.rotary_emb(h[None], positions[None])  # halves: [1, T, D / 2]
        table = (torch.cat((cos[0], cos[0]), -1), torch.cat((sin[0], sin[0]), -1))
        return {FULL: table, SLIDING: table}

    def _layer(self, layer_id, layer, h, tables, batch, pools):
        attn, n, d = layer.self_attn, h.shape[0], self.head_dim
        x = layer.input_layernorm(h)
        cos, sin = tables[self.kinds[layer_id]]
        q = rope_neox(attn.q_proj(x).view(n, -1, d), cos, sin)
        k = rope_neox(attn.k_proj(x).view(n, -1, d), cos, sin)
        out = self._attend(layer_id, q, k, attn.v_proj(x).view(n, -1, d), batch, pools, attn.scaling,
                           sinks=attn.sinks)
        h = h + attn.o_proj(out)
        return h + self._mlp(layer, layer.post_attention_layernorm(h))


class Gemma3Adapter(HybridAdapter):
    """Gemma 3: RMS-normed q and k, RoPE tables per layer kind (local and global bases and scaling), scores
    scaled by query_pre_attn_scalar ** -0.5 (optionally soft-capped), and norms after attention and around the
    MLP."""

    def _rope(self, h, positions):
        tables = {}
        for kind in (FULL, SLIDING):
            cos, sin = self.rotary_emb(h[None], positions[None], kind)
            tables[kind] = (cos[0], sin[0])
        return tables

    def _layer(self, layer_id, layer, h, tables, batch, pools):
        attn, n, d = layer.self_attn, h.shape[0], self.head_dim
        x = layer.input_layernorm(h)
        cos, sin = tables[self.kinds[layer_id]]
        q = rope_neox(attn.q_norm(attn.q_proj(x).view(n, -1, d)), cos, sin)
        k = rope_neox(attn.k_norm(attn.k_proj(x).view(n, -1, d)), cos, sin)
        out = self._attend(layer_id, q, k, attn.v_proj(x).view(n, -1, d), batch, pools, attn.scaling,
                           softcap=attn.attn_logit_softcapping)
        h = h + layer.post_attention_layernorm(attn.o_proj(out))
        return h + layer.post_feedforward_layernorm(self._mlp(layer, layer.pre_feedforward_layernorm(h)))


class Qwen3NextAdapter(HybridAdapter):
    """Qwen3-Next: gated DeltaNet layers over each request's state slot, and full-attention layers with a sigmoid
    output gate, RMS-normed q and k and partial RoPE (the first rotary_dim dims of each head); MoE with a shared
    expert."""

    def _state_pool(self, slots, device):
        # transformers' shapes: the conv's last K inputs in the model dtype, the recurrent state in float32.
        gdn = self.layers[self.kinds.index(LINEAR)].linear_attn
        return StatePool(slots, self.num_layers_of(LINEAR), (gdn.conv_dim, gdn.conv_kernel_size),
                         (gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim), self.dtype, torch.float32, device)

    def _layer(self, layer_id, layer, h, tables, batch, pools):
        x = layer.input_layernorm(h)
        if self.kinds[layer_id] == LINEAR:
            _, states, index = pools.layer(layer_id)
            conv, ssm = states.conv_states[index], states.ssm_states[index]
            mixed = torch.cat([gated_delta_net(layer.linear_attn, x[s.start:s.end], conv[s.state_slot],
                                               ssm[s.state_slot], fresh=s.fresh) for s in batch.spans])
        else:
            mixed = self._gated_attention(layer_id, layer.self_attn, x, tables[FULL], batch, pools)
        h = h + mixed
        return h + self._mlp(layer, layer.post_attention_layernorm(h))

    def _gated_attention(self, layer_id, attn, x, table, batch, pools):
        n, d = x.shape[0], self.head_dim
        q, gate = torch.chunk(attn.q_proj(x).view(n, -1, 2 * d), 2, dim=-1)
        cos, sin = table
        q = _partial_rope(attn.q_norm(q), cos, sin)
        k = _partial_rope(attn.k_norm(attn.k_proj(x).view(n, -1, d)), cos, sin)
        out = self._attend(layer_id, q, k, attn.v_proj(x).view(n, -1, d), batch, pools, attn.scaling)
        return attn.o_proj(out * torch.sigmoid(gate.reshape(n, -1)))


def _partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on halves over the first cos.shape[-1] dims of each head; the rest pass through."""
    dim = cos.shape[-1]
    return torch.cat((rope_neox(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)


HYBRID_ADAPTERS = {"gpt_oss": GptOssAdapter, "gemma3_text": Gemma3Adapter, "qwen3_next": Qwen3NextAdapter}
