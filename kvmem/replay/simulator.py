"""The trace-replay simulator: requests through kvmem's Scheduler and RadixCache with a fake model.

No model runs. Each step's batch is "executed" by handing back the request's next output token (the
trace's output ids, or `synthetic_output_ids` of its prompt), and a simulated clock advances by a simple
cost model, so that arrivals can be honoured: a step costs `decode_step_s` plus `1 / prefill_tokens_per_s`
per prefilled token. Only the order of events matters for the cache; the model sets how many requests
overlap in time, as a server of that speed would see them.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvmem.allocator import PagedTokenAllocator, TokenAllocator
from kvmem.batch import ForwardMode, Req
from kvmem.radix_cache import RadixCache
from kvmem.replay.belady import oracle_policies
from kvmem.replay.config import ReplayConfig
from kvmem.replay.report import ReplayReport
from kvmem.replay.traces import TraceRequest
from kvmem.req_to_token import ReqToTokenPool
from kvmem.scheduler import Scheduler, SchedulerConfig
from kvmem.storage import open_store
from kvmem.storage.page_format import CHECKSUM_BYTES, HEADER_BYTES
from kvmem.tiers import HiRadixCache, HostSlotPool


@dataclass(frozen=True)
class StepCost:
    """Simulated seconds per step: a fixed part per forward plus prefill tokens at a throughput.

    The defaults are of the order of one 8-GPU node serving a 70B-class model (tens of thousands of
    prefill tokens per second, tens of milliseconds per decode step); change them to model another
    server.
    """

    decode_step_s: float = 0.03
    prefill_tokens_per_s: float = 50_000.0

    def __post_init__(self) -> None:
        if not self.decode_step_s >= 0 or not self.prefill_tokens_per_s > 0:
            raise ValueError(f"need decode_step_s >= 0 and prefill_tokens_per_s > 0, got {self}")


def build_scheduler(config: ReplayConfig, policies: dict | None = None) -> Scheduler:
    """The pools, tree and scheduler a replay of `config` runs on; `policies` overrides the tiers' eviction
    policies with objects (`kvmem.replay.belady.oracle_policies`).

    Rows are as long as the longest request that can run: a request longer than the KV capacity can never
    be admitted, so one absurd request in a trace is rejected instead of sizing every row after it.
    """
    config.check_host_memory()
    ps = config.page_size
    capacity = config.capacity_tokens // ps * ps
    pool = ReqToTokenPool(config.max_running, config.context_len)
    alloc = TokenAllocator(capacity) if ps == 1 else PagedTokenAllocator(capacity, ps)
    policies = {"eviction_policy": config.eviction_policy, "pin_budget": config.pin_budget, **(policies or {})}
    if config.host_capacity_tokens is None:
        tree = RadixCache(pool, alloc, page_size=ps, **policies)
    else:
        # A replay waits for every prefetch: its clock, not the store's speed, decides what arrives in time.
        tree = HiRadixCache(pool, alloc, HostSlotPool(config.host_pages * ps, ps), page_size=ps,
                            write_policy=config.write_policy, storage=open_storage(config),
                            prefetch_policy="wait_complete", **policies)
    return Scheduler(pool, alloc, tree, SchedulerConfig(
        schedule_policy=config.schedule_policy, max_running_requests=config.max_running,
        chunked_prefill_size=config.chunked_prefill_size))


def open_storage(config: ReplayConfig):
    """The storage tier of `config` (None without one). The replay's host tier holds slots, not bytes, so a
    stored page is its header alone: a real store (keys, presence, persistence across runs) without KV bytes."""
    if config.storage is None:
        return None
    capacity = config.storage_capacity_tokens
    return open_store(config.storage, metadata_server=config.storage_metadata,
                      capacity_bytes=None if capacity is None else
                      max(1, capacity // config.page_size) * (HEADER_BYTES + CHECKSUM_BYTES))


def replay(requests: Sequence[TraceRequest], config: ReplayConfig, progress: bool = False,
           cost: StepCost = StepCost()) -> ReplayReport:
    """Replays `requests` (a Trace or a list of TraceRequest) and returns what it measured.

    Requests that can never run (longer than max_context_len or the KV capacity) are rejected at
    admission, counted in the report's `rejected`, and the replay goes on.
    """
    order = _arrival_order(requests, config.honour_arrivals)
    sched = build_scheduler(config, oracle_policies(requests, order, config))
    report = ReplayReport(capacity_tokens=sched.token_allocator.size)
    if config.host_capacity_tokens is not None:
        report.host_capacity_tokens = config.host_pages * config.page_size
    outputs: dict[int, np.ndarray] = {}
    admitted: set[int] = set()
    bar = _progress_bar(len(order), progress)
    clock = 0.0
    next_arrival = 0
    cache_s = 0.0
    t_start = time.perf_counter()
    alloc, tree = sched.token_allocator, sched.tree_cache
    while next_arrival < len(order) or not sched.is_idle():
        if sched.is_idle() and config.honour_arrivals:
            clock = max(clock, requests_arrival(requests, order[next_arrival]))
        while next_arrival < len(order) and (not config.honour_arrivals
                                    or requests_arrival(requests, order[next_arrival]) <= clock):
            next_arrival += 1
            i = int(order[next_arrival - 1])
            trace_req = requests[i]
            try:
                sched.add_request(Req(i, trace_req.input_ids.tolist(), trace_req.output_len))
            except ValueError as e:
                report.rejected += 1
                print(f"kvmem-replay: skipped: {e}", file=sys.stderr)
                if bar is not None:
                    bar.update(1)
                continue
            outputs[i] = trace_req.output_tokens()
        t0 = time.perf_counter()
        batch = sched.step()
        cache_s += time.perf_counter() - t0
        if batch is None:
            if not sched.is_idle():
                raise RuntimeError("scheduler stalled: requests wait but none can be admitted")
            continue
        extend = batch.forward_mode is ForwardMode.EXTEND
        if extend:
            for req in batch.reqs:
                if req.rid not in admitted:
                    admitted.add(req.rid)
                    report.record_admission(len(req.input_ids), len(req.prefix_indices), req.host_hit_len,
                                            req.storage_hit_len)
            clock += cost.decode_step_s + int(batch.extend_lens.sum()) / cost.prefill_tokens_per_s
        else:
            clock += cost.decode_step_s
        tokens = [int(outputs[r.rid][len(r.output_ids)]) for r in batch.reqs]
        t0 = time.perf_counter()
        finished = sched.process_batch_result(batch, tokens)
        cache_s += time.perf_counter() - t0
        for req in finished:
            del outputs[req.rid]
            if config.pin_prefix_tokens:  # its prompt is cached now: pin its head, as a server pins system prompts
                tree.pin(req.input_ids[:config.pin_prefix_tokens])
        if bar is not None and finished:
            bar.update(len(finished))
        report.record_step(clock, alloc.size - alloc.available_size(), tree.evictable_size(), len(sched.running))
    if bar is not None:
        bar.close()
    report.evicted_tokens = sched.stats.evicted_tokens
    report.retractions = sched.stats.retractions
    if isinstance(tree, HiRadixCache):
        tree.close()
        report.record_tiers(tree, config)
    report.cache_op_seconds = cache_s
    report.replay_seconds = time.perf_counter() - t_start
    return report


def requests_arrival(requests: Sequence[TraceRequest], i: int) -> float:
    arrivals = getattr(requests, "arrival_s", None)
    return float(arrivals[i]) if arrivals is not None else requests[i].arrival_s


def _arrival_order(requests: Sequence[TraceRequest], honour_arrivals: bool) -> np.ndarray:
    if not honour_arrivals:
        return np.arange(len(requests))
    arrivals = getattr(requests, "arrival_s", None)
    if arrivals is None:
        arrivals = np.array([r.arrival_s for r in requests], dtype=np.float64)
    return np.argsort(arrivals, kind="stable")


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
