"""Trace readers: Mooncake FAST'25 JSONL and kvmem JSONL, into compact, validated request sequences.

A trace file is read and checked whole when it is opened, so a bad line stops a run before the replay
starts and names its line; token ids, though, are materialized one request at a time. Holding every
request of the Mooncake conversation trace at once would take 145M token ids (580 MB as int32, about
5 GB as Python lists), so a `Trace` stores only what it needs to rebuild each request:

- `MooncakeTrace`: the `hash_ids` of each request (24 ids per request on average). `trace[i]` expands
  them into 512-token blocks whose token ids are a hash of (hash id, position in block): the same id
  always gives the same tokens, different ids give different tokens (collision odds 2**-30 per token).
  Its output tokens are drawn as `synthetic_output_ids` draws them, seeded by a digest of the hash ids and the
  input length instead of the expanded prompt: still a function of the prompt, without hashing 12k tokens.
- `TokenTrace`: all prompts concatenated in one int32 array with offsets (CSR); `trace[i]` is a view.

Each `TraceRequest.input_ids` is a read-only `[input_len] int32` numpy array: slice and compare it with
numpy, hash pages with `.tobytes()`, or hand it to `kvmem.Req` (which copies it into a list). Keep a
request only while it is in flight.

Bad lines: a line that is not a JSON object, lacks a field, has a wrong type, a negative or zero length,
an empty prompt, or `hash_ids` inconsistent with `input_length` raises `TraceError("FILE:LINE: why")`
with `on_error="stop"` (the default: a result computed on a silently shortened trace is worse than no
result), or is skipped and listed in `trace.skipped` with `on_error="skip"`. Blank lines are ignored.
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
import os
import random
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvmem._checks import check_int, check_number

BLOCK_SIZE = 512  # tokens per Mooncake hash id
TOKEN_ID_BOUND = 1 << 30  # synthetic token ids lie in [0, TOKEN_ID_BOUND)
OUTPUT_ID_LOW, OUTPUT_ID_HIGH = 10, 32000  # generated outputs, as the peers' drivers draw them
FORMATS = ("auto", "mooncake", "jsonl")
ON_ERROR = ("stop", "skip")

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_SHIFTS = (np.uint64(30), np.uint64(27), np.uint64(31))
_MUL1, _MUL2 = np.uint32(0x9E3779B1), np.uint32(0x85EBCA77)  # odd: bijections mod 2**32


class TraceError(ValueError):
    """A trace that cannot be read: `str()` is one line, "PATH:LINE: reason" (or "PATH: reason")."""

    def __init__(self, path: str | os.PathLike, line: int | None, reason: str) -> None:
        self.path, self.line, self.reason = str(path), line, reason
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {reason}")


# ---- deterministic fake tokens -------------------------------------------------------------------------

def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on a uint64 array, in place (a bijection, so distinct inputs stay distinct). One
    scratch array for the shifts: a temporary per step slows the expansion of a trace's blocks."""
    shifted = z >> _SHIFTS[0]
    z ^= shifted
    z *= _MIX1
    np.right_shift(z, _SHIFTS[1], out=shifted)
    z ^= shifted
    z *= _MIX2
    np.right_shift(z, _SHIFTS[2], out=shifted)
    z ^= shifted
    return z


_POSITION_KEYS = (_mix64(np.arange(BLOCK_SIZE, dtype=np.uint64) + _MIX2) >> np.uint64(32)).astype(np.uint32)


def block_token_ids(hash_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """The tokens of Mooncake blocks: `[len(hash_ids), BLOCK_SIZE] int32` in [0, TOKEN_ID_BOUND).

    Row j depends only on hash_ids[j]: a 64-bit mix of the id (a bijection) per block, then four 32-bit passes
    per token that key each position by both halves of the mix; rows of distinct ids agree at a position by
    chance, about once in 2**30. Cheaper than a 64-bit mix per token; looking blocks up in an LRU cache was
    slower still, so blocks are not cached.
    """
    mixed = _mix64(np.asarray(hash_ids, dtype=np.uint64) + _GOLDEN)
    z = mixed.astype(np.uint32)[:, None] ^ _POSITION_KEYS
    z *= _MUL1
    z ^= (mixed >> np.uint64(32)).astype(np.uint32)[:, None]
    z *= _MUL2
    z >>= np.uint32(2)  # to [0, TOKEN_ID_BOUND)
    return z.view(np.int32)


def synthetic_output_ids(input_ids: Sequence[int] | np.ndarray, n: int) -> np.ndarray:
    """The output a replay "generates" for a prompt: `[n] int32` in [10, 32000), a function of the prompt.

    These are the tokens ../shared/peers' SGLang and vLLM drivers generate for a JSONL request without
    `output_ids`: Python's `random.Random` seeded with the little-endian blake2b-64 digest of the prompt
    as int64 bytes, then `randrange(10, 32000)` per token. So a JSONL workload replays the same in kvmem
    and in the peers, follow-up turns that quote an earlier output included. Drawn in bulk (`_randrange_bulk`),
    not token by token.

    Prefix-consistent: the first m tokens are the same for every n >= m, so a simulator may draw all
    n at admission or one per decode step. Synthetic multi-turn workloads build turn k's prompt from
    turn k-1's prompt + these tokens, so a replay that uses this function caches real follow-up hits.
    """
    n = check_int("n", n, minimum=0)
    prompt = _as_token_array("input_ids", input_ids).astype(np.int64)
    return _output_draws(_digest_seed(prompt.tobytes()), n)


def _digest_seed(data: bytes, person: bytes = b"") -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=person).digest(), "little")


def _output_draws(seed: int, n: int) -> np.ndarray:
    return _randrange_bulk(random.Random(seed), OUTPUT_ID_LOW, OUTPUT_ID_HIGH, n)


def _randrange_bulk(rng: random.Random, low: int, high: int, n: int) -> np.ndarray:
    """`[rng.randrange(low, high) for _ in range(n)]` as `[n] int32`, drawn the same way in a few C calls.

    randrange(low, high) is low + the first k-bit draw below high - low (k = its bit length, rejection
    sampling), and a k-bit draw (k <= 32) is the top k bits of the next 32-bit Mersenne Twister word;
    `getrandbits(32 * m)` returns the next m words, least significant first. So the accepted top bits of
    those words are randrange's values, in order (`rng` is left further on than randrange would leave it).
    """
    width = high - low
    shift = np.uint32(32 - width.bit_length())
    parts, missing = [np.empty(0, dtype=np.uint32)], n
    while missing:
        m = missing + (missing >> 5) + 8  # rejection keeps width / 2**k of the draws (97.6% here)
        words = np.frombuffer(rng.getrandbits(32 * m).to_bytes(4 * m, "little"), dtype="<u4") >> shift
        parts.append(words[words < width][:missing])
        missing -= len(parts[-1])
    return (np.concatenate(parts) + low).astype(np.int32)


# ---- the request record ----------------------------------------------------------------------------------

def _as_token_array(name: str, values) -> np.ndarray:
    """A 1-D int32 array of token ids in [0, 2**31); raises naming `name` on anything else."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.dtype != np.int32:
        if arr.size and arr.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold ints, got dtype {arr.dtype}")
        if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
            raise ValueError(f"{name} must lie in [0, 2**31), got values in [{arr.min()}, {arr.max()}]")
        return arr.astype(np.int32)
    if arr.size and arr.min() < 0:
        raise ValueError(f"{name} must lie in [0, 2**31), got values in [{arr.min()}, {arr.max()}]")
    return arr


def _read_only(arr: np.ndarray) -> np.ndarray:
    view = arr.view()
    view.flags.writeable = False
    return view


@dataclass(frozen=True, eq=False)
class TraceRequest:
    """One request of a trace.

    input_ids: prompt token ids, stored as a read-only `[input_len] int32` numpy array (any int
        sequence is accepted and converted); non-empty.
    output_len: tokens to generate, >= 1 (prefill always emits the first one).
    arrival_s: arrival time in seconds from the start of the trace, >= 0.
    output_ids: the tokens to generate, `[output_len] int32`, or None to draw them (`output_tokens`).
    output_seed: what output tokens are drawn from when output_ids is None: None for `synthetic_output_ids`
        (seeded by a digest of the prompt), else that seed (a Mooncake request's: see MooncakeTrace).
    """

    input_ids: np.ndarray
    output_len: int
    arrival_s: float = 0.0
    output_ids: np.ndarray | None = None
    output_seed: int | None = None

    def __post_init__(self) -> None:
        ids = _as_token_array("input_ids", self.input_ids)
        if ids.size == 0:
            raise ValueError("input_ids is empty")
        check_int("output_len", self.output_len, minimum=1)
        if not math.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise ValueError(f"arrival_s must be finite and >= 0, got {self.arrival_s!r}")
        object.__setattr__(self, "input_ids", _read_only(ids))
        object.__setattr__(self, "output_len", int(self.output_len))
        object.__setattr__(self, "arrival_s", float(self.arrival_s))
        if self.output_ids is not None:
            out = _as_token_array("output_ids", self.output_ids)
            if out.size != self.output_len:
                raise ValueError(f"output_ids has {out.size} tokens but output_len is {self.output_len}")
            object.__setattr__(self, "output_ids", _read_only(out))

    def output_tokens(self) -> np.ndarray:
        """The `[output_len] int32` tokens a replay generates: output_ids, else drawn from output_seed, else
        synthetic_output_ids."""
        if self.output_ids is not None:
            return self.output_ids
        if self.output_seed is not None:
            return _output_draws(self.output_seed, self.output_len)
        return synthetic_output_ids(self.input_ids, self.output_len)


# ---- traces ----------------------------------------------------------------------------------------------

class Trace(Sequence[TraceRequest]):
    """Requests in file order; `trace[i]` builds request i afresh (hold it only while it is in flight).

    name: the file path, or the generator's name; format: "mooncake" or "jsonl" (the subclass's).
    input_lens / output_lens: `[n] int64` token counts; arrival_s: `[n] float64` seconds (not
        necessarily sorted in kvmem JSONL; Mooncake files are sorted).
    skipped: the TraceErrors of the lines skipped with on_error="skip".
    """

    def __init__(self, name: str, input_lens: np.ndarray, output_lens: np.ndarray, arrival_s: np.ndarray,
                 skipped: Sequence[TraceError] = ()) -> None:
        self.name = name
        self.input_lens = np.asarray(input_lens, dtype=np.int64)
        self.output_lens = np.asarray(output_lens, dtype=np.int64)
        self.arrival_s = np.asarray(arrival_s, dtype=np.float64)
        self.skipped = tuple(skipped)

    def __len__(self) -> int:
        return len(self.input_lens)

    def __getitem__(self, i: int) -> TraceRequest:  # type: ignore[override]  # no slices
        if isinstance(i, slice):
            raise TypeError("a Trace is indexed by int; use limit= to read a head")
        i = operator.index(i)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"request index {i} out of range for a trace of {n}")
        i %= n
        return TraceRequest(self._input_ids(i), int(self.output_lens[i]), float(self.arrival_s[i]),
                            self._output_ids(i), self._output_seed(i))

    def __iter__(self) -> Iterator[TraceRequest]:
        return (self[i] for i in range(len(self)))

    @property
    def prompt_tokens(self) -> int:
        return int(self.input_lens.sum())

    @property
    def max_context_len(self) -> int:
        """The longest prompt + output of any request: the req_to_token row length a replay needs."""
        return int((self.input_lens + self.output_lens).max(initial=0))

    def _input_ids(self, i: int) -> np.ndarray:
        raise NotImplementedError

    def _output_ids(self, i: int) -> np.ndarray | None:
        return None

    def _output_seed(self, i: int) -> int | None:
        return None


class MooncakeTrace(Trace):
    """A Mooncake trace: per request its 512-token block hash ids, expanded on access."""

    format = "mooncake"

    def __init__(self, name: str, hash_ids: np.ndarray, block_offsets: np.ndarray, input_lens: np.ndarray,
                 output_lens: np.ndarray, arrival_s: np.ndarray, skipped: Sequence[TraceError] = ()) -> None:
        super().__init__(name, input_lens, output_lens, arrival_s, skipped)
        self.hash_ids = hash_ids  # [total_blocks] int64, request i's at block_offsets[i]:block_offsets[i+1]
        self.block_offsets = block_offsets

    def _input_ids(self, i: int) -> np.ndarray:
        ids = self.hash_ids[self.block_offsets[i]:self.block_offsets[i + 1]]
        return block_token_ids(ids).reshape(-1)[:self.input_lens[i]]

    def _output_seed(self, i: int) -> int:
        ids = self.hash_ids[self.block_offsets[i]:self.block_offsets[i + 1]]
        return _digest_seed(np.append(ids, self.input_lens[i]).astype(np.int64).tobytes(), b"mooncake")


class TokenTrace(Trace):
    """A trace with explicit token ids, all prompts in one `[total] int32` array (CSR)."""

    format = "jsonl"

    def __init__(self, name: str, token_ids: np.ndarray, offsets: np.ndarray, output_lens: np.ndarray,
                 arrival_s: np.ndarray, output_token_ids: np.ndarray | None = None,
                 output_offsets: np.ndarray | None = None, skipped: Sequence[TraceError] = ()) -> None:
        super().__init__(name, np.diff(offsets), output_lens, arrival_s, skipped)
        self.token_ids, self.offsets = token_ids, offsets
        # Requests without output_ids have an empty row here (a real output has >= 1 token).
        self.output_token_ids, self.output_offsets = output_token_ids, output_offsets

    def _input_ids(self, i: int) -> np.ndarray:
        return self.token_ids[self.offsets[i]:self.offsets[i + 1]]

    def _output_ids(self, i: int) -> np.ndarray | None:
        if self.output_offsets is None or self.output_offsets[i] == self.output_offsets[i + 1]:
            return None
        return self.output_token_ids[self.output_offsets[i]:self.output_offsets[i + 1]]


class _TokenTraceBuilder:
    """Appends requests into growing int32 buffers (array('i') grows in place, no per-request objects)."""

    def __init__(self) -> None:
        self.tokens, self.offsets = array("i"), array("q", [0])
        self.out_tokens, self.out_offsets = array("i"), array("q", [0])
        self.output_lens, self.arrival_s = array("q"), array("d")
        self.skipped: list[TraceError] = []

    def add(self, input_ids: np.ndarray, output_len: int, arrival_s: float, output_ids: np.ndarray | None) -> None:
        self.tokens.frombytes(np.ascontiguousarray(input_ids, dtype=np.int32).tobytes())
        self.offsets.append(len(self.tokens))
        if output_ids is not None:
            self.out_tokens.frombytes(np.ascontiguousarray(output_ids, dtype=np.int32).tobytes())
        self.out_offsets.append(len(self.out_tokens))
        self.output_lens.append(output_len)
        self.arrival_s.append(arrival_s)

    def __len__(self) -> int:
        return len(self.output_lens)

    def build(self, name: str) -> TokenTrace:
        has_outputs = len(self.out_tokens) > 0
        return TokenTrace(
            name, np.frombuffer(self.tokens, dtype=np.int32), np.frombuffer(self.offsets, dtype=np.int64),
            np.frombuffer(self.output_lens, dtype=np.int64), np.frombuffer(self.arrival_s, dtype=np.float64),
            np.frombuffer(self.out_tokens, dtype=np.int32) if has_outputs else None,
            np.frombuffer(self.out_offsets, dtype=np.int64) if has_outputs else None, self.skipped)


# ---- readers ---------------------------------------------------------------------------------------------

def read_trace(path: str | os.PathLike, format: str = "auto", *, limit: int | None = None,
               time_scale: float = 1.0, on_error: str = "stop") -> Trace:
    """Reads and validates a trace file.

    format: "mooncake" (`timestamp` ms, `input_length`, `output_length`, `hash_ids`), "jsonl"
        (`input_ids`, `output_len`, optional `output_ids`, optional `timestamp` ms or `arrival_s`), or
        "auto": decided by the first non-blank line that parses as a JSON object (`hash_ids` means
        Mooncake, `input_ids` means jsonl).
    limit: keep only the first `limit` valid requests (None: all).
    time_scale: arrival times are multiplied by it (0.5 replays twice as fast).
    on_error: "stop" raises TraceError at the first bad line; "skip" skips bad lines and lists them in
        `trace.skipped`.
    Raises TraceError for an unreadable file, an undetectable format, a bad line (with "stop"), or a
    trace with no valid request; ValueError for a bad argument.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    if limit is not None:
        check_int("limit", limit, minimum=1)
    check_number("time_scale", time_scale, 0, allow_minimum=False)
    if format == "auto":
        format = detect_format(path)
    reader = _MooncakeReader() if format == "mooncake" else _JsonlReader()
    for line_no, record in _json_lines(path, on_error, reader.skipped):
        try:
            reader.add(record, time_scale)
        except (TypeError, ValueError, KeyError, OverflowError) as e:
            _fail(TraceError(path, line_no, _reason(e)), on_error, reader.skipped)
        if limit is not None and len(reader) == limit:
            break
    if len(reader) == 0:
        raise TraceError(path, None, f"no valid {format} requests")
    return reader.build(str(path))


def detect_format(path: str | os.PathLike) -> str:
    """ "mooncake" or "jsonl", from the first non-blank line that is a JSON object; raises TraceError."""
    skipped: list[TraceError] = []
    for line_no, record in _json_lines(path, "skip", skipped):
        if "hash_ids" in record:
            return "mooncake"
        if "input_ids" in record:
            return "jsonl"
        raise TraceError(path, line_no, "unknown trace format: expected a 'hash_ids' (Mooncake) "
                                        "or 'input_ids' (kvmem JSONL) field")
    first = f" (line {skipped[0].line}: {skipped[0].reason})" if skipped else ""
    raise TraceError(path, None, f"unknown trace format: no line is a JSON object{first}")


def _json_lines(path, on_error: str, skipped: list[TraceError]) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line; a line that is no JSON object goes to _fail."""
    try:
        f = open(path, "rb")  # bytes: a stray non-UTF-8 line fails alone instead of the whole file
    except OSError as e:
        raise TraceError(path, None, f"cannot open trace: {e.strerror or e}") from None
    with f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                # A file whose lines end in a bare CR reads as one line.
                cr = "; its lines end in a bare CR: convert them to LF" if b"\r" in line.rstrip(b"\r\n") else ""
                _fail(TraceError(path, line_no, f"not JSON ({_reason(e)}{cr})"), on_error, skipped)
                continue
            if not isinstance(record, dict):
                _fail(TraceError(path, line_no, f"expected a JSON object, got {type(record).__name__}"),
                      on_error, skipped)
                continue
            # numpy reads [1, true] as [1, 1]: look for bools only in the rare line that holds one.
            if (b"true" in line or b"false" in line) and (key := _ids_with_a_bool(record)) is not None:
                _fail(TraceError(path, line_no, f"{key} must be a list of ints, got a bool in it"), on_error, skipped)
                continue
            yield line_no, record


def _ids_with_a_bool(record: dict) -> str | None:
    for key in ("hash_ids", "input_ids", "output_ids"):
        ids = record.get(key)
        if isinstance(ids, list) and any(type(x) is bool for x in ids):
            return key
    return None


def _fail(error: TraceError, on_error: str, skipped: list[TraceError]) -> None:
    if on_error == "stop":
        raise error
    skipped.append(error)


def _reason(e: Exception) -> str:
    if isinstance(e, KeyError):
        return f"missing field {e.args[0]!r}"
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _int_field(record: dict, key: str, minimum: int) -> int:
    v = check_int(key, record[key])
    if v < minimum:
        raise ValueError(f"{key} must be >= {minimum}, got {v}")
    return v


def _seconds_field(record: dict, key: str, scale: float) -> float:
    v = record[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{key} must be a number, got {v!r}")
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{key} must be finite and >= 0, got {v!r}")
    return v * scale


def _int_list_field(record: dict, key: str) -> np.ndarray:
    """A JSON list of non-negative ints as a 1-D int64 array; raises on anything else."""
    v = record[key]
    if not isinstance(v, list):
        raise TypeError(f"{key} must be a list of ints, got {type(v).__name__}")
    try:
        arr = np.array(v) if v else np.empty(0, np.int64)
    except ValueError:
        arr = None  # ragged nesting
    if arr is None or arr.ndim != 1 or arr.dtype.kind != "i":
        raise TypeError(f"{key} must be a list of ints (below 2**63)")
    if arr.size and arr.min() < 0:
        raise ValueError(f"{key} must be non-negative, got {arr.min()}")
    return arr.astype(np.int64, copy=False)


class _MooncakeReader:
    def __init__(self) -> None:
        self.hash_ids, self.block_offsets = array("q"), array("q", [0])
        self.input_lens, self.output_lens, self.arrival_s = array("q"), array("q"), array("d")
        self.skipped: list[TraceError] = []

    def __len__(self) -> int:
        return len(self.input_lens)

    def add(self, record: dict, time_scale: float) -> None:
        arrival = _seconds_field(record, "timestamp", time_scale / 1000.0)
        input_len = _int_field(record, "input_length", 1)
        output_len = _int_field(record, "output_length", 1)
        ids = _int_list_field(record, "hash_ids")
        if ids.size != -(-input_len // BLOCK_SIZE):
            raise ValueError(f"hash_ids has {ids.size} ids but input_length {input_len} needs "
                             f"ceil({input_len}/{BLOCK_SIZE}) = {-(-input_len // BLOCK_SIZE)}")
        self.hash_ids.frombytes(ids.tobytes())
        self.block_offsets.append(len(self.hash_ids))
        self.input_lens.append(input_len)
        self.output_lens.append(output_len)
        self.arrival_s.append(arrival)

    def build(self, name: str) -> MooncakeTrace:
        i64 = [np.frombuffer(a, dtype=np.int64)
               for a in (self.hash_ids, self.block_offsets, self.input_lens, self.output_lens)]
        return MooncakeTrace(name, *i64, np.frombuffer(self.arrival_s, dtype=np.float64), self.skipped)


class _JsonlReader:
    def __init__(self) -> None:
        self.builder = _TokenTraceBuilder()
        self.skipped = self.builder.skipped

    def __len__(self) -> int:
        return len(self.builder)

    def add(self, record: dict, time_scale: float) -> None:
        input_ids = _int_list_field(record, "input_ids")
        if input_ids.size == 0:
            raise ValueError("input_ids is empty")
        if input_ids.max() > np.iinfo(np.int32).max:
            raise ValueError(f"input_ids must be < 2**31, got {input_ids.max()}")
        output_ids = _int_list_field(record, "output_ids") if "output_ids" in record else None
        if output_ids is not None and output_ids.size and output_ids.max() > np.iinfo(np.int32).max:
            raise ValueError(f"output_ids must be < 2**31, got {output_ids.max()}")
        if "output_len" in record or output_ids is None:
            output_len = _int_field(record, "output_len", 1)
            if output_ids is not None and output_ids.size != output_len:
                raise ValueError(f"output_ids has {output_ids.size} tokens but output_len is {output_len}")
        else:
            output_len = output_ids.size
            if output_len == 0:
                raise ValueError("output_ids is empty")
        if "timestamp" in record and "arrival_s" in record:
            raise ValueError("give either timestamp (ms) or arrival_s (s), not both")
        arrival = (_seconds_field(record, "timestamp", time_scale / 1000.0) if "timestamp" in record
                   else _seconds_field(record, "arrival_s", time_scale) if "arrival_s" in record else 0.0)
        self.builder.add(input_ids, output_len, arrival, output_ids)

    def build(self, name: str) -> TokenTrace:
        return self.builder.build(name)


def write_jsonl(requests: Iterable[TraceRequest], path: str | os.PathLike) -> int:
    """Writes requests as kvmem JSONL with explicit `output_ids` (synthetic ones resolved), so that the
    peer drivers replay exactly the outputs a kvmem replay generates. Returns the number written."""
    n = 0
    with open(path, "w") as f:
        for req in requests:
            f.write(json.dumps({"input_ids": req.input_ids.tolist(), "output_len": req.output_len,
                                "output_ids": req.output_tokens().tolist(), "arrival_s": req.arrival_s}))
            f.write("\n")
            n += 1
    return n


def default_trace_path() -> Path:
    """The embedded default: the first 400 requests of Mooncake's conversation trace (see data/ATTRIBUTION.md)."""
    return Path(__file__).with_name("data") / "mooncake_conversation_head.jsonl"
