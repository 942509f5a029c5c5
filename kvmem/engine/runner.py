"""The model runner: turns a `ScheduleBatch` into model inputs, plans attention, runs the model, samples greedily."""

from __future__ import annotations

import numpy as np

from kvmem._torch import torch
from kvmem.batch import ForwardMode, ScheduleBatch
from kvmem.engine.hybrid import HybridForwardBatch, RequestSpan
from kvmem.engine.models import ForwardBatch


def forward_batch(batch: ScheduleBatch, device: torch.device) -> ForwardBatch:
    """The inputs of one step: an extend feeds each request's tokens prefix_lens..seq_lens-1 of its prompt
    (plus, after a retraction, its outputs so far) at those positions; a decode feeds each request's last
    sampled token at position seq_lens - 1."""
    if batch.forward_mode is ForwardMode.DECODE:
        ids = np.fromiter((r.output_ids[-1] for r in batch.reqs), dtype=np.int64, count=len(batch.reqs))
        positions = batch.prefix_lens.numpy()
        logit_rows = np.arange(len(ids))
    else:
        spans = list(zip(batch.reqs, batch.prefix_lens.tolist(), batch.seq_lens.tolist()))
        ids = np.concatenate([np.frombuffer(r.fill_ids, dtype=np.int64)[p:s] for r, p, s in spans])
        positions = np.concatenate([np.arange(p, s) for _, p, s in spans])
        logit_rows = np.cumsum(batch.extend_lens.numpy()) - 1

    def to_device(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)

    return ForwardBatch(to_device(ids), to_device(positions), batch.out_cache_loc.to(device), to_device(logit_rows))


class ModelRunner:
    """Runs an adapted model over one KV pool with one attention backend."""

    def __init__(self, adapter, pool, attention, device: torch.device) -> None:
        self.adapter = adapter
        self.pool = pool
        self.attention = attention
        self.device = device

    def forward(self, batch: ScheduleBatch) -> torch.Tensor:
        """Next-token logits [bs, vocab_size] float32 for the batch (after its prepare_for_extend/decode)."""
        inputs = forward_batch(batch, self.device)
        self.attention.plan(batch.attention_metadata(), batch.seq_lens,
                            decode=batch.forward_mode is ForwardMode.DECODE)
        return self.adapter.forward(inputs, self.pool, self.attention)


class HybridModelRunner:
    """Runs a hybrid model (kvmem.engine.hybrid) over its pools (a kvmem.hybrid.HybridKVPool) and the radix cache that
    manages them (a HybridRadixCache): each request reads full slots of all its positions and window slots (the
    allocator's pairing) of the positions its queries can see, from its req_to_token row, and its state slot."""

    def __init__(self, adapter, pools, tree_cache, device: torch.device) -> None:
        self.adapter = adapter
        self.pools = pools
        self.tree_cache = tree_cache
        self.req_to_token = tree_cache.req_to_token_pool.req_to_token
        self.device = device

    def forward(self, batch: ScheduleBatch) -> torch.Tensor:
        """Next-token logits [bs, vocab_size] float32 for the batch (after its prepare_for_extend/decode)."""
        inputs = forward_batch(batch, self.device)
        adapter, tree, table = self.adapter, self.tree_cache, self.req_to_token
        window = adapter.window
        empty = inputs.out_cache_loc[:0]
        rows, prefix_lens, seq_lens = (t.tolist() for t in (batch.req_pool_indices, batch.prefix_lens, batch.seq_lens))
        states = tree.req_state_slots(rows).tolist() if self.pools.state_pool is not None else [0] * len(rows)
        spans, start = [], 0
        for req, row, prefix, seq, state in zip(batch.reqs, rows, prefix_lens, seq_lens, states):
            lo = max(prefix - window + 1, 0) if window is not None else seq
            window_kv = self._window_slots(table[row, lo:seq])
            if not window_kv.all():  # slot 0: a token this step's queries see has no window KV left
                raise RuntimeError(f"request {req.rid!r}: the window KV of a position in [{lo}, {prefix}) was freed")
            end = start + seq - prefix
            spans.append(RequestSpan(start, end, prefix, table[row, :seq].long(), lo, window_kv, state))
            start = end
        loc = inputs.out_cache_loc
        hybrid = HybridForwardBatch(inputs.input_ids, inputs.positions, inputs.logit_rows, loc,
                                    self._window_slots(loc) if window is not None else empty, tuple(spans))
        return adapter.forward(hybrid, self.pools)

    def _window_slots(self, full_slots: torch.Tensor) -> torch.Tensor:
        """The window slots paired with `full_slots` (none without window layers)."""
        if self.adapter.window is None:
            return full_slots[:0].long()
        return self.tree_cache.token_allocator.window_slots(full_slots).to(self.device)
