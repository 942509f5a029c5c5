#!/usr/bin/env python3
"""Scheduler overhead per step: kvmem's Scheduler loop beside SGLang's cache objects driven the same way.

Two step shapes, each at page_size 1 and 16 (CPU tensors, torch single-threaded; median microseconds per
step over repeats, after warm-up steps):
  decode  256 running requests with 1024..2048-token prompts: `Scheduler.step()` (a decode batch) and
          `process_batch_result`.
  extend  32 new requests of 2048 tokens whose first 1024 tokens are cached (32 prefixes run to completion
          first; every round brings fresh 1024-token suffixes): `step()` (fcfs admission with match_prefix +
          prepare_for_extend) and `process_batch_result`, which caches the finished requests (max_new_tokens 1).
The phases inside step() come from the Scheduler's own PhaseTimer ("match", "prepare_extend",
"prepare_decode"). A second block of steps builds `attention_metadata()` between step and process
(`metadata`, and `full` = step + metadata + process); it is kept apart because building the metadata walks
every row and leaves the next step cold host caches.

SGLang side (`--peer sglang`, run as a subprocess under SGLang's venv python): a per-step harness calls the
SGLang 0.5.x helpers that ../shared/peers/sglang_driver.py calls, in the same order (admission:
init_next_round_input + lock; prefill: alloc_req_slots + token slots + req_to_token writes; decode:
check_decode_capacity + slots + the req_to_token write; finish: release_kv_cache). SGLang builds FlashInfer
metadata on the GPU, so rows with kvmem's metadata have no SGLang counterpart (`sglang_covers` says what
the SGLang figure holds, and such rows stay out of `kvmem_slower_rows`).

`ratio` = sglang_us / kvmem_us (medians): above 1 means kvmem is faster; `ratio_min` compares the fastest
repeats, which preemption on a shared machine does not inflate. A ratio is reported only where both sides did
the same work (`work` in each side's raw results): the same batch size every step, and the same number of
slots taken from the allocator by each of the steps both sides ran (allocated, less what finished requests
gave back); shapes where they differ get no ratio and are listed in `shapes_with_unequal_work`.

    python scripts/bench_scheduler.py [--sglang-python PATH] [--quick] [--seed 0] [--out FILE]
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import time
from array import array

import numpy as np

import _peer  # scripts/_peer.py: the script's own folder is on sys.path

PAGE_SIZES = (1, 16)
DECODE_BS, DECODE_PROMPT = 256, (1024, 2048)
EXTEND_BS, PREFIX_LEN, PROMPT_LEN = 32, 1024, 2048
VOCAB = 32000
TOKEN = 7  # every "sampled" token: no step's work depends on the value
WARMUP = 3
REPEATS = {False: 30, True: 8}  # by --quick
# Both sides run torch single-threaded: a scheduler's tensors are small, and on a shared 2-core box an
# intra-op thread pool waiting for a busy core turned 2 ms steps into 6-28 ms ones (measured).
TORCH_THREADS = 1


# ---- workloads (numpy only: the same token ids in both processes for one seed) --------------------------
def decode_prompts(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(10, VOCAB, n) for n in rng.integers(DECODE_PROMPT[0], DECODE_PROMPT[1] + 1, DECODE_BS)]
    for i, p in enumerate(prompts):
        p[0] = VOCAB + i  # distinct first tokens: no accidental one-token hit at page_size 1
    return prompts


def extend_prompts(seed: int, rounds: int) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    """32 cached prefixes, and per round 32 prompts = prefix i + a fresh suffix."""
    rng = np.random.default_rng(seed + 1)
    prefixes = [rng.integers(10, VOCAB, PREFIX_LEN) for _ in range(EXTEND_BS)]
    for i, p in enumerate(prefixes):
        p[0] = VOCAB + i
    rounds_out = []
    for k in range(rounds):
        suffixes = rng.integers(10, VOCAB, (EXTEND_BS, PROMPT_LEN - PREFIX_LEN))
        suffixes[:, 0] = VOCAB + k  # a suffix never shares its first token with an earlier round's
        rounds_out.append([np.concatenate([p, s]) for p, s in zip(prefixes, suffixes)])
    return prefixes, rounds_out


def round_up(n: int, page_size: int) -> int:
    return -(-n // page_size) * page_size


def summarize(rec: dict[str, list[float]]) -> dict:
    """Median per phase in us, and the minimum (which preemption on a loaded machine does not inflate)."""
    out = {f"{k}_us": round(statistics.median(v) * 1e6, 1) for k, v in rec.items() if v}
    out["min"] = {f"{k}_us": round(min(v) * 1e6, 1) for k, v in rec.items() if v}
    return out


# ---- kvmem side ----------------------------------------------------------------------------------------------
def make_kvmem_scheduler(page_size: int, rows: int, max_context_len: int, capacity: int, max_running: int):
    from kvmem import (
        PagedTokenAllocator,
        PhaseTimer,
        RadixCache,
        ReqToTokenPool,
        Scheduler,
        SchedulerConfig,
        TokenAllocator,
    )

    pool = ReqToTokenPool(rows, max_context_len)
    size = round_up(capacity, page_size)
    alloc = TokenAllocator(size) if page_size == 1 else PagedTokenAllocator(size, page_size)
    # fcfs: one match per admitted request, as the SGLang side does; no chunking, as the driver has none.
    config = SchedulerConfig(schedule_policy="fcfs", max_running_requests=max_running, chunked_prefill_size=None)
    return Scheduler(pool, alloc, RadixCache(pool, alloc, page_size=page_size), config, timer=PhaseTimer())


def timed_steps(sched, steps: int, repeats: int, feed, check) -> dict:
    """Runs WARMUP + 2 * repeats steps (`feed(k)` queues round k's requests first): a plain block, then a block
    with attention_metadata() between step and process. Phases come from the scheduler's timer. The work: each
    step's batch size and, over the first WARMUP + repeats steps (what the SGLang side runs), the slots each
    took from the allocator."""
    pc, timer, rec = time.perf_counter, sched.timer, {}
    tokens = {}
    work = {"batch_sizes": set(), "slots_taken_per_step": []}
    free = sched.token_allocator.available_size
    gc.collect()
    gc.disable()  # a collection would land inside some timed step
    for k in range(WARMUP + 2 * repeats):
        feed(k)
        free_before = free()
        with_metadata = k >= WARMUP + repeats
        timer.reset()
        t0 = pc()
        batch = sched.step()
        t1 = pc()
        if with_metadata:
            batch.attention_metadata()
        t2 = pc()
        bs = batch.batch_size()
        sched.process_batch_result(batch, tokens.setdefault(bs, [TOKEN] * bs))
        t3 = pc()
        check(batch)
        work["batch_sizes"].add(bs)
        if k < WARMUP + repeats:
            work["slots_taken_per_step"].append(free_before - free())
        if k < WARMUP:
            continue
        phases = {p: s for p, s in timer.seconds.items() if p != "process"}
        samples = ({"metadata": t2 - t1, "full": t3 - t0} if with_metadata else
                   {"step": t1 - t0, "process_batch_result": t3 - t2, "step+process": (t1 - t0) + (t3 - t2),
                    **phases})
        for name, v in samples.items():
            rec.setdefault(name, []).append(v)
    gc.enable()
    return {**summarize(rec), "work": {**work, "batch_sizes": sorted(work["batch_sizes"])}}


def kvmem_decode(page_size: int, seed: int, repeats: int) -> dict:
    from kvmem import ForwardMode, Req

    steps = WARMUP + 2 * repeats
    max_ctx = DECODE_PROMPT[1] + steps + 2 * page_size
    sched = make_kvmem_scheduler(page_size, DECODE_BS + 4, max_ctx, DECODE_BS * max_ctx + (1 << 16), DECODE_BS)
    for i, p in enumerate(decode_prompts(seed)):
        sched.add_request(Req(i, p, steps + 2))  # never finishes while measured
    while sched.waiting:
        batch = sched.step()
        sched.process_batch_result(batch, [TOKEN] * batch.batch_size())
    assert len(sched.running) == DECODE_BS, "all 256 requests must be running before decode is timed"

    def check(batch):
        assert batch.forward_mode is ForwardMode.DECODE and batch.batch_size() == DECODE_BS

    out = timed_steps(sched, steps, repeats, lambda k: None, check)
    assert sched.stats.retractions == 0 and sched.stats.evicted_tokens == 0
    return out


def kvmem_extend(page_size: int, seed: int, repeats: int) -> dict:
    from kvmem import ForwardMode, Req

    rounds = WARMUP + 2 * repeats
    prefixes, prompts = extend_prompts(seed, rounds)
    sched = make_kvmem_scheduler(page_size, EXTEND_BS + 4, PROMPT_LEN + 2 * page_size,
                                 (rounds + 4) * EXTEND_BS * PREFIX_LEN, EXTEND_BS)
    for i, p in enumerate(prefixes):
        sched.add_request(Req(f"prefix{i}", p, 1))
    sched.process_batch_result(sched.step(), [TOKEN] * EXTEND_BS)
    assert sched.tree_cache.total_size() == EXTEND_BS * PREFIX_LEN and sched.is_idle()

    def feed(k):
        for i, p in enumerate(prompts[k]):
            sched.add_request(Req(f"r{k}.{i}", p, 1))

    def check(batch):
        assert batch.forward_mode is ForwardMode.EXTEND and batch.batch_size() == EXTEND_BS
        assert bool((batch.prefix_lens == PREFIX_LEN).all()), "every request must hit its 1024-token prefix"
        assert sched.is_idle()

    out = timed_steps(sched, rounds, repeats, feed, check)
    assert sched.stats.evicted_tokens == 0, "the pool must be large enough that nothing is evicted"
    return out


# ---- SGLang side (runs under SGLang's venv; imports nothing from kvmem) ---------------------------------------
class SglangLoop:
    """SGLang's pools, allocator and RadixCache, stepped with the helper calls sglang_driver.py makes."""

    def __init__(self, sg: dict, page_size: int, size: int, rows: int, max_context_len: int) -> None:
        torch = self.torch = sg["torch"]
        self.sg, self.ps = sg, page_size
        size = round_up(size, page_size)
        self.rtp = sg["ReqToTokenPool"](size=rows, max_context_len=max_context_len, device="cpu",
                                        enable_memory_saver=False)
        kv = sg["MHATokenToKVPool"](size=size, page_size=page_size, dtype=torch.float16, head_num=1, head_dim=8,
                                    layer_num=1, device="cpu", enable_memory_saver=False)
        if page_size == 1:
            self.alloc = sg["TokenToKVPoolAllocator"](size=size, dtype=torch.float16, device="cpu", kvcache=kv,
                                                      need_sort=False)
        else:
            self.alloc = sg["PagedTokenToKVPoolAllocator"](size=size, page_size=page_size, dtype=torch.float16,
                                                           device="cpu", kvcache=kv, need_sort=False)
        self.cache = sg["RadixCache"](sg["CacheInitParams"](
            disable=False, req_to_token_pool=self.rtp, token_to_kv_pool_allocator=self.alloc,
            page_size=page_size, eviction_policy="lru"))

    def new_req(self, rid: str, ids: np.ndarray, max_new_tokens: int):
        tokens = array("q")
        tokens.frombytes(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
        return self.sg["Req"](rid=rid, origin_input_text="", origin_input_ids=tokens,
                              sampling_params=self.sg["SamplingParams"](max_new_tokens=max_new_tokens))

    def admit(self, waiting: list, running: list, max_running: int) -> tuple[list, float]:
        """The driver's admission loop (fcfs, new_token_ratio 1.0); returns (admitted, seconds in match+lock)."""
        ps, cache, pc = self.ps, self.cache, time.perf_counter
        reserve = sum(r.sampling_params.max_new_tokens - len(r.output_ids) + ps for r in running)
        admitted, match_s = [], 0.0
        while waiting and len(running) + len(admitted) < max_running:
            r = waiting[0]
            t0 = pc()
            r.init_next_round_input(cache)
            lock = cache.lock(r.last_node)
            match_s += pc() - t0
            fill = len(r.full_untruncated_fill_ids)
            need = round_up(fill - r.prefix_len, ps) + r.sampling_params.max_new_tokens - len(r.output_ids) + ps
            if need > self.alloc.available_size() + cache.evictable_size() - reserve:
                cache.unlock(lock)
                break
            waiting.pop(0)
            r.lock, r.extend_end = lock, fill
            reserve += need
            admitted.append(r)
        return admitted, match_s

    def prefill(self, admitted: list) -> None:
        """The driver's prefill allocation: rows, slots (evicting first when short), req_to_token writes."""
        sg, torch, rtp, cache = self.sg, self.torch, self.rtp, self.cache
        prefix_tensors = [cache.prefix_device_indices(r) if r.prefix_len else torch.empty(0, dtype=torch.int64)
                          for r in admitted]
        idxs = sg["alloc_req_slots"](rtp, admitted, cache)
        pl, sl = [r.prefix_len for r in admitted], [r.extend_end for r in admitted]
        total = sum(s - p for s, p in zip(sl, pl))
        if self.ps == 1:
            loc = sg["alloc_token_slots"](cache, total)
        else:
            last = torch.cat([t[-1:] if len(t) else torch.tensor([-1]) for t in prefix_tensors])
            plt, slt = torch.tensor(pl), torch.tensor(sl)
            loc = sg["alloc_paged_token_slots_extend"](cache, plt, plt, slt, slt, last, total)
        off = 0
        for r, idx, p, s, pref in zip(admitted, idxs, pl, sl, prefix_tensors):
            rtp.write((idx, slice(0, p)), pref)
            rtp.write((idx, slice(p, s)), loc[off:off + s - p])
            off += s - p
            r.kv.kv_allocated_len = r.kv.kv_committed_len = s

    def after_prefill(self, admitted: list, running: list) -> None:
        for r in admitted:
            r.output_ids.append(TOKEN)
            if len(r.output_ids) >= r.sampling_params.max_new_tokens:
                self.finish(r)
            else:
                self.sg["checkpoint_kv_cache"](r, self.cache)
                running.append(r)

    def finish(self, r) -> None:
        r.finished_reason = self.sg["FINISH_LENGTH"](len(r.output_ids))
        self.sg["release_kv_cache"](r, self.cache, checkpoint=True)

    def decode(self, running: list) -> None:
        """The driver's decode step: capacity check, one slot per request, the req_to_token write."""
        sg, torch, ps, rtp = self.sg, self.torch, self.ps, self.rtp
        need = sum(ps for r in running if r.kv.kv_committed_len % ps == 0)
        if not self.alloc.check_decode_capacity(num_tokens=need, tree_cache=self.cache):
            raise RuntimeError("decode capacity short: the bench pool is too small")
        cur = torch.tensor([r.kv.kv_committed_len for r in running])
        idx_t = torch.tensor([r.kv.req_pool_idx for r in running])
        if ps == 1:
            loc = sg["alloc_token_slots"](self.cache, len(running))
        else:
            last = rtp.req_to_token[idx_t, cur - 1].to(torch.int64)
            loc = sg["alloc_paged_token_slots_decode"](self.cache, cur + 1, cur + 1, last)
        rtp.write((idx_t, cur), loc.to(torch.int32))
        for r in running:
            r.kv.kv_allocated_len += 1
            r.kv.kv_committed_len += 1

    def after_decode(self, running: list) -> list:
        still = []
        for r in running:
            r.output_ids.append(TOKEN)
            if len(r.output_ids) >= r.sampling_params.max_new_tokens:
                self.finish(r)
            else:
                still.append(r)
        return still


def sglang_decode(sg: dict, page_size: int, seed: int, repeats: int) -> dict:
    steps = WARMUP + repeats
    max_ctx = DECODE_PROMPT[1] + steps + 2 * page_size
    loop = SglangLoop(sg, page_size, DECODE_BS * max_ctx + (1 << 16), DECODE_BS + 4, max_ctx)
    waiting = [loop.new_req(str(i), p, steps + 2) for i, p in enumerate(decode_prompts(seed))]
    running: list = []
    while waiting:
        admitted, _ = loop.admit(waiting, running, DECODE_BS)
        loop.prefill(admitted)
        loop.after_prefill(admitted, running)
    assert len(running) == DECODE_BS
    pc, rec = time.perf_counter, {}
    taken = []
    gc.collect()
    gc.disable()
    for i in range(steps):
        free_before = loop.alloc.available_size()
        t0 = pc()
        loop.decode(running)
        t1 = pc()
        running = loop.after_decode(running)
        t2 = pc()
        assert len(running) == DECODE_BS
        taken.append(free_before - loop.alloc.available_size())
        if i >= WARMUP:
            for name, v in (("decode_alloc", t1 - t0), ("process", t2 - t1), ("step+process", t2 - t0)):
                rec.setdefault(name, []).append(v)
    gc.enable()
    return {**summarize(rec), "work": {"batch_sizes": [DECODE_BS], "slots_taken_per_step": taken}}


def sglang_extend(sg: dict, page_size: int, seed: int, repeats: int) -> dict:
    rounds = WARMUP + repeats
    prefixes, prompts = extend_prompts(seed, rounds)
    loop = SglangLoop(sg, page_size, (rounds + 4) * EXTEND_BS * PREFIX_LEN, EXTEND_BS + 4,
                      PROMPT_LEN + 2 * page_size)
    admitted, _ = loop.admit([loop.new_req(f"prefix{i}", p, 1) for i, p in enumerate(prefixes)], [], EXTEND_BS)
    loop.prefill(admitted)
    loop.after_prefill(admitted, [])
    pc, rec = time.perf_counter, {}
    taken = []
    gc.collect()
    gc.disable()
    for k in range(rounds):
        waiting = [loop.new_req(f"r{k}.{i}", p, 1) for i, p in enumerate(prompts[k])]
        running: list = []
        free_before = loop.alloc.available_size()
        t0 = pc()
        admitted, match_s = loop.admit(waiting, running, EXTEND_BS)
        t1 = pc()
        loop.prefill(admitted)
        t2 = pc()
        loop.after_prefill(admitted, running)
        t3 = pc()
        assert len(admitted) == EXTEND_BS and not running
        assert all(r.prefix_len == PREFIX_LEN for r in admitted), "every request must hit its prefix"
        taken.append(free_before - loop.alloc.available_size())
        if k >= WARMUP:
            for name, v in (("match", match_s), ("prefill_alloc", t2 - t1), ("step", t2 - t0), ("finish", t3 - t2),
                            ("step+process", t3 - t0)):
                rec.setdefault(name, []).append(v)
    gc.enable()
    return {**summarize(rec), "work": {"batch_sizes": [EXTEND_BS], "slots_taken_per_step": taken}}


def sglang_main(args) -> None:
    sg = _peer.load_driver(args.sglang_driver).import_sglang()
    sg["torch"].set_num_threads(TORCH_THREADS)
    import sglang

    repeats = REPEATS[args.quick]
    out = {"version": getattr(sglang, "__version__", "?")}
    for ps in PAGE_SIZES:
        out[f"page_size={ps}"] = {"decode": sglang_decode(sg, ps, args.seed, repeats),
                                  "extend": sglang_extend(sg, ps, args.seed, repeats)}
    print(json.dumps(out))


# ---- report --------------------------------------------------------------------------------------------------
NO_METADATA = "cache work only, no metadata"
# (row, kvmem key, SGLang key or None, what the SGLang figure covers)
DECODE_ROWS = (
    ("prepare_for_decode", "prepare_decode_us", "decode_alloc_us", "capacity check + alloc + req_to_token write"),
    ("step()", "step_us", "decode_alloc_us", "capacity check + alloc + req_to_token write"),
    ("process_batch_result", "process_batch_result_us", "process_us", "append token + finished check"),
    ("step() + process_batch_result", "step+process_us", "step+process_us", "decode step + append"),
    ("metadata", "metadata_us", None, "none on CPU (FlashInfer metadata is built on the GPU)"),
    ("full (step + metadata + process)", "full_us", "step+process_us", NO_METADATA),
)
EXTEND_ROWS = (
    ("match (match_prefix + lock)", "match_us", "match_us", "init_next_round_input + lock"),
    ("prepare_for_extend", "prepare_extend_us", "prefill_alloc_us", "alloc_req_slots + slots + row writes"),
    ("step() (admission + prepare)", "step_us", "step_us", "admission loop + prefill allocation"),
    ("process_batch_result (finish 32)", "process_batch_result_us", "finish_us", "32 x release_kv_cache"),
    ("step() + process_batch_result", "step+process_us", "step+process_us", "admission + allocation + finish"),
    ("metadata", "metadata_us", None, "none on CPU (FlashInfer metadata is built on the GPU)"),
    ("full (step + metadata + process)", "full_us", "step+process_us", NO_METADATA),
)


def same_work(mine: dict, theirs: dict) -> bool:
    """Both sides stepped batches of the same size, and each step both ran took the same number of slots."""
    a, b = mine.get("work"), theirs.get("work")
    return a is not None and b is not None and a["batch_sizes"] == b["batch_sizes"] \
        and len(a["slots_taken_per_step"]) > 0 and a["slots_taken_per_step"] == b["slots_taken_per_step"]


def report(kv: dict, sg: dict) -> dict:
    rows, slower, unequal = [], [], []
    for ps in PAGE_SIZES:
        for shape, table in (("decode", DECODE_ROWS), ("extend", EXTEND_ROWS)):
            mine, theirs = kv[f"page_size={ps}"][shape], sg.get(f"page_size={ps}", {}).get(shape, {})
            same = same_work(mine, theirs)
            if theirs and not same:
                unequal.append(f"{shape} (page {ps})")
            for name, kv_key, sg_key, covers in table:
                row = {"row": f"{shape}/{name}", "page_size": ps, "kvmem_us": mine[kv_key],
                       "kvmem_min_us": mine["min"][kv_key], "sglang_covers": covers}
                if sg_key and sg_key in theirs:
                    row.update(sglang_us=theirs[sg_key], sglang_min_us=theirs["min"][sg_key])
                    if not same:
                        row["unequal_work"] = True
                        rows.append(row)
                        continue
                    row.update(ratio=round(theirs[sg_key] / mine[kv_key], 2),
                               ratio_min=round(theirs["min"][sg_key] / mine["min"][kv_key], 2))
                    if covers == NO_METADATA:
                        row["lopsided"] = "kvmem's figure includes building FlashInfer metadata; SGLang's does not"
                    elif theirs[sg_key] < mine[kv_key]:
                        slower.append(f"{row['row']} (page {ps})")
                rows.append(row)
    return {"rows": rows, "kvmem_slower_rows": slower, "shapes_with_unequal_work": unequal,
            "raw": {"kvmem": kv, "sglang": sg}}


def main(argv: list[str] | None = None) -> None:
    ap = _peer.parser(__doc__, f"{REPEATS[True]} repeats instead of {REPEATS[False]}")
    ap.add_argument("--seed", type=int, default=0)
    args = _peer.parse_sides(ap, argv, sglang_main)
    if args is None:
        return
    import torch

    torch.set_num_threads(TORCH_THREADS)
    t0 = time.perf_counter()
    repeats = REPEATS[args.quick]
    kv = {f"page_size={ps}": {"decode": kvmem_decode(ps, args.seed, repeats),
                              "extend": kvmem_extend(ps, args.seed, repeats)} for ps in PAGE_SIZES}
    sg = _peer.run_peer(__file__, args, "--seed", str(args.seed))
    out = report(kv, sg)
    out["meta"] = {"cpus": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2), "torch": torch.__version__,
                   "numpy": np.__version__, "torch_threads": torch.get_num_threads(),
                   "python": platform.python_version(), "sglang": sg.get("version", sg.get("error")),
                   "seed": args.seed, "quick": args.quick, "repeats": repeats, "warmup": WARMUP,
                   "wall_s": round(time.perf_counter() - t0, 1)}
    _peer.emit(out, args.out)


if __name__ == "__main__":
    main()
