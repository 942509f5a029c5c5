"""The disaggregated replay: P prefill replicas and D decode replicas, each side behind its own router (the cluster
replay's `Fleet`), the KV of every prompt moved from one side to the other over a `KVLink`.

A request's way, as SGLang's disaggregated servers take it (see docs/disagg.md for the library's side):

1. It arrives; the prefill router picks a prefill replica and the decode router a decode replica.
2. The decode replica, at its next step boundary, matches the prompt in its own radix cache and gives the request a
   row and pages for the rest (`ReplicaSim.preallocate`); while its memory is short the request waits there, first
   come first served. Only then does the request join the prefill replica's queue: the prefill side writes into
   pages the decode side has given.
3. The prefill replica prefills the whole prompt (its own cache reuses what it holds), hands the request off with its
   first token (`ReplicaSim.hand_off`) and sends the pages beyond the decode side's match over its link, layer by
   layer while the step that finished the prompt runs (`kv_link`). Its memory is freed, the prompt cached there, once
   the bytes have landed.

With `preallocate="prefilled"` steps 2 and 3 swap, as Mooncake's conductor does: the request joins the prefill queue
on arrival, and once prefilled waits, its KV held on the prefill replica, until the decode replica gives it pages; the
transfer starts then, with nothing left to overlap.
4. The decode replica admits the request at its first step boundary after the landing (`ReplicaSim.add_prefilled`)
   and decodes it. Its TTFT ends at the landing, when the decode side can stream the first token.

Without the decode-side prefix cache (`decode_prefix_cache=False`) every request gets a namespace of its own on the
decode side, so it matches nothing there and its whole prompt is sent, while the decode pools and their eviction stay
as they are.

Time: every replica has its own clock, and the replay runs whichever has the earliest next event (a step, a landing)
before the next arrival. A decode replica's run of decode steps stops before it passes a landing due there or the
clock of a prefill replica with work (whose next hand-off may land there), so that it admits each request at the first
step boundary after its KV landed, as a real decode loop polls between steps.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvmem import sizing
from kvmem._checks import check_int
from kvmem._paging import round_up
from kvmem.replay.cluster import Fleet, Replica, check_policy
from kvmem.replay.cluster_report import ClusterReport
from kvmem.replay.config import ReplayConfig
from kvmem.replay.cost import DEFAULT_MODEL, RooflineCost, StepCost, cost_model, kv_copies
from kvmem.replay.kv_link import KVLink
from kvmem.replay.latency import SLO, RequestTimes
from kvmem.replay.simulator import _arrival_order, _progress_bar, requests_arrival
from kvmem.replay.traces import TraceRequest

PREFILL_OUTPUT_LEN = 2  # a prefill side's request asks for two tokens, so that it still runs after sampling the first
# When the decode side gives a request its pages: on arrival, before the prefill (SGLang: the prefill side waits for
# them), or once prefilled (Mooncake: the KV waits on the prefill side until the decode side has room).
PREALLOCATE = ("arrival", "prefilled")


class PrefillReplica(Replica):
    """A prefill replica: the requests it has handed off, held until their KV has landed, and its link."""

    def __init__(self, *args, link: KVLink, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.link = link
        self.link_free = 0.0
        self.sending: dict[int, float] = {}  # rid -> when its KV lands on the decode side (inf: not sent yet)
        self.waits = False  # for memory its sends hold: its next step comes after a landing

    def settle(self, now: float) -> None:
        """Frees the memory of the requests whose KV has landed by `now` (their prompts stay cached here)."""
        for rid in [rid for rid, landed in self.sending.items() if landed <= now]:
            del self.sending[rid]
            self.sim.release(rid, cache=True)

    def next_event(self) -> float:
        if self.sim.is_idle():
            return math.inf
        return max(self.clock, min(self.sending.values(), default=math.inf)) if self.waits else self.clock


class DecodeReplica(Replica):
    """A decode replica: requests waiting for pages, and those whose KV is on its way (with its landing time once
    their prefill has ended)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pending: deque[tuple[int, float]] = deque()  # (rid, from when) waiting for pages, first come first

        self.landing: dict[int, float | None] = {}   # pre-allocated: rid -> when its KV lands (None: not prefilled)
        # Memory held by pre-allocated requests stops the loop until a landing: the head of `pending` found no
        # pages (`stuck`), or the scheduler could admit none of its waiting requests with none running (`waits`).
        self.stuck = False
        self.waits = False

    def next_landing(self) -> float:
        return min((t for t in self.landing.values() if t is not None), default=math.inf)

    def next_event(self) -> float:
        if self.waits or (self.sim.is_idle() and (not self.pending or self.stuck)):
            return max(self.clock, self.next_landing())
        return self.clock if not self.sim.is_idle() else max(self.clock, self.pending[0][1])


@dataclass
class KVTransferCounts:
    """What the links moved: bytes (and what whole prompts would have been), seconds the links were busy, and the
    seconds from the end of each prompt's prefill to its bytes landing (waiting for decode pages included), summed
    over requests."""

    bytes: int = 0
    whole_prompt_bytes: int = 0
    busy_seconds: float = 0.0
    exposed_seconds: float = 0.0


@dataclass
class PDReport:
    """Metrics of one disaggregated replay: each side's `ClusterReport` (decode side: its hit rate is the decode
    prefix cache's), the KV moved, and the requests' latency (`kvmem.replay.latency`)."""

    prefill: ClusterReport
    decode: ClusterReport
    link: KVLink
    decode_prefix_cache: bool
    preallocate: str
    transfer: KVTransferCounts
    requests: int
    rejected: int
    latency: dict
    replay_seconds: float

    @property
    def kv_bytes_saved_fraction(self) -> float:
        """The share of the whole prompts' KV bytes the decode side's cache kept off the link."""
        whole = self.transfer.whole_prompt_bytes
        return 1.0 - self.transfer.bytes / whole if whole else 0.0

    def to_json(self) -> dict:
        t = self.transfer
        sides = {"prefill": self.prefill.to_json(), "decode": self.decode.to_json()}
        span = self.latency.get("span_s", 0.0)
        out = {
            "prefill_replicas": self.prefill.num_replicas, "decode_replicas": self.decode.num_replicas,
            "prefill_router": self.prefill.policy, "decode_router": self.decode.policy,
            "kv_link_gbps": self.link.gbps, "kv_link_latency_us": self.link.latency_us,
            "decode_prefix_cache": self.decode_prefix_cache, "decode_preallocate": self.preallocate,
            "requests": self.requests, "rejected": self.rejected,
            "kv_transfer_bytes": t.bytes, "kv_transfer_bytes_whole_prompts": t.whole_prompt_bytes,
            "kv_bytes_saved_fraction": round(self.kv_bytes_saved_fraction, 6),
            "kv_transfer_seconds": round(t.busy_seconds, 6), "kv_transfer_exposed_seconds": round(t.exposed_seconds, 6),
            "decode_hit_rate": sides["decode"]["hit_rate"], "prefill_hit_rate": sides["prefill"]["hit_rate"],
            "busy_seconds": {"prefill": round(sum(self.prefill.busy_seconds), 6),
                             "decode": round(sum(self.decode.busy_seconds), 6)},
            "simulated_seconds": round(span, 6),
            **{k: v for k, v in self.latency.items() if k != "span_s"},
            "replay_seconds": round(self.replay_seconds, 6),
        }
        out.update(sides)
        return out


class PDReplay:
    """A replay of `requests` on `prefill_replicas` + `decode_replicas` engines, each configured by `config` (same
    GPUs, same KV capacity), behind a `prefill_router` and a `decode_router` (`kvmem.router.POLICIES`), the KV moved
    over `link` (default: `KVLink()` with the model's layers, one NIC per GPU of a replica); `run()` returns a
    `PDReport`. See the module docstring.

    `preallocate`: when the decode side gives a request its pages (one of `PREALLOCATE`, see the module docstring).

    Raises before building anything: ValueError for a replica count below 1, an unknown policy or preallocate, a
    configuration with a host or storage tier or the belady oracle (not modelled on either side), or a decode pool
    that holds no request of the trace (prompt and output); TypeError for a config, link or slo of the wrong type.

    >>> from kvmem.replay.synthetic import shared_system_prompts
    >>> trace = shared_system_prompts(40, num_prompts=4, prompt_len=512, arrival_rate=5.0)
    >>> config = ReplayConfig(capacity_tokens=4096, max_context_len=trace.max_context_len, page_size=16)
    >>> report = PDReplay(trace, config, 1, 2).run()
    >>> report.requests, round(report.kv_bytes_saved_fraction, 2)
    (40, 0.72)
    """

    def __init__(self, requests: Sequence[TraceRequest], config: ReplayConfig, prefill_replicas: int,
                 decode_replicas: int, *, prefill_router: str = "cache-aware", decode_router: str = "cache-aware",
                 link: KVLink | None = None, decode_prefix_cache: bool = True, preallocate: str = "arrival",
                 slo: SLO | None = None, cost: StepCost | RooflineCost | None = None, progress: bool = False) -> None:
        check_int("prefill_replicas", prefill_replicas, minimum=1)
        check_int("decode_replicas", decode_replicas, minimum=1)
        check_policy("prefill_router", prefill_router)
        check_policy("decode_router", decode_router)
        if preallocate not in PREALLOCATE:
            raise ValueError(f"preallocate must be one of {', '.join(PREALLOCATE)}, got {preallocate!r}")
        if not isinstance(config, ReplayConfig):
            raise TypeError(f"config must be a ReplayConfig, got {type(config).__name__}")
        if link is not None and not isinstance(link, KVLink):
            raise TypeError(f"link must be a kvmem.replay.kv_link.KVLink, got {type(link).__name__}")
        if slo is not None and not isinstance(slo, SLO):
            raise TypeError(f"slo must be a kvmem.replay.latency.SLO, got {type(slo).__name__}")
        check_disaggregable(config)
        check_decode_pool(requests, config)
        cost = cost_model(config) if cost is None else cost
        model = config.model or DEFAULT_MODEL
        link = link_for(config) if link is None else link
        self.requests, self.config, self.link, self.slo = requests, config, link, slo
        self.decode_prefix_cache = bool(decode_prefix_cache)
        self.preallocate = preallocate
        self.progress = progress
        # A token's KV on every GPU of a replica: replicated KV heads are sent to each GPU that keeps a copy.
        self.token_bytes = config.token_kv_bytes * (kv_copies(model, config.tp) if config.gpu is not None else 1)
        self.times = RequestTimes()
        self.prefill = Fleet([PrefillReplica(r, config, cost, link=link) for r in range(prefill_replicas)],
                             prefill_router, config.page_size)
        self.decode = Fleet([DecodeReplica(r, config, cost) for r in range(decode_replicas)], decode_router,
                            config.page_size)
        self.transfer = KVTransferCounts()
        self.rejected = 0
        self._prefill_of: dict[int, int] = {}  # rid -> its prefill replica, until it has been queued there
        self._decode_of: dict[int, int] = {}   # rid -> its decode replica, until its KV has been sent
        # rid -> (its prefill replica, the start and end of the step that finished its prompt), until sent
        self._prefill_step_of: dict[int, tuple[PrefillReplica, float, float]] = {}
        self._ran = False
        self._bar = None

    # ---- the run ------------------------------------------------------------------------------------
    def run(self) -> PDReport:
        """Replays every request; returns the report. Runs once: a second call raises RuntimeError."""
        if self._ran:
            raise RuntimeError("this PDReplay has run; build a new one to replay again")
        self._ran = True
        t_start = time.perf_counter()
        requests, honour = self.requests, self.config.honour_arrivals
        self._bar = _progress_bar(len(requests), self.progress)
        for i in _arrival_order(requests, honour):
            arrival = requests_arrival(requests, int(i)) if honour else 0.0
            self._advance(arrival)
            self.prefill.deliver(arrival)
            self.decode.deliver(arrival)
            self._route(int(i), arrival)
        self._advance(math.inf)
        for replica in self.prefill.replicas:
            replica.settle(math.inf)
        self.prefill.deliver(math.inf)
        self.decode.deliver(math.inf)
        if self._bar is not None:
            self._bar.close()
        latency = self.times.to_json(self.slo)
        latency["span_s"] = self.times.span_s()
        replay_s = time.perf_counter() - t_start
        makespan = max(r.clock for r in self.prefill.replicas + self.decode.replicas)
        return PDReport(prefill=self.prefill.report(makespan, replay_s), decode=self.decode.report(makespan, replay_s),
                        link=self.link, decode_prefix_cache=self.decode_prefix_cache, preallocate=self.preallocate,
                        transfer=self.transfer,
                        requests=len(self.times.last), rejected=self.rejected, latency=latency,
                        replay_seconds=replay_s)

    def replicas(self) -> list[Replica]:
        return self.prefill.replicas + self.decode.replicas

    def check_invariants(self) -> None:
        """Every replica's invariants, counting what its requests outside the loop hold."""
        for replica in self.replicas():
            replica.sim.check_invariants()

    def _advance(self, until: float) -> None:
        """Runs, earliest first, every replica event (a step, a landing) that comes before `until`."""
        while True:
            replica = min(self.replicas(), key=lambda r: r.next_event())
            if replica.next_event() >= until:
                return
            if isinstance(replica, PrefillReplica):
                self._prefill_step(replica, until)
            else:
                self._decode_step(replica, until)

    # ---- routing and the decode side's pages --------------------------------------------------------------------
    def _route(self, rid: int, arrival: float) -> None:
        request = self.requests[rid]
        self.times.arrived(rid, arrival)
        if not self._fits(request):
            self.rejected += 1
            if self._bar is not None:
                self._bar.update(1)
            return
        prompt = request.input_ids.astype(np.int64)
        p_rank, p_cached = self.prefill.choose(prompt)
        d_rank, d_cached = self.decode.choose(prompt)
        self.prefill.routed(p_rank, rid, len(prompt) - p_cached, p_cached)
        self.decode.routed(d_rank, rid, 0, d_cached)
        self._prefill_of[rid], self._decode_of[rid] = p_rank, d_rank
        self.decode.replicas[d_rank].routed += 1
        if self.preallocate == "prefilled":
            self._queue_prefill(rid, arrival)
        else:
            self._wait_for_pages(rid, arrival)

    def _wait_for_pages(self, rid: int, now: float) -> None:
        """Queues a request for pages on its decode replica, from `now`; an idle decode loop takes it at once."""
        decode = self.decode.replicas[self._decode_of[rid]]
        if not decode.pending:
            decode.stuck = False
        decode.pending.append((rid, now))
        if decode.sim.is_idle() and decode.clock <= now:
            decode.sim.clock = now
            self._decode_boundary(decode)
            if decode.sim.is_idle():
                decode.publish([], [])

    def _fits(self, request: TraceRequest) -> bool:
        """Whether the request fits both sides' rows and pools (the scheduler's own admission check, before either
        side sees it: a request one side refuses is refused whole)."""
        return (_fits(self.prefill.replicas[0].sim, len(request.input_ids) + PREFILL_OUTPUT_LEN)
                and _fits(self.decode.replicas[0].sim, len(request.input_ids) + request.output_len))

    def _decode_boundary(self, decode: DecodeReplica) -> list[int]:
        """What a decode replica does between steps: admits the requests whose KV has landed, then gives pages to
        those waiting, in order, while its memory lasts (each then joins its prefill replica's queue, or, prefilled
        already, has its KV sent). Returns the requests that finished on admission (one output token)."""
        now, sim = decode.clock, decode.sim
        finished = []
        for rid in sorted((rid for rid, t in decode.landing.items() if t is not None and t <= now),
                          key=decode.landing.__getitem__):
            del decode.landing[rid]
            decode.stuck = decode.waits = False
            for req in sim.add_prefilled(rid, self.requests[rid]):
                self.times.finished(rid, now, len(req.output_ids))
                finished.append(rid)
        namespace = None
        while decode.pending and decode.pending[0][1] <= now:
            rid = decode.pending[0][0]
            if not self.decode_prefix_cache:
                namespace = f"pd-request-{rid}"  # a domain of its own: it matches nothing cached here
            if sim.preallocate(rid, self.requests[rid], namespace) is None:
                break
            decode.pending.popleft()
            decode.landing[rid] = None
            if self.preallocate == "prefilled":
                self._send(rid, now)
            else:
                self._queue_prefill(rid, now)
        decode.stuck = bool(decode.pending) and decode.pending[0][1] <= now
        if finished and self._bar is not None:
            self._bar.update(len(finished))
        return finished

    def _queue_prefill(self, rid: int, now: float) -> None:
        prefill = self.prefill.replicas[self._prefill_of.pop(rid)]
        prefill.settle(now)
        request = dataclasses.replace(self.requests[rid], output_len=PREFILL_OUTPUT_LEN, output_ids=None)
        if not prefill.add(rid, request, now):  # cannot happen: _fits checked its pool and rows
            raise RuntimeError(f"request {rid}: refused by the prefill replica after the decode side gave it pages")

    # ---- steps -----------------------------------------------------------------------------------------------------
    def _prefill_step(self, prefill: PrefillReplica, until: float) -> None:
        prefill.sim.clock = prefill.next_event()
        prefill.waits = False
        prefill.settle(prefill.clock)
        start = prefill.clock
        outcome = prefill.run_step(until)
        if prefill.clock == start and not outcome.prefilled:
            prefill.waits = True  # for memory its sends hold
            return
        handed = []
        for req in outcome.prefilled:
            rid = req.rid
            prefill.sim.hand_off(req)
            self._prefill_step_of[rid] = (prefill, start, prefill.clock)
            prefill.sending[rid] = math.inf
            if self.preallocate == "prefilled":
                self._wait_for_pages(rid, prefill.clock)
            else:
                self._send(rid, start)  # its pages were given before it joined the prefill queue
            handed.append(rid)
        prefill.publish(handed, handed)

    def _send(self, rid: int, ready: float) -> None:
        """Starts sending the KV of a prompt its prefill replica finished, its decode pages given by `ready`: the
        pages beyond its decode replica's match."""
        prefill, step_start, step_end = self._prefill_step_of.pop(rid)
        decode = self.decode.replicas[self._decode_of.pop(rid)]
        req = decode.sim.outside[rid]
        prompt, hit = len(req.input_ids), req.cache_protected_len
        nbytes = (prompt - hit) * self.token_bytes
        busy_until, landed = prefill.link.send(nbytes, step_start, step_end, max(prefill.link_free, ready))
        t = self.transfer
        t.bytes += nbytes
        t.whole_prompt_bytes += prompt * self.token_bytes
        t.busy_seconds += nbytes / prefill.link.bytes_per_s
        t.exposed_seconds += landed - step_end
        prefill.link_free = busy_until
        prefill.sending[rid] = landed
        decode.landing[rid] = landed
        self.times.first_token(rid, landed)

    def _decode_step(self, decode: DecodeReplica, until: float) -> None:
        sim = decode.sim
        sim.clock = decode.next_event()
        finished = self._decode_boundary(decode)
        if sim.is_idle() or decode.waits:
            decode.publish(finished, [])
            return
        # A run of decode steps stops before a landing here, or a hand-off from a prefill replica with work.
        horizon = min([until, decode.next_landing()] + [p.clock for p in self.prefill.replicas if not p.sim.is_idle()])
        start = sim.clock
        outcome = decode.run_step(horizon)
        if sim.clock == start and not outcome.finished and not outcome.prefilled:
            decode.waits = True  # for pages it gave requests whose KV has not landed
        if outcome.finished:
            decode.stuck = False  # their memory is back: the head of `pending` may fit now
        for req in outcome.finished:
            self.times.finished(req.rid, sim.clock, len(req.output_ids))
        if outcome.finished and self._bar is not None:
            self._bar.update(len(outcome.finished))
        decode.publish(finished + [r.rid for r in outcome.finished], [])


def link_for(config: ReplayConfig, link: KVLink | None = None) -> KVLink:
    """`link` (default: KVLink()'s bandwidth and latency) with `config`'s model's layers and one NIC per GPU of a
    replica."""
    model = config.model or DEFAULT_MODEL
    return dataclasses.replace(KVLink() if link is None else link,
                               num_layers=sizing.get_model_config(model).num_layers, nics=config.tp)


def _fits(sim, tokens: int) -> bool:
    sched = sim.sched
    return (round_up(tokens, sched.page_size) <= sched.token_allocator.size
            and tokens <= sched.req_to_token_pool.max_context_len)


def check_disaggregable(config: ReplayConfig) -> None:
    """ValueError for what the P:D replay does not model: host and storage tiers, the belady oracle."""
    if config.host_capacity_tokens is not None or config.storage is not None:
        raise ValueError("the P:D replay models the device caches only: drop the host tier (--host-capacity-tokens / "
                         "--host-mem-gb) and --storage")
    if config.eviction_policy == "belady":
        raise ValueError("--eviction-policy belady is the single replay's oracle; drop it with --prefill-replicas")


def check_decode_pool(requests: Sequence[TraceRequest], config: ReplayConfig) -> None:
    """ValueError when the decode replicas' KV capacity holds no request of `requests` (prompt and output)."""
    if not len(requests):
        return
    need = min(len(r.input_ids) + r.output_len for r in requests)
    capacity = config.capacity_tokens // config.page_size * config.page_size
    if round_up(need, config.page_size) > capacity:
        raise ValueError(f"the decode replicas' KV capacity ({capacity:,} tokens) holds no request: the smallest "
                         f"needs {need:,} (prompt and output); raise --capacity-tokens")


def replay_pd(requests: Sequence[TraceRequest], config: ReplayConfig, prefill_replicas: int, decode_replicas: int,
              **options) -> PDReport:
    """Replays `requests` disaggregated (see `PDReplay`, which takes the same options) and returns what it
    measured."""
    return PDReplay(requests, config, prefill_replicas, decode_replicas, **options).run()
