"""The control channel between a decode side and a prefill side: small messages, never a payload of KV.

Messages (`kvmem.disagg.messages`) go as they are between the two ends of a `LocalChannel` (one process), or as
JSON lines over a TCP socket on 127.0.0.1 (`connect`, `ChannelListener`). Neither end ever blocks without a bound:
`recv` returns what has arrived, `wait` waits at most its timeout, `send` gives up after `send_timeout_s`. A closed,
reset or misbehaving peer surfaces as `PeerGone`, once, with the reason.
"""

from __future__ import annotations

import select
import socket
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable

from kvmem._checks import check_number
from kvmem.disagg.messages import Message, decode_message, encode_message

SEND_TIMEOUT_S = 10.0


class PeerGone(Exception):
    """The other end closed, reset or broke the protocol; the message says which."""


class Channel(ABC):
    @abstractmethod
    def send(self, msg: Message) -> None:
        """Sends `msg`; raises PeerGone when the peer is gone."""

    @abstractmethod
    def recv(self) -> list[Message]:
        """The messages that have arrived, without waiting ([] for none); raises PeerGone once the peer is gone and
        everything it sent has been read."""

    @abstractmethod
    def wait(self, timeout_s: float) -> None:
        """Returns when a message (or the peer's going) can be read, or after `timeout_s` seconds."""

    @abstractmethod
    def close(self) -> None:
        """Closes this end; the peer then reads PeerGone."""

    def request(self, msg: Message, timeout_s: float) -> Message:
        """Sends `msg` and returns the first message that comes back within `timeout_s` seconds; RuntimeError
        (one line) when none does, PeerGone when the peer goes."""
        self.send(msg)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            self.wait(left)
            got = self.recv()
            if got:
                return got[0]
        raise RuntimeError(f"the peer sent no answer within {timeout_s} s")


class LocalChannel(Channel):
    """One end of an in-process pair (`LocalChannel.pair`). `peer_step`, when given, runs before each `recv` and
    during `wait`: the other end's owner gets its turn whenever this end listens (one thread serves both)."""

    def __init__(self, inbox: deque, outbox: deque, closed: list[bool], side: int,
                 peer_step: Callable[[], None] | None) -> None:
        self._inbox, self._outbox, self._peer_step = inbox, outbox, peer_step
        self._state, self._side = closed, side  # closed[side]: this end closed; closed[1 - side]: the peer's

    @classmethod
    def pair(cls, peer_step: Callable[[], None] | None = None) -> tuple[LocalChannel, LocalChannel]:
        """(a, b): what a sends b reads and back; `peer_step` runs when a listens (see the class docstring)."""
        to_a, to_b, closed = deque(), deque(), [False, False]
        return cls(to_a, to_b, closed, 0, peer_step), cls(to_b, to_a, closed, 1, None)

    def _peer_closed(self) -> bool:
        return self._state[1 - self._side]

    def send(self, msg: Message) -> None:
        if self._state[self._side]:
            raise PeerGone("this end is closed")
        if self._peer_closed():
            raise PeerGone("the peer closed the channel")
        self._outbox.append(msg)

    def recv(self) -> list[Message]:
        if self._peer_step is not None and not self._state[self._side]:
            self._peer_step()
        if self._inbox:
            got = list(self._inbox)
            self._inbox.clear()
            return got
        if self._peer_closed() or self._state[self._side]:
            raise PeerGone("the peer closed the channel")
        return []

    def wait(self, timeout_s: float) -> None:
        # With a peer to step, its step is what brings messages: recv runs it; nothing else can arrive meanwhile.
        if self._peer_step is None and not self._inbox and timeout_s > 0:
            time.sleep(min(timeout_s, 1e-3))

    def close(self) -> None:
        self._state[self._side] = True


class SocketChannel(Channel):
    """JSON lines over a connected TCP socket (see `connect` and `ChannelListener.accept`)."""

    def __init__(self, sock: socket.socket, send_timeout_s: float = SEND_TIMEOUT_S) -> None:
        self._sock = sock
        self._sock.settimeout(send_timeout_s)
        self._buffer = b""
        self._eof = ""
        self.peer = "{}:{}".format(*sock.getpeername()[:2])

    def fileno(self) -> int:
        return self._sock.fileno()

    def send(self, msg: Message) -> None:
        if self._sock.fileno() < 0:
            raise PeerGone("this end is closed")
        try:
            self._sock.sendall(encode_message(msg))
        except (OSError, TimeoutError) as e:
            raise PeerGone(f"cannot send to {self.peer}: {e}") from None

    def recv(self) -> list[Message]:
        if self._sock.fileno() >= 0 and not self._eof:
            self._read_available()
        lines = self._buffer.split(b"\n")
        self._buffer = lines.pop()
        try:
            messages = [decode_message(line) for line in lines if line]
        except ValueError as e:
            self.close()
            raise PeerGone(f"{self.peer} broke the protocol: {e}") from None
        if not messages and self._eof:
            raise PeerGone(self._eof)
        return messages

    def _read_available(self) -> None:
        while select.select([self._sock], [], [], 0)[0]:
            try:
                chunk = self._sock.recv(1 << 16)
            except OSError as e:
                self._eof = f"{self.peer} reset the channel ({e})"
                return
            if not chunk:
                self._eof = f"{self.peer} closed the channel"
                return
            self._buffer += chunk

    def wait(self, timeout_s: float) -> None:
        if self._sock.fileno() >= 0 and not self._eof and b"\n" not in self._buffer:
            select.select([self._sock], [], [], max(timeout_s, 0))

    def close(self) -> None:
        if self._sock.fileno() >= 0:
            self._sock.close()


def connect(address: str, timeout_s: float = 5.0) -> SocketChannel:
    """A channel to the prefill server listening at `address` ("127.0.0.1:PORT"); RuntimeError (one line) when
    nothing listens there."""
    host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address must be 'host:port', got {address!r}")
    try:
        sock = socket.create_connection((host, int(port)), timeout=check_number("timeout_s", timeout_s, 0))
    except OSError as e:
        raise RuntimeError(f"no KV prefill server listens at {address} ({e.strerror or e})") from None
    return SocketChannel(sock)


class ChannelListener:
    """A listening socket on 127.0.0.1 (`port` 0: a free one) whose `accept` never waits."""

    def __init__(self, port: int = 0) -> None:
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))
        self._sock.listen()
        self._sock.setblocking(False)
        self.address = "127.0.0.1:{}".format(self._sock.getsockname()[1])

    def fileno(self) -> int:
        return self._sock.fileno()

    def accept(self) -> SocketChannel | None:
        """A channel to a decode side that connected, or None when none is waiting."""
        try:
            sock, _ = self._sock.accept()
        except BlockingIOError:
            return None
        sock.setblocking(True)
        return SocketChannel(sock)

    def close(self) -> None:
        self._sock.close()
