"""The attention-state merge behind cascade attention, in torch (FlashInfer's `merge_state` / `merge_states`).

Attention over an index set I of keys has a state (v(I), s(I)): v the softmax-weighted values over I alone,
s the log-sum-exp of the scaled scores q.k/sqrt(D) over I. Two disjoint sets merge into the state of their union:

    s(I u J) = log(exp s(I) + exp s(J)),    v(I u J) = (exp s(I) v(I) + exp s(J) v(J)) / exp s(I u J)

The merge is commutative and associative, so a request's keys can be cut into any segments (a shared prefix
read once for many requests, then each request's own suffix) and the segment results merged in any order.

Base of the log-sum-exp: **2**, as FlashInfer. Its kernels fold log2(e) into the softmax scale and return
`lse = log2(sum_j exp(scale * q.k_j))`; its merge kernels (include/flashinfer/attention/cascade.cuh, "logsumexp
values with base 2") use exp2/log2. Every `s` here, and `reference_paged_attention(..., return_lse=True)`, is in
that base, so states from FlashInfer and from kvmem's reference mix freely. A natural-log lse (FlashAttention's,
`torch.logsumexp`) converts as `s_base2 = s_natural * math.log2(math.e)`.

An empty index set has the state (0, -inf): merging it changes nothing, and merging two empty states gives
(0, -inf) here, where FlashInfer's two-state kernel would divide 0 by 0. An lse of NaN or +inf is no state
(finite scores never give either: an overflow or a broken kernel upstream); both functions raise ValueError on
one rather than return a plausible zero output.
"""

from __future__ import annotations

from kvmem._torch import torch


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor,
                s_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges the attention states of two disjoint KV segments A and B (base-2 lse, see the module docstring).

    Args:
        v_a, v_b: [seq_len, num_heads, head_dim] partial outputs over A and over B (any float dtype).
        s_a, s_b: [seq_len, num_heads] their log-sum-exps, base 2 (any float dtype; computed in float32).

    Returns:
        (v, s): v [seq_len, num_heads, head_dim] in v_a's dtype, the attention output over A and B together;
        s [seq_len, num_heads] float32, its base-2 log-sum-exp.

    Raises TypeError / ValueError naming the argument for a non-float tensor, mismatched shapes, or an lse that
    holds NaN or +inf (-inf is an empty segment and merges as one).
    """
    _check_state("v_a", v_a, "s_a", s_a, 3)
    _check_state("v_b", v_b, "s_b", s_b, 3)
    if v_a.shape != v_b.shape:
        raise ValueError(f"v_a and v_b must have the same shape, got {tuple(v_a.shape)} and {tuple(v_b.shape)}")
    v, s = _merge(torch.stack((v_a, v_b), dim=1), torch.stack((s_a, s_b), dim=1))
    return v.to(v_a.dtype), s


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges num_states attention states per position (FlashInfer's `merge_states` layout).

    Args:
        v: [seq_len, num_states, num_heads, head_dim] partial outputs, one per KV segment.
        s: [seq_len, num_states, num_heads] their base-2 log-sum-exps.

    Returns:
        (v, s): [seq_len, num_heads, head_dim] in v's dtype and [seq_len, num_heads] float32. With no states
        (num_states 0) the output is zeros and the lse -inf, as for an empty KV set.

    Raises as merge_state does (an lse holding NaN or +inf: ValueError naming s).
    """
    _check_state("v", v, "s", s, 4)
    out, lse = _merge(v, s)
    return out.to(v.dtype), lse


def _merge(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """merge_states without checks: v [n, k, H, D], s [n, k, H] -> float32 [n, H, D], [n, H]."""
    s = s.float()
    if s.shape[1] == 0:
        return v.new_zeros(v.shape[0], *v.shape[2:], dtype=torch.float32), s.new_full((s.shape[0], s.shape[2]),
                                                                                      float("-inf"))
    top = s.amax(dim=1)
    # Where every state is empty the max is -inf; shifting by 0 there keeps exp2 at 0 instead of NaN.
    top = torch.where(torch.isneginf(top), 0.0, top)
    weights = torch.exp2(s - top[:, None])
    total = weights.sum(dim=1)
    out = torch.einsum("nkh,nkhd->nhd", weights, v.float())
    out = torch.where(total[..., None] > 0, out / total.clamp(min=torch.finfo(torch.float32).tiny)[..., None], 0.0)
    return out, torch.log2(total) + top


def _check_state(v_name: str, v: torch.Tensor, s_name: str, s: torch.Tensor, dim: int) -> None:
    for name, t in ((v_name, v), (s_name, s)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point torch.Tensor, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    if v.dim() != dim or s.shape != v.shape[:-1]:
        raise ValueError(f"{v_name} must be {dim}-D and {s_name} its shape without the last dim, got "
                         f"{tuple(v.shape)} and {tuple(s.shape)}")
    # The merge would weigh such a state 0 (or every state NaN) and return zeros: a wrong answer, not a NaN.
    if (torch.isnan(s) | torch.isposinf(s)).any():
        raise ValueError(f"{s_name} holds NaN or +inf: not the log-sum-exp of finite scores")
