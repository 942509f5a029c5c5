"""Publishing event batches over ZeroMQ the way vLLM's `ZmqEventPublisher` does, so that its subscribers
(Dynamo, llm-d, vLLM's own example subscriber) read kvmem's stream unchanged.

- A PUB socket sends each batch as three frames: (topic, sequence number as 8-byte big-endian, payload).
  Sequence numbers start at 0 and grow by one per batch, so a subscriber sees a gap when it misses one.
- A ROUTER socket answers replay requests: a client (REQ, or DEALER sending an empty delimiter frame first)
  sends the first sequence number it wants as 8 bytes big-endian; every batch still in the replay buffer
  from that number on comes back as (empty, topic, seq, payload), then an end marker (empty, empty,
  -1 as 8-byte signed big-endian, empty).
- The replay buffer keeps the last `buffer_steps` batches.

Sockets belong to one background thread, started by the constructor: `publish` (any thread) encodes the
batch, numbers it, and hands it over an inproc pipe, so a replay request is answered while the engine is
idle and an encoding error surfaces in the caller. PUB never blocks: past its high-water mark (per
subscriber) ZeroMQ drops batches, and the subscriber recovers them from the replay buffer.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections import deque

from kvmem._checks import check_int
from kvmem.events.schema import EventBatch, _check_wire_format, encode_batch

try:
    import zmq
except ImportError:  # pragma: no cover - exercised only without the extra
    raise ImportError("kvmem's event publisher needs pyzmq: pip install 'kvmem[events]'") from None

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STOP = b""  # the pipe message that stops the thread (a real message always has two frames)


class ZmqEventPublisher:
    """Sends `EventBatch`es on a PUB socket and replays recent ones from a ROUTER socket (vLLM's protocol).

    Args:
        endpoint: where the PUB socket binds, e.g. "tcp://127.0.0.1:5557" (port 0: any free port; read the
            bound address from `.endpoint`), "tcp://*:5557" (all interfaces), "ipc://..." or "inproc://...".
        topic: the first frame of every message; subscribers filter on it.
        replay_endpoint: where the ROUTER socket binds; None derives it from `endpoint` (tcp: the next
            port, or any free port when `endpoint`'s port is 0; ipc/inproc: `endpoint` + "-replay").
        buffer_steps: how many past batches the replay buffer keeps.
        hwm: the PUB socket's send high-water mark, in messages per subscriber.
        data_parallel_rank: stamped on batches that carry none (as vLLM's publisher does).
        wire_format: "map" or "array", see `kvmem.events.schema`.
        context: a zmq.Context to use (default: one of its own, terminated by `close`).

    Raises ValueError naming the endpoint when a socket cannot bind (a bad address, or a port in use).
    Use it as a context manager, or call `close()`.
    """

    def __init__(self, endpoint: str = "tcp://127.0.0.1:5557", topic: str = "kv-events", *,
                 replay_endpoint: str | None = None, buffer_steps: int = 10_000, hwm: int = 100_000,
                 data_parallel_rank: int = 0, wire_format: str = "map", context: zmq.Context | None = None) -> None:
        _check_endpoint("endpoint", endpoint)
        if replay_endpoint is None:
            replay_endpoint = derive_replay_endpoint(endpoint)
        _check_endpoint("replay_endpoint", replay_endpoint)
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        self.buffer_steps = check_int("buffer_steps", buffer_steps, minimum=1)
        self.hwm = check_int("hwm", hwm, minimum=0)
        self.data_parallel_rank = check_int("data_parallel_rank", data_parallel_rank, minimum=0)
        self.wire_format = _check_wire_format(wire_format)
        self.topic = topic
        self._topic = topic.encode("utf-8")
        self._own_context = context is None
        self._ctx = zmq.Context() if context is None else context
        self._sockets: list[zmq.Socket] = []
        try:
            self._pub = self._bind(zmq.PUB, endpoint, "endpoint", sndhwm=self.hwm)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            # A full replay plus its end marker must fit the ROUTER's queue for one client; ZeroMQ credits a
            # reader's progress only every HWM/2 messages, hence twice that.
            self._router = self._bind(zmq.ROUTER, replay_endpoint, "replay_endpoint",
                                      sndhwm=2 * (self.buffer_steps + 1))
            self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            pipe = f"inproc://kvmem-event-publisher-{id(self)}"
            self._pipe_in = self._bind(zmq.PAIR, pipe, "pipe", rcvhwm=0)
            self._pipe_out = self._ctx.socket(zmq.PAIR)
            self._pipe_out.setsockopt(zmq.SNDHWM, 0)
            self._pipe_out.connect(pipe)
        except BaseException:
            self._close_sockets()
            raise
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._closed = False
        self.published = 0        # batches handed to the publisher
        self.replays_served = 0   # replay requests answered
        self.bad_replay_requests = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvmem-event-publisher", daemon=True)
        self._thread.start()

    # ---- the caller's side ------------------------------------------------------------------------
    def publish(self, batch: EventBatch) -> int:
        """Encodes `batch` (stamping `data_parallel_rank` if it has none) and queues it for sending;
        returns its sequence number. Raises RuntimeError once closed or if the sending thread failed."""
        if not isinstance(batch, EventBatch):
            raise TypeError(f"batch must be an EventBatch, got {type(batch).__name__}")
        if batch.data_parallel_rank is None:
            batch = dataclasses.replace(batch, data_parallel_rank=self.data_parallel_rank)
        payload = encode_batch(batch, self.wire_format)
        with self._lock:
            self._check_running()
            seq = next(self._seq)
            self._pipe_out.send_multipart((seq.to_bytes(8, "big"), payload))
            self.published += 1
        return seq

    def close(self, timeout: float = 5.0) -> None:
        """Sends what is queued, stops the thread and closes the sockets (idempotent). Batches still in
        ZeroMQ's queues after a short linger (0.1 s) are dropped, as vLLM's publisher drops them."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._thread.is_alive():
                self._pipe_out.send(_STOP)
        self._thread.join(timeout)
        self._close_sockets()

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ZmqEventPublisher(endpoint={self.endpoint!r}, replay_endpoint={self.replay_endpoint!r}, "
                f"topic={self.topic!r}, published={self.published}, closed={self._closed})")

    def _check_running(self) -> None:
        if self._closed:
            raise RuntimeError("publish() on a closed ZmqEventPublisher")
        if self._error is not None or not self._thread.is_alive():
            raise RuntimeError(f"the publisher's sending thread stopped: {self._error!r}")

    # ---- the thread's side ------------------------------------------------------------------------
    def _run(self) -> None:
        buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=self.buffer_steps)
        poller = zmq.Poller()
        poller.register(self._pipe_in, zmq.POLLIN)
        poller.register(self._router, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                # Everything published before a replay request arrived is sent (and buffered) before the
                # request is answered, so a replay never misses a batch its client saw published.
                if not self._send_queued(buffer):
                    return
                if self._router in ready:
                    self._serve_replay(buffer)
        except BaseException as e:  # recorded for publish() to raise; the thread must not die silently
            self._error = e

    def _send_queued(self, buffer: deque) -> bool:
        """Sends every batch waiting in the pipe; False when the stop message came."""
        while True:
            try:
                frames = self._pipe_in.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if len(frames) == 1 and frames[0] == _STOP:
                return False
            seq_bytes, payload = frames
            self._pub.send_multipart((self._topic, seq_bytes, payload))
            buffer.append((int.from_bytes(seq_bytes, "big"), seq_bytes, payload))

    def _serve_replay(self, buffer: deque) -> None:
        frames = self._router.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.bad_replay_requests += 1
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, seq_bytes, payload in buffer:
            if seq >= start:
                self._router.send_multipart((client, b"", self._topic, seq_bytes, payload))
        self.replays_served += 1  # before the end marker: a client that has it sees the count
        self._router.send_multipart((client, b"", b"", END_SEQ, b""))

    # ---- sockets ----------------------------------------------------------------------------------
    def _bind(self, kind: int, endpoint: str, name: str, **options: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        self._sockets.append(sock)
        for option, value in options.items():
            sock.setsockopt(getattr(zmq, option.upper()), value)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            raise ValueError(f"{name} {endpoint!r} cannot be bound: {e}") from None
        return sock

    def _close_sockets(self) -> None:
        for sock in self._sockets + [getattr(self, "_pipe_out", None)]:
            if sock is not None and not sock.closed:
                sock.close(linger=100 if sock is getattr(self, "_pub", None) else 0)
        if self._own_context:
            self._ctx.term()


def derive_replay_endpoint(endpoint: str) -> str:
    """The replay endpoint a publisher at `endpoint` uses by default: the next tcp port (port 0 stays 0,
    any free port), or `endpoint` + "-replay" for ipc and inproc."""
    port = _tcp_port(endpoint)
    if port is None:
        return endpoint + "-replay"
    host = endpoint[:endpoint.rfind(":")]
    return f"{host}:{0 if port == 0 else port + 1}"


def _tcp_port(endpoint: str) -> int | None:
    if not endpoint.startswith("tcp://"):
        return None
    port = endpoint[endpoint.rfind(":") + 1:]
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"endpoint {endpoint!r} must end with a tcp port (0-65535), e.g. tcp://127.0.0.1:5557")
    return int(port)


def _check_endpoint(name: str, endpoint) -> None:
    if not isinstance(endpoint, str):
        raise TypeError(f"{name} must be a str such as 'tcp://127.0.0.1:5557', got {type(endpoint).__name__}")
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"{name} must start with tcp://, ipc:// or inproc://, got {endpoint!r}")
    if _tcp_port(endpoint) is not None and endpoint.rfind(":") == len("tcp://"):
        raise ValueError(f"{name} {endpoint!r} must name a host, e.g. tcp://127.0.0.1:5557")
