#!/usr/bin/env python3
"""Scheduler overhead per step: kvmem's Scheduler loop beside SGLang's cache objects driven the same way.

Two step shapes, each at page_size 1 and 16 (CPU tensors, torch single-threaded; median microseconds per
step over repeats, after warm-up steps):
  decode  256 running requests with 1024..2048-token prompts. kvmem: one real `Scheduler.step()` (a decode
          batch, `ScheduleBatch.prepare_for_decode` timed inside it) and `process_batch_result`; then, in
          a second block of steps, `ScheduleBatch.attention_metadata()` between the two (`batch_level` =
          prepare + metadata, `full` = step + metadata + process).
  extend  32 new requests of 2048 tokens whose first 1024 tokens are cached (32 prefixes run to completion
          first, then every round brings fresh 1024-token suffixes). kvmem: `step()` (fcfs admission with
          match_prefix + prepare_for_extend) and `process_batch_result`, which caches the finished requests
          (max_new_tokens 1) in the tree; a second block times the matches inside step(), a third adds
          `attention_metadata()`.
The steps compared with SGLang come from the blocks without metadata: building it walks every row and
leaves the next step cold host caches (`prepare_after_metadata_us` shows by how much).

SGLang side (`--peer sglang`, run as a subprocess under SGLang's venv python): the peer harness
../shared/peers/sglang_driver.py is imported by path for its import shim; a per-step harness here calls
the same SGLang helpers that driver calls, in the same order (admission: init_next_round_input + lock;
prefill: alloc_req_slots + alloc_token_slots / alloc_paged_token_slots_extend + req_to_token writes;
decode: check_decode_capacity + alloc_token_slots / alloc_paged_token_slots_decode + the req_to_token
write; finish: release_kv_cache). As a cross-check (`driver_check`) it also runs the driver's own `run_one`
on JSONL workloads of the same shapes written here, with the driver's Timer swapped for one that keeps
every sample, since its alloc_s sums prefill and decode. SGLang builds FlashInfer metadata on the GPU inside
its attention backend, so the metadata rows have no SGLang counterpart; rows that include kvmem's metadata
are set against SGLang's cache work alone (`sglang_covers` says so) and left out of `kvmem_slower_rows`.

`ratio` = sglang_us / kvmem_us (medians): above 1 means kvmem is faster; `ratio_min` compares the fastest
repeats, which preemption on a shared machine does not inflate. A cProfile of 30 more kvmem steps (with
metadata; own time per step and its share of the total) shows where kvmem's time goes; cProfile inflates
many small Python calls, so read its shares as a rough guide.

    python scripts/bench_scheduler.py [--sglang-python PATH] [--quick] [--seed 0] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from array import array
from contextlib import contextmanager
from pathlib import Path

import _peer  # scripts/_peer.py: the script's own folder is on sys.path
import numpy as np

PAGE_SIZES = (1, 16)
DECODE_BS = 256
DECODE_PROMPT = (1024, 2048)
EXTEND_BS = 32
PREFIX_LEN = 1024
PROMPT_LEN = 2048
VOCAB = 32000
TOKEN = 7  # every "sampled" token: no step's work depends on the value
WARMUP = 3
REPEATS = {False: 30, True: 8}  # by --quick
PROFILE_STEPS = 30  # many, so that a preemption does not land on one function's row
DRIVER_ROUNDS = {False: 24, True: 4}  # extend batches in the driver's workload
DRIVER_DECODE_STEPS = {False: 32, True: 8}
# Both sides run torch single-threaded: a scheduler's tensors are small, and on a shared 2-core box an
# intra-op thread pool waiting for a busy core turned 2 ms steps into 6-28 ms ones (measured).
TORCH_THREADS = 1


# ---- workloads (numpy only: the same token ids in both processes for one seed) --------------------------
def decode_prompts(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(DECODE_PROMPT[0], DECODE_PROMPT[1] + 1, DECODE_BS)
    prompts = [rng.integers(10, VOCAB, n) for n in lens]
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


def write_driver_workloads(workdir: Path, seed: int, quick: bool) -> dict:
    """JSONL files for sglang_driver.py. extend: the 32 prefixes (one batch), then rounds of 32 prompts that
    hit them; decode: the 256 prompts (one batch), then DRIVER_DECODE_STEPS decode steps."""
    prefixes, rounds = extend_prompts(seed, DRIVER_ROUNDS[quick])
    dec = decode_prompts(seed)
    files = {
        "extend": [(p, 1) for p in prefixes] + [(q, 1) for r in rounds for q in r],
        "decode": [(p, DRIVER_DECODE_STEPS[quick] + 1) for p in dec],
    }
    for name, reqs in files.items():
        with open(workdir / f"{name}.jsonl", "w") as f:
            for ids, out_len in reqs:
                f.write(json.dumps({"input_ids": ids.tolist(), "output_len": out_len}) + "\n")
    return {name: str(workdir / f"{name}.jsonl") for name in files}


# ---- shared helpers ----------------------------------------------------------------------------------------
def round_up(n: int, page_size: int) -> int:
    return -(-n // page_size) * page_size


def med_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 1)


def summarize(rec: dict[str, list[float]]) -> dict:
    """Median per phase, and the minimum: on a loaded machine preemption inflates some steps by
    milliseconds, which the minimum ignores."""
    out = {f"{k}_us": med_us(v) for k, v in rec.items() if v}
    out["min"] = {f"{k}_us": round(min(v) * 1e6, 1) for k, v in rec.items() if v}
    out["repeats"] = max(len(v) for v in rec.values())
    return out


# ---- kvmem side ----------------------------------------------------------------------------------------------
@contextmanager
def timed_schedule_batches(times: list[float]):
    """Has the Scheduler build ScheduleBatches whose prepare_for_* calls append their durations to `times`."""
    import kvmem.scheduler as scheduler_module
    from kvmem.batch import ScheduleBatch

    pc = time.perf_counter

    class TimedScheduleBatch(ScheduleBatch):
        def prepare_for_decode(self) -> None:
            t0 = pc()
            super().prepare_for_decode()
            times.append(pc() - t0)

        def prepare_for_extend(self) -> bool:
            t0 = pc()
            ok = super().prepare_for_extend()
            times.append(pc() - t0)
            return ok

    scheduler_module.ScheduleBatch = TimedScheduleBatch
    try:
        yield
    finally:
        scheduler_module.ScheduleBatch = ScheduleBatch


@contextmanager
def timed_matches(tree, times: list[float]):
    """Adds the time of every match_prefix and inc_lock_ref call on `tree` (instance wrappers) to times[-1]."""
    pc = time.perf_counter
    match, lock = tree.match_prefix, tree.inc_lock_ref

    def timed_match(key):
        t0 = pc()
        m = match(key)
        times[-1] += pc() - t0
        return m

    def timed_lock(node):
        t0 = pc()
        lock(node)
        times[-1] += pc() - t0

    tree.match_prefix, tree.inc_lock_ref = timed_match, timed_lock
    try:
        yield
    finally:
        del tree.match_prefix, tree.inc_lock_ref


def make_kvmem_scheduler(page_size: int, rows: int, max_context_len: int, capacity: int, max_running: int):
    from kvmem.allocator import PagedTokenAllocator, TokenAllocator
    from kvmem.radix_cache import RadixCache
    from kvmem.req_to_token import ReqToTokenPool
    from kvmem.scheduler import Scheduler, SchedulerConfig

    pool = ReqToTokenPool(rows, max_context_len)
    size = round_up(capacity, page_size)
    alloc = TokenAllocator(size) if page_size == 1 else PagedTokenAllocator(size, page_size)
    tree = RadixCache(pool, alloc, page_size=page_size)
    # fcfs: one match per admitted request, as the SGLang side does; no chunking, as the driver has none.
    config = SchedulerConfig(schedule_policy="fcfs", max_running_requests=max_running, chunked_prefill_size=None)
    return Scheduler(pool, alloc, tree, config)


def profile_top(prof: cProfile.Profile, steps: int, top: int = 14) -> dict:
    """The functions with the most own time; `share` is of the profiled total, which stays meaningful when
    preemption inflates the absolute figures (it lands on functions in proportion to their time)."""
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if line else file
        rows.append({"function": f"{where}({func})", "calls_per_step": round(ncalls / steps, 1),
                     "share": round(tottime / stats.total_tt, 3),
                     "tottime_us_per_step": round(tottime / steps * 1e6, 1),
                     "cumtime_us_per_step": round(cumtime / steps * 1e6, 1)})
    rows.sort(key=lambda r: -r["tottime_us_per_step"])
    return {"total_us_per_step": round(stats.total_tt / steps * 1e6, 1), "top": rows[:top]}


def kvmem_decode(page_size: int, seed: int, repeats: int) -> dict:
    """A block of plain steps (step + process, the loop the SGLang side runs), then a block with the
    metadata built between them: the metadata walks every row and evicts the host caches the next step
    would find warm, so the compared rows come from the plain block."""
    from kvmem.batch import ForwardMode, Req

    steps = WARMUP + 2 * repeats + PROFILE_STEPS
    max_ctx = DECODE_PROMPT[1] + steps + 2 * page_size
    sched = make_kvmem_scheduler(page_size, DECODE_BS + 4, max_ctx, DECODE_BS * max_ctx + (1 << 16), DECODE_BS)
    for i, p in enumerate(decode_prompts(seed)):
        sched.add_request(Req(i, p, steps + 2))  # never finishes while measured
    while sched.waiting:
        batch = sched.step()
        sched.process_batch_result(batch, [TOKEN] * batch.batch_size())
    assert len(sched.running) == DECODE_BS, "all 256 requests must be running before decode is timed"
    tokens, pc = [TOKEN] * DECODE_BS, time.perf_counter

    def one_step(with_metadata: bool):
        t0 = pc()
        batch = sched.step()
        t1 = pc()
        md = batch.attention_metadata() if with_metadata else None
        t2 = pc()
        sched.process_batch_result(batch, tokens)
        t3 = pc()
        assert batch.forward_mode is ForwardMode.DECODE and batch.batch_size() == DECODE_BS
        return batch, md, (t1 - t0, t2 - t1, t3 - t2)

    prepare: list[float] = []
    rec = {k: [] for k in ("prepare_for_decode", "step", "process_batch_result", "step+process", "metadata",
                           "batch_level", "full", "prepare_after_metadata")}
    gc.collect()
    gc.disable()  # a collection would land inside some timed step
    with timed_schedule_batches(prepare):
        for i in range(WARMUP + 2 * repeats):
            with_metadata = i >= WARMUP + repeats
            batch, md, (step, meta, proc) = one_step(with_metadata)
            if i < WARMUP:
                continue
            if with_metadata:
                samples = (("metadata", meta), ("batch_level", prepare[-1] + meta), ("full", step + meta + proc),
                           ("prepare_after_metadata", prepare[-1]))
            else:
                samples = (("prepare_for_decode", prepare[-1]), ("step", step), ("process_batch_result", proc),
                           ("step+process", step + proc))
            for k, v in samples:
                rec[k].append(v)
    pages = int(((batch.seq_lens + page_size - 1) // page_size).sum())
    assert len(md.kv_indices) == pages, "decode metadata must list every page of the batch"
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(PROFILE_STEPS):
        one_step(True)
    prof.disable()
    gc.enable()
    assert sched.stats.retractions == 0 and sched.stats.evicted_tokens == 0
    return summarize(rec) | {"kv_tokens": int(batch.seq_lens.sum()), "profile": profile_top(prof, PROFILE_STEPS)}


def kvmem_extend(page_size: int, seed: int, repeats: int) -> dict:
    """Three blocks of rounds, as for decode: plain (step + process), matches timed inside step(), and
    with the metadata built between step and process."""
    from kvmem.batch import ForwardMode, Req

    rounds = WARMUP + 3 * repeats + PROFILE_STEPS
    prefixes, prompts = extend_prompts(seed, rounds)
    sched = make_kvmem_scheduler(page_size, EXTEND_BS + 4, PROMPT_LEN + 2 * page_size,
                                 (rounds + 4) * EXTEND_BS * PREFIX_LEN, EXTEND_BS)
    tree, pc = sched.tree_cache, time.perf_counter
    for i, p in enumerate(prefixes):
        sched.add_request(Req(f"prefix{i}", p, 1))
    batch = sched.step()
    sched.process_batch_result(batch, [TOKEN] * EXTEND_BS)
    assert tree.total_size() == EXTEND_BS * PREFIX_LEN and sched.is_idle()
    tokens = [TOKEN] * EXTEND_BS

    def one_round(k: int, with_metadata: bool, prof: cProfile.Profile | None = None):
        for i, p in enumerate(prompts[k]):
            sched.add_request(Req(f"r{k}.{i}", p, 1))
        if prof is not None:
            prof.enable()
        t0 = pc()
        batch = sched.step()
        t1 = pc()
        if with_metadata:
            md = batch.attention_metadata()
            assert len(md.qo_indptr) == EXTEND_BS + 1
        t2 = pc()
        finished = sched.process_batch_result(batch, tokens)
        t3 = pc()
        if prof is not None:
            prof.disable()
        assert batch.forward_mode is ForwardMode.EXTEND and batch.batch_size() == EXTEND_BS
        assert bool((batch.prefix_lens == PREFIX_LEN).all()), "every request must hit its 1024-token prefix"
        assert len(finished) == EXTEND_BS
        return t1 - t0, t2 - t1, t3 - t2

    prepare: list[float] = []
    matches: list[float] = []
    rec = {k: [] for k in ("match", "prepare_for_extend", "step", "process_batch_result", "step+process",
                           "metadata", "batch_level", "full", "prepare_after_metadata")}
    gc.collect()
    gc.disable()
    with timed_schedule_batches(prepare):
        for k in range(WARMUP + 3 * repeats):
            block = max(0, k - WARMUP) // repeats  # 0 plain, 1 matches timed, 2 with metadata
            if block == 1:
                matches.append(0.0)
                with timed_matches(tree, matches):
                    one_round(k, False)
                rec["match"].append(matches[-1])
                continue
            step, meta, proc = one_round(k, block == 2)
            if k < WARMUP:
                continue
            if block == 2:
                samples = (("metadata", meta), ("batch_level", prepare[-1] + meta), ("full", step + meta + proc),
                           ("prepare_after_metadata", prepare[-1]))
            else:
                samples = (("prepare_for_extend", prepare[-1]), ("step", step), ("process_batch_result", proc),
                           ("step+process", step + proc))
            for name, v in samples:
                rec[name].append(v)
    prof = cProfile.Profile()
    for k in range(WARMUP + 3 * repeats, rounds):
        one_round(k, True, prof)
    gc.enable()
    assert sched.stats.evicted_tokens == 0, "the pool must be large enough that nothing is evicted"
    return summarize(rec) | {"profile": profile_top(prof, PROFILE_STEPS)}


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
            extend = fill - r.prefix_len
            need = round_up(extend, ps) + r.sampling_params.max_new_tokens - len(r.output_ids) + ps
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
        pl = [r.prefix_len for r in admitted]
        sl = [r.extend_end for r in admitted]
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
        cur = [r.kv.kv_committed_len for r in running]
        idx_t = torch.tensor([r.kv.req_pool_idx for r in running])
        if ps == 1:
            loc = sg["alloc_token_slots"](self.cache, len(running))
        else:
            cur_t = torch.tensor(cur)
            last = rtp.req_to_token[idx_t, cur_t - 1].to(torch.int64)
            loc = sg["alloc_paged_token_slots_decode"](self.cache, cur_t + 1, cur_t + 1, last)
        rtp.write((idx_t, torch.tensor(cur)), loc.to(torch.int32))
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
    pc = time.perf_counter
    rec = {k: [] for k in ("decode_alloc", "process", "step+process")}
    gc.collect()
    gc.disable()
    for i in range(steps):
        t0 = pc()
        loop.decode(running)
        t1 = pc()
        running = loop.after_decode(running)
        t2 = pc()
        assert len(running) == DECODE_BS
        if i >= WARMUP:
            rec["decode_alloc"].append(t1 - t0)
            rec["process"].append(t2 - t1)
            rec["step+process"].append(t2 - t0)
    gc.enable()
    return summarize(rec)


def sglang_extend(sg: dict, page_size: int, seed: int, repeats: int) -> dict:
    rounds = WARMUP + repeats
    prefixes, prompts = extend_prompts(seed, rounds)
    loop = SglangLoop(sg, page_size, (rounds + 4) * EXTEND_BS * PREFIX_LEN, EXTEND_BS + 4,
                      PROMPT_LEN + 2 * page_size)
    waiting = [loop.new_req(f"prefix{i}", p, 1) for i, p in enumerate(prefixes)]
    admitted, _ = loop.admit(waiting, [], EXTEND_BS)
    loop.prefill(admitted)
    loop.after_prefill(admitted, [])
    pc = time.perf_counter
    rec = {k: [] for k in ("match", "admission", "prefill_alloc", "step", "finish", "step+process")}
    gc.collect()
    gc.disable()
    for k in range(rounds):
        waiting = [loop.new_req(f"r{k}.{i}", p, 1) for i, p in enumerate(prompts[k])]
        running: list = []
        t0 = pc()
        admitted, match_s = loop.admit(waiting, running, EXTEND_BS)
        t1 = pc()
        loop.prefill(admitted)
        t2 = pc()
        loop.after_prefill(admitted, running)
        t3 = pc()
        assert len(admitted) == EXTEND_BS and not running
        assert all(r.prefix_len == PREFIX_LEN for r in admitted), "every request must hit its prefix"
        if k >= WARMUP:
            for name, v in (("match", match_s), ("admission", t1 - t0), ("prefill_alloc", t2 - t1),
                            ("step", t2 - t0), ("finish", t3 - t2), ("step+process", t3 - t0)):
                rec[name].append(v)
    gc.enable()
    return summarize(rec)


def run_driver(driver, sg: dict, workloads: dict, page_size: int, quick: bool) -> dict:
    """The driver's own replay of both shapes. Its Timer sums alloc_s over prefill and decode; a Timer that
    also keeps every sample (one per prefill batch or decode step, one match/release per request) gives
    the per-step figures: medians over the measured batches/steps, the first (cold) batch left out."""
    from argparse import Namespace

    class RecordingTimer(driver.Timer):
        def __init__(self) -> None:
            super().__init__()
            self.samples: dict[str, list[float]] = {}
            timers.append(self)

        def add(self, key, dt):
            super().add(key, dt)
            self.samples.setdefault(key, []).append(dt)

    timers: list = []

    def run(name: str, max_running: int, budget: int) -> tuple[dict, dict]:
        args = Namespace(page_size=page_size, token_budget=budget, max_running=max_running,
                         max_prefill_tokens=1 << 20, eviction_policy="lru", policy="fcfs", new_token_ratio=1.0,
                         check=False)
        plain, driver.Timer = driver.Timer, RecordingTimer
        try:
            result = driver.run_one("radix", driver.load_workload(workloads[name]), args, sg)
        finally:
            driver.Timer = plain
        return result, timers[-1].samples

    rounds, steps = DRIVER_ROUNDS[quick], DRIVER_DECODE_STEPS[quick]
    ext, ext_t = run("extend", EXTEND_BS, (rounds + 4) * EXTEND_BS * PREFIX_LEN)
    dec, dec_t = run("decode", DECODE_BS, 1 << 20)
    assert ext["prefill_batches"] == rounds + 1 and ext["evicted_tokens"] == 0
    assert ext["cached_tokens"] == rounds * EXTEND_BS * PREFIX_LEN, "every measured request must hit its prefix"
    assert dec["prefill_batches"] == 1 and dec["decode_steps"] == steps and dec["evicted_tokens"] == 0

    def per_batch(samples: list[float]) -> list[float]:  # one sample per request -> one sum per batch
        return [sum(samples[i:i + EXTEND_BS]) for i in range(EXTEND_BS, len(samples), EXTEND_BS)]

    keep = ("num_requests", "hit_rate", "prefill_batches", "decode_steps", "evicted_tokens", "invariant_ok",
            "cache_ops_breakdown_s", "replay_wall_s")
    return {
        "extend_step_median_us": {"match_s": med_us(per_batch(ext_t["match_s"])),
                                  "alloc_s": med_us(ext_t["alloc_s"][1:]),
                                  "release_s": med_us(per_batch(ext_t["release_s"]))},
        "decode_step_median_us": {"alloc_s": med_us(dec_t["alloc_s"][1:])},
        "extend_batches": rounds, "decode_steps": steps,
        "runs": {"extend": {k: ext[k] for k in keep}, "decode": {k: dec[k] for k in keep}},
    }


def sglang_main(args) -> None:
    driver = _peer.load_driver(args.sglang_driver)
    sg = driver.import_sglang()
    sg["torch"].set_num_threads(TORCH_THREADS)
    import sglang

    repeats = REPEATS[args.quick]
    out = {"version": getattr(sglang, "__version__", "?"), "import_s": round(sg["import_s"], 1),
           "torch_threads": sg["torch"].get_num_threads()}
    workloads = json.loads(args.workloads)
    for ps in PAGE_SIZES:
        out[f"page_size={ps}"] = {"decode": sglang_decode(sg, ps, args.seed, repeats),
                                  "extend": sglang_extend(sg, ps, args.seed, repeats),
                                  "driver_check": run_driver(driver, sg, workloads, ps, args.quick)}
    print(json.dumps(out))


# ---- report --------------------------------------------------------------------------------------------------
NO_METADATA = "cache work only, no metadata"
# (row, kvmem key, SGLang key or None, what the SGLang figure covers)
DECODE_ROWS = (
    ("prepare_for_decode", "prepare_for_decode_us", "decode_alloc_us", "capacity check + alloc + req_to_token write"),
    ("metadata", "metadata_us", None, "none on CPU (FlashInfer metadata is built on the GPU)"),
    ("batch_level (prepare + metadata)", "batch_level_us", "decode_alloc_us", NO_METADATA),
    ("step()", "step_us", "decode_alloc_us", "capacity check + alloc + req_to_token write"),
    ("process_batch_result", "process_batch_result_us", "process_us", "append token + finished check"),
    ("step() + process_batch_result", "step+process_us", "step+process_us", "decode step + append"),
    ("full (step + metadata + process)", "full_us", "step+process_us", NO_METADATA),
)
EXTEND_ROWS = (
    ("match (match_prefix + lock)", "match_us", "match_us", "init_next_round_input + lock"),
    ("prepare_for_extend", "prepare_for_extend_us", "prefill_alloc_us", "alloc_req_slots + slots + row writes"),
    ("metadata", "metadata_us", None, "none on CPU (FlashInfer metadata is built on the GPU)"),
    ("batch_level (prepare + metadata)", "batch_level_us", "prefill_alloc_us", NO_METADATA),
    ("step() (admission + prepare)", "step_us", "step_us", "admission loop + prefill allocation"),
    ("process_batch_result (finish 32)", "process_batch_result_us", "finish_us", "32 x release_kv_cache"),
    ("step() + process_batch_result", "step+process_us", "step+process_us", "admission + allocation + finish"),
    ("full (step + metadata + process)", "full_us", "step+process_us", NO_METADATA),
)


def report(kv: dict, sg: dict) -> dict:
    rows, slower = [], []
    for ps in PAGE_SIZES:
        key = f"page_size={ps}"
        for shape, table in (("decode", DECODE_ROWS), ("extend", EXTEND_ROWS)):
            mine, theirs = kv[key][shape], sg.get(key, {}).get(shape, {})
            for name, kv_key, sg_key, covers in table:
                row = {"row": f"{shape}/{name}", "page_size": ps, "kvmem_us": mine[kv_key],
                       "kvmem_min_us": mine["min"][kv_key]}
                if sg_key and sg_key in theirs:
                    row["sglang_us"] = theirs[sg_key]
                    row["sglang_min_us"] = theirs["min"][sg_key]
                    row["ratio"] = round(theirs[sg_key] / mine[kv_key], 2)
                    row["ratio_min"] = round(theirs["min"][sg_key] / mine["min"][kv_key], 2)
                    # Rows with kvmem's metadata against SGLang's cache work alone are not like for like.
                    if row["ratio"] < 1 and covers != NO_METADATA:
                        slower.append(f"{row['row']} (page {ps})")
                row["sglang_covers"] = covers
                rows.append(row)
    profiles = {f"page_size={ps}/{shape}": kv[f"page_size={ps}"][shape].pop("profile")
                for ps in PAGE_SIZES for shape in ("decode", "extend")}
    return {"rows": rows, "kvmem_slower_rows": slower, "profile_kvmem_top_tottime": profiles,
            "raw": {"kvmem": kv, "sglang": sg}}


def main() -> None:
    ap = _peer.parser(__doc__, f"{REPEATS[True]} repeats instead of {REPEATS[False]}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workloads", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer == "sglang":
        sglang_main(args)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    torch.set_num_threads(TORCH_THREADS)
    t0 = time.perf_counter()
    repeats = REPEATS[args.quick]
    kv = {f"page_size={ps}": {"decode": kvmem_decode(ps, args.seed, repeats),
                              "extend": kvmem_extend(ps, args.seed, repeats)} for ps in PAGE_SIZES}
    with tempfile.TemporaryDirectory(prefix="bench_scheduler_") as workdir:
        workloads = write_driver_workloads(Path(workdir), args.seed, args.quick)
        sg = _peer.run_peer(__file__, args, "--seed", str(args.seed), "--workloads", json.dumps(workloads))
    out = report(kv, sg)
    out["meta"] = {"cpus": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2), "torch": torch.__version__,
                   "numpy": np.__version__, "torch_threads": torch.get_num_threads(),
                   "python": platform.python_version(), "sglang": sg.get("version", sg.get("error")),
                   "seed": args.seed, "quick": args.quick, "repeats": repeats, "warmup": WARMUP,
                   "wall_s": round(time.perf_counter() - t0, 1)}
    _peer.emit(out, args.out)


if __name__ == "__main__":
    main()
