"""Following one replica's event stream (vLLM's PUB + ROUTER-replay protocol) into an index of its blocks.

A subscriber applies batches strictly in sequence order, so the index it feeds is always the replica's
cache as of some step, or a subset of it (never a block the replica does not hold):

- a batch numbered below the next expected one is a duplicate (a replay and the live stream overlap): skipped;
- a batch numbered above it reveals a gap (the high-water mark dropped batches, or the subscriber joined
  late): the missing ones are asked for on the replay socket and applied in order;
- a batch the index refuses (raises in `apply`) is not skipped: the error reaches the caller, and the
  batch is applied again at the next gap's replay;
- batches the replay buffer no longer holds, or a payload that does not decode, cannot be applied: the
  subscriber clears the replica in the index (as an `AllBlocksCleared` would) and goes on from the next
  batch, counting what it lost. From then on the index holds only blocks stored after the loss, which
  are all still held unless a later event says otherwise;
- a live batch numbered at or below the last live one is a new stream: the engine restarted (its cache
  is empty, its publisher numbers from 0 again). The replica is cleared and followed from 0. The stream
  carries no epoch, so a restart is seen only so: one whose first batch seen here is numbered above the
  old stream's last looks like a gap, and one before any live batch was seen, like duplicates.

Replays are read in both forms engines send: (b"", topic, seq, payload), as vLLM and SGLang now do, and
the older (b"", seq, payload).

Sequence numbers are 8 bytes unsigned; the top one, 2**64-1, is the replay's end marker (-1 signed), so no
batch can carry it: a live frame numbered so counts as malformed and changes nothing.

Every wait is bounded by a timeout; nothing blocks forever.
"""

from __future__ import annotations

import time
from typing import Protocol

from kvmem._checks import check_int, check_number
from kvmem.events.publisher import END_SEQ, _check_endpoint, derive_replay_endpoint
from kvmem.events.schema import EventBatch, EventDecodeError, decode_batch

try:
    import zmq
except ImportError:  # pragma: no cover - exercised only without the extra
    raise ImportError("kvmem's event subscriber needs pyzmq: pip install 'kvmem[events]'") from None


LAST_SEQ = 2**64 - 2  # the last sequence number a batch can carry: the one above is the replay's end marker


class EventIndex(Protocol):
    """What a subscriber feeds (`kvmem.router.BlockIndex` is one)."""

    def apply(self, replica: int, batch: EventBatch) -> None: ...

    def clear(self, replica: int) -> None: ...


class KVEventSubscriber:
    """Subscribes to one publisher and keeps `index`'s view of `replica` in step with it.

    Args:
        endpoint: the publisher's PUB address (its `.endpoint`).
        index: what to apply batches to; `replica` is this publisher's replica number in it.
        replay_endpoint: the publisher's ROUTER address (None: derived as the publisher derives it).
        topic: the topic to follow (exact match; ZeroMQ's own filter is a prefix match).
        hwm: the SUB socket's receive high-water mark, in messages.
        replay_timeout: seconds to wait for a replay's end marker.
        context: a zmq.Context to use (default: one of its own, terminated by `close`).

    Counters: `received` (batches that came on the live stream), `missed` (sequence numbers the live
    stream skipped: dropped at a high-water mark, or sent before this subscriber joined), `applied`
    (batches applied), `replayed` (of which from a replay), `duplicates` (batches skipped, already
    applied), `lost` (batches neither stream delivered), `malformed` (frames or payloads that did not
    decode), `clears` (times the replica was cleared to resynchronise), `restarts` (new streams seen: of
    those clears, the ones for an engine that restarted), `next_seq` (the next sequence number it will apply).
    """

    def __init__(self, endpoint: str, index: EventIndex, replica: int, *, replay_endpoint: str | None = None,
                 topic: str = "kv-events", hwm: int = 100_000, replay_timeout: float = 2.0,
                 context: zmq.Context | None = None) -> None:
        _check_endpoint("endpoint", endpoint)
        if replay_endpoint is None:
            replay_endpoint = derive_replay_endpoint(endpoint)
        _check_endpoint("replay_endpoint", replay_endpoint)
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        if not (callable(getattr(index, "apply", None)) and callable(getattr(index, "clear", None))):
            raise TypeError(f"index must have apply(replica, batch) and clear(replica), got {type(index).__name__}")
        # An index that knows its replicas refuses this one now, not at the first batch.
        num_replicas = getattr(index, "num_replicas", None)
        maximum = None if num_replicas is None else num_replicas - 1
        self.replica = check_int("replica", replica, minimum=0, maximum=maximum)
        self.index = index
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self._topic = topic.encode("utf-8")
        self.replay_timeout = check_number("replay_timeout", replay_timeout, 0, allow_minimum=False)
        hwm = check_int("hwm", hwm, minimum=0)
        self._own_context = context is None
        self._ctx = zmq.Context() if context is None else context
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, hwm)
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._sub.connect(endpoint)
        self.next_seq = 0
        self._last_live: int | None = None
        self.received = self.missed = self.applied = self.replayed = self.duplicates = self.lost = 0
        self.malformed = self.clears = self.restarts = 0
        self._closed = False

    # ---- receiving --------------------------------------------------------------------------------
    def poll(self, timeout: float = 0.0) -> int:
        """Waits up to `timeout` seconds for the first batch, applies it and every batch already waiting,
        filling gaps through replay; returns how many batches were applied."""
        timeout = check_number("timeout", timeout, 0)
        self._check_open()
        before = self.applied
        wait_ms = int(timeout * 1000)
        while self._sub.poll(wait_ms):
            wait_ms = 0
            self._on_frames(self._sub.recv_multipart())
        return self.applied - before

    def sync(self) -> bool:
        """Asks the replay socket for every batch from `next_seq` on and applies them (a late joiner
        calls this first). Returns False if the replay's end marker did not come within `replay_timeout`
        (what arrived is applied; the rest comes from the live stream or a later sync)."""
        self._check_open()
        dealer = self._ctx.socket(zmq.DEALER)
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
            deadline = time.monotonic() + self.replay_timeout
            while (left := deadline - time.monotonic()) > 0 and dealer.poll(int(left * 1000) + 1):
                frames = dealer.recv_multipart()
                if len(frames) not in (3, 4) or frames[0] != b"" or len(frames[-2]) != 8:
                    self.malformed += 1
                    continue
                if frames[-2] == END_SEQ:
                    return True
                self._receive(int.from_bytes(frames[-2], "big"), frames[-1], replayed=True)
            return False
        finally:
            dealer.close(linger=0)

    def catch_up(self, seq: int, timeout: float = 5.0) -> bool:
        """Applies batches until batch `seq` (at most 2**64-2, the last a batch can carry) is applied (or lost
        and resynchronised past); True then, False if `timeout` seconds pass first. When the live stream goes
        quiet before that (its last batches dropped, or published before this subscription took effect) it asks
        for a replay."""
        seq = check_int("seq", seq, minimum=0, maximum=LAST_SEQ)
        deadline = time.monotonic() + check_number("timeout", timeout, 0)
        self.poll()  # what has arrived first: it may be a restarted engine's stream, numbered from 0 again
        while self.next_seq <= seq:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if not self.poll(min(left, 0.05)) and self.next_seq <= seq:
                self.sync()
        return True

    def close(self) -> None:
        """Closes the socket (and the context it made); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._sub.close(linger=0)
        if self._own_context:
            self._ctx.term()

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"KVEventSubscriber(endpoint={self.endpoint!r}, replica={self.replica}, next_seq={self.next_seq}, "
                f"applied={self.applied}, missed={self.missed}, lost={self.lost}, clears={self.clears})")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("KVEventSubscriber is closed")

    # ---- ordering ---------------------------------------------------------------------------------
    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.malformed += 1
            return
        if frames[0] != self._topic:
            return  # another topic that shares this one's prefix
        if frames[1] == END_SEQ:  # no batch is numbered so (the module docstring); next_seq stays in range
            self.malformed += 1
            return
        seq = int.from_bytes(frames[1], "big")
        self.received += 1
        if self._last_live is not None and seq <= self._last_live:  # the engine restarted: a new stream
            self.restarts += 1
            self._resynchronise(lost=0)
            self.next_seq, self._last_live = 0, None
        expected = self.next_seq if self._last_live is None else self._last_live + 1
        self.missed += max(0, seq - expected)
        self._last_live = seq
        if seq > self.next_seq:
            self.sync()
        self._receive(seq, frames[2], replayed=False)

    def _receive(self, seq: int, payload: bytes, replayed: bool) -> None:
        """Applies batch `seq` if it is the next one; a later one means the ones between are lost."""
        if seq < self.next_seq:
            self.duplicates += 1
            return
        if seq > self.next_seq:
            self._resynchronise(lost=seq - self.next_seq)
        try:
            batch = decode_batch(payload)
        except EventDecodeError:
            self.malformed += 1
            self._resynchronise(lost=1)
            self.next_seq = seq + 1
            return
        self.index.apply(self.replica, batch)
        self.next_seq = seq + 1  # only once applied: a batch the index refused is not skipped
        self.applied += 1
        self.replayed += replayed

    def _resynchronise(self, lost: int) -> None:
        self.lost += lost
        self.clears += 1
        self.index.clear(self.replica)
