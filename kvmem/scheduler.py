"""A reference scheduler loop over kvmem's pools and radix cache, small enough to embed or copy.

Each `step()` returns one batch for the model runner: an extend batch when waiting requests can be admitted
(prefill first, as SGLang does), else a decode batch of the running requests. The runner computes and hands
the sampled token ids back through `process_batch_result`, which appends them, finishes requests into the
radix cache and keeps chunked prefills going.

Admission keeps room for the running requests' future tokens (`new_token_ratio` x remaining output tokens,
the ratio decaying while decode goes well and jumping back after a retraction, as SGLang does), so that a
retraction is rare and not followed at once by re-admitting what was just retracted.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import compress, islice
from time import perf_counter
from typing import NamedTuple

import numpy as np
import torch

from kvmem._checks import check_int, check_number
from kvmem._paging import num_new_pages, round_up
from kvmem.allocator import PagedTokenAllocator, TokenAllocator
from kvmem.batch import ForwardMode, Req, ReqStatus, ScheduleBatch, check_parts
from kvmem.radix_cache import RadixCache, request_token_ids
from kvmem.radix_tree import TOKEN_BYTES, TreeNode, Walk, key_bytes
from kvmem.req_to_token import ReqToTokenPool
from kvmem.timing import PhaseTimer

SCHEDULE_POLICIES = ("lpm", "fcfs")
_UNBOUNDED = 1 << 62  # the fewest output tokens left among no requests
_NO_REQS = np.empty(0, dtype=np.int64)


@dataclass(frozen=True)
class SchedulerConfig:
    """How the loop admits work.

    schedule_policy: "lpm" (longest cached prefix first) or "fcfs" (arrival order).
    max_running_requests: cap on requests in the running batch (None: the req_to_token rows).
    chunked_prefill_size: new tokens per extend step (None: no cap, no chunking); a request longer
        than what is left of the step is prefilled in chunks.
    lpm_window: how many waiting requests "lpm" matches against the tree per step (bounds its cost).
    load_back_threshold: with a tiered cache, a prefix part held only by the host is loaded back when it has
        at least this many tokens, and recomputed when shorter (a copy costs more than a few tokens' prefill).
    init_new_token_ratio / min_new_token_ratio / new_token_ratio_decay: the share of running requests'
        remaining output tokens that admission keeps free.
    cache_decode_pages: a running request's full pages of output count as cached as soon as they are written
        (as vLLM caches them), so a request that continues them, or the request itself after a retraction,
        reuses them; False caches output only when the request finishes (as SGLang does). The pages enter
        the tree when a match reaches them or the request is retracted, so a decode step costs nothing more.
    in_batch_prefix_caching: a waiting request whose next uncached page is one that a request admitted in the
        same prefill batch computes waits for the next batch (with those behind it) and finds it cached there
        (SGLang's in-batch prefix caching; vLLM gets the same hits by caching pages when they are scheduled).
        Off: it computes the page again, beside the other.
    """

    schedule_policy: str = "lpm"
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = 8192
    lpm_window: int = 128
    load_back_threshold: int = 16
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001
    cache_decode_pages: bool = True
    in_batch_prefix_caching: bool = False

    def __post_init__(self) -> None:
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        for name in ("max_running_requests", "chunked_prefill_size"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum=1)
        check_int("lpm_window", self.lpm_window, minimum=1)
        check_int("load_back_threshold", self.load_back_threshold, minimum=1)
        for name in ("init_new_token_ratio", "min_new_token_ratio", "new_token_ratio_decay"):
            check_number(name, getattr(self, name), 0)
        if not 0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1:
            raise ValueError("need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1, got "
                             f"{self.min_new_token_ratio} and {self.init_new_token_ratio}")
        if not self.new_token_ratio_decay >= 0:
            raise ValueError(f"new_token_ratio_decay must be >= 0, got {self.new_token_ratio_decay!r}")
        for name in ("cache_decode_pages", "in_batch_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")


@dataclass
class SchedulerStats:
    retractions: int = 0
    evicted_tokens: int = 0
    prefill_batches: int = 0
    decode_batches: int = 0
    rejected: int = 0


class DecodeRun(NamedTuple):
    """What `Scheduler.run_decode` did: `steps` decode steps, the requests that finished in the last of them,
    and after each step the KV slots in use and the evictable tokens (`[steps] int64` each)."""

    steps: int
    finished: list[Req]
    tokens_used: np.ndarray
    evictable_tokens: np.ndarray


class Scheduler:
    """Admits, prefills (chunked), decodes and finishes requests over one set of pools and one tree.

    A request's prompt enters the tree as soon as it is prefilled (`cache_unfinished_req`, as SGLang
    checkpoints it), so requests admitted while it decodes share it; its outputs enter when it finishes, or
    page by page as they are written (`SchedulerConfig.cache_decode_pages`).
    `timer`: a PhaseTimer that accumulates the seconds of "rank" (ordering the waiting queue by cached prefix),
    "match" (each admitted request's match_prefix and inc_lock_ref), "prepare_extend", "prepare_decode",
    "process" (process_batch_result) and "decode_run" (`run_decode`), and inside those of "alloc" (slot
    allocation), "evict" (radix-cache eviction) and "cache" (requests entering the tree: insert and frees);
    None times nothing.

    >>> from kvmem import RadixCache, Req, ReqToTokenPool, Scheduler, TokenAllocator
    >>> pool, alloc = ReqToTokenPool(4, 64), TokenAllocator(256)
    >>> sched = Scheduler(pool, alloc, RadixCache(pool, alloc))
    >>> sched.add_request(Req("a", [1, 2, 3, 4], max_new_tokens=2))
    >>> batch = sched.step()                       # prefill: slots allocated, req_to_token written
    >>> batch.forward_mode.value, batch.out_cache_loc.tolist()
    ('extend', [1, 2, 3, 4])
    >>> sched.process_batch_result(batch, [7])     # the model sampled 7
    []
    >>> batch = sched.step()                       # decode one token
    >>> [r.rid for r in sched.process_batch_result(batch, [8])]
    ['a']
    >>> sched.is_idle(), sched.tree_cache.total_size()   # finished: its tokens stay cached
    (True, 5)
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool, token_allocator: TokenAllocator | PagedTokenAllocator,
                 tree_cache: RadixCache, config: SchedulerConfig = SchedulerConfig(), *,
                 timer: PhaseTimer | None = None) -> None:
        check_parts(req_to_token_pool, token_allocator, tree_cache)
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"config must be a SchedulerConfig, got {type(config).__name__}")
        if timer is not None and not isinstance(timer, PhaseTimer):
            raise TypeError(f"timer must be a PhaseTimer or None, got {type(timer).__name__}")
        self.req_to_token_pool = req_to_token_pool
        self.token_allocator = token_allocator
        self.tree_cache = tree_cache
        self.config = config
        self.timer = timer
        self.page_size = token_allocator.page_size
        self.max_running = min(config.max_running_requests or req_to_token_pool.size, req_to_token_pool.size)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        # A decode run advances the running batch in these arrays (kv_len, req_to_token rows, output tokens still
        # to generate) and in the run clock (decode-run steps so far); each Req catches up when read (see Req.
        # kv_len), so that a run costs a few numpy calls and its finishes, not a Python pass over the batch.
        # None until a run needs them after a decode step changed the batch.
        self._run_kv: np.ndarray | None = _NO_REQS
        self._run_rows: np.ndarray | None = _NO_REQS
        self._run_left: np.ndarray | None = _NO_REQS
        self._run_clock = 0
        self._lagging = False  # a run has left requests behind since a step last brought them all up to date
        self._unchecked: list[Req] = []  # joined the batch since the last run, outputs not checked yet
        self.chunked_req: Req | None = None
        self.new_token_ratio = config.init_new_token_ratio
        self.stats = SchedulerStats()
        self._batch: ScheduleBatch | None = None
        # The fewest output tokens a running request still lacks (_UNBOUNDED with none running), kept up to date
        # by the results of each step and decode run (a retraction's batch sets it when its results come):
        # pure_decode_steps() reads it at every step of a replay.
        self._fewest_left = _UNBOUNDED
        # Output tokens the running requests have still to generate, kept up to date as they change: admission
        # reserves a share of it every step, and summing it over the batch then cost a tenth of the loop.
        self._tokens_left = 0
        # With cache_decode_pages: the running requests by the node where their cached prefix ends, and back
        # (see _take_decode_pages).
        self._tails: dict[TreeNode, list[Req]] = {}
        self._tail_node: dict[Req, TreeNode] = {}
        # Each waiting request's last ranking walk: (its key's bytes, the walk, the key's page after it, minus the
        # prefix length), see _sort_waiting_by_prefix.
        self._walks: dict[Req, tuple] = {}
        # Whether a walk tells what a failed admission's match returns (see _head_waits): not with a host tier,
        # whose match may load pages back. Known once: _head_waits runs at every step of a decode run.
        self._walk_tells_match = getattr(tree_cache, "host_pool", None) is None

    # ---- intake -------------------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        """Queues a request, or raises ValueError (nothing queued) if it can never run here."""
        if not isinstance(req, Req):
            raise TypeError(f"req must be a Req, got {type(req).__name__}")
        total = len(req.input_ids) + req.max_new_tokens
        # The capacity first: where it also caps max_context_len (a replay sizes its rows so), it is the reason.
        if round_up(total, self.page_size) > self.token_allocator.size:
            self.stats.rejected += 1
            raise ValueError(f"request {req.rid!r}: {len(req.input_ids)} prompt + {req.max_new_tokens} new tokens "
                             f"exceed the KV capacity {self.token_allocator.size}")
        if total > self.req_to_token_pool.max_context_len:
            self.stats.rejected += 1
            raise ValueError(f"request {req.rid!r}: {len(req.input_ids)} prompt + {req.max_new_tokens} new tokens "
                             f"exceed max_context_len {self.req_to_token_pool.max_context_len}")
        if req.status is not ReqStatus.NEW:
            raise ValueError(f"request {req.rid!r} is already queued, running or finished ({req.status.value})")
        req.status = ReqStatus.WAITING
        self.waiting.append(req)
        key = req.match_key()
        # A storage tier starts reading the prompt's pages now, while the request waits to be admitted, and a
        # policy that looks ahead keeps what it will match.
        req.prefetch = self.tree_cache.prefetch(key, req.namespace)
        self.tree_cache.request_waiting(req.rid, key, req.namespace)

    def is_idle(self) -> bool:
        return not self.waiting and not self.running and self.chunked_req is None

    def running_kv_tokens(self) -> int:
        """The KV tokens the running requests hold (the sum of their kv_len): what a decode step reads."""
        return int(self._run_arrays()[0].sum())

    # ---- the loop -----------------------------------------------------------------------------------
    def step(self) -> ScheduleBatch | None:
        """The next batch to run (extend if anything can be admitted, else decode), or None when idle.

        Call `process_batch_result` with its sampled tokens before the next `step()`.
        """
        if self._batch is not None:
            raise RuntimeError("step() called before process_batch_result() for the previous batch")
        self.tree_cache.writing_check()
        batch = self._get_extend_batch()
        if batch is None and self.running:
            t0 = perf_counter() if self.timer is not None else 0.0
            # The step changes every request's kv_len and may retract some: a run rebuilds the arrays.
            self._run_kv = self._run_rows = self._run_left = None
            self._unchecked = []
            if self._lagging:  # the batch and its results then read the requests' fields directly
                for req in self.running:
                    req._sync()
                self._lagging = False
            batch = self._new_batch(self.running)
            batch._prepare_for_decode()  # running requests, which add_request checked fit max_context_len
            if self.timer is not None:
                self.timer.add("prepare_decode", perf_counter() - t0)
            self.stats.decode_batches += 1
            self.stats.evicted_tokens += batch.evicted_tokens
            if batch.retracted:
                self.stats.retractions += len(batch.retracted)
                self._tokens_left -= sum(r.max_new_tokens - len(r.output_ids) for r in batch.retracted)
                for req in batch.retracted:
                    self._untrack_tail(req)
                self.waiting.extendleft(reversed(batch.retracted))  # the batch told the tree (request_waiting)
                self.new_token_ratio = self.config.init_new_token_ratio
            else:
                self._decay_new_token_ratio()
        self._batch = batch
        return batch

    def process_batch_result(self, batch: ScheduleBatch, next_token_ids, stopped: Iterable[int] = ()) -> list[Req]:
        """Appends each request's sampled token (ignored for a chunk that is not the prompt's last) and
        returns the requests that finished, already cached in the tree with their memory released.

        next_token_ids: [bs] token ids, a list of ints or a 1-D integer tensor/array (read once on the host).
        stopped: positions in the batch of requests whose sampled token ends them (a stop token, EOS): they
        finish with it, their max_new_tokens becoming their output's length, and what they would still have
        generated is no longer reserved.
        """
        if self._batch is None:
            raise RuntimeError("process_batch_result: no batch is pending (call step() first)")
        if batch is not self._batch:
            raise ValueError("batch is not the one the last step() returned")
        t0 = perf_counter() if self.timer is not None else 0.0
        tokens = _token_ids(next_token_ids)
        if len(tokens) != batch.batch_size():
            raise ValueError(f"next_token_ids has {len(tokens)} tokens for a batch of {batch.batch_size()}")
        stopped = self._stopped_reqs(batch, stopped)
        self._batch = None
        for req in stopped:
            left = req.max_new_tokens - len(req.output_ids) - 1  # beyond this step's token
            if batch.forward_mode is ForwardMode.DECODE:
                self._tokens_left -= left  # owed while it decoded; an extend's request is counted after its token
            req.max_new_tokens -= left
        finished = self._process(batch, tokens)
        if self.timer is not None:
            self.timer.add("process", perf_counter() - t0)
        return finished

    @staticmethod
    def _stopped_reqs(batch: ScheduleBatch, stopped: Iterable[int]) -> list[Req]:
        """The requests at positions `stopped`, each one that samples a token in this step."""
        if isinstance(stopped, (str, bytes)) or not isinstance(stopped, Iterable):
            raise TypeError(f"stopped must be positions in the batch (ints), got {type(stopped).__name__}")
        reqs = []
        extend = batch.forward_mode is ForwardMode.EXTEND
        for i in stopped:
            i = check_int("stopped: a position", i, minimum=0, maximum=batch.batch_size() - 1)
            req = batch.reqs[i]
            if extend and req.is_chunked():
                raise ValueError(f"stopped: request {req.rid!r} samples nothing in this step (a middle chunk of its "
                                 f"prompt)")
            if req in reqs:
                raise ValueError(f"stopped: position {i} is given twice")
            reqs.append(req)
        return reqs

    def _process(self, batch: ScheduleBatch, tokens: array) -> list[Req]:
        finished = []
        if batch.forward_mode is ForwardMode.EXTEND:
            joined = []
            for req, tok in zip(batch.reqs, tokens):
                decoding = not req.is_chunked()  # a middle chunk samples nothing
                if decoding:
                    req.output_ids.append(tok)
                    if req.finished():
                        self._finish(req, finished)
                        continue
                    joined.append(req)
                    left = req.max_new_tokens - len(req.output_ids)
                    self._tokens_left += left
                    self._fewest_left = min(self._fewest_left, left)
                # The prefilled tokens enter the tree now, as SGLang checkpoints every prefilled request:
                # requests admitted while this one runs reuse them instead of waiting for it to finish.
                self._cache(req, finished=False)
                if decoding and self.config.cache_decode_pages:
                    self._track_tail(req)
            if joined:
                self._join_running(joined)
            return finished
        still_running, fewest = [], _UNBOUNDED
        for req, tok in zip(batch.reqs, tokens):
            out = req._output_ids  # up to date: the step brought every request up to date
            out.append(tok)
            left = req.max_new_tokens - len(out)  # not req.finished(), inlined: this runs once per decoded token
            if left > 0:
                still_running.append(req)
                if left < fewest:
                    fewest = left
            else:
                self._finish(req, finished)
        self.running = still_running
        self._run_kv = self._run_rows = self._run_left = None  # read between the step and now, they are stale
        self._fewest_left = fewest
        self._tokens_left -= len(batch.reqs)
        return finished

    def _finish(self, req: Req, finished: list[Req]) -> None:
        req._leave_runs()
        if self._tail_node:
            self._untrack_tail(req)
        self._cache(req, finished=True)
        req.status = ReqStatus.FINISHED
        finished.append(req)

    def _cache(self, req: Req, finished: bool) -> None:
        """Puts a request's tokens into the tree (see RadixCache.cache_finished_req / cache_unfinished_req)."""
        timer = self.timer
        t0 = perf_counter() if timer is not None else 0.0
        self.tree_cache._cache_req(req, finished=finished, checked=False)
        if timer is not None:
            timer.add("cache", perf_counter() - t0)

    def _decay_new_token_ratio(self) -> None:
        self.new_token_ratio = max(self.config.min_new_token_ratio,
                                   self.new_token_ratio - self.config.new_token_ratio_decay)

    def _new_batch(self, reqs: list[Req]) -> ScheduleBatch:
        return ScheduleBatch._of(reqs, self.req_to_token_pool, self.token_allocator, self.tree_cache,
                                 timer=self.timer, cache_decode_pages=self.config.cache_decode_pages)

    # ---- decode runs, for simulators ----------------------------------------------------------------
    def pure_decode_steps(self) -> int:
        """How many of the next steps are decode steps that `run_decode` may take at once: steps that retract
        none (their slots fit in free + evictable memory), finish none before the last of them (at most the
        fewest output tokens a running request still lacks) and admit no request, with no prompt being
        prefilled in chunks. 0 when the next step is not one.

        A step admits none when none waits, when the running batch is full, or when the request at the head of
        the queue does not fit the room left: that last one `run_decode` checks again at every step and stops
        before the first that admits. A tiered cache's match may load pages back, which only the match itself
        tells, so with one a step that may admit (a request waits and the batch is not full) is never taken in
        a run. With "lpm" it ranks the waiting window to find that head, as the next step would (the same
        order again); the timer counts that as "rank".
        """
        if self._batch is not None or self.chunked_req is not None or not self.running:
            return 0
        steps = self._fitting_decode_steps(self._fewest_left)
        if steps and self._may_admit() and not self._head_waits(self.token_allocator.available_size(),
                                                                 self._reserved_tokens(), attempt=False):
            return 0
        return steps

    def _may_admit(self) -> bool:
        """Whether a step would try to admit the head of the queue (a decode step would have room for it)."""
        return bool(self.waiting) and len(self.running) < self.max_running

    def _head_waits(self, available: int, reserved: int, *, attempt: bool, ranked: bool = False) -> bool:
        """Whether admission fails at the head of the queue with `available` free slots and `reserved` tokens
        kept for the running requests' outputs, known from walks that change nothing in the tree; with
        `attempt`, and when it fails, then makes that failed attempt (ranking, match, lock and unlock: their
        access times, hit counts and splits are the step's), so that a decode run leaves the tree as the steps
        one by one would. False when it does not fail, or when only the real match can tell: a tiered cache,
        or a walk that ends where a running request's output pages could continue it (a decode run has not
        written them yet), and, without `attempt`, when the head of the last ranking still fits with its last
        walk. `ranked`: no waiting request's cached prefix changed since the last ranking, which would give the
        same order again, so it is not redone (the head's kept walk may be one a split made stale: it still
        counts the same tokens)."""
        if not self._walk_tells_match:
            return False
        tree, timer = self.tree_cache, self.timer
        room = available - reserved + tree.evictable_size()
        if self.config.schedule_policy == "lpm":
            kept = self._walks.get(self.waiting[0])
            if not attempt and kept is not None and self._charge(self.waiting[0], kept[1].num_tokens) <= room:
                # The head of the last ranking fits with its last walk: the next step all but surely admits,
                # and finding out for sure would rank the window once more before that step ranks it again.
                return False
            if not ranked:
                t0 = perf_counter() if timer is not None else 0.0
                in_order = self._sort_waiting_by_prefix(take_decode_pages=False)
                if timer is not None:
                    timer.add("rank", perf_counter() - t0)
                if not in_order:
                    return False
            req = self.waiting[0]
            walk = self._walks[req][1]
        else:
            req = self.waiting[0]
            walk = tree._prefix_walk(key_bytes("key", req.match_key()), req.namespace)
        if walk.child is None and walk.node in self._tails:
            return False
        prefix = walk.num_tokens
        if self._charge(req, prefix) <= room:
            return False
        if attempt:
            t0 = perf_counter() if timer is not None else 0.0
            self._match(req, room)
            node = req.last_node
            if req.cache_protected_len != prefix:  # the walk and the match are the same descent
                raise RuntimeError(f"request {req.rid!r}: matched {req.cache_protected_len} tokens, walked {prefix}")
            tree._lock_below(node, tree._root(req.namespace))
            tree._unlock(node)
            if timer is not None:
                timer.add("match", perf_counter() - t0)
        return True

    def _fitting_decode_steps(self, steps: int) -> int:
        """How many of the next `steps` decode steps find their slots in free + evictable memory."""
        room = self.token_allocator.available_size() + self.tree_cache.evictable_size()
        if self.page_size == 1:
            return min(steps, room // len(self.running))
        kv, ps = self._run_arrays()[0], self.page_size
        if int(num_new_pages(kv, kv + steps, ps).sum()) * ps <= room:
            return steps
        low, high = 0, steps  # the first `low` steps fit, `high` do not
        while high - low > 1:
            mid = (low + high) // 2
            if int(num_new_pages(kv, kv + mid, ps).sum()) * ps <= room:
                low = mid
            else:
                high = mid
        return low

    def run_decode(self, num_steps: int, outputs: Mapping) -> DecodeRun:
        """Takes up to `num_steps` decode steps at once (1 <= num_steps <= pure_decode_steps()), as `num_steps`
        rounds of step() and process_batch_result() would, without building the batches a model reads: the
        same evictions at the same steps, the same slots taken, the same requests finishing in the last step,
        the same stats. For a simulator, which executes no model and knows every output in advance.

        outputs[rid]: the whole output of each running request, a list of ints (what process_batch_result
        stores); the tokens after those it has are what it samples in these steps. Each request's list is read
        at its first run since it joined the batch and kept while it decodes: it must not change. Stops early,
        before a step that would have to retract a request or would admit one, or where only the real match can
        tell (see pure_decode_steps); step() then takes it. `steps` in the result says how many it took. A run that
        stops before an admission may leave the waiting window ranked as that step will rank it.
        """
        check_int("num_steps", num_steps, minimum=1)
        if self._batch is not None:
            raise RuntimeError("run_decode() called before process_batch_result() for the previous batch")
        # Only the bound a step cannot check for itself: each step checks its room and its admission again.
        # The message names that bound, not pure_decode_steps(), whose ranking would reorder the queue.
        if self.chunked_req is not None:
            raise ValueError(f"num_steps {num_steps} exceeds pure_decode_steps(): 0 while a prompt is prefilled "
                             f"in chunks")
        if not self.running:
            raise ValueError(f"num_steps {num_steps} exceeds pure_decode_steps(): 0 with no request running")
        if num_steps > self._fewest_left:
            raise ValueError(f"num_steps {num_steps} exceeds pure_decode_steps(): at most {self._fewest_left}, "
                             f"the fewest output tokens a running request lacks")
        self._run_arrays()
        checked = []
        for req in self._unchecked:  # once per join to the batch: a run reads its list as it goes on
            try:
                out = outputs[req.rid]
            except KeyError:
                raise KeyError(f"outputs has no entry for running request {req.rid!r}") from None
            if out is not req._run_outputs:  # a list checked before (the same request again) is not read again
                _check_run_outputs(req, out)
                checked.append((req, out))
        for req, out in checked:
            req._run_outputs = out
        self._unchecked = []
        timer = self.timer
        if timer is not None:
            t0, admission = perf_counter(), timer.seconds.get("rank", 0.0) + timer.seconds.get("match", 0.0)
        steps, used, evictable = self._decode_steps(num_steps)
        finished = self._advance_running(steps) if steps else []
        if steps:  # the last step's finishes released memory
            used[steps - 1] = self.token_allocator.size - self.token_allocator.available_size()
            evictable[steps - 1] = self.tree_cache.evictable_size()
        if timer is not None:  # its steps' admission attempts are timed as "rank" and "match", as step()'s are
            admission = timer.seconds.get("rank", 0.0) + timer.seconds.get("match", 0.0) - admission
            timer.add("decode_run", perf_counter() - t0 - admission)
        return DecodeRun(steps, finished, used[:steps], evictable[:steps])

    def _decode_steps(self, num_steps: int) -> tuple[int, np.ndarray, np.ndarray]:
        """The memory side of run_decode: per step the writing check, the eviction of any shortfall and the
        slots taken, allocated and written into req_to_token as that step's decode batch would (the free list's
        order, and so which slot each request gets, depends on the evictions between the steps)."""
        reqs, tree, alloc, ps = self.running, self.tree_cache, self.token_allocator, self.page_size
        bs = len(reqs)
        kv, rows, _ = self._run_arrays()
        batch = self._new_batch(reqs)
        may_admit, lpm = self._may_admit(), self.config.schedule_policy == "lpm"
        ranked = False  # the waiting window is in the order a ranking would give now (see _head_waits)
        # Requests whose kv_len is r modulo the page size open a new page at the steps j with (r + j) % ps == 0.
        per_residue = np.bincount(kv % ps, minlength=ps) * ps if ps > 1 else None
        used = np.empty(num_steps, dtype=np.int64)
        evictable = np.empty(num_steps, dtype=np.int64)
        available = alloc.available_size()
        steps = evicted = 0
        for j in range(num_steps):
            tree.writing_check()  # as step() does first thing
            need = bs if per_residue is None else int(per_residue[-j % ps])
            if need > available + tree.evictable_size():
                break  # this step retracts: step() takes it
            if may_admit:
                # The output tokens of the steps before this one count as generated, as _process counts them.
                if not self._head_waits(available, int((self._tokens_left - j * bs) * self.new_token_ratio),
                                        attempt=True, ranked=ranked):
                    break  # this step admits (or only the real match can tell): step() takes it
                # Within a run only an eviction changes a waiting request's cached prefix (a split by that
                # match keeps every path's tokens): until one, ranking again would give the same order.
                ranked = lpm
            short = need - available
            if short > 0:
                ranked = False
                evicted += self._evict(short)
            if batch._write_decode(kv + j, rows) is None:  # cannot happen: the shortfall was just evicted
                raise RuntimeError("decode-run allocation failed after eviction")
            available = alloc.available_size()
            used[j] = alloc.size - available
            evictable[j] = tree.evictable_size()
            self._decay_new_token_ratio()
            steps += 1
        self.stats.decode_batches += steps
        self.stats.evicted_tokens += evicted
        return steps, used, evictable

    def _evict(self, num_tokens: int) -> int:
        timer = self.timer
        t0 = perf_counter() if timer is not None else 0.0
        freed = self.tree_cache.evict(num_tokens)
        if timer is not None:
            timer.add("evict", perf_counter() - t0)
        return freed

    def _advance_running(self, steps: int) -> list[Req]:
        """Gives each running request its next `steps` output tokens (in the arrays; its Req catches up when
        read); the requests they finish go into the tree, in batch order as process_batch_result finishes them.
        Returns those."""
        kv, rows, left = self._run_arrays()
        self._run_clock += steps
        self._lagging = True
        self._tokens_left -= steps * len(self.running)
        kv, left = kv + steps, left - steps
        finished = []
        if left.min() <= 0:
            done = left <= 0
            running = self.running
            for i in np.flatnonzero(done).tolist():
                self._finish(running[i], finished)
            keep = ~done
            self.running = list(compress(running, keep.tolist()))
            kv, rows, left = kv[keep], rows[keep], left[keep]
        self._run_kv, self._run_rows, self._run_left = kv, rows, left
        self._fewest_left = int(left.min()) if len(left) else _UNBOUNDED
        return finished

    def _run_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The running requests' kv_len, req_to_token rows and output tokens left (each [bs] int64)."""
        if self._run_kv is None:  # a decode step changed the batch since the last run: none lags
            self._run_kv, self._run_rows, self._run_left = _batch_arrays(self.running)
            self._unchecked = list(self.running)
        return self._run_kv, self._run_rows, self._run_left

    def _join_running(self, reqs: list[Req]) -> None:
        """Appends requests that have just prefilled to the batch (up to date, at the run clock)."""
        self.running.extend(reqs)
        clock = self._run_clock
        for req in reqs:
            req._runner, req._run_clock_seen = self, clock
        if self._run_kv is not None:
            kv, rows, left = _batch_arrays(reqs)
            self._run_kv = np.concatenate((self._run_kv, kv))
            self._run_rows = np.concatenate((self._run_rows, rows))
            self._run_left = np.concatenate((self._run_left, left))
            self._unchecked.extend(reqs)

    # ---- admission ----------------------------------------------------------------------------------
    def _get_extend_batch(self) -> ScheduleBatch | None:
        if not self.waiting and self.chunked_req is None:
            return None
        budget = self.config.chunked_prefill_size or float("inf")
        # Room is read live at each check: a tiered cache's match loads host pages back, which takes device
        # slots (after evicting for them), so free slots counted before it would overstate the room.
        reserved = self._reserved_tokens()
        reqs: list[Req] = []
        chunked, self.chunked_req = self.chunked_req, None
        if chunked is not None:
            # Its whole prompt was charged when it was admitted; it continues without a new check.
            budget, reserved = self._plan_extend(chunked, budget, reserved)
            reqs.append(chunked)
        timer, tree = self.timer, self.tree_cache
        can_admit = len(self.running) + len(reqs) < self.max_running and budget > 0 and self.chunked_req is None
        # Ranking the waiting window costs a tree walk per request: only when someone can be admitted.
        if can_admit and self.config.schedule_policy == "lpm":
            t0 = perf_counter() if timer is not None else 0.0
            self._sort_waiting_by_prefix()
            if timer is not None:
                timer.add("rank", perf_counter() - t0)
        while self.waiting and len(self.running) + len(reqs) < self.max_running and budget > 0 \
                and self.chunked_req is None:
            req = self.waiting[0]
            t0 = perf_counter() if timer is not None else 0.0
            self._match(req, self.token_allocator.available_size() - reserved + tree.evictable_size())
            # The node the match just returned: inc_lock_ref's body, without its walk checking the node's tree.
            tree._lock_below(req.last_node, tree._root(req.namespace))
            if timer is not None:
                timer.add("match", perf_counter() - t0)
            if self.config.in_batch_prefix_caching and self._next_page_in_batch(req, reqs):
                tree._unlock(req.last_node)
                break  # it and those behind it wait a step (no match of the whole queue)
            room = self.token_allocator.available_size() - reserved + self.tree_cache.evictable_size()
            if self._charge(req, req.prefix_indices.numel()) > room:
                tree._unlock(req.last_node)
                break
            self.waiting.popleft()
            self._walks.pop(req, None)
            budget, reserved = self._plan_extend(req, budget, reserved)
            reqs.append(req)
        if not reqs:
            return None
        t1 = perf_counter() if timer is not None else 0.0
        batch = self._new_batch(reqs)
        ok = batch._prepare_for_extend(*batch._extend_lens())  # admission built a valid batch
        if timer is not None:
            timer.add("prepare_extend", perf_counter() - t1)
        self.stats.evicted_tokens += batch.evicted_tokens  # a failed attempt may still have evicted
        if not ok:
            self._undo_admission(reqs, chunked)
            return None
        for req in reqs:
            if req is not chunked:
                self.tree_cache.request_admitted(req.rid)
        self.stats.prefill_batches += 1
        return batch

    def _next_page_in_batch(self, req: Req, batch: list[Req]) -> bool:
        """Whether the page after `req`'s cached prefix is one a request of this batch computes now, after the
        same tokens: then `req` finds it cached a step later instead of computing it a second time now."""
        start, ps = req.cache_protected_len, self.page_size
        end = start + ps
        if len(req.fill_ids) - 1 < end:  # the match key leaves the last token out
            return False
        head = memoryview(req.fill_ids)[:end]
        for other in batch:  # only its own namespace's pages can be its hit
            if other.namespace == req.namespace and other.extend_end >= end and request_token_ids(other, end) == head:
                return True
        return False

    def _undo_admission(self, reqs: list[Req], chunked: Req | None) -> None:
        """Puts back what `_get_extend_batch` took when its allocation failed (tree and pools unchanged)."""
        self.chunked_req = chunked
        fresh = [r for r in reqs if r is not chunked]
        for req in fresh:
            self.tree_cache.dec_lock_ref(req.last_node)
        self.waiting.extendleft(reversed(fresh))

    def _plan_extend(self, req: Req, budget: float, reserved: int) -> tuple[float, int]:
        """Sets how far this step prefills `req` and charges the budget and the reserved room for it."""
        start = req.kv_len if req.status is ReqStatus.RUNNING else req.prefix_indices.numel()
        end = min(len(req.fill_ids), start + budget)
        req.extend_end = int(end)
        if req.is_chunked():
            self.chunked_req = req
        return budget - (end - start), reserved + self._charge(req, start)

    def _charge(self, req: Req, start: int) -> int:
        """Room admission keeps for `req`: slots (whole pages) for the rest of its prompt from token
        `start`, plus its share of future output tokens; never more than the request can ever take
        (which `add_request` checked fits the pool), so an idle scheduler always admits its queue's head."""
        ps, fill, left = self.page_size, len(req.fill_ids), req.max_new_tokens - len(req.output_ids)
        done = round_up(start, ps)
        return min(round_up(fill, ps) - done + int(left * self.new_token_ratio), round_up(fill + left, ps) - done)

    def _reserved_tokens(self) -> int:
        return int(self._tokens_left * self.new_token_ratio)

    def _match(self, req: Req, room: int) -> None:
        """Matches the request's prefix; with a tiered cache, loads its host-only part back to the device when
        it is long enough (else that part is recomputed) and the request then fits in `room` (free plus
        evictable slots not yet charged to this step's batch)."""
        from_storage = 0
        if req.prefetch is not None:
            from_storage = self.tree_cache.finish_prefetch(req.prefetch)
            req.prefetch = None
        key = req.match_key()
        m = self.tree_cache.match_prefix(key, req.namespace)
        if m.last_node in self._tails and m.host_hit_length == 0:  # a running request's output may continue it
            view = key_bytes("key", key)
            while m.host_hit_length == 0 and self._take_decode_pages(view, m.last_node,
                                                                     m.indices.numel() * TOKEN_BYTES):
                m = self.tree_cache.match_prefix(key, req.namespace)
        indices, node = m.indices, m.last_node
        req.host_hit_len = req.storage_hit_len = 0
        host = m.host_hit_length
        if host >= self.config.load_back_threshold and host + self._charge(req, indices.numel() + host) <= room:
            self._evict_for_load_back(m.last_host_node, host)
            loaded = self.tree_cache.load_back(m.last_host_node, host)
            if loaded is not None:
                indices, node, req.host_hit_len = loaded, m.last_host_node, host
                req.storage_hit_len = min(from_storage, host)
        req.prefix_indices = indices
        req.last_node = node
        # numel(), not len(): a tensor's len() goes through a Python wrapper that costs about 6x as much, and
        # admission and prepare_for_extend read each prefix length several times.
        req.cache_protected_len = indices.numel()

    def _evict_for_load_back(self, last_host_node, host_hit_length: int) -> None:
        """Evicts the device slots a load-back is short of, with the matched path locked so that its own nodes
        stay: load_back would evict them itself, but then they would be missing from stats.evicted_tokens."""
        short = host_hit_length - self.token_allocator.available_size()
        if short > 0:
            self.tree_cache.inc_lock_ref(last_host_node)
            self.stats.evicted_tokens += self.tree_cache.evict(short)
            self.tree_cache.dec_lock_ref(last_host_node)

    def _sort_waiting_by_prefix(self, take_decode_pages: bool = True) -> bool:
        """Puts the first `lpm_window` waiting requests with the longest cached prefixes first (arrival order
        among equals). Ranking walks the tree read-only (no split, no access-time or hit-count update, no index
        gather): at saturation the window is ranked every step while few are admitted, and a full match for
        each would dominate the loop. For the same reason each request's walk is kept (`_walks`) and taken
        again only when the tree changed where it stopped.

        Without `take_decode_pages`, returns False, reordering nothing, when a walk ends where a running
        request's output pages could continue it (see _head_waits); else True."""
        waiting, walks, tails = self.waiting, self._walks, self._tails
        n = min(self.config.lpm_window, len(waiting))
        ranks = []
        for req in islice(waiting, n):
            # The common case, inlined (the window is ranked at every step): a kept walk that is still current
            # (RadixTree._walk_is_current, for a walk that matched something) and no running request's tail.
            kept = walks.get(req)
            if kept is not None:
                walk = kept[1]
                child, node = walk.child, walk.node
                if child is None:
                    if node.parent is not None and node not in tails and (
                            kept[2] is None or kept[2] not in node.children):
                        ranks.append(kept[3])
                        continue
                elif child.parent is node:
                    ranks.append(kept[3])
                    continue
            rank = self._rank(req, take_decode_pages)
            if rank is None:
                return False
            ranks.append(rank)
        if ranks != sorted(ranks):
            order = sorted(range(n), key=ranks.__getitem__)
            window = [waiting.popleft() for _ in range(n)]
            waiting.extendleft([window[i] for i in reversed(order)])
        return True

    def _rank(self, req: Req, take_decode_pages: bool) -> int | None:
        tree, ns = self.tree_cache, req.namespace
        kept = self._walks.get(req)
        if kept is None or not tree._walk_is_current(kept[1], kept[2], ns):
            view = key_bytes("key", req.match_key()) if kept is None else kept[0]  # fixed while it waits
            kept = self._keep_walk(req, view, tree._prefix_walk(view, ns))
        walk = kept[1]
        if walk.child is None and walk.node in self._tails:  # a running request's output may continue it
            if not take_decode_pages:
                return None
            view = kept[0]
            while walk.child is None and self._take_decode_pages(view, walk.node, walk.matched):
                walk = tree._prefix_walk(view, ns)
            kept = self._keep_walk(req, view, walk)
        return kept[3]

    def _keep_walk(self, req: Req, view: memoryview, walk: Walk) -> tuple:
        kept = self._walks[req] = (view, walk, self.tree_cache._next_page(view, walk), -walk.num_tokens)
        return kept

    # ---- output pages of running requests ------------------------------------------------------------
    def _take_decode_pages(self, view: memoryview, node: TreeNode, matched: int) -> bool:
        """With cache_decode_pages: when a walk of a key (`view`, its bytes) ends at `node` after `matched`
        bytes, where a running request's cached prefix ends, and the key goes on with that request's next full
        page of output, puts the request's full pages into the tree (the walk may go further now) and returns
        True.

        Decode steps write output pages without inserting them, so that a step costs what it did: a match is
        the only thing that could see them, and here it finds what inserting them as written would have given.
        """
        candidates = self._tails.get(node)
        if not candidates:
            return False
        ps = self.page_size
        page_bytes = ps * TOKEN_BYTES
        if len(view) < matched + page_bytes:
            return False
        page = view[matched:matched + page_bytes]
        start = matched // TOKEN_BYTES
        for r in candidates:
            if r.kv_len - r.kv_len % ps - r.cache_protected_len >= ps and \
                    memoryview(request_token_ids(r, start + ps, start)).cast("B") == page:
                self._untrack_tail(r)
                self._cache(r, finished=False)  # its full pages up to kv_len; the rest are not written yet
                self._track_tail(r)
                return True
        return False

    def _track_tail(self, req: Req) -> None:
        node = req.last_node
        self._tail_node[req] = node
        self._tails.setdefault(node, []).append(req)

    def _untrack_tail(self, req: Req) -> None:
        node = self._tail_node.pop(req, None)
        if node is not None:
            reqs = self._tails[node]
            reqs.remove(req)
            if not reqs:
                del self._tails[node]

    # ---- checks -------------------------------------------------------------------------------------
    def held_by_requests(self) -> int:
        """Slots held by running requests (decoding, prefilling or in the pending batch) and not by the tree
        (whole pages)."""
        holders = set(self.running)
        if self.chunked_req is not None:
            holders.add(self.chunked_req)
        if self._batch is not None:
            holders.update(self._batch.reqs)
        return sum(round_up(r.kv_len, self.page_size) - r.cache_protected_len
                   for r in holders if r.status is ReqStatus.RUNNING)

    def check_invariants(self) -> None:
        """Raises AssertionError unless free + evictable + protected + held by requests == total,
        the output tokens the running requests still owe are counted right, and the tree's own invariants
        hold."""
        self.tree_cache.check_invariants()
        free = self.token_allocator.available_size()
        evictable = self.tree_cache.evictable_size()
        protected = self.tree_cache.protected_size()
        held = self.held_by_requests()
        total = self.token_allocator.size
        if free + evictable + protected + held != total:
            raise AssertionError(f"memory leak or double count: free {free} + evictable {evictable} + protected "
                                 f"{protected} + held by requests {held} != total {total}")
        left = sum(r.max_new_tokens - len(r.output_ids) for r in self.running)
        if left != self._tokens_left:
            raise AssertionError(f"running requests owe {left} output tokens, the count says {self._tokens_left}")
        if self._run_kv is not None:
            reqs = self.running
            for name, have, want in (("kv_len", self._run_kv, [r.kv_len for r in reqs]),
                                     ("rows", self._run_rows, [r.req_pool_idx for r in reqs]),
                                     ("output tokens left", self._run_left,
                                      [r.max_new_tokens - len(r.output_ids) for r in reqs])):
                if have.tolist() != want:
                    raise AssertionError(f"the running batch's {name} array {have.tolist()} != its requests' {want}")


def _check_run_outputs(req: Req, out) -> None:
    """Raises unless `out` is a list of at least max_new_tokens int token ids, as process_batch_result stores them."""
    if type(out) is not list:
        raise TypeError(f"outputs[{req.rid!r}] must be a list of ints (as process_batch_result stores them), got "
                        f"{type(out).__name__}")
    if len(out) < req.max_new_tokens:
        raise ValueError(f"request {req.rid!r}: its output has {len(out)} of its {req.max_new_tokens} tokens")
    _token_ids(out, f"outputs[{req.rid!r}]")


def _kv_lens(reqs: list[Req]) -> np.ndarray:
    return np.fromiter((r.kv_len for r in reqs), dtype=np.int64, count=len(reqs))


def _batch_arrays(reqs: list[Req]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The requests' kv_len, req_to_token rows and output tokens left, as a decode run keeps them."""
    n = len(reqs)
    return (_kv_lens(reqs), np.fromiter((r.req_pool_idx for r in reqs), dtype=np.int64, count=n),
            np.fromiter((r.max_new_tokens - len(r.output_ids) for r in reqs), dtype=np.int64, count=n))


def _token_ids(next_token_ids, name: str = "next_token_ids") -> array:
    """Token ids (the sampled tokens, or a run's outputs) as an int64 array, converted in one C-level pass. Read
    token by token, a tensor costs a 0-d tensor and an int() per token: 256 tokens took 242 us that way against
    5 us with one tolist() (a list of ints: 11 us against 3 us). Raises TypeError for non-integer tokens."""
    if isinstance(next_token_ids, torch.Tensor) and next_token_ids.device.type == "meta":
        raise ValueError(f"{name} is on the 'meta' device, which holds no values")
    if isinstance(next_token_ids, (torch.Tensor, np.ndarray)):
        if next_token_ids.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(next_token_ids.shape)}")
        if next_token_ids.dtype in (torch.bool, np.bool_):
            raise TypeError(f"{name} must hold int token ids, got dtype {next_token_ids.dtype}")
        next_token_ids = next_token_ids.tolist()
    elif isinstance(next_token_ids, (list, tuple)) and _holds_a_bool(next_token_ids):
        raise TypeError(f"{name} must hold int token ids, got a bool")  # array("q") would store 1
    try:
        return array("q", next_token_ids)
    except TypeError as e:
        raise TypeError(f"{name} must hold int token ids ({e})") from None
    except OverflowError:
        raise ValueError(f"{name} holds a token id outside int64") from None


def _holds_a_bool(ids: list | tuple) -> bool:
    # `in` scans in C, but finds the ints 1 and 0 too (True == 1): only then is each element's type looked at.
    try:
        maybe = True in ids or False in ids
    except (TypeError, ValueError):  # an element == True could not say (an array): look at every type
        maybe = True
    return maybe and any(type(t) is bool for t in ids)
