#!/usr/bin/env python3
"""kvmem's HybridRadixCache beside SGLang 0.5.23's UnifiedRadixCache, on the same random operation sequences: with
(FULL, SWA) components (`--component window`, the default) or (FULL, MAMBA) components (`--component states`).

Each sequence (page size 1, pools large enough that nothing fails to allocate) is a list of operations drawn from
one seed, the same in both processes. Window sequences (a sliding window W):
  insert KEY CURSOR   a request's tokens enter the tree; its window already left the first CURSOR tokens (their
                      window KV freed: kvmem `free_window`, SGLang `free_swa` and the insert's evicted seqlen); the
                      already-cached part of the value is freed after (SGLang's insert does that itself)
  match KEY           the matched length
  evict N             full-KV eviction of N tokens
  evict_window N      window eviction of N tokens
  lock KEY            a match, whose node a request then locks (nothing at the root): the matched length
  unlock I            the I-th held lock (modulo their number) released (-1 when none is held)
State sequences (linear-attention states), over keys of whole 64-token blocks (two blocks share their first half,
so paths also part off the grid) and, in odd-seeded sequences, inserts with a few tokens past the last block:
  insert KEY          a finished request of exactly KEY hands its state (the state after its last token) and its
                      KV to the tree: kvmem `start_reqs` + `cache_finished_req`, SGLang `insert` with its
                      `mamba_value` (its state slot freed when the tree already had one there), as SGLang's
                      no-buffer strategy caches a finished request; returns [cached prefix, whether the tree kept the
                      state]
  match KEY, lock KEY [the matched length, which insert's state the match ends at (-1: none)]
  evict N             full-KV eviction of N tokens
  evict_states N      state eviction of N states: the number freed
  unlock I            as above
After every operation each side records what it returned and its sizes: full and window (or state) free slots, full
and window (or state) evictable tokens (states). The report lists, per sequence, the first operation where the two
differ, its class, and how many differ, split at the first eviction: before it both trees hold every inserted token,
so a difference there is a convention (`state_off_the_grid`) or a bug (`unexplained`); after it the two evict
differently by design (docs/hybrid.md, "Differences from SGLang").

SGLang's window is W' = W - 1 kept tokens (`sliding_window_size`), kvmem's the model's W: both run with W' = W - 1.
SGLang's states are driven through its tree alone (`UnifiedRadixCache` over a `HybridReqToTokenPool` with its CPU
`MambaPool` and `MambaSlotAllocator`, no extra buffer): its scheduler's state tracking (the extra buffer's ping-pong
slots, branching points, decode track interval) and the copy on write at a match are not driven.

    python scripts/compare_sglang_hybrid.py [--component window|states] [--sglang-python PATH] [--quick] [--seed 0]
        [--out FILE]
"""

from __future__ import annotations

import json
import random

import _peer  # scripts/_peer.py: the script's own folder is on sys.path

WINDOW = 4  # the model's sliding window W
POOL = 4096
WINDOW_POOL = 4096
GRID = 64  # kvmem keeps states on lcm(64, page_size) (kvmem.sizing.STATE_GRID); page size 1 here
STATE_POOL = 8192
STATE_SLOTS = 64  # more than a sequence's inserts: a request's own slot never needs an eviction
BLOCKS = [[1000 + i for i in range(GRID)], [2000 + i for i in range(GRID)],
          [2000 + i for i in range(GRID // 2)] + [3000 + i for i in range(GRID // 2)]]
SEQUENCES, QUICK_SEQUENCES = 40, 8
OPS = 60


def operations(seed: int, component: str = "window") -> list[tuple]:
    """One random sequence of `component`'s operations (see the module docstring)."""
    rng = random.Random(seed)
    return window_operations(rng) if component == "window" else state_operations(rng, off_grid=seed % 2 == 1)


def window_operations(rng: random.Random) -> list[tuple]:
    """Keys over a 3-token alphabet (shared prefixes), up to 12 tokens."""
    ops = []
    for _ in range(OPS):
        kind = rng.choices(("insert", "match", "evict", "evict_window", "lock", "unlock"), (4, 4, 1, 1, 1, 1))[0]
        if kind == "unlock":
            ops.append((kind, rng.randrange(8)))
        elif kind in ("insert", "match", "lock"):
            key = [rng.randrange(3) + 10 for _ in range(rng.randint(1, 12))]
            if kind == "insert":
                ops.append((kind, key, rng.randint(0, len(key)) if rng.random() < 0.5 else 0))
            else:
                ops.append((kind, key))
        else:
            ops.append((kind, rng.randint(1, 8)))
    return ops


def state_operations(rng: random.Random, off_grid: bool) -> list[tuple]:
    """Keys of 1-3 blocks; matches may go on past them, and inserts too when `off_grid`. Evictions are rarer than in
    window sequences: a state is a whole block, and the comparison that matters ends at the first eviction."""
    ops = []
    for _ in range(OPS):
        kind = rng.choices(("insert", "match", "evict", "evict_states", "lock", "unlock"), (4, 4, .5, .5, 1, 1))[0]
        if kind == "unlock":
            ops.append((kind, rng.randrange(8)))
        elif kind == "evict":
            ops.append((kind, rng.randint(1, 2 * GRID)))
        elif kind == "evict_states":
            ops.append((kind, rng.randint(1, 3)))
        else:
            key = [t for _ in range(rng.randint(1, 3)) for t in BLOCKS[rng.randrange(3)]]
            if (kind != "insert" or off_grid) and rng.random() < 0.5:
                key += [rng.randrange(3) + 10 for _ in range(rng.randint(1, 8))]
            ops.append((kind, key))
    return ops


def run(side, ops: list[tuple]) -> list[list]:
    out = []
    for kind, *args in ops:
        got = getattr(side, kind)(*args)
        out.append([got, *side.sizes()])
    return out


# ---- kvmem ----------------------------------------------------------------------------------------------------
class KvmemSide:
    """What both kvmem sides share: their HybridRadixCache's locks and full eviction (the subclass builds it)."""

    def __init__(self) -> None:
        self.held = []

    def locked(self, m) -> int:
        if m.indices.numel():
            self.cache.inc_lock_ref(m.last_node)
            self.held.append(m.last_node)
        return int(m.indices.numel())

    def unlock(self, i):
        if not self.held:
            return -1
        self.cache.dec_lock_ref(self.held.pop(i % len(self.held)))
        return 0

    def evict(self, n):
        return self.cache.evict(n)


class KvmemWindowSide(KvmemSide):
    def __init__(self) -> None:
        from kvmem import ReqToTokenPool
        from kvmem.hybrid import HybridRadixCache, HybridTokenAllocator

        super().__init__()
        self.alloc = HybridTokenAllocator(POOL, WINDOW_POOL)
        self.cache = HybridRadixCache(ReqToTokenPool(1, 64), self.alloc, window=WINDOW, window_free_interval=1)

    def lock(self, key):
        return self.locked(self.cache.match_prefix(key))

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

    def evict_window(self, n):
        return self.cache.evict_window(n)

    def sizes(self):
        c, a = self.cache, self.alloc
        return [a.available_size(), a.window_available_size(), c.evictable_size(), c.window_evictable_size()]


class KvmemStateSide(KvmemSide):
    def __init__(self) -> None:
        from kvmem import ReqToTokenPool, TokenAllocator
        from kvmem.hybrid import HybridRadixCache, StateSlotPool

        super().__init__()
        self.alloc = TokenAllocator(STATE_POOL)
        self.cache = HybridRadixCache(ReqToTokenPool(1, 4 * GRID), self.alloc, state_pool=StateSlotPool(STATE_SLOTS))
        if self.cache.chunk_grid != GRID:
            raise RuntimeError(f"kvmem's state grid is {self.cache.chunk_grid}, the script's keys assume {GRID}")
        self.origin = {}  # state slot -> the insert whose state it holds
        self.inserts = 0

    def insert(self, key):
        from kvmem import Req

        cache = self.cache
        req = Req(self.inserts, key, 1)
        row = cache.req_to_token_pool.alloc(1)[0]
        cache.req_to_token_pool.write((row, slice(0, len(key))), self.alloc.alloc(len(key)))
        req.req_pool_idx, req.kv_len = row, len(key)
        cache.start_reqs([req])
        slot = int(cache.req_state_slots([row])[0])
        tokens, states = cache.total_size(), self.tree_states()
        cache.cache_finished_req(req)
        kept = self.tree_states() > states
        if kept:
            self.origin[slot] = self.inserts
        self.inserts += 1
        return [len(key) - (cache.total_size() - tokens), int(kept)]

    def tree_states(self) -> int:
        return self.cache.state_evictable_size() + self.cache.state_protected_size()

    def matched(self, m) -> list[int]:
        return [int(m.indices.numel()), self.origin[m.last_node.state] if m.last_node.state else -1]

    def match(self, key):
        return self.matched(self.cache.match_prefix(key))

    def lock(self, key):
        m = self.cache.match_prefix(key)
        self.locked(m)
        return self.matched(m)

    def evict_states(self, n):
        return self.cache.evict_states(n)

    def sizes(self):
        c = self.cache
        return [self.alloc.available_size(), c.state_available_size(), c.evictable_size(), c.state_evictable_size()]


# ---- SGLang (runs under SGLang's venv; imports nothing from kvmem) --------------------------------------------
class SglangSide:
    """What both SGLang sides share: a UnifiedRadixCache built by the subclass, its locks and full eviction."""

    def __init__(self, sg: dict) -> None:
        from array import array

        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        self.sg = sg
        self.key = lambda tokens: RadixKey(array("q", tokens))
        self.EvictParams, self.InsertParams, self.MatchPrefixParams = EvictParams, InsertParams, MatchPrefixParams
        self.held = []

    def build(self, components: tuple, pool, **params):
        sg = self.sg
        return sg["UnifiedRadixCache"](sg["CacheInitParams"](
            disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=self.alloc, page_size=1,
            tree_core_backend="python", tree_components=(sg["ComponentType"].FULL, *components), **params))

    def match_result(self, key):
        return self.cache.match_prefix(self.MatchPrefixParams(key=self.key(key)))

    def locked(self, m) -> int:
        if m.device_prefix_len:
            self.held.append(self.cache.lock(m.last_device_node))
        return int(m.device_prefix_len)

    def unlock(self, i):
        if not self.held:
            return -1
        self.cache.unlock(self.held.pop(i % len(self.held)))
        return 0

    def evict(self, n):
        return int(self.cache.evict(self.EvictParams(num_tokens=n)).num_tokens_evicted)


class SglangWindowSide(SglangSide):
    def __init__(self, sg: dict) -> None:
        import torch
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        super().__init__(sg)
        kv = SWAKVPool(size=POOL, size_swa=WINDOW_POOL, page_size=1, dtype=torch.float16, head_num=1, head_dim=8,
                       swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu",
                       enable_memory_saver=False)
        self.alloc = SWATokenToKVPoolAllocator(size=POOL, size_swa=WINDOW_POOL, page_size=1, dtype=torch.float16,
                                               device="cpu", kvcache=kv, need_sort=False)
        pool = sg["ReqToTokenPool"](size=1, max_context_len=64, device="cpu", enable_memory_saver=False)
        self.swa = sg["ComponentType"].SWA
        self.cache = self.build((self.swa,), pool, sliding_window_size=WINDOW - 1)

    def lock(self, key):
        return self.locked(self.match_result(key))

    def insert(self, key, cursor):
        value = self.alloc.alloc(len(key))
        params = self.InsertParams(key=self.key(key), value=value)
        if cursor:
            self.alloc.free_swa(value[:cursor])
            params.set_evicted_seqlen(self.swa, cursor)
        return int(self.cache.insert(params).prefix_len)

    def match(self, key):
        return int(self.match_result(key).device_prefix_len)

    def evict_window(self, n):
        return int(self.cache.evict(self.EvictParams(swa_num_tokens=n)).swa_num_tokens_evicted)

    def sizes(self):
        c, a = self.cache, self.alloc
        return [a.full_available_size(), a.swa_available_size(), c.full_evictable_size(), c.swa_evictable_size()]


class SglangStateSide(SglangSide):
    def __init__(self, sg: dict) -> None:
        import torch
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
        from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
        from sglang.srt.runtime_context import get_server_args

        super().__init__(sg)
        # The state grid SGLang derives from the model's config (its FLA chunk, 64), given as its own tests do: the
        # "dummy" model has no config to read it from.
        get_server_args()._mamba_cache_chunk_size = GRID
        shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=4, n_groups=1, num_heads=1, head_dim=2,
                                        state_size=2, conv_kernel=2)
        params = Mamba2CacheParams(shape=shape, layers=[0],
                                   dtype=Mamba2StateDType(conv=torch.float32, temporal=torch.float32))
        pool = HybridReqToTokenPool(size=1, mamba_size=STATE_SLOTS, mamba_spec_state_size=STATE_SLOTS,
                                    max_context_len=4 * GRID, device="cpu", enable_memory_saver=False,
                                    cache_params=params, mamba_layer_ids=[0], enable_mamba_extra_buffer=False)
        kv = sg["MHATokenToKVPool"](size=STATE_POOL, page_size=1, dtype=torch.float16, head_num=1, head_dim=8,
                                    layer_num=1, device="cpu", enable_memory_saver=False)
        self.alloc = sg["TokenToKVPoolAllocator"](size=STATE_POOL, dtype=torch.float16, device="cpu", kvcache=kv,
                                                  need_sort=False)
        self.states = pool.mamba_allocator
        self.mamba = sg["ComponentType"].MAMBA
        self.cache = self.build((self.mamba,), pool, enable_mamba_extra_buffer=False)
        self.origin = {}
        self.inserts = 0

    def insert(self, key):
        slot = self.states.alloc(1)
        result = self.cache.insert(self.InsertParams(key=self.key(key), value=self.alloc.alloc(len(key)),
                                                     mamba_value=slot))
        if result.mamba_exist:  # the tree kept its own: the request's slot is freed (as its release does)
            self.states.free(slot)
        else:
            self.origin[int(slot[0])] = self.inserts
        self.inserts += 1
        return [int(result.prefix_len), int(not result.mamba_exist)]

    def matched(self, m) -> list[int]:
        state = self.cache.tree_core.get_component_device_value(m.best_match_node, self.mamba)
        return [int(m.device_prefix_len), -1 if state is None else self.origin[int(state[0])]]

    def match(self, key):
        return self.matched(self.match_result(key))

    def lock(self, key):
        m = self.match_result(key)
        self.locked(m)
        return self.matched(m)

    def evict_states(self, n):
        return int(self.cache.evict(self.EvictParams(mamba_num=n)).mamba_num_evicted)

    def sizes(self):
        c = self.cache
        return [self.alloc.available_size(), self.states.available_size(), c.full_evictable_size(),
                c.mamba_evictable_size()]


SIDES = {"window": (KvmemWindowSide, SglangWindowSide), "states": (KvmemStateSide, SglangStateSide)}
FIELDS = {"window": ("returned", "full_free", "window_free", "full_evictable", "window_evictable"),
          "states": ("returned", "full_free", "state_free", "full_evictable", "state_evictable")}


def sequences(args) -> range:
    return range(args.seed, args.seed + (QUICK_SEQUENCES if args.quick else SEQUENCES))


def sglang_main(args) -> None:
    sg = _peer.load_driver(args.sglang_driver).import_sglang()
    import sglang

    side = SIDES[args.component][1]
    out = {"version": getattr(sglang, "__version__", "?"), "runs": {}}
    for seed in sequences(args):
        try:
            out["runs"][seed] = run(side(sg), operations(seed, args.component))
        except Exception as e:  # a call SGLang refuses: reported as that sequence's result
            out["runs"][seed] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out))


def difference_class(op: tuple, first_eviction: int, i: int) -> str:
    """Why the two first differ at operation i (op): a convention named in docs/hybrid.md's "Differences from
    SGLang" (`state_off_the_grid`; `eviction` at the first eviction, `after_eviction` after it), or `unexplained`
    before any eviction (a bug, on one side or the other)."""
    if op[0] == "insert" and len(op) == 2 and len(op[1]) % GRID:
        return "state_off_the_grid"  # SGLang keeps a finished request's state at its end, kvmem on the grid only
    if i > first_eviction:
        return "after_eviction"
    return "eviction" if i == first_eviction else "unexplained"


def compare(ops: list[tuple], mine: list, theirs, component: str = "window") -> dict:
    if isinstance(theirs, dict):
        return {"sglang_error": theirs["error"]}
    first_evict = next((i for i, op in enumerate(ops) if op[0].startswith("evict")), len(ops))
    differ = [i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b]
    before = [i for i in differ if i < first_evict]
    row = {"ops": len(ops), "first_eviction": first_evict, "differing_ops": len(differ),
           "differing_before_first_eviction": len(before)}
    if differ:
        i = differ[0]
        fields = FIELDS[component]
        row["first_difference"] = {"op": i, "operation": list(ops[i]),
                                   "class": difference_class(ops[i], first_evict, i),
                                   "kvmem": dict(zip(fields, mine[i])), "sglang": dict(zip(fields, theirs[i]))}
    return row


def summarize(rows: dict) -> dict:
    summary = {"sequences": len(rows), "identical": sum(r.get("differing_ops") == 0 for r in rows.values()),
               "agree_up_to_first_eviction": sum(r.get("differing_before_first_eviction") == 0 for r in rows.values()),
               "differing_before_any_eviction": [seed for seed, r in rows.items()
                                                 if r.get("differing_before_first_eviction")],
               "sglang_errors": [seed for seed, r in rows.items() if "sglang_error" in r],
               "first_difference_at": {}, "first_difference_class": {}}
    for r in rows.values():  # which operation the two trees first disagree on, sequence by sequence, and why
        if "first_difference" in r:
            first = r["first_difference"]
            for field, value in (("first_difference_at", first["operation"][0]), ("first_difference_class",
                                                                                 first["class"])):
                summary[field][value] = summary[field].get(value, 0) + 1
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = _peer.parser(__doc__, f"{QUICK_SEQUENCES} sequences instead of {SEQUENCES}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--component", choices=tuple(SIDES), default="window",
                    help="the component beside full attention: window (SWA) or states (linear attention, Mamba)")
    args = _peer.parse_sides(ap, argv, sglang_main)
    if args is None:
        return
    side = SIDES[args.component][0]
    mine = {seed: run(side(), operations(seed, args.component)) for seed in sequences(args)}
    sg = _peer.run_peer(__file__, args, "--seed", str(args.seed), "--component", args.component)
    if "error" in sg:
        _peer.emit({"error": sg["error"], "kvmem": {"sequences": len(mine)}}, args.out)
        return
    rows = {seed: compare(operations(seed, args.component), mine[seed], sg["runs"][str(seed)], args.component)
            for seed in mine}
    report = {"sglang": sg["version"], "component": args.component, "summary": summarize(rows), "sequences": rows}
    if args.component == "window":
        report["window"] = WINDOW
    else:
        report["grid"] = GRID
        report["summary"]["by_keys"] = {
            keys: summarize({seed: r for seed, r in rows.items() if seed % 2 == odd})
            for keys, odd in (("whole_blocks", 0), ("with_off_grid_inserts", 1))}
        for part in report["summary"]["by_keys"].values():
            part.pop("sglang_errors")
    _peer.emit(report, args.out)


if __name__ == "__main__":
    main()
