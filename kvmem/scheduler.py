"""A reference scheduler loop over kvmem's pools and radix cache, small enough to embed or copy.

Each `step()` returns one batch for the model runner: an extend batch when waiting requests can be admitted
(prefill first, as SGLang does), else a decode batch of the running requests. The runner computes and hands
the sampled token ids back through `process_batch_result`, which appends them, finishes requests into the
radix cache and keeps chunked prefills going.

Admission (`kvmem.prefill_adder`) keeps room for the running requests' future tokens (`new_token_ratio` x
remaining output tokens, the ratio decaying while decode goes well and jumping back after a retraction, as
SGLang does), so that a retraction is rare and not followed at once by re-admitting what was just retracted.
The waiting queue is ordered by `kvmem.schedule_policy`; the running requests' output pages are cached when a
match needs them (`kvmem.decode_pages`). A request's memory is released on one path
(`RadixCache.release_req`), whether it finishes, is retracted, is aborted or its admission is undone.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterable

from kvmem._checks import check_int
from kvmem._paging import TOKEN_BYTES, round_up
from kvmem.allocator import PagedTokenAllocator, TokenAllocator
from kvmem.batch import ForwardMode, Req, ReqStatus, ScheduleBatch, check_parts, token_ids
from kvmem.decode_pages import DecodePageTails
from kvmem.prefill_adder import PrefillAdder, admission_charge
from kvmem.radix_cache import RadixCache, request_token_ids
from kvmem.radix_tree import key_bytes
from kvmem.req_to_token import ReqToTokenPool
from kvmem.schedule_policy import SCHEDULE_POLICIES, PrefixRanker
from kvmem.scheduler_config import SchedulerConfig, SchedulerStats
from kvmem.timing import NO_TIMER, NullTimer, PhaseTimer

__all__ = ["SCHEDULE_POLICIES", "Scheduler", "SchedulerConfig", "SchedulerStats"]


class Scheduler:
    """Admits, prefills (chunked), decodes and finishes requests over one set of pools and one tree.

    A request's prompt enters the tree as soon as it is prefilled (`cache_unfinished_req`, as SGLang
    checkpoints it), so requests admitted while it decodes share it; its outputs enter when it finishes, or
    page by page as they are written (`SchedulerConfig.cache_decode_pages`).
    `timer`: a PhaseTimer that accumulates the seconds of "rank" (ordering the waiting queue by cached prefix),
    "match" (each admitted request's match_prefix and lock), "prepare_extend", "prepare_decode", "process"
    (process_batch_result), and inside those of "alloc" (slot allocation), "evict" (radix-cache eviction) and
    "cache" (requests entering the tree: insert and frees); None times nothing.

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
        self.timer: PhaseTimer | NullTimer = NO_TIMER if timer is None else timer
        self.page_size = token_allocator.page_size
        self.max_running = min(config.max_running_requests or req_to_token_pool.size, req_to_token_pool.size)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.new_token_ratio = config.init_new_token_ratio
        self.stats = SchedulerStats()
        self.tails = DecodePageTails(self.page_size, lambda req: self._cache(req, finished=False),
                                     lambda: self.stats.decode_batches)
        self.ranker = PrefixRanker(tree_cache, self.tails, config.lpm_window)
        self._batch: ScheduleBatch | None = None
        # Output tokens the running requests have still to generate, kept up to date as they change: admission
        # reserves a share of it every step.
        self._tokens_left = 0

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
        key = req.match_key()
        # A policy that looks ahead keeps what the request will match (and may refuse its id: before it is
        # queued), and a storage tier starts reading the prompt's pages now, while the request waits.
        self.tree_cache.request_waiting(req.rid, key, req.namespace)
        req.prefetch = self.tree_cache.prefetch(key, req.namespace)
        req.status = ReqStatus.WAITING
        self.waiting.append(req)

    def abort(self, req: Req) -> None:
        """Drops a queued or running request: a waiting one leaves the queue (its storage prefetch released), a
        running one is finished where it is (what it computed is cached, its memory released) without another
        token. Raises ValueError for a request that is neither, and RuntimeError while a batch holding it is
        pending (call process_batch_result first)."""
        if not isinstance(req, Req):
            raise TypeError(f"req must be a Req, got {type(req).__name__}")
        if self._batch is not None and req in self._batch.reqs:
            raise RuntimeError(f"request {req.rid!r} is in the pending batch: call process_batch_result first")
        if req.status in (ReqStatus.WAITING, ReqStatus.RETRACTED) and req in self.waiting:
            self.waiting.remove(req)
            self.ranker.forget(req)
            if req.prefetch is not None:
                self.tree_cache.finish_prefetch(req.prefetch)
                req.prefetch = None
        elif req.status is ReqStatus.RUNNING and (req in self.running or req is self.chunked_req):
            if req is self.chunked_req:
                self.chunked_req = None
            else:
                self.running.remove(req)
                self._tokens_left -= req.max_new_tokens - len(req.output_ids)
            self.tails.untrack(req)
            req.max_new_tokens = max(len(req.output_ids), 1)
            with self.timer.phase("cache"):
                self.tree_cache.release_req(req, cache=True)
        else:
            raise ValueError(f"request {req.rid!r} is not queued or running here ({req.status.value})")
        req.status = ReqStatus.FINISHED

    def is_idle(self) -> bool:
        return not self.waiting and not self.running and self.chunked_req is None

    # ---- disaggregation (kvmem.disagg) ---------------------------------------------------------------
    def hand_off(self, req: Req) -> None:
        """Takes a running request out of the loop with its memory, for a prefill side to send its KV: it runs no more
        batches here and no longer counts in held_by_requests; its new owner releases it with
        `tree_cache.release_req(req, cache=True)`. Raises ValueError for a request that is not decoding here and
        RuntimeError while the pending batch holds it."""
        if not isinstance(req, Req):
            raise TypeError(f"req must be a Req, got {type(req).__name__}")
        if self._batch is not None and req in self._batch.reqs:
            raise RuntimeError(f"request {req.rid!r} is in the pending batch: call process_batch_result first")
        if req.status is not ReqStatus.RUNNING or req not in self.running:
            raise ValueError(f"request {req.rid!r} is not decoding here ({req.status.value})")
        self.running.remove(req)
        self._tokens_left -= req.max_new_tokens - len(req.output_ids)
        self.tails.untrack(req)

    def add_prefilled_request(self, req: Req, stopped: bool = False) -> bool:
        """Admits a request whose prompt another instance prefilled straight to decoding, as the step that prefills a
        prompt here would: its row holds the KV of its whole prompt (kv_len == extend_end == len(input_ids)), its
        first cache_protected_len slots are the tree's (locked through last_node), and output_ids holds the one
        token the other instance sampled. Its prompt's whole pages enter the tree now. `stopped`: that token ends it.
        Returns True when it finished at once (then cached and released). Raises, changing nothing, for a request
        that is not so."""
        if not isinstance(req, Req):
            raise TypeError(f"req must be a Req, got {type(req).__name__}")
        if req.status is not ReqStatus.RUNNING or req in self.running or req is self.chunked_req:
            raise ValueError(f"request {req.rid!r} must hold memory outside this scheduler (status RUNNING, not "
                             f"running here), got {req.status.value}")
        prompt = len(req.input_ids)
        if len(req.output_ids) != 1 or req.kv_len != prompt or req.extend_end != prompt:
            raise ValueError(f"request {req.rid!r}: need one output token and kv_len == extend_end == {prompt} "
                             f"(its prompt), got {len(req.output_ids)}, {req.kv_len} and {req.extend_end}")
        self.tree_cache.cache_unfinished_req(req)  # checks its row, lock and slots before it changes anything
        if stopped:
            req.max_new_tokens = 1
        if req.finished():
            self._finish(req, [])
            return True
        self.running.append(req)
        self._tokens_left += req.max_new_tokens - len(req.output_ids)
        if self.config.cache_decode_pages:
            self.tails.track(req)
        return False

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
            batch = self._get_decode_batch()
        self._batch = batch
        return batch

    def _get_decode_batch(self) -> ScheduleBatch:
        batch = self._new_batch(self.running)
        with self.timer.phase("prepare_decode"):
            batch._prepare_for_decode()  # running requests, which add_request checked fit max_context_len
        self.stats.decode_batches += 1
        self.stats.evicted_tokens += batch.evicted_tokens
        if batch.retracted:
            self.stats.retractions += len(batch.retracted)
            self._tokens_left -= sum(r.max_new_tokens - len(r.output_ids) for r in batch.retracted)
            for req in batch.retracted:
                self.tails.untrack(req)
            self.waiting.extendleft(reversed(batch.retracted))  # the batch told the tree (request_waiting)
            self.new_token_ratio = self.config.init_new_token_ratio
        else:
            self._decay_new_token_ratio()
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
        with self.timer.phase("process"):
            tokens = token_ids(next_token_ids)
            if len(tokens) != batch.batch_size():
                raise ValueError(f"next_token_ids has {len(tokens)} tokens for a batch of {batch.batch_size()}")
            stopped = [] if type(stopped) is tuple and not stopped else self._stopped_reqs(batch, stopped)
            self._batch = None
            for req in stopped:
                left = req.max_new_tokens - len(req.output_ids) - 1  # beyond this step's token
                if batch.forward_mode is ForwardMode.DECODE:
                    self._tokens_left -= left  # owed while it decoded; an extend's request counts after its token
                req.max_new_tokens -= left
            if batch.forward_mode is ForwardMode.EXTEND:
                return self._process_extend(batch, tokens)
            return self._process_decode(batch, tokens)

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

    def _process_extend(self, batch: ScheduleBatch, tokens: array) -> list[Req]:
        finished, joined = [], []
        for req, tok in zip(batch.reqs, tokens):
            decoding = not req.is_chunked()  # a middle chunk samples nothing
            if decoding:
                req.output_ids.append(tok)
                if req.finished():
                    self._finish(req, finished)
                    continue
                joined.append(req)
                self._tokens_left += req.max_new_tokens - len(req.output_ids)
            # The prefilled tokens enter the tree now, as SGLang checkpoints every prefilled request: requests
            # admitted while this one runs reuse them instead of waiting for it to finish.
            self._cache(req, finished=False)
            if decoding and self.config.cache_decode_pages:
                self.tails.track(req)
        self.running.extend(joined)
        return finished

    def _process_decode(self, batch: ScheduleBatch, tokens: array) -> list[Req]:
        reqs = batch.reqs
        for req, tok in zip(reqs, tokens):
            req.output_ids.append(tok)
        # Finishes found in a second pass: cheaper than a branch per token in the loop above.
        done = [req for req in reqs if len(req.output_ids) >= req.max_new_tokens]  # Req.finished(), inline
        finished: list[Req] = []
        for req in done:
            self._finish(req, finished)
        self.running = [req for req in reqs if req.status is not ReqStatus.FINISHED] if done else list(reqs)
        self._tokens_left -= len(reqs)
        return finished

    def _finish(self, req: Req, finished: list[Req]) -> None:
        self.tails.untrack(req)
        self._cache(req, finished=True)
        req.status = ReqStatus.FINISHED
        finished.append(req)

    def _cache(self, req: Req, finished: bool) -> None:
        """Puts a request's tokens into the tree (see RadixCache.cache_req); a finished one's memory goes back."""
        with self.timer.phase("cache"):
            if finished:
                self.tree_cache.release_req(req, cache=True)
            else:
                self.tree_cache.cache_req(req, finished=False)

    def _decay_new_token_ratio(self) -> None:
        self.new_token_ratio = max(self.config.min_new_token_ratio,
                                   self.new_token_ratio - self.config.new_token_ratio_decay)

    def _new_batch(self, reqs: list[Req]) -> ScheduleBatch:
        return ScheduleBatch._of(reqs, self.req_to_token_pool, self.token_allocator, self.tree_cache,
                                 timer=self.timer, cache_decode_pages=self.config.cache_decode_pages)

    # ---- admission ----------------------------------------------------------------------------------
    def _get_extend_batch(self) -> ScheduleBatch | None:
        if not self.waiting and self.chunked_req is None:
            return None
        tree, timer = self.tree_cache, self.timer
        adder = PrefillAdder(self.token_allocator, tree, rows_left=self.max_running - len(self.running),
                             budget=self.config.chunked_prefill_size or float("inf"),
                             reserved=self._reserved_tokens(), new_token_ratio=self.new_token_ratio)
        chunked, self.chunked_req = self.chunked_req, None
        if chunked is not None:
            adder.add(chunked, chunked.kv_len)  # its whole prompt was charged at admission: it goes on unchecked
        # Ranking the waiting window costs a tree walk per request: only when someone can be admitted.
        if adder.can_add() and self.waiting and self.config.schedule_policy == "lpm":
            with timer.phase("rank"):
                self.ranker.sort(self.waiting)
        while self.waiting and adder.can_add():
            req = self.waiting[0]
            with timer.phase("match"):
                self._match(req, adder.room())
                tree.lock(req.last_node)
            if self.config.in_batch_prefix_caching and self._next_page_in_batch(req, adder.reqs):
                tree.unlock(req.last_node)
                break  # it and those behind it wait a step (no match of the whole queue)
            if not adder.fits(req, req.cache_protected_len):
                tree.unlock(req.last_node)
                break
            self.waiting.popleft()
            self.ranker.forget(req)
            adder.add(req, req.cache_protected_len)
        reqs = adder.reqs
        if not reqs:
            return None
        batch = self._new_batch(reqs)
        with timer.phase("prepare_extend"):
            ok = batch._prepare_for_extend(*batch._extend_lens())  # admission built a valid batch
        self.stats.evicted_tokens += batch.evicted_tokens  # a failed attempt may still have evicted
        if not ok:
            self._undo_admission(reqs, chunked)
            return None
        self.chunked_req = adder.chunked
        for req in reqs:
            if req is not chunked:
                tree.request_admitted(req.rid)
        self.stats.prefill_batches += 1
        return batch

    def _reserved_tokens(self) -> int:
        """KV slots admission keeps for the running requests' future output tokens."""
        return int(self._tokens_left * self.new_token_ratio)

    def _charge(self, req: Req, start: int) -> int:
        return admission_charge(req, start, self.page_size, self.new_token_ratio)

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
            self.tree_cache.release_req(req, cache=False)  # matched and locked, but given no row
        self.waiting.extendleft(reversed(fresh))

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
        if m.last_node in self.tails and m.host_hit_length == 0:  # a running request's output may continue it
            view = key_bytes("key", key)
            while m.host_hit_length == 0 and self.tails.take(view, m.last_node, m.indices.numel() * TOKEN_BYTES):
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
        req.cache_protected_len = indices.numel()

    def _evict_for_load_back(self, last_host_node, host_hit_length: int) -> None:
        """Evicts the device slots a load-back is short of, with the matched path locked so that its own nodes
        stay: load_back would evict them itself, but then they would be missing from stats.evicted_tokens."""
        short = host_hit_length - self.token_allocator.available_size()
        if short > 0:
            self.tree_cache.lock(last_host_node)
            self.stats.evicted_tokens += self.tree_cache.evict(short)
            self.tree_cache.unlock(last_host_node)

    # ---- checks -------------------------------------------------------------------------------------
    def held_by_requests(self) -> int:
        """Slots held by running requests (decoding, prefilling or in the pending batch) and not by the tree
        (whole pages)."""
        return self._slots_held(self._holders())

    def _slots_held(self, reqs: Iterable[Req]) -> int:
        return sum(round_up(r.kv_len, self.page_size) - r.cache_protected_len for r in reqs)

    def _holders(self) -> list[Req]:
        """The requests holding memory: running ones, decoding, prefilling or in the pending batch."""
        holders = set(self.running)
        if self.chunked_req is not None:
            holders.add(self.chunked_req)
        if self._batch is not None:
            holders.update(self._batch.reqs)
        return [r for r in holders if r.status is ReqStatus.RUNNING]

    def check_invariants(self, held_outside: Iterable[Req] = ()) -> None:
        """Raises AssertionError unless free + evictable + protected + held by requests == total (in the token
        pool, and in each of a hybrid tree's other components), the output tokens the running requests still owe
        are counted right, and the tree's own invariants hold. held_outside: the requests holding memory outside
        the loop (a disaggregated side's transfers)."""
        outside = list(held_outside)
        self.tree_cache.check_invariants()
        free = self.token_allocator.available_size()
        evictable = self.tree_cache.evictable_size()
        protected = self.tree_cache.protected_size()
        held = self.held_by_requests() + self._slots_held(outside)
        total = self.token_allocator.size
        if free + evictable + protected + held != total:
            raise AssertionError(f"memory leak or double count: free {free} + evictable {evictable} + protected "
                                 f"{protected} + held by requests {held} != total {total}")
        self.tree_cache.check_held(self._holders() + outside)
        left = sum(r.max_new_tokens - len(r.output_ids) for r in self.running)
        if left != self._tokens_left:
            raise AssertionError(f"running requests owe {left} output tokens, the count says {self._tokens_left}")
