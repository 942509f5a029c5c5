"""How a trace reuses its prompts' prefixes: the ceiling of every cache, and the facts that bound what an eviction
policy can do.

- `reuse_ceiling`: the share of prompt tokens an unbounded cache would serve (each prompt's leading blocks seen
  before, all but its last token): no capacity and no policy does better. Mooncake traces only (their hash ids
  name prefixes); None for others.
- `reuse_facts` (`scripts/trace_reuse.py`): the ceiling, the seconds between a prefix's uses, conversation turns.
- `unbounded_capacity`: a KV capacity at which a replay of the trace never evicts.

A Mooncake block id names its block and everything before it (two prompts share id x only if they agree up to
and including block x), so a prefix is looked up by its last block id alone.
"""

from __future__ import annotations

import numpy as np

from kvmem.replay.traces import BLOCK_SIZE, MooncakeTrace

PERCENTILES = (10, 25, 50, 75, 90)
TURNS = 8  # by_turn's entries: 0 .. TURNS-2, then TURNS-1 and later


def conversations(trace: MooncakeTrace) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per request (`[n]` arrays, file order): the prompt tokens an unbounded cache would serve it, the seconds
    since their prefix was last used (nan: none), its conversation turn (0: a first prompt) and whether it
    gets a next turn (see the module docstring)."""
    n = len(trace)
    order = np.argsort(trace.arrival_s, kind="stable")
    last_use: dict[int, float] = {}  # block id -> last arrival that used it
    ends_full_prefix: dict[int, int] = {}  # block id -> latest request whose full blocks end with it
    reused, gaps = np.zeros(n, dtype=np.int64), np.full(n, np.nan)
    turn, has_next = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=bool)
    for i in order.tolist():
        ids = trace.hash_ids[trace.block_offsets[i]:trace.block_offsets[i + 1]].tolist()
        t, length = float(trace.arrival_s[i]), int(trace.input_lens[i])
        seen = 0
        while seen < len(ids) and ids[seen] in last_use:
            seen += 1
        if seen:
            reused[i] = min(seen * BLOCK_SIZE, length - 1)
            gaps[i] = t - last_use[ids[seen - 1]]
        for k in range(len(ids) - 1, 1, -1):  # the longest earlier full-block prompt that begins this one
            prev = ends_full_prefix.get(ids[k - 1])
            if prev is not None and trace.block_offsets[prev + 1] - trace.block_offsets[prev] - 1 == k:
                turn[i], has_next[prev] = turn[prev] + 1, True
                break
        for b in ids:
            last_use[b] = t
        if len(ids) >= 3:
            ends_full_prefix[ids[-2]] = i
    return reused, gaps, turn, has_next


def reuse_facts(trace: MooncakeTrace) -> dict:
    """The JSON-ready facts of a Mooncake trace (requests in arrival order): `reusable_share` (the reuse ceiling),
    `reuse_gap_s` (for the reusable tokens, the seconds since their prefix was last used, arrival to arrival, as
    percentiles weighted by tokens: a page that LRU keeps for less than the gap is gone when it is needed) and
    `next_turn` (request j continues request i, its previous turn, when i is the latest earlier request whose
    prompt, less its last partial block and at least two blocks long, begins j's; `share` of prompts that get a
    next turn, `by_turn[k]` that share among k-th turns, 0 the first, the last entry counting every later one)."""
    n = len(trace)
    reused, gaps, turn, has_next = conversations(trace)
    weights = reused[reused > 0]
    gap = gaps[reused > 0]
    by_gap = np.argsort(gap, kind="stable")
    cumulative = np.cumsum(weights[by_gap]) / weights.sum() if weights.size else np.empty(0)
    percentiles = {f"p{q}": round(float(gap[by_gap][np.searchsorted(cumulative, q / 100)]), 3)
                   for q in PERCENTILES} if weights.size else {}
    turns = np.minimum(turn, TURNS - 1)
    return {"trace": trace.name, "requests": n, "prompt_tokens": int(trace.input_lens.sum()),
            "reusable_share": round(float(reused.sum() / max(trace.input_lens.sum(), 1)), 4),
            "reuse_gap_s": percentiles,
            "next_turn": {"share": round(float(has_next.mean()), 4) if n else 0.0,
                          "by_turn": [{"turn": k, "prompts": int((turns == k).sum()),
                                       "share": round(float(has_next[turns == k].mean()), 4)}
                                      for k in range(TURNS) if (turns == k).any()]}}


def reuse_ceiling(trace) -> float | None:
    """The share of prompt tokens an unbounded cache would serve a Mooncake trace (None for other traces)."""
    if not isinstance(trace, MooncakeTrace):
        return None
    reused = conversations(trace)[0]
    return float(reused.sum() / max(int(trace.input_lens.sum()), 1))


def unbounded_capacity(trace, page_size: int = 1) -> int:
    """KV tokens (whole pages) that hold everything a replay of `trace` caches, so that it never evicts: the pages
    of every distinct prompt block of a Mooncake trace, or every prompt token of another, every output token (a
    partial page each), plus the longest request."""
    outputs = int(np.sum(trace.output_lens)) if hasattr(trace, "output_lens") else sum(r.output_len for r in trace)
    if isinstance(trace, MooncakeTrace):
        # Block k starts at token k x BLOCK_SIZE of every prompt that holds it: the pages that start in it are the
        # same pages wherever it is, at most ceil(BLOCK_SIZE / page_size) of them.
        prompts = len(np.unique(trace.hash_ids)) * -(-BLOCK_SIZE // page_size) * page_size
    else:
        prompts = int(trace.prompt_tokens)
    tokens = prompts + outputs + len(trace) * page_size + trace.max_context_len
    return -(-tokens // page_size) * page_size
