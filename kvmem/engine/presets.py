"""Model configs by name, built with seeded random weights: tiny ones for tests and CPU figures, and a
0.5B-class one (Qwen2-0.5B's shapes) for the GPU figure. Nothing is downloaded.

Weights are drawn with `initializer_range` 0.2 rather than the usual 0.02: a tiny random model at 0.02 has
near-uniform next-token logits whose top two differ by about 1e-4, so greedy tokens would hinge on float
rounding; at 0.2 the gaps are orders of magnitude above the 1e-6 differences that batching and attention
kernels introduce in fp32.
"""

from __future__ import annotations

from kvmem._torch import torch

# name -> (model_type, config fields). eos_token_id is None unless overridden, so that a random model's
# generations run their full length; tests that stop on EOS pass eos_token_id.
PRESETS: dict[str, tuple[str, dict]] = {
    "llama-tiny": ("llama", dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512)),
    "mistral-tiny": ("mistral", dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=None)),
    "qwen2-tiny": ("qwen2", dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, use_sliding_window=False)),
    "deepseek-v2-tiny": ("deepseek_v2", dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, topk_method="greedy", max_position_embeddings=512)),
    "deepseek-v3-tiny": ("deepseek_v3", dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        n_group=2, topk_group=1, first_k_dense_replace=1, max_position_embeddings=512)),
    # Hybrid models: windows of 8 tokens (prompts of several windows stay short), their real layer patterns.
    # gpt-oss: [sliding, full] with sinks and YaRN RoPE (16 -> 512 positions, factor 32 as in gpt-oss-20b).
    "gpt-oss-tiny": ("gpt_oss", dict(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=512, rope_parameters=dict(
            rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=16))),
    # Gemma 3: local, local, global; the global RoPE scaled linearly by 8 (as gemma-3-27b), query_pre_attn_scalar
    # unlike head_dim; no pad token (generate would mask the prompt's 0s as padding). Untied: tied to the
    # sqrt(hidden)-scaled embedding, a random model repeats its last token.
    "gemma3-tiny": ("gemma3_text", dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=8, max_position_embeddings=512,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], tie_word_embeddings=False,
        pad_token_id=None,
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                         "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1000000.0)})),
    # Qwen3-Next: three gated DeltaNet layers, then gated full attention with partial RoPE; MoE and shared expert.
    "qwen3-next-tiny": ("qwen3_next", dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, max_position_embeddings=512)),
    # Qwen2-0.5B's shapes (494M parameters with its 151,936-token vocabulary).
    "qwen2-0.5b": ("qwen2", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, use_sliding_window=False, tie_word_embeddings=True)),
}
_TINY_INIT = 0.2


def build_config(preset: str, **overrides):
    """The transformers config of `preset` (see PRESETS), with `overrides` applied."""
    from transformers import AutoConfig

    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    model_type, fields = PRESETS[preset]
    init = {"initializer_range": _TINY_INIT} if preset.endswith("-tiny") else {}
    return AutoConfig.for_model(model_type, **{**init, "eos_token_id": None, **fields, **overrides})


def build_model(preset: str, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", **overrides):
    """A causal LM of `preset` with weights drawn under torch.manual_seed(seed), in eval mode.

    overrides: config fields to change (e.g. eos_token_id=7). Deterministic for a given seed, dtype and
    torch build, and the same weights on every device: they are drawn on the CPU and moved (drawn on a GPU,
    they came from its own generator, and a GPU engine could not be held against a CPU one).
    """
    from transformers import AutoModelForCausalLM

    config = build_config(preset, **overrides)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device).eval()
