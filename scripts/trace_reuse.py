"""How a Mooncake trace reuses its prefixes, the facts that bound what an eviction policy can do: prints JSON.

    python scripts/trace_reuse.py ../shared/traces/mooncake/conversation_trace.jsonl

- `reusable_share`: the prompt tokens an unbounded cache would serve (each prompt's leading blocks seen
  before, all but its last token), the ceiling of every policy at every capacity.
- `reuse_gap_s`: for those tokens, the seconds since their prefix was last used (arrival to arrival),
  percentiles weighted by tokens. A page that LRU keeps for less than the gap is gone when it is needed.
- `next_turn`: conversations. Request j continues request i (its previous turn) when i is the latest earlier
  request whose prompt, less its last (partial) block and at least two blocks long, begins j's. `share` is the
  share of prompts that get a next turn, `by_turn[k]` that share among k-th turns (0: first turns; the
  last entry counts every turn from there on), with how many prompts each has.

A Mooncake block id names its block and everything before it (two prompts share id x only if they agree up to
and including block x), so a prefix is looked up by its last block id alone.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvmem.replay.reuse import reuse_facts
from kvmem.replay.traces import TraceError, read_trace


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a Mooncake trace (JSONL with hash_ids)")
    args = p.parse_args(argv)
    try:
        trace = read_trace(args.trace, "mooncake")
    except TraceError as e:
        p.error(f"argument trace: {e}")
    print(json.dumps(reuse_facts(trace), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
