"""KV cache events in vLLM's schema (`vllm/distributed/kv_events.py`), and their msgpack wire forms.

An engine reports what enters and leaves its cache as a stream of `EventBatch`es, one per scheduler step:
`BlockStored` (pages that entered a tier, with their chained hashes, the hash of the page before them, and
their token ids), `BlockRemoved` (pages that left a tier) and `AllBlocksCleared` (the cache was reset).
Routers (Dynamo, llm-d, SGLang's gateway) rebuild each replica's cached blocks from these alone.

Wire forms (msgpack), both as vLLM's msgspec structs encode them:

- A batch is always a positional array `[ts, [event, ...], data_parallel_rank]`, the rank nil when it is
  None (msgspec's `omit_defaults` does not apply to `array_like` structs; vLLM releases before the rank
  existed sent `[ts, events]`, which decodes too).
- `"map"` (what vLLM sends since its events stopped being `array_like`, and SGLang too): each event is a
  map whose first key `"type"` holds the class name, then the fields in declaration order:
  `{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
  "medium", "lora_name"}`, `{"type": "BlockRemoved", "block_hashes", "medium"}`, `{"type":
  "AllBlocksCleared"}`. These are the fields vLLM declares without a default, so they are always present
  (vLLM's decoder requires them); fields with defaults that kvmem never sets are left out, as vLLM leaves
  them out.
- `"array"` (older vLLM, `array_like=True, tag=True`): each event is an array, class name first, then
  the same fields by position: `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name]`, `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`.
  msgspec skips trailing array elements a struct does not declare, so releases that predate `lora_name`
  (or `medium`) decode these arrays too.

`decode_batch` reads both forms (per event), block hashes as ints (vLLM's default; SGLang's are signed
int64) or bytes (vLLM with integer block hashes turned off), and ignores fields and trailing elements it
does not know, as msgspec does. Anything else raises `EventDecodeError` and produces nothing.

Media: "GPU" (device memory), "CPU_PINNED" (host memory) and "DISK" (a replica's own disk), SGLang's names
for its HiCache tiers. kvmem's caches report "GPU" and "CPU_PINNED"; its storage tier is shared by every
replica and reports nothing (see `kvmem.tiers.hiradix_cache`). vLLM itself says "CPU" and "STORAGE" for its
offloading tiers; `medium` is a free string on the wire, so every name decodes.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping, Set
from dataclasses import dataclass
from typing import Union

import numpy as np

from kvmem._checks import check_int

MEDIUM_GPU = "GPU"
MEDIUM_CPU_PINNED = "CPU_PINNED"
MEDIUM_DISK = "DISK"
MEDIA = (MEDIUM_GPU, MEDIUM_CPU_PINNED, MEDIUM_DISK)

WIRE_FORMATS = ("map", "array")

BlockHash = Union[int, bytes]
_HASH_MIN, _HASH_END = -(2**63), 2**64  # SGLang's signed int64 through vLLM's uint64


class EventDecodeError(ValueError):
    """A payload that is not a valid event batch in either wire form."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Pages that entered a tier: `block_hashes` (one per page, chained: each names its whole prefix),
    `parent_block_hash` (the hash of the page before the first one, None at the start of a sequence),
    `token_ids` (the pages' tokens: `len(block_hashes) * block_size` of them), `block_size` (tokens per
    page), `lora_id` / `lora_name` (the adapter, None for the base model), `medium` (the tier)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None

    def __post_init__(self) -> None:
        hashes = _hash_tuple(self.block_hashes)
        if not hashes:
            raise ValueError("block_hashes is empty: a BlockStored event names at least one block")
        parent = self.parent_block_hash
        if parent is not None:
            parent = _check_hash("parent_block_hash", parent)
        block_size = check_int("block_size", self.block_size, minimum=1)
        token_ids = _token_tuple(self.token_ids)
        if len(token_ids) != len(hashes) * block_size:
            raise ValueError(f"token_ids has {len(token_ids)} tokens for {len(hashes)} blocks of block_size "
                             f"{block_size} (must be {len(hashes) * block_size})")
        if self.lora_id is not None:
            check_int("lora_id", self.lora_id)
        _check_optional_str("medium", self.medium)
        _check_optional_str("lora_name", self.lora_name)
        object.__setattr__(self, "block_hashes", hashes)
        object.__setattr__(self, "parent_block_hash", parent)
        object.__setattr__(self, "token_ids", token_ids)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Pages that left a tier (`medium`), by hash."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = MEDIUM_GPU

    def __post_init__(self) -> None:
        hashes = _hash_tuple(self.block_hashes)
        if not hashes:
            raise ValueError("block_hashes is empty: a BlockRemoved event names at least one block")
        _check_optional_str("medium", self.medium)
        object.__setattr__(self, "block_hashes", hashes)


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block of the replica left every tier (the cache was reset)."""


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
_EVENT_TYPES = (BlockStored, BlockRemoved, AllBlocksCleared)


@dataclass(frozen=True, slots=True)
class EventBatch:
    """The events of one scheduler step, in order: `ts` (seconds since the epoch, float),
    `events`, and the data-parallel rank of the engine that sent them (None: not set)."""

    ts: float
    events: tuple[KVCacheEvent, ...]
    data_parallel_rank: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.ts, bool) or not isinstance(self.ts, (int, float)) or math.isnan(self.ts):
            raise ValueError(f"ts must be a number of seconds, got {self.ts!r}")
        try:
            events = tuple(self.events)
        except TypeError:
            raise TypeError(f"events must be a sequence of events, got {type(self.events).__name__}") from None
        for i, event in enumerate(events):
            if not isinstance(event, _EVENT_TYPES):
                raise TypeError(f"events[{i}] is a {type(event).__name__}, not BlockStored, BlockRemoved or "
                                f"AllBlocksCleared")
        if self.data_parallel_rank is not None:
            check_int("data_parallel_rank", self.data_parallel_rank, minimum=0)
        object.__setattr__(self, "ts", float(self.ts))
        object.__setattr__(self, "events", events)


# ---- encoding ---------------------------------------------------------------------------------------
def encode_batch(batch: EventBatch, wire_format: str = "map") -> bytes:
    """`batch` as msgpack bytes in `wire_format` ("map": named fields, what vLLM sends now; "array":
    positional, older vLLM): the msgpack values vLLM's msgspec encoder writes for the same batch, in the
    same order. The bytes differ only in a map header's width: msgpack's smallest here, while msgspec sizes
    it by the fields a class could have (vLLM 0.33's BlockStored, 16 possible keys, gets a map16 header);
    `scripts/check_vllm_events.py` checks both ways."""
    if not isinstance(batch, EventBatch):
        raise TypeError(f"batch must be an EventBatch, got {type(batch).__name__}")
    as_map = _check_wire_format(wire_format) == "map"
    events = [_event_wire(e, as_map) for e in batch.events]
    return _msgpack().packb((batch.ts, events, batch.data_parallel_rank), use_bin_type=True, default=_builtin_int)


def _event_wire(event: KVCacheEvent, as_map: bool):
    if type(event) is BlockStored:
        if as_map:
            return {"type": "BlockStored", "block_hashes": event.block_hashes,
                    "parent_block_hash": event.parent_block_hash, "token_ids": event.token_ids,
                    "block_size": event.block_size, "lora_id": event.lora_id, "medium": event.medium,
                    "lora_name": event.lora_name}
        return ("BlockStored", event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                event.lora_id, event.medium, event.lora_name)
    if type(event) is BlockRemoved:
        if as_map:
            return {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium}
        return ("BlockRemoved", event.block_hashes, event.medium)
    return {"type": "AllBlocksCleared"} if as_map else ("AllBlocksCleared",)


# ---- decoding ---------------------------------------------------------------------------------------
# Per event type: its fields in wire order, and how many of them a decoder requires (the rest default to
# None). vLLM's earliest release sent five BlockStored fields and a bare BlockRemoved.
_FIELDS = {
    "BlockStored": (BlockStored, ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                  "medium", "lora_name"), 4),
    "BlockRemoved": (BlockRemoved, ("block_hashes", "medium"), 1),
    "AllBlocksCleared": (AllBlocksCleared, (), 0),
}


def decode_batch(payload: bytes) -> EventBatch:
    """The `EventBatch` in msgpack `payload` (either wire form, even mixed). Raises `EventDecodeError`
    naming what is wrong (and where) on anything that is not a valid batch."""
    msgpack = _msgpack()
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"payload must be bytes, got {type(payload).__name__}")
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise EventDecodeError(f"payload is not msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(body, list) or not 2 <= len(body) <= 3 or not isinstance(body[1], list):
        raise EventDecodeError(f"a batch must be an array [ts, events, data_parallel_rank?], got "
                               f"{_describe(body)}")
    events = [_decode_event(i, raw) for i, raw in enumerate(body[1])]
    rank = body[2] if len(body) == 3 else None
    try:
        return EventBatch(body[0], events, rank)
    except (TypeError, ValueError) as e:
        raise EventDecodeError(f"bad batch: {e}") from None


def _decode_event(i: int, raw) -> KVCacheEvent:
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag, values = raw[0], raw[1:]
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
        tag, values = raw["type"], raw
    else:
        raise EventDecodeError(f"event {i} is neither [type, fields...] nor {{'type': ...}}: {_describe(raw)}")
    if tag not in _FIELDS:
        raise EventDecodeError(f"event {i} has unknown type {tag!r} (expected one of {sorted(_FIELDS)})")
    cls, names, required = _FIELDS[tag]
    if isinstance(values, dict):
        missing = [n for n in names[:required] if n not in values]
        kwargs = {n: values[n] for n in names if n in values}
    else:
        missing = list(names[len(values):required])
        kwargs = dict(zip(names, values))
    if missing:
        raise EventDecodeError(f"event {i} ({tag}) lacks required field(s) {missing}")
    if cls is not AllBlocksCleared and "medium" not in kwargs:
        kwargs["medium"] = None
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise EventDecodeError(f"event {i} ({tag}): {e}") from None


# ---- checks -----------------------------------------------------------------------------------------
_SEQUENCES = (list, tuple)  # the common case, told apart by its type alone: an ABC check is several times slower
# Iterable, but not a sequence of ids: a str's characters, or a mapping's or a set's keys in an order that is
# not the chain's (a msgpack map where an array belongs decodes to a dict).
_NOT_SEQUENCES = (str, bytes, bytearray, Mapping, Set)


def _hash_tuple(block_hashes) -> tuple:
    if type(block_hashes) not in _SEQUENCES and isinstance(block_hashes, _NOT_SEQUENCES):
        raise TypeError(f"block_hashes must be a sequence of block hashes, got {type(block_hashes).__name__}")
    try:
        hashes = tuple(block_hashes)
    except TypeError:
        raise TypeError(f"block_hashes must be a sequence of block hashes, got "
                        f"{type(block_hashes).__name__}") from None
    if bool not in set(map(type, hashes)):
        try:  # the common case, checked at C speed: unsigned 64-bit ints (numpy's become ints)
            return tuple(array("Q", hashes).tolist())
        except (TypeError, OverflowError, RuntimeError):  # RuntimeError: a tensor without values (meta)
            pass
    # signed (SGLang's), bytes, or a bad hash that the slow path names
    return tuple([_check_hash("block_hashes", h) for h in hashes])


def _check_hash(name: str, value) -> BlockHash:
    """`value` as a block hash: a Python int in the 64-bit range (numpy integers converted) or bytes."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must hold int or bytes block hashes, got {type(value).__name__} {value!r}")
    value = int(value)
    if not _HASH_MIN <= value < _HASH_END:
        raise ValueError(f"{name} holds {value}, outside the 64-bit range of a block hash")
    return value


def _token_tuple(token_ids) -> tuple[int, ...]:
    """Token ids as a tuple, each checked (at C speed, through an int64 array) to be an int in int64."""
    if type(token_ids) not in _SEQUENCES and isinstance(token_ids, _NOT_SEQUENCES):
        raise TypeError(f"token_ids must be a sequence of int token ids, got {type(token_ids).__name__}")
    if isinstance(token_ids, (np.ndarray, array)):
        token_ids = token_ids.tolist()
    try:
        token_ids = tuple(token_ids)
        array("q", token_ids)
    except TypeError as e:
        raise TypeError(f"token_ids must be a sequence of int token ids ({e})") from None
    except OverflowError:
        raise ValueError("token_ids holds a token id outside int64") from None
    return token_ids


def _check_optional_str(name: str, value) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a str or None, got {type(value).__name__} {value!r}")


def _check_wire_format(wire_format: str) -> str:
    if wire_format not in WIRE_FORMATS:
        raise ValueError(f"wire_format must be one of {WIRE_FORMATS}, got {wire_format!r}")
    return wire_format


def _builtin_int(value):
    """msgpack's hook for what it cannot write: a numpy integer among the token ids becomes an int."""
    if isinstance(value, np.integer):
        return int(value)
    raise TypeError(f"cannot encode {type(value).__name__} {value!r} in an event")


def _describe(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _msgpack():
    try:
        import msgpack
    except ImportError:
        raise ImportError("kvmem's event encoding needs msgpack: pip install 'kvmem[events]'") from None
    return msgpack
