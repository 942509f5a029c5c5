"""The model runner: turns a `ScheduleBatch` into model inputs, plans attention, runs the model, samples greedily."""

from __future__ import annotations

import numpy as np
import torch

from kvmem.batch import ForwardMode, ScheduleBatch
from kvmem.engine.hybrid import FULL, HybridForwardBatch, RequestSpan
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
    """Runs a hybrid model (kvmem.engine.hybrid) over its memory (kvmem.engine.hybrid_memory): the spans of each
    request (full slots of every position, window slots of the positions its queries can see, its state slot) come
    from its req_to_token row."""

    def __init__(self, adapter, memory, req_to_token_pool, device: torch.device) -> None:
        self.adapter = adapter
        self.memory = memory
        self.req_to_token = req_to_token_pool.req_to_token
        self.device = device

    def forward(self, batch: ScheduleBatch) -> torch.Tensor:
        """Next-token logits [bs, vocab_size] float32 for the batch (after its prepare_for_extend/decode)."""
        inputs = forward_batch(batch, self.device)
        adapter, memory, table = self.adapter, self.memory, self.req_to_token
        full = adapter.num_layers_of(FULL) > 0
        window = adapter.window
        empty = inputs.out_cache_loc[:0]
        spans, start = [], 0
        rows, prefix_lens, seq_lens = (t.tolist() for t in (batch.req_pool_indices, batch.prefix_lens, batch.seq_lens))
        for req, row, prefix, seq in zip(batch.reqs, rows, prefix_lens, seq_lens):
            lo = max(prefix - window + 1, 0) if window is not None else seq
            window_kv = memory.window_slots(table[row, lo:seq].long()) if window is not None else empty
            spans.append(RequestSpan(start, start + seq - prefix, prefix, table[row, :seq].long() if full else empty,
                                     lo, window_kv, memory.state_slot(req)))
            start += seq - prefix
        loc = inputs.out_cache_loc
        hybrid = HybridForwardBatch(inputs.input_ids, inputs.positions, inputs.logit_rows, loc,
                                    memory.window_slots(loc) if window is not None else empty, tuple(spans))
        return adapter.forward(hybrid, memory)
