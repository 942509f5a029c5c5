"""A gated DeltaNet layer (Qwen3-Next's linear attention) run for one request over a state slot: transformers' own
module and kernels, with the conv and recurrent state read from and written back to a state pool.

The state of a request after t tokens is (conv, ssm): conv [conv_dim, K] holds the last K inputs of the short
causal convolution (zeros before the first token), in the model dtype; ssm [Hv, k_dim, v_dim] float32 is the
recurrent state. The calls follow transformers' cached path exactly, so that a request continued from a state
computes what one forward over all its tokens computes:

- first call of a request (no state yet): the convolution over the new tokens with zero left padding, and the
  chunked gated-delta rule from a zero state;
- one new token after a state: `causal_conv1d_update` and the recurrent rule;
- several new tokens after a state: the convolution over [conv state, new tokens] and the chunked rule from the
  state. The chunked rule pads each call to a multiple of 64 from its start, so a call that starts on the
  64-token grid keeps a one-shot prefill's chunk boundaries; the hand-over of the state still rounds differently
  (outputs within 1e-6 of one pass on the tiny model, with this torch build), as in transformers' own cache.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

CHUNK = 64  # transformers' chunk size for the chunked gated-delta rule


def gated_delta_net(attn, x: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor, *, fresh: bool) -> torch.Tensor:
    """Runs `attn` (a transformers Qwen3NextGatedDeltaNet) on one request's new tokens x [n, hidden], continuing
    the state (conv [conv_dim, K] model dtype, ssm [Hv, k_dim, v_dim] float32: views into a state pool, updated
    in place). fresh: the request has no state yet (its first tokens), whatever conv and ssm hold.
    Returns [n, hidden]."""
    hf = sys.modules[type(attn).__module__]  # the module's own kernels (torch fallbacks on the CPU)
    n = x.shape[0]
    qkvz, ba = attn.in_proj_qkvz(x[None]), attn.in_proj_ba(x[None])
    q, k, v, z, b, a = attn.fix_query_key_value_ordering(qkvz, ba)
    mixed = torch.cat([t.reshape(1, n, -1) for t in (q, k, v)], dim=-1).transpose(1, 2)  # [1, conv_dim, n]
    weight, kernel = attn.conv1d.weight.squeeze(1), attn.conv_kernel_size
    if not fresh and n == 1:
        state = conv[None].clone()
        mixed = hf.causal_conv1d_update(mixed, state, weight, attn.conv1d.bias, attn.activation)
        conv.copy_(state[0])
    else:
        if fresh:
            inputs = F.pad(mixed, (max(kernel - n, 0), 0))  # transformers pads a short first call to K columns
        else:
            inputs = torch.cat([conv[None].to(mixed.dtype), mixed], dim=-1)
        conv.copy_(inputs[0, :, -kernel:])
        mixed = hf.causal_conv1d_fn(inputs, weight, attn.conv1d.bias, activation=attn.activation)[:, :, -n:]
    q, k, v = torch.split(mixed.transpose(1, 2), [attn.key_dim, attn.key_dim, attn.value_dim], dim=-1)
    q = q.reshape(1, n, -1, attn.head_k_dim)
    k = k.reshape(1, n, -1, attn.head_k_dim)
    v = v.reshape(1, n, -1, attn.head_v_dim)
    beta = b.sigmoid()
    g = -attn.A_log.float().exp() * F.softplus(a.float() + attn.dt_bias)
    rule = hf.torch_recurrent_gated_delta_rule if not fresh and n == 1 else hf.torch_chunk_gated_delta_rule
    out, last = rule(q, k, v, g=g, beta=beta, initial_state=None if fresh else ssm[None],
                     output_final_state=True, use_qk_l2norm_in_kernel=True)
    ssm.copy_(last[0])
    out = attn.norm(out.reshape(-1, out.shape[-1]), z.reshape(-1, z.shape[-1]))
    return attn.out_proj(out.reshape(n, -1))
