"""The messages of the disaggregation protocol, and their JSON lines.

    decode side                                   prefill side
    Hello(layout, buffers,              ->                           the handshake: refused unless the layouts match
          window_buffers, state_buffers)
                                        <-    Welcome(layout) | Refused(reason, layout)
    KVRequest(rid, input_ids, start,    ->                           prefill the prompt, then write its pages from
              dst_pages,                                             token `start` on into dst_pages (a hybrid
              dst_window_pages,                                      engine's also its window tail's window pages
              dst_state_slot)                                        and its state)
    Cancel(rid)                         ->                           the decode side gave up: do not write, answer
                                        <-    KVDone(rid, first_token) | KVFailed(rid, reason)

Every KVRequest gets exactly one answer, KVDone or KVFailed, unless the channel breaks; the prefill side sends it
once its write has ended (no byte of it lands later), so the decode side frees the pages then. A Cancel only hurries
the answer (KVFailed, or KVDone when the write had already ended).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Hello:
    layout: dict       # KVLayout.to_dict()
    buffers: dict      # KVBuffers.to_dict() of the (full-attention layers') KV pool
    window_buffers: dict | None = None  # a hybrid engine's window pool and state pool, when it has them
    state_buffers: dict | None = None


@dataclass(frozen=True)
class Welcome:
    layout: dict


@dataclass(frozen=True)
class Refused:
    reason: str
    layout: dict       # the prefill side's, so that the decode side names a difference in its own terms


@dataclass(frozen=True)
class KVRequest:
    rid: int
    input_ids: list[int]
    start: int         # the first prompt token whose KV the decode side needs (a multiple of the page size)
    dst_pages: list[int]  # its pages for tokens start.. of the prompt, in order
    # A hybrid engine's: the window pages of the prompt's last len(dst_window_pages) pages (its window tail,
    # `kvmem.disagg.request_memory.window_start`), and the state slot for the state after the whole prompt.
    dst_window_pages: list[int] | None = None
    dst_state_slot: int = 0


@dataclass(frozen=True)
class Cancel:
    rid: int


@dataclass(frozen=True)
class KVDone:
    rid: int
    first_token: int   # the token the prefill side sampled after the prompt


@dataclass(frozen=True)
class KVFailed:
    rid: int
    reason: str


Message = Hello | Welcome | Refused | KVRequest | Cancel | KVDone | KVFailed
_KINDS = {cls.__name__: cls for cls in (Hello, Welcome, Refused, KVRequest, Cancel, KVDone, KVFailed)}


def encode_message(msg: Message) -> bytes:
    """One JSON line: {"type": class name, **fields}."""
    return json.dumps({"type": type(msg).__name__, **asdict(msg)}, separators=(",", ":")).encode() + b"\n"


def decode_message(line: bytes) -> Message:
    """The message of one JSON line; ValueError for anything that is not one."""
    try:
        fields = json.loads(line)
        kind = _KINDS[fields.pop("type")]
        return kind(**fields)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"not a message: {line[:80]!r} ({e!r})") from None
