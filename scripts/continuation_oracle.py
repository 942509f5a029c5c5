"""What knowing a conversation's future would buy an eviction policy: replays a Mooncake trace under `multiturn`
handed what the trace knows, beside lru, multiturn and belady, and prints JSON.

    python scripts/continuation_oracle.py ../shared/traces/mooncake/conversation_trace.jsonl \
        --capacities 1000000,3000000 [--gpu H100 --model llama-3-8b --tp 8]

The policies (each ranks leaves as multiturn does, by last access plus a head start per turn):
- `multiturn`: the turn inferred online from the tree and the ghosts of evicted prefixes (kvmem's policy);
- `true-turn`: each request's real conversation turn, read from the trace (scripts/trace_reuse.py's
  `conversations`), which bounds what inferring the turn better could buy;
- `whether`: the top turn for a prompt that gets a next turn and 0 for one that does not: an oracle told
  *whether* each conversation goes on, but not when. No signal a request carries predicts that perfectly, so
  it bounds every policy that ranks by how likely a prefix is to come back.
`belady` (the next use of every leaf, the replay's ceiling) knows when as well. Each report carries
`gap_closed` = (hit - lru) / (belady - lru). An oracle finds its request by the prompt's length and last
tokens, which the cache hands a policy (`request_turn`), so it changes nothing in the cache or scheduler.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from kvmem._checks import positive_int_arg
from kvmem.eviction import MultiTurn
from kvmem.replay.config import ReplayConfig
from kvmem.replay.cost import GPUS
from kvmem.replay.reuse import conversations
from kvmem.replay.simulator import replay
from kvmem.replay.traces import MooncakeTrace, TraceError, read_trace

import _peer  # scripts/_peer.py: the script's own folder is on sys.path

TAIL = 16  # prompt tokens that, with its length, name a request
POLICIES = ("lru", "multiturn", "true-turn", "whether", "belady")


class TraceTurns(MultiTurn):
    """multiturn whose request turns come from a table (`turns[i]` for request i) instead of the tree. `tails`:
    `prompt_tails(trace)`, which it copies (it takes each request's entry once)."""

    def __init__(self, tails: dict[int, list[tuple[bytes, int]]], turns: np.ndarray) -> None:
        super().__init__()
        self._turns = turns
        self._by_length = {length: list(entries) for length, entries in tails.items()}

    def request_turn(self, node, rest: Sequence[int], matched: int, prompt_len: int) -> int:
        tail = np.asarray(rest, dtype=np.int64)[-TAIL:].tobytes()  # rest ends with the prompt
        candidates = self._by_length.get(prompt_len, [])
        for k, (full, i) in enumerate(candidates):
            if full.endswith(tail):
                del candidates[k]  # the same prompt sent again is the next request in file order
                return int(self._turns[i])
        raise LookupError(f"no request of the trace has a {prompt_len}-token prompt ending so")


def prompt_tails(trace: MooncakeTrace) -> dict[int, list[tuple[bytes, int]]]:
    """prompt length -> (its last TAIL tokens as int64 bytes, request index) of each request, in file order."""
    tails: dict[int, list[tuple[bytes, int]]] = {}
    for i in range(len(trace)):
        tail = np.asarray(trace[i].input_ids[-TAIL:], dtype=np.int64).tobytes()
        tails.setdefault(int(trace.input_lens[i]), []).append((tail, i))
    return tails


# What the worker processes read (forked with them): the trace, its prompt tails, and the oracles' turns.
_TRACE: MooncakeTrace | None = None
_TAILS: dict = {}
_TURNS: dict[str, np.ndarray] = {}


def _config(trace: MooncakeTrace, policy: str, capacity: int, cost: dict) -> ReplayConfig:
    named = policy if policy in ("lru", "multiturn", "belady") else "multiturn"  # the oracles replace multiturn
    return ReplayConfig(capacity_tokens=capacity, max_context_len=trace.max_context_len, eviction_policy=named,
                        **cost)


def _run(policy: str, capacity: int, cost: dict) -> float:
    trace = _TRACE
    config = _config(trace, policy, capacity, cost)
    policies = {"eviction_policy": TraceTurns(_TAILS, _TURNS[policy])} if policy in _TURNS else None
    return replay(trace, config, policies=policies).hit_rate


def main(argv: list[str] | None = None) -> int:
    global _TRACE
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a Mooncake trace (JSONL with hash_ids)")
    p.add_argument("--capacities", type=_peer.list_arg(positive_int_arg), default="1000000,3000000",
                   help="KV capacities in tokens, comma-separated")
    p.add_argument("--gpu", choices=sorted(GPUS), help="price steps with a roofline (as kvmem-replay --gpu)")
    p.add_argument("--model", default="llama-3-8b", help="with --gpu (default llama-3-8b)")
    p.add_argument("--tp", type=positive_int_arg, default=1, help="with --gpu (default 1)")
    p.add_argument("--limit", type=positive_int_arg, help="replay only the first N requests")
    p.add_argument("--jobs", type=positive_int_arg, default=os.cpu_count() or 1,
                   help="replays at once (default: the cores)")
    args = p.parse_args(argv)
    capacities = args.capacities
    try:
        _TRACE = read_trace(args.trace, "mooncake", limit=args.limit)
    except (TraceError, OSError) as e:
        p.error(f"argument trace: {e}")
    cost = {"gpu": args.gpu, "model": args.model, "tp": args.tp} if args.gpu else {}
    try:
        _config(_TRACE, "lru", capacities[0], cost)
    except ValueError as e:  # an unknown --model, refused before the trace's facts are computed
        p.error(f"argument --model: {e}")
    _, _, turn, has_next = conversations(_TRACE)
    _TURNS.update({"true-turn": turn, "whether": np.where(has_next, MultiTurn().max_turns, 0)})
    _TAILS.update(prompt_tails(_TRACE))
    runs = [(policy, c) for c in capacities for policy in POLICIES]
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        hits = list(pool.map(_run, *zip(*runs), [cost] * len(runs)))
    hit = dict(zip(runs, hits))
    table = {}
    for c in capacities:
        lru, belady = hit["lru", c], hit["belady", c]
        table[str(c)] = {policy: {"hit_rate": round(hit[policy, c], 6),
                                  "gap_closed": round((hit[policy, c] - lru) / (belady - lru), 4)
                                  if belady > lru else None}
                         for policy in POLICIES}
    print(json.dumps({"trace": args.trace, "cost": cost or "replay default", "capacities": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
