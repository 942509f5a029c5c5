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
from dataclasses import dataclass
from time import perf_counter

import numpy as np
import torch

from kvmem._checks import check_int, check_number
from kvmem._paging import round_up
from kvmem.allocator import PagedTokenAllocator, TokenAllocator
from kvmem.batch import ForwardMode, Req, ReqStatus, ScheduleBatch, check_parts
from kvmem.radix_cache import RadixCache
from kvmem.req_to_token import ReqToTokenPool
from kvmem.timing import PhaseTimer

SCHEDULE_POLICIES = ("lpm", "fcfs")


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
    """

    schedule_policy: str = "lpm"
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = 8192
    lpm_window: int = 128
    load_back_threshold: int = 16
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001

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


@dataclass
class SchedulerStats:
    retractions: int = 0
    evicted_tokens: int = 0
    prefill_batches: int = 0
    decode_batches: int = 0
    rejected: int = 0


class Scheduler:
    """Admits, prefills (chunked), decodes and finishes requests over one set of pools and one tree.

    A request's prompt enters the tree as soon as it is prefilled (`cache_unfinished_req`, as SGLang
    checkpoints it), so requests admitted while it decodes share it; its outputs enter when it finishes.
    `timer`: a PhaseTimer that accumulates the seconds of "match" (each admitted request's match_prefix and
    inc_lock_ref),
    "prepare_extend", "prepare_decode" and "process" (process_batch_result); None times nothing.

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
        self.chunked_req: Req | None = None
        self.new_token_ratio = config.init_new_token_ratio
        self.stats = SchedulerStats()
        self._batch: ScheduleBatch | None = None

    # ---- intake -------------------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        """Queues a request, or raises ValueError (nothing queued) if it can never run here."""
        if not isinstance(req, Req):
            raise TypeError(f"req must be a Req, got {type(req).__name__}")
        total = len(req.input_ids) + req.max_new_tokens
        if total > self.req_to_token_pool.max_context_len:
            self.stats.rejected += 1
            raise ValueError(f"request {req.rid!r}: {len(req.input_ids)} prompt + {req.max_new_tokens} new tokens "
                             f"exceed max_context_len {self.req_to_token_pool.max_context_len}")
        if round_up(total, self.page_size) > self.token_allocator.size:
            self.stats.rejected += 1
            raise ValueError(f"request {req.rid!r}: {total} tokens exceed the KV capacity "
                             f"{self.token_allocator.size}")
        if req.status is not ReqStatus.NEW:
            raise ValueError(f"request {req.rid!r} is already queued, running or finished ({req.status.value})")
        req.status = ReqStatus.WAITING
        self.waiting.append(req)
        # A storage tier starts reading the prompt's pages now, while the request waits to be admitted.
        req.prefetch = self.tree_cache.prefetch(_match_key(req), req.namespace)

    def is_idle(self) -> bool:
        return not self.waiting and not self.running and self.chunked_req is None

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
            batch = ScheduleBatch._of(self.running, self.req_to_token_pool, self.token_allocator, self.tree_cache)
            batch._prepare_for_decode()  # running requests, which add_request checked fit max_context_len
            if self.timer is not None:
                self.timer.add("prepare_decode", perf_counter() - t0)
            self.stats.decode_batches += 1
            self.stats.evicted_tokens += batch.evicted_tokens
            if batch.retracted:
                self.stats.retractions += len(batch.retracted)
                self.waiting.extendleft(reversed(batch.retracted))
                self.new_token_ratio = self.config.init_new_token_ratio
            else:
                self.new_token_ratio = max(self.config.min_new_token_ratio,
                                           self.new_token_ratio - self.config.new_token_ratio_decay)
        self._batch = batch
        return batch

    def process_batch_result(self, batch: ScheduleBatch, next_token_ids) -> list[Req]:
        """Appends each request's sampled token (ignored for a chunk that is not the prompt's last) and
        returns the requests that finished, already cached in the tree with their memory released.

        next_token_ids: [bs] token ids, a list of ints or a 1-D integer tensor/array (read once on the host).
        """
        if self._batch is None:
            raise RuntimeError("process_batch_result: no batch is pending (call step() first)")
        if batch is not self._batch:
            raise ValueError("batch is not the one the last step() returned")
        t0 = perf_counter() if self.timer is not None else 0.0
        tokens = _token_ids(next_token_ids)
        if len(tokens) != batch.batch_size():
            raise ValueError(f"next_token_ids has {len(tokens)} tokens for a batch of {batch.batch_size()}")
        self._batch = None
        finished = self._process(batch, tokens)
        if self.timer is not None:
            self.timer.add("process", perf_counter() - t0)
        return finished

    def _process(self, batch: ScheduleBatch, tokens: array) -> list[Req]:
        finished = []
        if batch.forward_mode is ForwardMode.EXTEND:
            for req, tok in zip(batch.reqs, tokens):
                if not req.is_chunked():  # a middle chunk samples nothing
                    req.output_ids.append(tok)
                    if req.finished():
                        self._finish(req, finished)
                        continue
                    self.running.append(req)
                # The prefilled tokens enter the tree now, as SGLang checkpoints every prefilled request:
                # requests admitted while this one runs reuse them instead of waiting for it to finish.
                self.tree_cache._cache_req(req, finished=False, checked=False)
            return finished
        still_running = []
        for req, tok in zip(batch.reqs, tokens):
            out = req.output_ids
            out.append(tok)
            if len(out) < req.max_new_tokens:  # not req.finished(), inlined: this runs once per decoded token
                still_running.append(req)
            else:
                self._finish(req, finished)
        self.running = still_running
        return finished

    def _finish(self, req: Req, finished: list[Req]) -> None:
        self.tree_cache._cache_req(req, finished=True, checked=False)
        req.status = ReqStatus.FINISHED
        finished.append(req)

    # ---- admission ----------------------------------------------------------------------------------
    def _get_extend_batch(self) -> ScheduleBatch | None:
        if not self.waiting and self.chunked_req is None:
            return None
        budget = self.config.chunked_prefill_size or float("inf")
        free_tokens = self.token_allocator.available_size() - self._reserved_tokens()
        reqs: list[Req] = []
        chunked, self.chunked_req = self.chunked_req, None
        if chunked is not None:
            # Its whole prompt was charged when it was admitted; it continues without a new check.
            budget, free_tokens = self._plan_extend(chunked, budget, free_tokens)
            reqs.append(chunked)
        timer = self.timer
        can_admit = len(self.running) + len(reqs) < self.max_running and budget > 0 and self.chunked_req is None
        # Ranking the waiting window costs a tree walk per request: only when someone can be admitted.
        if can_admit and self.config.schedule_policy == "lpm":
            self._sort_waiting_by_prefix()
        while self.waiting and len(self.running) + len(reqs) < self.max_running and budget > 0 \
                and self.chunked_req is None:
            req = self.waiting[0]
            t0 = perf_counter() if timer is not None else 0.0
            self._match(req)
            self.tree_cache.inc_lock_ref(req.last_node)
            if timer is not None:
                timer.add("match", perf_counter() - t0)
            if self._charge(req, req.prefix_indices.numel()) > free_tokens + self.tree_cache.evictable_size():
                self.tree_cache.dec_lock_ref(req.last_node)
                break
            self.waiting.popleft()
            budget, free_tokens = self._plan_extend(req, budget, free_tokens)
            reqs.append(req)
        if not reqs:
            return None
        t1 = perf_counter() if timer is not None else 0.0
        batch = ScheduleBatch._of(reqs, self.req_to_token_pool, self.token_allocator, self.tree_cache)
        ok = batch._prepare_for_extend(*batch._extend_lens())  # admission built a valid batch
        if timer is not None:
            timer.add("prepare_extend", perf_counter() - t1)
        self.stats.evicted_tokens += batch.evicted_tokens  # a failed attempt may still have evicted
        if not ok:
            self._undo_admission(reqs, chunked)
            return None
        self.stats.prefill_batches += 1
        return batch

    def _undo_admission(self, reqs: list[Req], chunked: Req | None) -> None:
        """Puts back what `_get_extend_batch` took when its allocation failed (tree and pools unchanged)."""
        self.chunked_req = chunked
        fresh = [r for r in reqs if r is not chunked]
        for req in fresh:
            self.tree_cache.dec_lock_ref(req.last_node)
        self.waiting.extendleft(reversed(fresh))

    def _plan_extend(self, req: Req, budget: float, free_tokens: int) -> tuple[float, int]:
        """Sets how far this step prefills `req` and charges the budget and free room for it."""
        start = req.kv_len if req.status is ReqStatus.RUNNING else req.prefix_indices.numel()
        end = min(len(req.fill_ids), start + budget)
        req.extend_end = int(end)
        if req.is_chunked():
            self.chunked_req = req
        return budget - (end - start), free_tokens - self._charge(req, start)

    def _charge(self, req: Req, start: int) -> int:
        """Room admission keeps for `req`: slots (whole pages) for the rest of its prompt from token
        `start`, plus its share of future output tokens; never more than the request can ever take
        (which `add_request` checked fits the pool), so an idle scheduler always admits its queue's head."""
        ps, fill, left = self.page_size, len(req.fill_ids), req.max_new_tokens - len(req.output_ids)
        done = round_up(start, ps)
        return min(round_up(fill, ps) - done + int(left * self.new_token_ratio), round_up(fill + left, ps) - done)

    def _reserved_tokens(self) -> int:
        reqs = self.running
        return int(sum(r.max_new_tokens - len(r.output_ids) for r in reqs) * self.new_token_ratio)

    def _match(self, req: Req) -> None:
        """Matches the request's prefix; with a tiered cache, loads its host-only part back to the device when
        it is long enough (else that part is recomputed)."""
        from_storage = 0
        if req.prefetch is not None:
            from_storage = self.tree_cache.finish_prefetch(req.prefetch)
            req.prefetch = None
        m = self.tree_cache.match_prefix(_match_key(req), req.namespace)
        indices, node = m.indices, m.last_node
        req.host_hit_len = req.storage_hit_len = 0
        if m.host_hit_length >= self.config.load_back_threshold:
            self._evict_for_load_back(m.last_host_node, m.host_hit_length)
            loaded = self.tree_cache.load_back(m.last_host_node, m.host_hit_length)
            if loaded is not None:
                indices, node, req.host_hit_len = loaded, m.last_host_node, m.host_hit_length
                req.storage_hit_len = min(from_storage, m.host_hit_length)
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

    def _sort_waiting_by_prefix(self) -> None:
        """Puts the first `lpm_window` waiting requests with the longest cached prefixes first. Ranking
        uses the tree's read-only `prefix_len`: at saturation the window is ranked every step while few
        are admitted, and a full match (split, index gather) for each would dominate the loop."""
        window = [self.waiting.popleft() for _ in range(min(self.config.lpm_window, len(self.waiting)))]
        prefix_len = self.tree_cache.prefix_len
        window.sort(key=lambda r: -prefix_len(_match_key(r), r.namespace))  # stable: arrival order among equals
        self.waiting.extendleft(reversed(window))

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
        and the tree's own invariants hold."""
        self.tree_cache.check_invariants()
        free = self.token_allocator.available_size()
        evictable = self.tree_cache.evictable_size()
        protected = self.tree_cache.protected_size()
        held = self.held_by_requests()
        total = self.token_allocator.size
        if free + evictable + protected + held != total:
            raise AssertionError(f"memory leak or double count: free {free} + evictable {evictable} + protected "
                                 f"{protected} + held by requests {held} != total {total}")


def _token_ids(next_token_ids) -> array:
    """The sampled tokens as an int64 array, converted in one C-level pass. Read token by token, a tensor
    costs a 0-d tensor and an int() per token: 256 tokens took 242 us that way against 5 us with one
    tolist() (a list of ints: 11 us against 3 us). Raises TypeError for non-integer tokens."""
    if isinstance(next_token_ids, torch.Tensor) and next_token_ids.device.type == "meta":
        raise ValueError("next_token_ids is on the 'meta' device, which holds no values")
    if isinstance(next_token_ids, (torch.Tensor, np.ndarray)):
        if next_token_ids.ndim != 1:
            raise ValueError(f"next_token_ids must be 1-D, got shape {tuple(next_token_ids.shape)}")
        next_token_ids = next_token_ids.tolist()
    try:
        return array("q", next_token_ids)
    except TypeError as e:
        raise TypeError(f"next_token_ids must hold int token ids ({e})") from None
    except OverflowError:
        raise ValueError("next_token_ids holds a token id outside int64") from None


def _match_key(req: Req) -> memoryview:
    # At least one token is always left to compute: the prefill must produce the next token's logits.
    return memoryview(req.fill_ids)[:-1]

