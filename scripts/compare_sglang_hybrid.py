#!/usr/bin/env python3
"""kvmem's HybridRadixCache beside SGLang 0.5.23's UnifiedRadixCache with (FULL, SWA) components, on the same random
operation sequences.

Each sequence (page size 1, a sliding window W, pools large enough that nothing fails to allocate) is a list of
operations drawn from one seed, the same in both processes:
  insert KEY CURSOR   a request's tokens enter the tree; its window already left the first CURSOR tokens (their
                      window KV freed: kvmem `free_window`, SGLang `free_swa` and the insert's evicted seqlen); the
                      already-cached part of the value is freed after (SGLang's insert does that itself)
  match KEY           the matched length
  evict N             full-KV eviction of N tokens
  evict_window N      window eviction of N tokens
  lock KEY            a match, whose node a request then locks (nothing at the root): the matched length
  unlock I            the I-th held lock (modulo their number) released (-1 when none is held)
After every operation each side records what it returned and its sizes: full and window free slots, full and window
evictable tokens. The report lists, per sequence, the first operation where the two differ and how many differ, and
splits them at the first eviction: before it both trees hold every inserted token, so a difference there is in
matching or inserting (a convention, or a bug); after it the two evict differently by design (docs/hybrid.md,
"Differences from SGLang"). Linear-attention states are not driven here.

SGLang's window is W' = W - 1 kept tokens (`sliding_window_size`), kvmem's the model's W: both run with W' = W - 1.

    python scripts/compare_sglang_hybrid.py [--sglang-python PATH] [--quick] [--seed 0] [--out FILE]
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import _peer  # scripts/_peer.py: the script's own folder is on sys.path

WINDOW = 4  # the model's sliding window W
POOL = 4096
WINDOW_POOL = 4096
SEQUENCES, QUICK_SEQUENCES = 40, 8
OPS = 60


def operations(seed: int) -> list[tuple]:
    """One random sequence: keys over a 3-token alphabet (shared prefixes), up to 12 tokens."""
    rng = random.Random(seed)
    ops = []
    for _ in range(OPS):
        kind = rng.choices(("insert", "match", "evict", "evict_window", "lock", "unlock"), (4, 4, 1, 1, 1, 1))[0]
        if kind == "unlock":
            ops.append((kind, rng.randrange(8)))
        elif kind in ("insert", "match", "lock"):
            key = [rng.randrange(3) + 10 for _ in range(rng.randint(1, 12))]
            ops.append((kind, key, rng.randint(0, len(key)) if kind == "insert" and rng.random() < 0.5 else 0))
        else:
            ops.append((kind, rng.randint(1, 8)))
    return ops


def run(side, ops: list[tuple]) -> list[list[int]]:
    out = []
    for op in ops:
        if op[0] == "insert":
            got = side.insert(op[1], op[2])
        elif op[0] == "match":
            got = side.match(op[1])
        elif op[0] == "lock":
            got = side.lock(op[1])
        elif op[0] == "unlock":
            got = side.unlock(op[1])
        elif op[0] == "evict":
            got = side.evict(op[1])
        else:
            got = side.evict_window(op[1])
        out.append([got, *side.sizes()])
    return out


# ---- kvmem ----------------------------------------------------------------------------------------------------
class KvmemSide:
    def __init__(self) -> None:
        from kvmem import ReqToTokenPool
        from kvmem.hybrid import HybridRadixCache, HybridTokenAllocator

        self.alloc = HybridTokenAllocator(POOL, WINDOW_POOL)
        self.cache = HybridRadixCache(ReqToTokenPool(1, 64), self.alloc, window=WINDOW, window_free_interval=1)
        self.held = []

    def lock(self, key):
        m = self.cache.match_prefix(key)
        if m.indices.numel():
            self.cache.inc_lock_ref(m.last_node)
            self.held.append(m.last_node)
        return int(m.indices.numel())

    def unlock(self, i):
        if not self.held:
            return -1
        self.cache.dec_lock_ref(self.held.pop(i % len(self.held)))
        return 0

    def insert(self, key, cursor):
        slots = self.alloc.alloc(len(key))
        if cursor:
            self.alloc.free_window(slots[:cursor])
        cached = self.cache.insert(key, slots)
        if cached:
            self.alloc.free(slots[:cached])
        return cached

    def match(self, key):
        return int(self.cache.match_prefix(key).indices.numel())

    def evict(self, n):
        return self.cache.evict(n)

    def evict_window(self, n):
        return self.cache.evict_window(n)

    def sizes(self):
        c, a = self.cache, self.alloc
        return [a.available_size(), a.window_available_size(), c.evictable_size(), c.window_evictable_size()]


# ---- SGLang (runs under SGLang's venv; imports nothing from kvmem) --------------------------------------------
class SglangSide:
    def __init__(self, sg: dict) -> None:
        from array import array

        import torch
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        kv = SWAKVPool(size=POOL, size_swa=WINDOW_POOL, page_size=1, dtype=torch.float16, head_num=1, head_dim=8,
                       swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu",
                       enable_memory_saver=False)
        self.alloc = SWATokenToKVPoolAllocator(size=POOL, size_swa=WINDOW_POOL, page_size=1, dtype=torch.float16,
                                               device="cpu", kvcache=kv, need_sort=False)
        pool = sg["ReqToTokenPool"](size=1, max_context_len=64, device="cpu", enable_memory_saver=False)
        params = sg["CacheInitParams"](disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=self.alloc,
                                       page_size=1, sliding_window_size=WINDOW - 1, tree_core_backend="python",
                                       tree_components=(sg["ComponentType"].FULL, sg["ComponentType"].SWA))
        self.cache = sg["UnifiedRadixCache"](params)
        self.key = lambda tokens: RadixKey(array("q", tokens))
        self.swa = sg["ComponentType"].SWA
        self.EvictParams, self.InsertParams, self.MatchPrefixParams = EvictParams, InsertParams, MatchPrefixParams
        self.held = []

    def lock(self, key):
        m = self.cache.match_prefix(self.MatchPrefixParams(key=self.key(key)))
        if m.device_prefix_len:
            self.held.append(self.cache.lock(m.last_device_node))
        return int(m.device_prefix_len)

    def unlock(self, i):
        if not self.held:
            return -1
        self.cache.unlock(self.held.pop(i % len(self.held)))
        return 0

    def insert(self, key, cursor):
        value = self.alloc.alloc(len(key))
        params = self.InsertParams(key=self.key(key), value=value)
        if cursor:
            self.alloc.free_swa(value[:cursor])
            params.set_evicted_seqlen(self.swa, cursor)
        return int(self.cache.insert(params).prefix_len)

    def match(self, key):
        return int(self.cache.match_prefix(self.MatchPrefixParams(key=self.key(key))).device_prefix_len)

    def evict(self, n):
        return int(self.cache.evict(self.EvictParams(num_tokens=n, swa_num_tokens=0)).num_tokens_evicted)

    def evict_window(self, n):
        return int(self.cache.evict(self.EvictParams(num_tokens=0, swa_num_tokens=n)).swa_num_tokens_evicted)

    def sizes(self):
        c, a = self.cache, self.alloc
        return [a.full_available_size(), a.swa_available_size(), c.full_evictable_size(), c.swa_evictable_size()]


def sequences(args) -> range:
    return range(args.seed, args.seed + (QUICK_SEQUENCES if args.quick else SEQUENCES))


def sglang_main(args) -> None:
    sg = _peer.load_driver(args.sglang_driver).import_sglang()
    import sglang

    out = {"version": getattr(sglang, "__version__", "?"), "runs": {}}
    for seed in sequences(args):
        try:
            out["runs"][seed] = run(SglangSide(sg), operations(seed))
        except Exception as e:  # a call SGLang refuses: reported as that sequence's result
            out["runs"][seed] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out))


FIELDS = ("returned", "full_free", "window_free", "full_evictable", "window_evictable")


def compare(ops: list[tuple], mine: list, theirs) -> dict:
    if isinstance(theirs, dict):
        return {"sglang_error": theirs["error"]}
    first_evict = next((i for i, op in enumerate(ops) if op[0].startswith("evict")), len(ops))
    differ = [i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b]
    before = [i for i in differ if i < first_evict]
    row = {"ops": len(ops), "first_eviction": first_evict, "differing_ops": len(differ),
           "differing_before_first_eviction": len(before)}
    if differ:
        i = differ[0]
        row["first_difference"] = {"op": i, "operation": list(ops[i]), "kvmem": dict(zip(FIELDS, mine[i])),
                                   "sglang": dict(zip(FIELDS, theirs[i]))}
    return row


def main(argv: list[str] | None = None) -> None:
    ap = _peer.parser(__doc__, f"{QUICK_SEQUENCES} sequences instead of {SEQUENCES}")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.peer == "sglang":
        sglang_main(args)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    _peer.check_args(ap, args)
    mine = {seed: run(KvmemSide(), operations(seed)) for seed in sequences(args)}
    sg = _peer.run_peer(__file__, args, "--seed", str(args.seed))
    if "error" in sg:
        _peer.emit({"error": sg["error"], "kvmem": {"sequences": len(mine)}}, args.out)
        return
    rows = {seed: compare(operations(seed), mine[seed], sg["runs"][str(seed)]) for seed in mine}
    early = [seed for seed, r in rows.items() if r.get("differing_before_first_eviction")]
    summary = {"sequences": len(rows), "identical": sum(r.get("differing_ops") == 0 for r in rows.values()),
               "differing_before_any_eviction": early,
               "sglang_errors": [seed for seed, r in rows.items() if "sglang_error" in r],
               "first_difference_at": {}}
    for r in rows.values():  # which operation the two trees first disagree on, sequence by sequence
        if "first_difference" in r:
            kind = r["first_difference"]["operation"][0]
            summary["first_difference_at"][kind] = summary["first_difference_at"].get(kind, 0) + 1
    _peer.emit({"sglang": sg["version"], "window": WINDOW, "summary": summary, "sequences": rows}, args.out)


if __name__ == "__main__":
    main()
