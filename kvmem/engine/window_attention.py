"""Attention of one request's new tokens over keys gathered from a pool, with an optional sliding window, attention
sinks and logit soft-capping: what hybrid models' layers need beyond plain causal attention.

Positions are absolute: queries sit at q_start.., keys at kv_start.. (a window layer gathers only the keys its
queries can see). A query at position p sees keys p - window + 1 .. p (transformers' `sliding_window`: window
keys including itself) or, without a window, 0 .. p.

Sinks (gpt-oss): a learned logit per head joins every softmax's denominator but contributes no value. Attention
over the keys alone, with its log-sum-exp, gives the same result after scaling each output by
1 / (1 + exp(sink - lse)) = sigmoid(lse - sink): the correction a kernel that returns lse allows, with no extra
key column.
"""

from __future__ import annotations

import torch


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_start: int, kv_start: int,
                     scale: float, window: int | None = None, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal (and windowed) attention of one request, in float32.

    q: [n, Hq, D] at positions q_start .. q_start + n - 1; k: [m, Hkv, D], v: [m, Hkv, Dv] at positions
    kv_start .. kv_start + m - 1, covering every key a query sees (Hq a multiple of Hkv, GQA). window: keys a
    query sees including itself (None: all earlier ones). softcap: scores become softcap * tanh(s / softcap)
    before masking (Gemma 2's attn_logit_softcapping). sinks: [Hq] per-head sink logits (gpt-oss).
    Returns [n, Hq, Dv] in q's dtype.
    """
    n, m = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(q_start, q_start + n, device=q.device)[:, None]
    kv_pos = torch.arange(kv_start, kv_start + m, device=q.device)[None, :]
    hidden = kv_pos > q_pos
    if window is not None:
        hidden |= kv_pos <= q_pos - window
    scores.masked_fill_(hidden, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vf)
    if sinks is not None:
        lse = torch.logsumexp(scores, dim=-1).T  # [n, Hq]
        out = out * torch.sigmoid(lse - sinks.float())[..., None]
    return out.to(q.dtype)
