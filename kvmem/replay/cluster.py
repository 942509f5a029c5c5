"""The cluster replay: N simulated engines behind a router that sees only their KV events and their loads.

Each replica is the engine of a single replay (`simulator.ReplicaSim`: its own pools, tree, tiers, simulated
clock and cost model), and reports its KV events to an `EventCollector`. Each request is routed
when it arrives by a `kvmem.router.Router`, whose `BlockIndex` the replicas' event batches alone feed, and
whose loads the router keeps itself, as a router beside real engines would:

- a step's results (its event batch, its finished requests, the pages its running requests pin) reach the
  router when the step ends on the replica's clock, as an engine publishes once per step: a request that
  arrives while a step runs is routed on the state from before that step;
- running requests: +1 when routed there, -1 when the step that finishes it reaches the router (SGLang's
  router counts the requests it has in flight on each worker);
- prefill tokens: the prompt tokens beyond the prefix the index showed cached there, from routing until the
  step that prefills the prompt's last chunk reaches the router (Dynamo's queued prefill work);
- active blocks: the pages the replica's running requests pin, as of its last step the router has seen.

Replicas step in simulated-time order (the earliest clock first) up to the next arrival; a replica whose
step ends past it waits for the arrival to be routed. A cluster of one replays exactly as `simulator.replay`.

The router hashes a prompt's whole pages as the replicas name them (`kvmem.page_hash`), up to the prompt's
last token (which a replica always recomputes), only for the policies that read the index.

With a storage tier (`ReplayConfig.storage`), every replica opens the same store (or shares the one simulated
store), so the pages one replica wrote are read by any other: a global pool, Mooncake's. The index does not see
that pool (a replica reports no event for a shared store's pages, see `kvmem.tiers.hiradix_cache`); before each
routing every replica's queued writes are finished, so the store holds what the steps run so far wrote and a
replay repeats exactly.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvmem._checks import check_int
from kvmem._paging import TOKEN_BYTES
from kvmem.events import EventBatch, EventCollector
from kvmem.page_hash import chain_page_digests, event_hashes, namespace_prefix
from kvmem.replay.cluster_report import ClusterReport, EventCounts
from kvmem.replay.config import ReplayConfig
from kvmem.replay.cost import RooflineCost, StepCost, cost_model
from kvmem.replay.latency import SLO, RequestTimes
from kvmem.replay.simulator import (
    ReplicaSim,
    StepOutcome,
    _arrival_order,
    _progress_bar,
    is_simulated,
    open_storage,
    requests_arrival,
)
from kvmem.replay.traces import TraceRequest
from kvmem.router import POLICIES, ReplicaLoad, Router

# The policies that read the block index: only for them does the router hash each prompt.
INDEX_POLICIES = ("cache-aware", "kv-overlap")


@dataclass
class _StepResult:
    """What one replica step hands the router when it ends (at `ts` on the replica's clock)."""

    ts: float
    batch: EventBatch | None
    finished: list
    prefilled: list
    pinned_pages: int


class Replica:
    """One simulated engine (a `ReplicaSim`: scheduler, cache, tiers, clock, report), its events, and the step
    results the router has not seen yet."""

    def __init__(self, rank: int, config: ReplayConfig, cost: StepCost | RooflineCost, storage=None,
                 times: RequestTimes | None = None) -> None:
        self.rank = rank
        self.times = times  # where the first and last tokens of its requests are noted
        self.collector = EventCollector(clock=lambda: self.sim.clock)
        self.sim = ReplicaSim(config, cost, event_sink=self.collector, name=f"replica {rank}", storage=storage)
        self.busy_s = 0.0
        self.prefill_s = 0.0
        self.routed = 0
        self.results: deque[_StepResult] = deque()  # steps that ended here, not yet seen by the router

    @property
    def clock(self) -> float:
        return self.sim.clock

    def add(self, rid: int, request: TraceRequest, arrival_s: float) -> bool:
        """Queues a routed request; False (counted as rejected) when it can never run here."""
        sim = self.sim
        sim.clock = max(sim.clock, arrival_s)  # a replica that was idle starts when the request arrives
        if not sim.add_request(rid, request, arrival_s):
            return False
        self.routed += 1
        return True

    def step(self, until: float) -> int:
        """Runs the replica's next step (or a run of decode steps: see ReplicaSim.step) from its clock,
        queues the results for the router; returns the requests it finished."""
        outcome = self.run_step(until)
        times = self.times
        if times is not None:
            for req in outcome.prefilled:
                times.first_token(req.rid, self.sim.clock)
            for req in outcome.finished:
                times.finished(req.rid, self.sim.clock, len(req.output_ids))
        self.publish([r.rid for r in outcome.finished], [r.rid for r in outcome.prefilled])
        return len(outcome.finished)

    def run_step(self, until: float) -> StepOutcome:
        """ReplicaSim.step, its time counted as busy (and as prefill when it prefilled a prompt)."""
        sim = self.sim
        start = sim.clock
        outcome = sim.step(until)
        if outcome.prefilled:
            self.prefill_s += sim.clock - start
        self.busy_s += sim.clock - start
        return outcome

    def publish(self, finished: list, prefilled: list) -> None:
        """Queues for the router what ended by the replica's clock: its KV events since the last, the requests that
        `finished` (ids) and those whose prompt was `prefilled`, and the pages its running requests pin."""
        sched = self.sim.sched
        used = sched.token_allocator.size - sched.token_allocator.available_size()
        pinned = (used - sched.tree_cache.evictable_size()) // sched.page_size
        self.results.append(_StepResult(self.sim.clock, self.collector.take_batch(), finished, prefilled, pinned))

    def drain_storage_writes(self) -> None:
        link = getattr(self.sim.sched.tree_cache, "storage_link", None)
        if link is not None:
            link.drain_writes()


class Fleet:
    """Replicas behind one `policy` router (see the module docstring): the loads the router keeps of them, the step
    results it has read, and the routing itself. A cluster replay has one; a disaggregated one, one per side."""

    def __init__(self, replicas: list[Replica], policy: str, page_size: int, **router_params) -> None:
        self.replicas = replicas
        self.router = Router(policy, len(replicas), block_size=page_size, **router_params)
        self.page_size = page_size
        self.events = EventCounts()
        self.reads_index = policy in INDEX_POLICIES
        self.index_cached_tokens = 0
        self.routing_s = 0.0
        n = len(replicas)
        self._running = [0] * n
        self._prefill_tokens = [0] * n
        self._active_blocks = [0] * n
        self._queued_prefill: dict[int, int] = {}  # rid -> the prefill tokens its routing added
        self._key_prefix = namespace_prefix(None)

    def deliver(self, now: float) -> None:
        """Hands the router every step result that has ended by `now`."""
        index = self.router.index
        for replica in self.replicas:
            results, rank = replica.results, replica.rank
            while results and results[0].ts <= now:
                result = results.popleft()
                if result.batch is not None:
                    index.apply(rank, result.batch)
                    self.events.count(result.batch)
                for rid in result.prefilled:
                    self._prefill_tokens[rank] -= self._queued_prefill.pop(rid, 0)
                self._running[rank] -= len(result.finished)
                self._active_blocks[rank] = result.pinned_pages

    def choose(self, prompt: np.ndarray) -> tuple[int, int]:
        """The replica for `prompt` ([input_len] int64), and the prompt tokens the index shows cached there."""
        t0 = time.perf_counter()
        hashes = self._prompt_hashes(prompt) if self.reads_index else []
        loads = [ReplicaLoad(*load) for load in zip(self._running, self._active_blocks, self._prefill_tokens)]
        rank = self.router.route(hashes, loads, len(prompt))
        cached = self.router.index.prefix_overlaps(hashes)[rank] * self.page_size if hashes else 0
        self.routing_s += time.perf_counter() - t0
        return rank, cached

    def routed(self, rank: int, rid: int, prefill_tokens: int, cached: int) -> None:
        """Counts a request queued on `rank`: running there, with `prefill_tokens` to prefill there until a result
        names it prefilled; `cached` tokens the index showed."""
        self.index_cached_tokens += cached
        self._running[rank] += 1
        self._queued_prefill[rid] = prefill_tokens
        self._prefill_tokens[rank] += prefill_tokens

    def _prompt_hashes(self, prompt: np.ndarray) -> list[int]:
        """The event hashes of the whole pages of the prompt before its last token (what a replica can hit)."""
        page_bytes = self.page_size * TOKEN_BYTES
        key = memoryview(prompt).cast("B")[:(len(prompt) - 1) * TOKEN_BYTES]
        key = key[:len(key) - len(key) % page_bytes]
        if not key:
            return []
        return event_hashes(chain_page_digests(self._key_prefix, None, key, page_bytes))

    def report(self, makespan_s: float, replay_s: float, times: RequestTimes | None = None,
               slo: SLO | None = None) -> ClusterReport:
        """The replicas' reports (closing them) and the routing, as a ClusterReport; with `slo`, the requests' latency
        and goodput (`times`) too."""
        replicas = self.replicas
        return ClusterReport(
            policy=self.router.policy, reports=[r.sim.close() for r in replicas],
            routed=[r.routed for r in replicas], busy_seconds=[r.busy_s for r in replicas],
            prefill_seconds=[r.prefill_s for r in replicas], makespan_seconds=makespan_s, events=self.events,
            index_cached_tokens=self.index_cached_tokens if self.reads_index else None,
            routing_seconds=self.routing_s, replay_seconds=replay_s,
            latency=None if times is None or slo is None else times.to_json(slo))


class ClusterReplay:
    """A replay of `requests` on `replicas` engines, each configured by `config`, behind a `policy` router
    (one of `kvmem.router.POLICIES`); `run()` returns a `ClusterReport`. See the module docstring.

    Raises ValueError (before building anything) for a replica count below 1 or an unknown policy.
    `router_params` are the policy's parameters (see `kvmem.router.Router`); `slo`: the objectives its report's
    goodput counts (see `kvmem.replay.latency`).

    >>> from kvmem.replay.synthetic import shared_system_prompts
    >>> trace = shared_system_prompts(40, num_prompts=4, prompt_len=512, arrival_rate=5.0)
    >>> config = ReplayConfig(capacity_tokens=1536, max_context_len=trace.max_context_len, page_size=16)
    >>> report = ClusterReplay(trace, config, replicas=2, policy="cache-aware").run()
    >>> report.routed, round(report.hit_rate, 2), round(report.load_imbalance, 2)
    ([18, 22], 0.62, 1.1)
    """

    def __init__(self, requests: Sequence[TraceRequest], config: ReplayConfig, replicas: int, policy: str, *,
                 cost: StepCost | RooflineCost | None = None, progress: bool = False, slo: SLO | None = None,
                 **router_params) -> None:
        replicas = check_int("replicas", replicas, minimum=1)
        check_policy("policy", policy)
        if not isinstance(config, ReplayConfig):
            raise TypeError(f"config must be a ReplayConfig, got {type(config).__name__}")
        if slo is not None and not isinstance(slo, SLO):
            raise TypeError(f"slo must be a kvmem.replay.latency.SLO, got {type(slo).__name__}")
        config.check_host_memory(replicas)
        self.requests = requests
        self.config = config
        self.progress = progress
        self.slo = slo
        cost = cost_model(config) if cost is None else cost
        # A simulated store lives in this process: the replicas share one, as they would a real store's pages.
        shared = open_storage(config) if is_simulated(config) else None
        self.times = RequestTimes()
        self.replicas = [Replica(r, config, cost, shared, self.times) for r in range(replicas)]
        self.fleet = Fleet(self.replicas, policy, config.page_size, **router_params)
        self.router = self.fleet.router
        self._clocks: list[tuple[float, int]] = []  # (clock, rank) of the replicas with work, a heap
        self._bar = None
        self._ran = False

    def run(self) -> ClusterReport:
        """Replays every request; returns the cluster's report. A ClusterReplay runs once (its replicas keep
        what they cached): a second call raises RuntimeError."""
        if self._ran:
            raise RuntimeError("this ClusterReplay has run; build a new one to replay again")
        self._ran = True
        t_start = time.perf_counter()
        requests, honour = self.requests, self.config.honour_arrivals
        self._bar = _progress_bar(len(requests), self.progress)
        for i in _arrival_order(requests, honour):
            arrival = requests_arrival(requests, int(i)) if honour else 0.0
            self._advance(arrival)
            self._deliver(arrival)
            self._route(int(i), arrival)
        self._advance(float("inf"))
        self._deliver(float("inf"))
        if self._bar is not None:
            self._bar.close()
        return self.fleet.report(max(r.clock for r in self.replicas), time.perf_counter() - t_start, self.times,
                                 self.slo)

    # ---- time ---------------------------------------------------------------------------------------
    def _advance(self, until: float) -> None:
        """Runs, in clock order, every step that starts before `until`."""
        clocks, replicas, bar = self._clocks, self.replicas, self._bar
        while clocks and clocks[0][0] < until:
            rank = heapq.heappop(clocks)[1]
            replica = replicas[rank]
            finished = replica.step(until)
            if bar is not None and finished:
                bar.update(finished)
            if not replica.sim.is_idle():
                heapq.heappush(clocks, (replica.clock, rank))

    def _deliver(self, now: float) -> None:
        self.fleet.deliver(now)

    # ---- routing ------------------------------------------------------------------------------------
    def _route(self, i: int, arrival: float) -> None:
        trace_req = self.requests[i]
        prompt = trace_req.input_ids.astype(np.int64)
        rank, cached = self.fleet.choose(prompt)
        for replica in self.replicas:  # the shared store holds every write of the steps run so far
            replica.drain_storage_writes()
        replica = self.replicas[rank]
        was_idle = replica.sim.is_idle()
        self.times.arrived(i, arrival)
        if not replica.add(i, trace_req, arrival):
            if self._bar is not None:
                self._bar.update(1)
            return
        self.fleet.routed(rank, i, len(prompt) - cached, cached)
        if was_idle:
            heapq.heappush(self._clocks, (replica.clock, rank))


def check_policy(name: str, policy: str) -> str:
    """ValueError naming `name` unless `policy` is one of kvmem.router.POLICIES."""
    if policy not in POLICIES:
        raise ValueError(f"unknown routing policy {policy!r} ({name}); choose one of {', '.join(POLICIES)}")
    return policy


def replay_cluster(requests: Sequence[TraceRequest], config: ReplayConfig, replicas: int, policy: str, *,
                   progress: bool = False, cost: StepCost | RooflineCost | None = None, slo: SLO | None = None,
                   **router_params) -> ClusterReport:
    """Replays `requests` on `replicas` engines configured by `config` behind a `policy` router (see
    `ClusterReplay`) and returns what it measured."""
    return ClusterReplay(requests, config, replicas, policy, cost=cost, progress=progress, slo=slo,
                         **router_params).run()
