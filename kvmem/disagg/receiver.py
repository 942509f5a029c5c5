"""The decode side: matches each prompt in its own radix cache, gives it memory for the pages beyond the match, asks
the prefill side for exactly those pages, and admits the request to decode once they have arrived.

A request goes QUEUED (no memory) -> RECEIVING (its row: the tree's matched prefix, then its own pages, which the
prefill side writes; a KVRequest sent) -> admitted (`Engine.add_prefilled_request`, with the first token the prefill
side sampled; the received pages enter this side's tree as the prompt of any request prefilled here would). A hybrid
engine's request also receives its window tail's window KV and its linear layers' state. A request
whose KV does not come within kv_timeout_s, or that is aborted, is CANCELLING: its pages stay held until the prefill
side answers (its answer comes once its write has ended, so nothing lands in pages given to another request) or is
gone; a prefill side that does not answer within cancel_timeout_s is dropped as gone. A request that ends without
output is in `failed`, with the reason.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmem._checks import check_number
from kvmem.batch import Req
from kvmem.disagg.channel import Channel, PeerGone
from kvmem.disagg.layout import KVLayout, engine_layout
from kvmem.disagg.messages import Cancel, Hello, KVDone, KVFailed, KVRequest, Refused, Welcome
from kvmem.disagg.request_memory import held_tokens, preallocate, release, request_kv
from kvmem.disagg.transport import EngineBuffers, KVTransport

KV_TIMEOUT_S = 60.0
CANCEL_TIMEOUT_S = 60.0
HANDSHAKE_TIMEOUT_S = 10.0
_IDLE_WAIT_S = 0.05


@dataclass
class ReceiverStats:
    requests: int = 0        # admitted with received KV
    prompt_tokens: int = 0   # of those requests
    cached_tokens: int = 0   # prompt tokens this side's tree held: not asked for
    received_pages: int = 0
    received_bytes: int = 0


@dataclass
class _Pending:
    req: Req
    deadline: float = 0.0
    reason: str = ""  # why it is being cancelled


class KVReceiver:
    """Decodes with `engine` (a kvmem.engine.Engine that serves nothing else) what the prefill side at the other end
    of `channel` prefills, its KV written into this engine's pool over `transport`.

    The constructor registers the pool and shakes hands: it raises ValueError (one line, the first difference) when
    the prefill side's KV layout (page size, model, dtype, layer count, head shapes, KV cache dtype; a hybrid
    engine's layer kinds, window and state shapes) is not this one's, and RuntimeError when the prefill side does
    not answer or refuses; nothing is allocated before.
    """

    def __init__(self, engine, transport: KVTransport, channel: Channel, *, kv_timeout_s: float = KV_TIMEOUT_S,
                 cancel_timeout_s: float = CANCEL_TIMEOUT_S, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
        self.kv_timeout_s = check_number("kv_timeout_s", kv_timeout_s, 0, allow_minimum=False)
        self.cancel_timeout_s = check_number("cancel_timeout_s", cancel_timeout_s, 0, allow_minimum=False)
        self.engine = engine
        self.transport = transport
        self.layout = engine_layout(engine)
        self.pools = EngineBuffers.register(transport, engine)
        self.buffers = self.pools.kv  # the KV pool's registration, as before hybrid engines
        self._channel = channel
        try:
            self._handshake(check_number("handshake_timeout_s", handshake_timeout_s, 0, allow_minimum=False))
        except BaseException:
            channel.close()
            self.pools.unregister(transport)
            raise
        self.stats = ReceiverStats()
        self.failed: dict[int, str] = {}
        self._queue: deque[_Pending] = deque()
        self._receiving: dict[int, _Pending] = {}
        self._cancelling: dict[int, _Pending] = {}
        self._gone = ""  # why the prefill side is gone, once it is

    def _handshake(self, timeout_s: float) -> None:
        try:
            reply = self._channel.request(Hello(self.layout.to_dict(), *self.pools.to_dicts()), timeout_s)
        except PeerGone as e:
            raise RuntimeError(f"the prefill side went away during the handshake: {e}") from None
        if not isinstance(reply, (Welcome, Refused)):
            raise RuntimeError(f"the prefill side answered the handshake with {type(reply).__name__}")
        difference = self.layout.mismatch(KVLayout.from_dict(reply.layout))
        if difference:
            raise ValueError(f"KV layouts differ: {difference}")
        if isinstance(reply, Refused):
            raise RuntimeError(reply.reason)

    # ---- requests ---------------------------------------------------------------------------------------
    def add_request(self, input_ids: Sequence[int], max_new_tokens: int) -> int:
        """Queues a prompt (checked as `Engine.add_request` checks it: ValueError naming the request when it cannot
        fit this engine's context or pool, nothing queued) and returns its request id. It stops at the model's EOS.
        RuntimeError once the prefill side is gone."""
        if self._gone:
            raise RuntimeError(f"the prefill side is gone: {self._gone}")
        req = self.engine.new_req(input_ids, max_new_tokens)
        self._queue.append(_Pending(req))
        return req.rid

    def abort(self, rid: int) -> None:
        """Drops a request that has not been admitted yet (queued, or waiting for its KV: then cancelled, its pages
        freed once the prefill side answers). ValueError for any other id, such as one decoding already."""
        for pending in self._queue:
            if pending.req.rid == rid:
                self._queue.remove(pending)
                self.failed[rid] = "aborted"
                return
        if rid in self._receiving:
            self._cancel(self._receiving.pop(rid), "aborted")
        elif rid not in self._cancelling:
            raise ValueError(f"request {rid!r} is not waiting for its KV here")

    # ---- the loop ---------------------------------------------------------------------------------------
    def step(self) -> list:
        """Reads the prefill side's answers (admitting the requests whose KV arrived), cancels the overdue ones, gives
        queued requests memory and asks for their KV, and runs one engine step when there is work; returns the
        RequestOutputs of the requests that finished."""
        outputs = []
        self._read(outputs)
        self._expire()
        if not self.engine.scheduler.waiting:  # requests retracted here resume before new ones take memory
            self._preallocate()
        if self._engine_has_work():
            outputs += self.engine.step()
        return outputs

    def _engine_has_work(self) -> bool:
        """Whether an engine step would run a batch. Retracted requests waiting alone may have to wait for memory
        that requests receiving their KV hold: they resume once those join the running batch or fail."""
        sched = self.engine.scheduler
        return bool(sched.running) or sched.chunked_req is not None or \
            bool(sched.waiting) and not (self._receiving or self._cancelling)

    def _read(self, outputs: list) -> None:
        if self._gone:
            return
        try:
            messages = self._channel.recv()
        except PeerGone as e:
            self._peer_gone(str(e))
            return
        for msg in messages:
            rid = getattr(msg, "rid", None)
            if not isinstance(msg, (KVDone, KVFailed)) or not isinstance(rid, int) or \
                    (rid not in self._receiving and rid not in self._cancelling):
                self._peer_gone(f"the prefill side broke the protocol with {msg!r:.80}")
                return
            pending = self._receiving.pop(rid, None)
            if pending is None:  # cancelled: its answer only says the pages are free again
                self._fail(self._cancelling.pop(rid), "")
            elif isinstance(msg, KVFailed):
                self._fail(pending, f"the prefill side failed: {msg.reason}")
            elif not isinstance(msg.first_token, int) or not 0 <= msg.first_token < self.engine.adapter.vocab_size:
                self._fail(pending, f"the prefill side sent first token {msg.first_token!r}, outside the vocabulary")
            else:
                self._admit(pending.req, msg.first_token, outputs)

    def _admit(self, req: Req, first_token: int, outputs: list) -> None:
        stats = self.stats
        stats.requests += 1
        stats.prompt_tokens += len(req.input_ids)
        stats.cached_tokens += req.cache_protected_len
        kv, layout = request_kv(req, self.engine.req_to_token_pool, self.engine.tree_cache, req.cache_protected_len), \
            self.layout
        stats.received_pages += len(kv.pages)
        stats.received_bytes += len(kv.pages) * layout.bytes_per_page + len(kv.window_pages) * \
            layout.window_bytes_per_page + (layout.state_bytes if kv.state_slot else 0)
        req.output_ids.append(first_token)
        out = self.engine.add_prefilled_request(req)
        if out is not None:
            outputs.append(out)

    def _expire(self) -> None:
        if self._gone:
            return
        now = time.monotonic()
        for rid in [rid for rid, p in self._receiving.items() if p.deadline <= now]:
            self._cancel(self._receiving.pop(rid), f"no KV within {self.kv_timeout_s} s")
        if any(p.deadline <= now for p in self._cancelling.values()):
            self._peer_gone(f"the prefill side did not answer a cancel within {self.cancel_timeout_s} s")

    def _cancel(self, pending: _Pending, reason: str) -> None:
        pending.reason = reason
        pending.deadline = time.monotonic() + self.cancel_timeout_s
        self._cancelling[pending.req.rid] = pending
        try:
            self._channel.send(Cancel(pending.req.rid))
        except PeerGone as e:
            self._peer_gone(str(e))

    def _preallocate(self) -> None:
        engine = self.engine
        # Room for one more page per running request: a decode step after these allocations needs no retraction.
        reserve = engine.token_allocator.page_size * len(engine.scheduler.running)
        while self._queue and not self._gone:
            req = self._queue[0].req
            start = preallocate(req, engine.req_to_token_pool, engine.token_allocator, engine.tree_cache,
                                reserve_tokens=reserve)
            if start is None:
                return
            pending = self._queue.popleft()
            pending.deadline = time.monotonic() + self.kv_timeout_s
            self._receiving[req.rid] = pending
            kv = request_kv(req, engine.req_to_token_pool, engine.tree_cache, start)
            window = kv.window_pages.tolist() if self.pools.window is not None else None
            try:
                self._channel.send(KVRequest(req.rid, req.input_ids.tolist(), start, kv.pages.tolist(), window,
                                             kv.state_slot))
            except PeerGone as e:
                self._peer_gone(str(e))

    def _fail(self, pending: _Pending, reason: str) -> None:
        """Frees a request's pages (nothing of it enters the tree: its KV may be partial) and records why it ended."""
        release(pending.req, self.engine.tree_cache, cache=False)
        self.failed[pending.req.rid] = pending.reason or reason

    def _peer_gone(self, reason: str) -> None:
        """The prefill side is gone: nothing more lands from it, so every request's pages are freed; every request
        not admitted fails."""
        self._gone = reason
        self._channel.close()
        for pending in [*self._receiving.values(), *self._cancelling.values()]:
            self._fail(pending, f"the prefill side is gone: {reason}")
        self._receiving.clear()
        self._cancelling.clear()
        for pending in self._queue:
            self.failed[pending.req.rid] = f"the prefill side is gone: {reason}"
        self._queue.clear()

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy outputs of `prompts`, in order (see add_request); needs an idle receiver. Raises RuntimeError naming
        the first request that failed, once every request has ended (no memory is left held)."""
        if not self.is_idle():
            raise RuntimeError("generate() needs an idle receiver")
        if self._gone:
            raise RuntimeError(f"the prefill side is gone: {self._gone}")
        reqs = []
        for i, prompt in enumerate(prompts):  # all checked before any is queued
            try:
                reqs.append(self.engine.new_req(prompt, max_new_tokens))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        self._queue.extend(_Pending(req) for req in reqs)
        rids = [req.rid for req in reqs]
        outputs = self.run_until_idle()
        failures = [f"request {rid}: {self.failed[rid]}" for rid in rids if rid in self.failed]
        if failures:
            raise RuntimeError(f"{len(failures)} of {len(rids)} requests failed; {failures[0]}")
        return [outputs[rid] for rid in rids]

    def run_until_idle(self, on_step: Callable[[], None] | None = None) -> dict[int, list[int]]:
        """Steps until every request has ended; returns the finished ones' output ids by rid. `on_step` runs after
        each step (tests check invariants there). Every wait is bounded by the timeouts."""
        outputs = {}
        while not self.is_idle():
            for out in self.step():
                outputs[out.rid] = out.output_ids
            if on_step is not None:
                on_step()
            if not self._engine_has_work() and not self._gone and (self._receiving or self._cancelling):
                self._channel.wait(_IDLE_WAIT_S)
        return outputs

    # ---- state ------------------------------------------------------------------------------------------
    def is_idle(self) -> bool:
        return not (self._queue or self._receiving or self._cancelling) and self.engine.is_idle()

    def held_tokens(self) -> int:
        """Slots held by requests waiting for their KV (beyond their cached prefix)."""
        ps = self.layout.page_size
        return sum(held_tokens(p.req, ps) for p in [*self._receiving.values(), *self._cancelling.values()])

    def check_invariants(self) -> None:
        """The engine's invariants, counting what requests waiting for their KV hold: free + evictable + protected +
        held == total, in every pool."""
        waiting = [p.req for p in [*self._receiving.values(), *self._cancelling.values()]]
        self.engine.scheduler.check_invariants(held_outside=waiting)

    def close(self) -> None:
        """Cancels what waits for KV, waits (within cancel_timeout_s) for the prefill side to let go of its pages,
        then closes the channel and ends the registration. Requests already admitted are left to the engine."""
        for pending in list(self._queue):
            self.abort(pending.req.rid)
        for rid in list(self._receiving):
            self._cancel(self._receiving.pop(rid), "closed")
        while self._cancelling and not self._gone:
            self._read([])
            self._expire()
            if self._cancelling:
                self._channel.wait(_IDLE_WAIT_S)
        self._channel.close()
        self.pools.unregister(self.transport)
