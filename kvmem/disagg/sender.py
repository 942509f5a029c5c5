"""The prefill side: prefills the prompts decode sides ask for, writes their KV into the decode sides' pages, then
releases their memory.

A KVRequest becomes a request of the prefill engine (its own radix cache reuses prompt prefixes across requests).
In the step that samples its first token the request joins the engine's running batch; before the engine's next step
the sender takes it out with its memory (`Engine.hand_off`) and writes the pages of its tokens `start`.. into the
decode side's pages. When the write ends the memory goes back (the prompt's whole pages stay cached in the tree) and
the decode side gets KVDone or KVFailed. A hybrid engine's write also moves the window KV of the prompt's window tail
and the linear layers' state after the prompt (`kvmem.disagg.request_memory.RequestKV`). A cancelled request (the
decode side gave up) or one whose decode side is gone still finishes its prefill, since the engine cannot drop it
midway, and is then released without a write.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from kvmem._paging import pages_for
from kvmem.batch import Req
from kvmem.disagg.channel import Channel, LocalChannel, PeerGone
from kvmem.disagg.layout import KVLayout, engine_layout
from kvmem.disagg.messages import Cancel, Hello, KVDone, KVFailed, KVRequest, Refused, Welcome
from kvmem.disagg.request_memory import RequestKV, held_tokens, request_kv, window_start
from kvmem.disagg.transport import AllOf, EngineBuffers, KVBuffers, KVTransport, Transfer, TransferStatus

HANDSHAKE_TIMEOUT_S = 10.0
# Requests ask for two tokens: with one, the step that prefills a request also finishes it and frees its partial
# last page before the sender can write it; with two it joins the running batch, where the sender takes it out.
_PREFILL_TOKENS = 2


@dataclass
class SenderStats:
    requests: int = 0      # KVRequests whose prompt was prefilled here
    sent_pages: int = 0
    sent_bytes: int = 0
    failed: int = 0        # answered KVFailed (bad request, cancelled, failed write)


@dataclass
class _Peer:
    channel: Channel
    since: float
    buffers: EngineBuffers | None = None  # None until its Hello is accepted
    jobs: dict[int, _Job] = field(default_factory=dict)  # by the decode side's rid
    gone: bool = False


@dataclass
class _Job:
    peer: _Peer
    rid: int                # the decode side's
    start: int
    dst: RequestKV          # where the decode side wants it
    req: Req | None = None  # once handed off by the engine
    transfer: Transfer | None = None
    cancelled: bool = False


_NONE = np.empty(0, dtype=np.int64)


def _check_pages(name: str, pages, expected: int, buffers: KVBuffers) -> np.ndarray:
    """A KVRequest's page list for one pool: `expected` distinct page ids of the peer's pool, as int64."""
    array = np.asarray(pages if pages is not None else [])
    if array.ndim != 1 or len(array) != expected or (expected and array.dtype.kind not in "iu"):
        raise ValueError(f"{name} must list {expected} page ids, got {str(pages)[:80]}")
    array = array.astype(np.int64)
    if expected and (array.min() < 1 or array.max() >= buffers.num_pages or len(np.unique(array)) != expected):
        raise ValueError(f"{name} must be distinct pages in [1, {buffers.num_pages})")
    return array


class KVSender:
    """Serves KV to decode sides over `transport` from `engine` (a kvmem.engine.Engine that serves nothing else).

    Decode sides join with `accept(channel)` (a socket from a `ChannelListener`) or `connect_local()` (one in this
    process); `step()` does a round of work and never blocks. `held_tokens()` is what requests hold outside the
    engine's scheduler (handed off, being sent), so `check_invariants()` checks the prefill side's memory.
    """

    def __init__(self, engine, transport: KVTransport, *, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
        self.engine = engine
        self.transport = transport
        self.layout = engine_layout(engine)
        self.pools = EngineBuffers.register(transport, engine)
        self.buffers = self.pools.kv  # the KV pool's registration, as before hybrid engines
        self.handshake_timeout_s = handshake_timeout_s
        self.stats = SenderStats()
        self._peers: list[_Peer] = []
        self._jobs: dict[int, _Job] = {}  # by the engine's rid
        self._sending: list[_Job] = []

    # ---- peers ------------------------------------------------------------------------------------------
    def accept(self, channel: Channel) -> None:
        """Takes a decode side that connected on `channel`; its handshake goes on in `step()` (a peer that sends
        no Hello within handshake_timeout_s is dropped)."""
        self._peers.append(_Peer(channel, time.monotonic()))

    def connect_local(self) -> LocalChannel:
        """A channel to this sender for a decode side in this process: listening on it runs this sender's step."""
        decode_end, prefill_end = LocalChannel.pair(peer_step=self.step)
        self.accept(prefill_end)
        return decode_end

    def _handshake(self, peer: _Peer, msg) -> None:
        """Answers a Hello: Welcome when the peer's layout is ours and its KV endpoint answers, else Refused (the
        reason names the first difference) and the peer is dropped; nothing of it is loaded either way."""
        try:
            if not isinstance(msg, Hello):
                raise ValueError(f"expected Hello, got {type(msg).__name__}")
            difference = self.layout.mismatch(KVLayout.from_dict(msg.layout))
            if difference:
                raise ValueError(f"KV layouts differ: {difference}")
            buffers = self._peer_buffers(msg)
            for b in buffers:
                if b is not None:
                    self.transport.check_peer(b)
        except (ValueError, RuntimeError) as e:
            self._send(peer, Refused(f"the prefill side refused: {e}", self.layout.to_dict()))
            self._drop(peer)
            return
        peer.buffers = buffers
        self._send(peer, Welcome(self.layout.to_dict()))

    def _peer_buffers(self, msg: Hello) -> EngineBuffers:
        """The pools a Hello names, one for each of ours (ValueError for a missing or extra one)."""
        ends = []
        for name, mine, theirs in zip(("KV", "window", "state"), self.pools,
                                      (msg.buffers, msg.window_buffers, msg.state_buffers)):
            if (mine is None) != (theirs is None):
                raise ValueError(f"the peer {'sent no' if theirs is None else 'sent a'} {name} pool; this side has "
                                 f"{'one' if mine is not None else 'none'}")
            ends.append(None if theirs is None else KVBuffers.from_dict(theirs))
        return EngineBuffers(*ends)

    def _drop(self, peer: _Peer) -> None:
        """Forgets a peer: its requests are cancelled (released once their prefill or write ends, unanswered)."""
        if peer.gone:
            return
        peer.gone = True
        peer.channel.close()
        self._peers.remove(peer)
        for job in peer.jobs.values():
            job.cancelled = True

    def _send(self, peer: _Peer, msg) -> None:
        if peer.gone:
            return
        try:
            peer.channel.send(msg)
        except PeerGone:
            self._drop(peer)

    # ---- the loop ---------------------------------------------------------------------------------------
    def step(self) -> bool:
        """Reads every peer's messages, runs one engine step when there is work, takes out the requests it prefilled
        and starts their writes, and answers the writes that ended. Returns whether the engine ran a batch (it runs
        none while requests being sent hold the memory the next prompt needs)."""
        for peer in list(self._peers):
            self._read(peer)
        ran = False
        if not self.engine.is_idle():
            batches = self.engine.stats.prefill_batches
            self.engine.step()  # its requests never finish inside it: they are handed off below
            ran = self.engine.stats.prefill_batches > batches
            self._hand_off()
        self._poll_writes()
        return ran

    def _read(self, peer: _Peer) -> None:
        try:
            messages = peer.channel.recv()
        except PeerGone:
            self._drop(peer)
            return
        if peer.buffers is None and not messages and time.monotonic() - peer.since > self.handshake_timeout_s:
            self._drop(peer)
        for msg in messages:
            if peer.gone:
                return
            if peer.buffers is None:
                self._handshake(peer, msg)
            elif isinstance(msg, KVRequest):
                self._start(peer, msg)
            elif isinstance(msg, Cancel) and msg.rid in peer.jobs:
                peer.jobs[msg.rid].cancelled = True
            elif not isinstance(msg, Cancel):  # a Cancel for a request already answered crossed the answer
                self._drop(peer)  # anything else breaks the protocol

    def _start(self, peer: _Peer, msg: KVRequest) -> None:
        """Queues a KVRequest's prompt in the engine, or answers KVFailed naming what is wrong with it."""
        try:
            if not isinstance(msg.rid, int) or msg.rid in peer.jobs:
                raise ValueError(f"rid {msg.rid!r} is not a new integer id")
            dst = self._check_request(peer, msg)
            rid = self.engine.add_request(msg.input_ids, _PREFILL_TOKENS, stop_token_ids=())
        except (ValueError, TypeError) as e:
            self.stats.failed += 1
            self._send(peer, KVFailed(msg.rid if isinstance(msg.rid, int) else -1, f"bad KV request: {e}"))
            return
        job = _Job(peer, msg.rid, msg.start, dst)
        peer.jobs[msg.rid] = job
        self._jobs[rid] = job

    def _check_request(self, peer: _Peer, msg: KVRequest) -> RequestKV:
        ps = self.layout.page_size
        prompt = len(msg.input_ids) if isinstance(msg.input_ids, list) else -1
        if not isinstance(msg.start, int) or not 0 <= msg.start <= prompt or msg.start % ps:
            raise ValueError(f"start {msg.start!r} is not a multiple of {ps} within the {prompt}-token prompt")
        pages = _check_pages("dst_pages", msg.dst_pages, pages_for(prompt - msg.start, ps), peer.buffers.kv)
        window = _NONE
        if peer.buffers.window is not None:
            tail = pages_for(prompt - window_start(self.engine.tree_cache, msg.start, prompt), ps)
            window = _check_pages("dst_window_pages", msg.dst_window_pages, tail, peer.buffers.window)
        elif msg.dst_window_pages:
            raise ValueError("dst_window_pages for an engine without window layers")
        slots = peer.buffers.state.num_pages if peer.buffers.state is not None else 1
        if isinstance(msg.dst_state_slot, bool) or not isinstance(msg.dst_state_slot, int) or \
                not (0 < msg.dst_state_slot < slots if slots > 1 else msg.dst_state_slot == 0):
            raise ValueError(f"dst_state_slot {msg.dst_state_slot!r} is not " +
                             (f"a state slot in [1, {slots})" if slots > 1 else "0 (no linear layers)"))
        return RequestKV(pages, window, msg.dst_state_slot)

    def _hand_off(self) -> None:
        """Takes out the requests the engine has just prefilled and starts their writes."""
        engine = self.engine
        for req in [r for r in engine.scheduler.running if r.rid in self._jobs]:
            job = self._jobs[req.rid]
            engine.hand_off(req)
            job.req = req
            self.stats.requests += 1
            if job.cancelled:
                self._finish(job, KVFailed(job.rid, "cancelled"))
                continue
            src = request_kv(req, engine.req_to_token_pool, engine.tree_cache, job.start)
            if not src.window_pages.all():  # the prefill's lock keeps the window tail: a bug, never a wrong token
                self._finish(job, KVFailed(job.rid, "the window KV of the prompt's window tail is gone here"))
                continue
            job.transfer = self._write(src, job.peer.buffers, job.dst)
            self._sending.append(job)

    def _write(self, src: RequestKV, peer: EngineBuffers, dst: RequestKV) -> Transfer:
        """One write for the full pages, and a hybrid engine's window pages and state."""
        mine, write = self.pools, self.transport.write
        writes = [write(mine.kv, src.pages, peer.kv, dst.pages)]
        if mine.window is not None:
            writes.append(write(mine.window, src.window_pages, peer.window, dst.window_pages))
        if mine.state is not None:
            writes.append(write(mine.state, [src.state_slot], peer.state, [dst.state_slot]))
        return writes[0] if len(writes) == 1 else AllOf(writes)

    def _poll_writes(self) -> None:
        still = []
        for job in self._sending:
            status = job.transfer.poll()
            if status is TransferStatus.PENDING:
                still.append(job)
            elif status is TransferStatus.DONE:
                layout, dst = self.layout, job.dst
                self.stats.sent_pages += len(dst.pages)
                self.stats.sent_bytes += len(dst.pages) * layout.bytes_per_page + len(dst.window_pages) * \
                    layout.window_bytes_per_page + (layout.state_bytes if dst.state_slot else 0)
                self._finish(job, KVDone(job.rid, job.req.output_ids[0]))
            else:
                self._finish(job, KVFailed(job.rid, job.transfer.error))
        self._sending = still

    def _finish(self, job: _Job, answer: KVDone | KVFailed) -> None:
        """Releases a handed-off request (its prompt's whole pages stay cached) and answers its decode side."""
        self.engine.release_handed_off(job.req)
        del self._jobs[job.req.rid]
        del job.peer.jobs[job.rid]
        if isinstance(answer, KVFailed):
            self.stats.failed += 1
        self._send(job.peer, answer)

    # ---- state ------------------------------------------------------------------------------------------
    def channels(self) -> list[Channel]:
        """The channels of the decode sides it serves (a server waits on them when idle)."""
        return [peer.channel for peer in self._peers]

    def is_idle(self) -> bool:
        """No request queued, prefilling or being sent."""
        return not self._jobs

    def held_tokens(self) -> int:
        """Slots held by requests taken out of the engine (their partial last pages, while being sent)."""
        return sum(held_tokens(job.req, self.layout.page_size) for job in self._sending)

    def check_invariants(self) -> None:
        """The engine's invariants, counting what requests being sent hold: free + evictable + protected + held ==
        total, in every pool."""
        self.engine.scheduler.check_invariants(held_outside=[job.req for job in self._sending])

    def close(self) -> None:
        """Drops every peer and ends the pool's registration (requests still in flight are not waited for)."""
        for peer in list(self._peers):
            self._drop(peer)
        self.pools.unregister(self.transport)
