"""Decode runs: the replay's fast path through the library's Scheduler.

A replay executes no model and knows every output in advance, so a run of decode steps in which nothing can be
admitted, nothing is retracted and nothing finishes before the last step needs no batch a model reads: only
the memory each step takes. `ReplayScheduler.run_decode` takes such a run at once, with the steps' real calls
(the writing check, the eviction of any shortfall, the slots each step allocates and writes into req_to_token,
the failed admission attempt at the head of the queue: match, lock and unlock, whose access times, hit counts
and splits are the steps'), and writes the results back into the requests when the run ends. Each run is as
its steps one by one through `step()` and `process_batch_result()` would be: the same evictions at the same
steps, the same slots, the same requests finishing in the last step, the same stats.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import islice
from time import perf_counter
from typing import NamedTuple

import numpy as np

from kvmem._checks import check_int
from kvmem._paging import num_new_pages
from kvmem.batch import Req, alloc_decode_slots, token_ids
from kvmem.radix_tree import key_bytes
from kvmem.scheduler import Scheduler


class DecodeRun(NamedTuple):
    """What `ReplayScheduler.run_decode` did: `steps` decode steps, the requests that finished in the last of
    them, and after each step the KV slots in use and the evictable tokens (`[steps] int64` each)."""

    steps: int
    finished: list[Req]
    tokens_used: np.ndarray
    evictable_tokens: np.ndarray


class ReplayScheduler(Scheduler):
    """A Scheduler that can also take a run of pure decode steps at once (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The running requests' kv_len, req_to_token rows and output tokens left, as a run advances them; None
        # once a step changed the batch (rebuilt from the requests, which runs keep up to date).
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._outputs: dict[Req, list] = {}  # each running request's whole output, checked once
        # Whether a walk tells what a failed admission's match returns: not with a host tier, whose match may
        # load pages back, nor with a hybrid tree, whose match may end above the walk's end.
        self._walk_tells_match = getattr(self.tree_cache, "host_pool", None) is None and self.tree_cache.match_is_walk

    # The arrays follow every change to the running batch, so that a run starts from them with no pass over the
    # requests: a decode step adds a token to each (or retracts some), its results finish some, an extend step's
    # results add the requests that start decoding.
    def _get_decode_batch(self):
        batch = super()._get_decode_batch()
        if self._arrays is not None:
            if batch.retracted:
                self._arrays = None
            else:
                kv, rows, left = self._arrays
                self._arrays = (kv + 1, rows, left)
        return batch

    def process_batch_result(self, batch, next_token_ids, stopped=()):
        if stopped:  # a stop changes what a request owes
            self._arrays = None
        return super().process_batch_result(batch, next_token_ids, stopped)

    def _process_decode(self, batch, tokens):
        finished = super()._process_decode(batch, tokens)
        if self._arrays is not None:
            kv, rows, left = self._arrays
            left = left - 1
            if finished:
                keep = left > 0
                kv, rows, left = kv[keep], rows[keep], left[keep]
            self._arrays = (kv, rows, left)
        return finished

    def _process_extend(self, batch, tokens):
        before = len(self.running)
        finished = super()._process_extend(batch, tokens)
        if self._arrays is not None and len(self.running) > before:
            self._arrays = tuple(np.concatenate(pair) for pair in zip(self._arrays, _arrays(self.running[before:])))
        return finished

    def abort(self, req: Req) -> None:
        self._arrays = None
        self._outputs.pop(req, None)
        super().abort(req)

    # A request leaving or joining the running batch from outside the loop (disaggregation) rebuilds the arrays.
    def hand_off(self, req: Req) -> None:
        super().hand_off(req)
        self._arrays = None
        self._outputs.pop(req, None)

    def add_prefilled_request(self, req: Req, stopped: bool = False) -> bool:
        finished = super().add_prefilled_request(req, stopped)
        self._arrays = None
        return finished

    def _finish(self, req: Req, finished: list[Req]) -> None:
        self._outputs.pop(req, None)
        super()._finish(req, finished)

    def check_invariants(self, held_outside: Iterable[Req] = ()) -> None:
        """The Scheduler's invariants, and the run arrays equal to what the running requests hold."""
        super().check_invariants(held_outside)
        if self._arrays is not None:
            for name, have, want in zip(("kv_len", "rows", "output tokens left"), self._arrays, _arrays(self.running)):
                if not np.array_equal(have, want):
                    raise AssertionError(f"the running batch's {name} array {have.tolist()} != its requests' "
                                         f"{want.tolist()}")

    def running_kv_tokens(self) -> int:
        """The KV tokens the running requests hold (the sum of their kv_len): what a decode step reads."""
        return int(self._run_arrays()[0].sum())

    def running_kv_lens(self) -> np.ndarray:
        """The running requests' kv_len ([bs] int64, a copy): what a decode step's window layers read is priced from."""
        return self._run_arrays()[0].copy()

    # ---- how far a run may go -----------------------------------------------------------------------------
    def pure_decode_steps(self) -> int:
        """How many of the next steps are decode steps that `run_decode` may take at once: steps that retract
        none (their slots fit in free + evictable memory), finish none before the last of them (at most the
        fewest output tokens a running request still lacks) and admit no request, with no prompt being
        prefilled in chunks. 0 when the next step is not one.

        A step admits none when none waits, when the running batch is full, or when the request at the head of
        the queue does not fit the room left: that last one `run_decode` checks again at every step and stops
        before the first that admits. A tiered cache's match may load pages back, which only the match itself
        tells, so with one a step that may admit is never taken in a run. With "lpm" it ranks the waiting window
        to find that head, as the next step would (the same order again); the timer counts that as "rank".
        """
        if self._batch is not None or self.chunked_req is not None or not self.running:
            return 0
        steps = self._fitting_decode_steps(self._fewest_left())
        if steps and self._may_admit() and not self._head_waits(self.token_allocator.available_size(),
                                                                 self._reserved_tokens(), attempt=False):
            return 0
        return steps

    def _fewest_left(self) -> int:
        return int(self._run_arrays()[2].min())

    def _may_admit(self) -> bool:
        """Whether a step would try to admit the head of the queue (a decode step would have room for it)."""
        return bool(self.waiting) and len(self.running) < self.max_running

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

    def _window_meets_tails(self) -> bool:
        """Whether a request of the ranking window may reach a running request's output pages: its kept walk
        ends where a running request's cached prefix ends (or it has none). Within a run the requests do not yet
        hold the pages the run wrote, so only a step's ranking can tell what such a walk would take."""
        tails, walk_of = self.tails, self.ranker.walk_of
        for req in islice(self.waiting, min(self.ranker.window, len(self.waiting))):
            kept = walk_of(req)
            if kept is None or (kept.walk.child is None and kept.walk.node in tails):
                return True
        return False

    def _head_waits(self, available: int, reserved: int, *, attempt: bool, ranked: bool = False,
                    stale_tails: bool = False) -> bool:
        """Whether admission fails at the head of the queue with `available` free slots and `reserved` tokens
        kept for the running requests' outputs, known from walks that change nothing in the tree; with
        `attempt`, and when it fails, then makes that failed attempt (ranking, match, lock and unlock), so that a
        run leaves the tree as the steps one by one would. False when it does not fail, or when only the real
        match can tell: a tiered cache, or a walk that ends where a running request's output pages could continue
        it (a run has not written them yet), and, without `attempt`, when the head of the last ranking still fits
        with its last walk. `ranked`: no waiting request's cached prefix changed since the last ranking, which
        would give the same order again, so it is not redone."""
        if not self._walk_tells_match:
            return False
        tree, timer = self.tree_cache, self.timer
        room = available - reserved + tree.evictable_size()
        req = self.waiting[0]
        if self.config.schedule_policy == "lpm":
            kept = self.ranker.walk_of(req)
            if not attempt and kept is not None and self._charge(req, kept.walk.num_tokens) <= room:
                # The head of the last ranking fits with its last walk: the next step all but surely admits,
                # and finding out for sure would rank the window once more before that step ranks it again.
                return False
            if not ranked:
                with timer.phase("rank"):
                    in_order = self.ranker.sort(self.waiting, take_decode_pages=False)
                if not in_order:
                    return False
            if stale_tails and self.config.cache_decode_pages and self._window_meets_tails():
                return False
            req = self.waiting[0]
            walk = self.ranker.walk_of(req).walk
        else:
            walk = tree.prefix_walk(key_bytes("key", req.match_key()), req.namespace)
        if walk.child is None and walk.node in self.tails:
            return False
        prefix = walk.num_tokens
        if self._charge(req, prefix) <= room:
            return False
        if attempt:
            with timer.phase("match"):
                self._match(req, room)
                node = req.last_node
                if req.cache_protected_len != prefix:  # the walk and the match are the same descent
                    raise RuntimeError(f"request {req.rid!r}: matched {req.cache_protected_len} tokens, walked "
                                       f"{prefix}")
                tree.lock(node)
                tree.unlock(node)
        return True

    # ---- the run --------------------------------------------------------------------------------------------
    def run_decode(self, num_steps: int, outputs: Mapping) -> DecodeRun:
        """Takes up to `num_steps` decode steps at once (1 <= num_steps <= pure_decode_steps()), as `num_steps`
        rounds of step() and process_batch_result() would, without building the batches a model reads.

        outputs[rid]: the whole output of each running request, a list of ints (what process_batch_result
        stores); the tokens after those it has are what it samples in these steps. Each request's list is
        checked the first time a run reads it and must not change while it decodes. Stops early, before a step
        that would have to retract a request or would admit one, or where only the real match can tell (see
        pure_decode_steps); step() then takes it. `steps` in the result says how many it took.
        """
        check_int("num_steps", num_steps, minimum=1)
        if self._batch is not None:
            raise RuntimeError("run_decode() called before process_batch_result() for the previous batch")
        # Only the bound a step cannot check for itself: each step checks its room and its admission again.
        if self.chunked_req is not None:
            raise ValueError(f"num_steps {num_steps} exceeds pure_decode_steps(): 0 while a prompt is prefilled "
                             f"in chunks")
        if not self.running:
            raise ValueError(f"num_steps {num_steps} exceeds pure_decode_steps(): 0 with no request running")
        fewest = self._fewest_left()
        if num_steps > fewest:
            raise ValueError(f"num_steps {num_steps} exceeds pure_decode_steps(): at most {fewest}, the fewest "
                             f"output tokens a running request lacks")
        self._check_outputs(outputs)
        timer = self.timer
        seconds = getattr(timer, "seconds", None)
        admission = 0.0 if seconds is None else seconds.get("rank", 0.0) + seconds.get("match", 0.0)
        t0 = perf_counter()
        steps, used, evictable = self._decode_steps(num_steps)
        finished = self._advance(steps) if steps else []
        if steps:  # the last step's finishes released memory
            used[steps - 1] = self.token_allocator.size - self.token_allocator.available_size()
            evictable[steps - 1] = self.tree_cache.evictable_size()
        if seconds is not None:  # its steps' admission attempts are timed as "rank" and "match", as step()'s are
            admission = seconds.get("rank", 0.0) + seconds.get("match", 0.0) - admission
            timer.add("decode_run", perf_counter() - t0 - admission)
        return DecodeRun(steps, finished, used[:steps], evictable[:steps])

    def _check_outputs(self, outputs: Mapping) -> None:
        """Reads the output list of each running request that no run has read yet: once, then kept while it
        decodes (and after a retraction), until it finishes."""
        checked = []
        for req in self.running:
            if req in self._outputs:
                continue
            try:
                out = outputs[req.rid]
            except KeyError:
                raise KeyError(f"outputs has no entry for running request {req.rid!r}") from None
            if type(out) is not list:
                raise TypeError(f"outputs[{req.rid!r}] must be a list of ints (as process_batch_result stores "
                                f"them), got {type(out).__name__}")
            if len(out) < req.max_new_tokens:
                raise ValueError(f"request {req.rid!r}: its output has {len(out)} of its {req.max_new_tokens} "
                                 f"tokens")
            token_ids(out, f"outputs[{req.rid!r}]")
            checked.append((req, out))
        for req, out in checked:
            self._outputs[req] = out

    def _decode_steps(self, num_steps: int) -> tuple[int, np.ndarray, np.ndarray]:
        """The memory side of run_decode: per step the writing check, the eviction of any shortfall and the
        slots taken, allocated and written into req_to_token as that step's decode batch would (the free list's
        order, and so which slot each request gets, depends on the evictions between the steps)."""
        reqs, tree, alloc, ps = self.running, self.tree_cache, self.token_allocator, self.page_size
        bs = len(reqs)
        kv, rows, _ = self._run_arrays()
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
            # What a component frees as requests advance (a hybrid tree's window slots), which a decode step frees
            # after its admission attempt: here before it, the only order in which a step that must retract for the
            # window is left whole to step().
            tree.decode_step(reqs, kv + j)
            need = bs if per_residue is None else int(per_residue[-j % ps])
            if not tree.can_fit(need):
                break  # this step retracts: step() takes it
            if may_admit:
                # The output tokens of the steps before this one count as generated, as a step's results count them.
                if not self._head_waits(available, int((self._tokens_left - j * bs) * self.new_token_ratio),
                                        attempt=True, ranked=ranked, stale_tails=j > 0):
                    break  # this step admits (or only the real match can tell): step() takes it
                # Within a run only an eviction changes a waiting request's cached prefix (a split by that
                # match keeps every path's tokens): until one, ranking again would give the same order.
                ranked = lpm
            if not tree.fits(need):
                ranked = False
                with self.timer.phase("evict"):
                    evicted += tree.evict_for(need)
            with self.timer.phase("alloc"):
                out = alloc_decode_slots(self.req_to_token_pool, alloc, kv + j, rows)
            if out is None:  # cannot happen: the shortfall was just evicted
                raise RuntimeError("decode-run allocation failed after eviction")
            available = alloc.available_size()
            used[j] = alloc.size - available
            evictable[j] = tree.evictable_size()
            self._decay_new_token_ratio()
            steps += 1
        self.stats.decode_batches += steps
        self.stats.evicted_tokens += evicted
        return steps, used, evictable

    def _advance(self, steps: int) -> list[Req]:
        """Writes the run's results into the running requests (their next `steps` output tokens and KV slots);
        the requests they finish go into the tree, in batch order as process_batch_result finishes them.
        Returns those."""
        kv, rows, left = self._run_arrays()
        running, outputs = self.running, self._outputs
        for req in running:
            out = req.output_ids
            n = len(out)
            out.extend(outputs[req][n:n + steps])
            req.kv_len += steps
        self._tokens_left -= steps * len(running)
        kv, left = kv + steps, left - steps
        finished = []
        if left.min() <= 0:
            done = left <= 0
            for i in np.flatnonzero(done).tolist():
                self._finish(running[i], finished)
            keep = ~done
            self.running = [req for req, kept in zip(running, keep.tolist()) if kept]
            kv, rows, left = kv[keep], rows[keep], left[keep]
        self._arrays = (kv, rows, left)
        return finished

    def _run_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The running requests' kv_len, req_to_token rows and output tokens left (each [bs] int64)."""
        if self._arrays is None:
            self._arrays = _arrays(self.running)
        return self._arrays


def _arrays(reqs: list[Req]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = len(reqs)
    return (np.fromiter((r.kv_len for r in reqs), dtype=np.int64, count=n),
            np.fromiter((r.req_pool_idx for r in reqs), dtype=np.int64, count=n),
            np.fromiter((r.max_new_tokens - len(r.output_ids) for r in reqs), dtype=np.int64, count=n))
