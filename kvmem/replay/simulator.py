"""The trace-replay simulator: requests through kvmem's Scheduler and RadixCache with a fake model.

No model runs. Each step's batch is "executed" by handing back the request's next output token (the
trace's output ids, or `synthetic_output_ids` of its prompt), and a simulated clock advances by a cost model
(`kvmem.replay.cost`: the fixed StepCost, or a roofline of a model on a GPU), so that arrivals can be
honoured and times to first token measured. Only the order of events matters for the cache; the cost model
sets how many requests overlap in time, as a server of that speed would see them.

`ReplicaSim` is one simulated server with its own clock; `replay` drives one through a trace (a cluster
replay drives several, each with `run_until` the next arrival). Every call that decides a hit is the real
one (admission, match, insert, eviction, retraction), but the simulator skips what only a model needs: a
run of decode steps in which nothing can be admitted and nothing finishes before the last goes through
`kvmem.replay.decode_runs.ReplayScheduler.run_decode` (the same evictions at the same steps, no batch
tensors), and output tokens are drawn per request in bulk.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from kvmem._checks import check_number
from kvmem.allocator import PagedTokenAllocator, TokenAllocator
from kvmem.batch import ForwardMode, Req
from kvmem.disagg.request_memory import preallocate, release
from kvmem.events.schema import KVCacheEvent
from kvmem.hybrid import HybridRadixCache, HybridTokenAllocator, StateSlotPool
from kvmem.radix_cache import RadixCache
from kvmem.replay.belady import oracle_policies
from kvmem.replay.config import ReplayConfig
from kvmem.replay.cost import RooflineCost, StepCost, cost_model
from kvmem.replay.decode_runs import ReplayScheduler
from kvmem.replay.report import ReplayReport
from kvmem.replay.traces import TraceRequest
from kvmem.req_to_token import ReqToTokenPool
from kvmem.scheduler import SchedulerConfig
from kvmem.storage import SimStore, open_store, parse_store_spec
from kvmem.storage.page_format import CHECKSUM_BYTES, HEADER_BYTES
from kvmem.tiers import HiRadixCache, HostSlotPool
from kvmem.timing import PhaseTimer

__all__ = ["ReplicaSim", "StepCost", "build_scheduler", "replay"]
MAX_SKIP_NOTES = 10  # requests that can never run, named one by one on stderr; the rest are counted


def build_scheduler(config: ReplayConfig, timer: PhaseTimer | None = None,
                    event_sink: Callable[[KVCacheEvent], None] | None = None,
                    policies: dict | None = None, storage=None) -> ReplayScheduler:
    """The pools, tree and scheduler a replay of `config` runs on; the tree reports its KV events to
    `event_sink` (a cluster replay's replicas feed their router that way), `policies` overrides the tiers'
    eviction policies with objects (`kvmem.replay.belady.oracle_policies`), and `storage` is a store to use
    instead of opening config.storage's (a cluster's replicas share one simulated store).

    Rows are as long as the longest request that can run: a request longer than the KV capacity can never
    be admitted, so one absurd request in a trace is rejected instead of sizing every row after it.
    """
    config.check_host_memory()
    ps = config.page_size
    capacity = config.capacity_tokens // ps * ps
    pool = ReqToTokenPool(config.max_running, config.context_len)
    alloc = TokenAllocator(capacity) if ps == 1 else PagedTokenAllocator(capacity, ps)
    policies = {"eviction_policy": config.eviction_policy, "pin_budget": config.pin_budget, **(policies or {})}
    hybrid = config.hybrid
    if hybrid is not None:
        if event_sink is not None:
            raise ValueError("KV events with a hybrid model's window-aware pools, which publish none: replay the "
                             "cluster with full_attention_pools")
        window = hybrid.sliding_window if hybrid.window_layers else None
        if window is not None:
            window = min(window, config.context_len)  # a window no request outgrows holds every token anyway
            alloc = HybridTokenAllocator(capacity, config.hybrid_window_tokens, ps)
        states = StateSlotPool(config.hybrid_state_slots) if hybrid.linear_layers else None
        tree = HybridRadixCache(pool, alloc, ps, window=window, state_pool=states, **policies)
    elif config.host_capacity_tokens is None:
        tree = RadixCache(pool, alloc, page_size=ps, event_sink=event_sink, **policies)
    else:
        # A replay waits for every prefetch: its clock, not the store's speed, decides what arrives in time.
        tree = HiRadixCache(pool, alloc, HostSlotPool(config.host_pages * ps, ps), page_size=ps,
                            write_policy=config.write_policy,
                            storage=open_storage(config) if storage is None else storage,
                            prefetch_policy="wait_complete", event_sink=event_sink, **policies)
    return ReplayScheduler(pool, alloc, tree, SchedulerConfig(
        schedule_policy=config.schedule_policy, max_running_requests=config.max_running,
        chunked_prefill_size=config.chunked_prefill_size, cache_decode_pages=config.cache_decode_pages,
        in_batch_prefix_caching=config.in_batch_prefix_caching),
        timer=timer)


def open_storage(config: ReplayConfig):
    """The storage tier of `config` (None without one), holding at least one page when capped. A simulated store
    keeps the pages' keys; a real one, under the replay's host tier of slots, stores each page's header alone:
    keys, presence and persistence across runs without KV bytes."""
    if config.storage is None:
        return None
    capacity = config.store_capacity_tokens
    pages = None if capacity is None else max(1, capacity // config.page_size)
    if is_simulated(config):
        return SimStore(None if pages is None else pages * config.page_size)
    return open_store(config.storage, metadata_server=config.storage_metadata,
                      capacity_bytes=None if pages is None else pages * (HEADER_BYTES + CHECKSUM_BYTES))


def is_simulated(config: ReplayConfig) -> bool:
    """Whether `config`'s storage tier is a simulated store."""
    return config.storage is not None and parse_store_spec(config.storage)[0] == "sim"


class StepOutcome(NamedTuple):
    """What a `ReplicaSim.step` ended: the requests it finished, and those whose prompt it finished prefilling."""

    finished: list[Req]
    prefilled: list[Req]


class ReplicaSim:
    """One simulated server: a Scheduler over its own pools and tree, a fake model, and a clock.

    Requests arrive with `add_request` (at the replica's clock); `run_until(t)` takes steps while the clock is
    before `t`, each step advancing it by `cost`; `close()` returns the report. A cluster of replicas, each
    with its own clock, routes every arrival to one of them after running them all until its time. `storage`: a
    store to use instead of opening config.storage's (see `build_scheduler`).

    >>> from kvmem.replay.config import ReplayConfig
    >>> from kvmem.replay.traces import TraceRequest
    >>> sim = ReplicaSim(ReplayConfig(capacity_tokens=4096, max_context_len=64))
    >>> sim.add_request(0, TraceRequest(list(range(1, 33)), output_len=4))
    True
    >>> sim.run_until(1.0)              # the prefill and three decode steps, 30 ms each by StepCost
    >>> round(sim.clock, 5), sim.is_idle()
    (0.12064, True)
    >>> sim.add_request(1, TraceRequest(list(range(1, 40)), output_len=2))   # shares 32 prompt tokens
    True
    >>> sim.run_until(math.inf); report = sim.close()
    >>> report.cached_tokens, report.prompt_tokens
    (32, 71)
    """

    def __init__(self, config: ReplayConfig, cost: StepCost | RooflineCost | None = None, *,
                 progress=None, event_sink: Callable[[KVCacheEvent], None] | None = None, name: str = "",
                 policies: dict | None = None, storage=None) -> None:
        self.config = config
        self._note = f"kvmem-replay: {name}: " if name else "kvmem-replay: "  # how its notes on stderr start
        self.cost = cost_model(config) if cost is None else cost
        self.timer = PhaseTimer()
        self.sched = build_scheduler(config, self.timer, event_sink, policies, storage)
        self.clock = 0.0
        self.report = ReplayReport(capacity_tokens=self.sched.token_allocator.size, cost_model=self.cost.name,
                                   num_gpus=self.cost.num_gpus)
        if config.host_capacity_tokens is not None:
            self.report.host_capacity_tokens = config.host_pages * config.page_size
        self._hybrid = self.sched.tree_cache if isinstance(self.sched.tree_cache, HybridRadixCache) else None
        if self._hybrid is not None:
            self.report.start_hybrid(self._hybrid)
        self._progress = progress
        self._outputs: dict = {}     # rid -> the output tokens it generates, a list of ints
        self._arrival: dict = {}     # rid -> arrival time, until its first token
        self._admitted: set = set()  # rids admitted at least once (the hit rate counts first admissions)
        self._live: set = set()      # rids holding memory now (admitted, not finished nor retracted)
        # rid -> a request holding memory outside the scheduler's loop: on a prefill side from its hand-off until
        # its KV has left, on a decode side from its pre-allocation until its KV has arrived (disaggregation).
        self.outside: dict = {}
        self._cache_s = 0.0
        self._t_start = time.perf_counter()

    def is_idle(self) -> bool:
        return self.sched.is_idle()

    def add_request(self, rid, request: TraceRequest, arrival: float | None = None) -> bool:
        """Queues `request`, arrived at `arrival` (default: now; it may be earlier, during the step that just
        ended, and its time to first token counts from then); False (counted in the report's `rejected`, with a
        note on stderr) when it can never run here (longer than max_context_len or the KV capacity)."""
        if arrival is not None and not check_number("arrival", arrival) <= self.clock:
            raise ValueError(f"arrival {arrival} is after the replica's clock {self.clock}: run_until it first")
        if self.report.start_s is None:
            self.report.start_s = self.clock if arrival is None else arrival
        try:
            self.sched.add_request(Req(rid, request.input_ids, request.output_len))
        except ValueError as e:
            self.report.rejected += 1
            if self.report.rejected <= MAX_SKIP_NOTES:
                print(f"{self._note}skipped: {e}", file=sys.stderr)
            if self._progress is not None:
                self._progress.update(1)
            return False
        self._outputs[rid] = request.output_tokens().tolist()
        self._arrival[rid] = self.clock if arrival is None else arrival
        return True

    def run_until(self, t: float) -> None:
        """Steps while the clock is before `t` and there is work; a run of decode steps stops at the first that
        would start at or after `t`."""
        while self.clock < t and not self.sched.is_idle():
            self.step(t)

    def step(self, until: float = math.inf) -> StepOutcome:
        """Takes the next scheduler step, or a run of pure decode steps (see ReplayScheduler.pure_decode_steps): the
        first, and those after it that end by `until`; returns what ended in it."""
        t0 = time.perf_counter()
        steps = self.sched.pure_decode_steps()  # it may rank the waiting window: cache time, as a step's ranking
        self._cache_s += time.perf_counter() - t0
        if steps:
            return self._decode_run(steps, until)
        return self._step()

    def _step(self) -> StepOutcome:
        sched, report, cost = self.sched, self.report, self.cost
        t0 = time.perf_counter()
        batch = sched.step()
        self._cache_s += time.perf_counter() - t0
        if batch is None:
            if not sched.is_idle() and not self.outside:  # memory held outside comes back: then the replica waits
                raise RuntimeError("scheduler stalled: requests wait but none can be admitted")
            return StepOutcome([], [])
        extend = batch.forward_mode is ForwardMode.EXTEND
        if extend:
            self.clock += cost.extend_seconds(batch.prefix_lens.numpy(), batch.seq_lens.numpy(),
                                              *self._admit(batch.reqs))
        else:
            for req in batch.retracted:
                self._live.discard(req.rid)
            window = None if cost.window is None else cost.window_keys(batch.seq_lens.numpy())
            self.clock += cost.decode_seconds(batch.batch_size(), int(batch.seq_lens.sum()), window)
        outputs = self._outputs
        tokens = [outputs[r.rid][len(r.output_ids)] for r in batch.reqs]
        # Read before the results: a request's sampled token makes it look partly prefilled again.
        prefilled = [r for r in batch.reqs if not r.is_chunked()] if extend else []
        t0 = time.perf_counter()
        finished = sched.process_batch_result(batch, tokens)
        self._cache_s += time.perf_counter() - t0
        if extend:
            self._first_tokens(batch.reqs)
        self._finished(finished)
        alloc = sched.token_allocator
        report.record_step(self.clock, alloc.size - alloc.available_size(), sched.tree_cache.evictable_size(),
                           len(sched.running))
        if self._hybrid is not None:
            report.sample_hybrid(self._hybrid)
        return StepOutcome(finished, prefilled)

    def _admit(self, reqs: list[Req]) -> tuple[int, int]:
        """Counts the first admission of each request new in this extend batch; returns the tokens that the
        batch's new requests load back from the host tier, and of those, read from storage first."""
        loaded = stored = 0
        for req in reqs:
            if req.rid in self._live:
                continue  # a chunked prompt going on
            self._live.add(req.rid)
            loaded += req.host_hit_len
            stored += req.storage_hit_len
            if req.rid not in self._admitted:
                self._admitted.add(req.rid)
                cached = len(req.prefix_indices)
                self.report.record_admission(len(req.input_ids), cached, req.host_hit_len, req.storage_hit_len)
                self.report.prefill_seconds_saved += self.cost.prefill_seconds_saved(cached)
        return loaded, stored

    def _first_tokens(self, reqs: list[Req]) -> None:
        arrival = self._arrival
        for req in reqs:
            if req.output_ids and req.rid in arrival:
                self.report.ttft_s.append(self.clock - arrival.pop(req.rid))
                self.report.first_token_s.append(self.clock)

    def _finished(self, finished: list[Req]) -> None:
        pin = self.config.pin_prefix_tokens
        for req in finished:
            del self._outputs[req.rid]
            self._live.discard(req.rid)
            self.report.output_tokens += len(req.output_ids)
            if pin:  # its prompt is cached now: pin its head, as a server pins its system prompts
                self.sched.tree_cache.pin(req.input_ids[:pin])
        if self._progress is not None and finished:
            self._progress.update(len(finished))

    def _decode_run(self, steps: int, until: float) -> StepOutcome:
        """Up to `steps` pure decode steps at once, each priced as its own step: the first, and those after it
        that end by `until`. A run's KV events are published when it ends, so its steps after the first end by
        the next arrival, when a cluster's router reads them, as a real engine's would have."""
        sched, cost = self.sched, self.cost
        bs = len(sched.running)
        kv_tokens = sched.running_kv_tokens()
        kv_lens = None if cost.window is None else sched.running_kv_lens()
        times = []
        clock = self.clock
        for j in range(steps):
            kv_tokens += bs  # every request attends to its kv_len tokens and the one it decodes
            window = None if kv_lens is None else cost.window_keys(kv_lens + (j + 1))
            end = clock + cost.decode_seconds(bs, kv_tokens, window)
            if j and end > until:
                break
            clock = end
            times.append(clock)
        t0 = time.perf_counter()
        run = sched.run_decode(len(times), self._outputs)
        self._cache_s += time.perf_counter() - t0
        if run.steps == 0:  # the first step must retract: step() does that
            return self._step()
        self.clock = times[run.steps - 1]
        running_after = np.full(run.steps, bs, dtype=np.int64)
        running_after[-1] = len(sched.running)
        self.report.record_steps(times[:run.steps], run.tokens_used, run.evictable_tokens, running_after)
        if self._hybrid is not None:
            self.report.sample_hybrid(self._hybrid)
        self._finished(run.finished)
        return StepOutcome(run.finished, [])

    # ---- disaggregation: requests that hold memory outside the loop (see kvmem.disagg.request_memory) ----------
    def hand_off(self, req: Req) -> None:
        """Takes a request whose prompt this replica prefilled (it has its first token) out of the loop with its
        memory, for its KV to be sent; `release` frees it once sent."""
        self.sched.hand_off(req)
        del self._outputs[req.rid]
        self._live.discard(req.rid)
        self.outside[req.rid] = req

    def preallocate(self, rid, request: TraceRequest, namespace: str | None = None) -> Req | None:
        """Matches `request`'s prompt in this replica's tree and gives it a row and pages for the rest, for its KV to
        arrive from a prefill side (`kvmem.disagg.preallocate`); None, nothing changed, when memory is short.
        `namespace`: the request's KV-sharing domain (a namespace of its own matches nothing).

        Room stays free or evictable for every output token the running requests, those waiting for their KV and this
        one may still write: a decode step cannot retract its way out of pages held outside the loop.
        """
        sched = self.sched
        ps = sched.page_size
        reserve = sum(r.max_new_tokens - len(r.output_ids) + ps - 1 for r in sched.running)
        reserve += sum(r.max_new_tokens + ps - 1 for r in self.outside.values()) + request.output_len + ps - 1
        req = Req(rid, request.input_ids, request.output_len, namespace=namespace)
        if preallocate(req, sched.req_to_token_pool, sched.token_allocator, sched.tree_cache,
                       reserve_tokens=reserve) is None:
            return None
        self.outside[rid] = req
        return req

    def release(self, rid, *, cache: bool) -> None:
        """Frees the memory of a request held outside the loop (`cache`: its whole pages enter the tree first)."""
        release(self.outside.pop(rid), self.sched.tree_cache, cache=cache)

    def add_prefilled(self, rid, request: TraceRequest) -> list[Req]:
        """Admits a pre-allocated request whose KV has arrived to decoding, with its first token (sampled by the
        prefill side); returns it when that token finished it."""
        req = self.outside.pop(rid)
        outputs = request.output_tokens().tolist()
        req.output_ids.append(outputs[0])
        if self.report.start_s is None:
            self.report.start_s = self.clock
        self.report.record_admission(len(req.input_ids), req.cache_protected_len, 0, 0)
        self._admitted.add(rid)
        self._outputs[rid] = outputs
        self._live.add(rid)
        if not self.sched.add_prefilled_request(req):
            return []
        self._finished([req])
        return [req]

    def check_invariants(self) -> None:
        """The scheduler's invariants, counting the memory that requests outside the loop hold."""
        self.sched.check_invariants(held_outside=self.outside.values())

    def close(self) -> ReplayReport:
        """Finishes the report (counters, tier statistics, timings) and closes the storage tier, if any."""
        sched, report = self.sched, self.report
        if report.rejected > MAX_SKIP_NOTES:
            print(f"{self._note}skipped {report.rejected - MAX_SKIP_NOTES} more requests that can never run here",
                  file=sys.stderr)
        report.evicted_tokens = sched.stats.evicted_tokens
        report.retractions = sched.stats.retractions
        if isinstance(sched.tree_cache, HiRadixCache):
            sched.tree_cache.close()
            report.record_tiers(sched.tree_cache, self.config)
        if self._hybrid is not None:
            report.finish_hybrid(self._hybrid)
        report.cache_op_seconds = self._cache_s
        report.record_cache_phases(self.timer)
        report.replay_seconds = time.perf_counter() - self._t_start
        return report


def replay(requests: Sequence[TraceRequest], config: ReplayConfig, progress: bool = False,
           cost: StepCost | RooflineCost | None = None, policies: dict | None = None) -> ReplayReport:
    """Replays `requests` (a Trace or a list of TraceRequest) and returns what it measured.

    cost: the simulated clock (default: `kvmem.replay.cost.cost_model(config)`, the fixed StepCost unless
    config names a GPU). Requests that can never run (longer than max_context_len or the KV capacity) are
    rejected at admission, counted in the report's `rejected`, and the replay goes on. policies: policy
    objects for the tiers ({"eviction_policy": ..., "host_eviction_policy": ...}), in place of the ones
    `config.eviction_policy` names: a policy that reads the trace, as scripts/continuation_oracle.py's does.
    """
    order = _arrival_order(requests, config.honour_arrivals)
    bar = _progress_bar(len(order), progress)
    policies = oracle_policies(requests, order, config) if policies is None else policies
    sim = ReplicaSim(config, cost, progress=bar, policies=policies)
    for i in order.tolist():
        arrival = requests_arrival(requests, i) if config.honour_arrivals else 0.0
        sim.run_until(arrival)
        sim.clock = max(sim.clock, arrival)  # idle until it arrives
        sim.add_request(i, requests[i], arrival)  # it waits from its arrival, if a step was running then
    sim.run_until(math.inf)
    if bar is not None:
        bar.close()
    return sim.close()


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
