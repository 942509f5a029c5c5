"""Requests and the batch a model runner executes: what goes where in memory for one forward step.

A `ScheduleBatch` is either an extend (prefill) batch or a decode batch. `prepare_for_extend` and
`prepare_for_decode` allocate `out_cache_loc`, write `req_to_token`, and evict from the radix cache (or,
for decode, retract requests) when slots are short. Each shortage is met by one eviction of exactly the
shortfall, so a loop under pressure does not thrash the tree with many small evictions.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Mapping, Sequence, Set
from itertools import compress
from typing import TYPE_CHECKING

import numpy as np

from kvmem._checks import check_int
from kvmem._paging import num_new_pages
from kvmem._torch import torch
from kvmem.allocator import PagedTokenAllocator, TokenAllocator
from kvmem.page_hash import encode_namespace
from kvmem.radix_cache import RadixCache
from kvmem.req_to_token import ReqToTokenPool
from kvmem.timing import NO_TIMER, NullTimer, PhaseTimer

if TYPE_CHECKING:
    from kvmem.attention.metadata import PagedKVMetadata

_EMPTY = torch.empty(0, dtype=torch.int64)


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"


class ReqStatus(enum.Enum):
    """Where a request is in its life. Only RUNNING requests hold memory (a req_to_token row and slots)."""

    NEW = "new"              # built, not queued yet
    WAITING = "waiting"      # queued for admission
    RUNNING = "running"      # admitted: prefilling (perhaps in chunks) or decoding
    RETRACTED = "retracted"  # its memory was released under pressure; queued to resume from its outputs
    FINISHED = "finished"    # done: cached in the tree, memory released


class Req:
    """One generation request.

    Args:
        rid: caller's id, echoed in errors.
        input_ids: prompt token ids (non-empty), kept as an int64 `array`.
        max_new_tokens: output tokens to generate (>= 1); the request finishes after that many.
        priority: larger is more valuable to the "priority" eviction policy.
        namespace: the KV-sharing domain (a tenant salt, a LoRA or model id): requests in different namespaces
            never share cached KV, in any tier, and cannot see each other's prompts through hit timing. None:
            the default namespace.

    State, kept by the scheduler: `status` (a ReqStatus), `req_pool_idx` (its req_to_token row or None),
    `kv_len` (leading tokens of input_ids + output_ids whose slots are in the row), `prefix_indices` and
    `last_node` (the cached prefix it matched, locked in the tree), `cache_protected_len` (how many leading
    slots of the row belong to the tree; the rest are the request's: see `kvmem.radix_cache.CachedRequest`).
    """

    def __init__(self, rid, input_ids: Sequence[int], max_new_tokens: int, *, priority: int = 0,
                 namespace: str | None = None) -> None:
        ids = _as_token_array(rid, input_ids)
        self.rid = rid
        self.input_ids: array = ids
        self.max_new_tokens = check_int(f"request {rid!r}: max_new_tokens", max_new_tokens, minimum=1)
        self.priority = check_int(f"request {rid!r}: priority", priority, minimum=-2**63, maximum=2**63 - 1)
        if namespace is not None:
            encode_namespace(f"request {rid!r}: namespace", namespace)
        self.namespace = namespace
        self.status = ReqStatus.NEW
        self.output_ids: list[int] = []  # the tokens generated so far
        self.req_pool_idx: int | None = None
        self.kv_len = 0  # leading tokens of input_ids + output_ids whose KV slots are in the req_to_token row
        self.prefix_indices: torch.Tensor = _EMPTY
        self.last_node = None
        self.cache_protected_len = 0
        self.host_hit_len = 0  # tokens of the prefix that the last admission loaded back from the host tier
        self.storage_hit_len = 0  # of those, tokens the host tier had just read from the storage tier
        self.prefetch = None  # pages being read from the storage tier for it, taken at its admission
        # Tokens this extend step brings the row up to; below len(fill_ids) while chunked prefill goes on.
        self.extend_end = 0
        self.num_retractions = 0

    @property
    def fill_ids(self) -> array:
        """The tokens whose KV a prefill computes: the prompt and, after a retraction, the outputs so far
        (an int64 array)."""
        if not self.output_ids:
            return self.input_ids
        ids = array("q", self.input_ids)
        ids.extend(self.output_ids)
        return ids

    def match_key(self) -> memoryview:
        """The key its admission matches against the tree: fill_ids but the last token (at least one token is
        always left to compute: the prefill must produce the next token's logits)."""
        return memoryview(self.fill_ids)[:-1]

    def finished(self) -> bool:
        return len(self.output_ids) >= self.max_new_tokens

    def is_chunked(self) -> bool:
        """True while the prompt is only partly prefilled."""
        return self.extend_end < len(self.input_ids) + len(self.output_ids)

    def reset_for_retract(self) -> None:
        self.status = ReqStatus.RETRACTED
        self.req_pool_idx = None
        self.kv_len = 0
        self.prefix_indices = _EMPTY
        self.last_node = None
        self.cache_protected_len = 0
        self.extend_end = 0
        self.num_retractions += 1

    def __repr__(self) -> str:
        return (f"Req(rid={self.rid!r}, {self.status.value}, input={len(self.input_ids)}, "
                f"output={len(self.output_ids)}/{self.max_new_tokens}, kv_len={self.kv_len})")


def _as_token_array(rid, input_ids) -> array:
    """Prompt ids as a C int64 array: the radix cache reads its bytes without converting, and it takes
    about a quarter of the memory of a list of Python ints."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise TypeError(f"request {rid!r}: input_ids must hold ints, got dtype {input_ids.dtype}")
        if input_ids.device.type == "meta":
            raise ValueError(f"request {rid!r}: input_ids is on the 'meta' device, which holds no values")
        input_ids = input_ids.cpu().numpy()
    if isinstance(input_ids, np.ndarray):
        if input_ids.ndim != 1 or (input_ids.size and input_ids.dtype.kind not in "iu"):
            raise TypeError(f"request {rid!r}: input_ids must be a 1-D sequence of ints, got "
                            f"{input_ids.dtype} of shape {input_ids.shape}")
        if input_ids.dtype == np.uint64 and input_ids.size and input_ids.max() >= 2**63:
            raise ValueError(f"request {rid!r}: input_ids holds a token id outside int64")
        ids = array("q")
        ids.frombytes(np.ascontiguousarray(input_ids, dtype=np.int64).data.cast("B"))  # no bytes copy between
    elif isinstance(input_ids, (bytes, bytearray, str, Set, Mapping)):
        # array("q", b"...") would read raw bytes as machine integers; a set or a dict has no order.
        raise TypeError(f"request {rid!r}: input_ids must be a sequence of ints, got {type(input_ids).__name__}")
    else:
        try:
            ids = array("q", input_ids)
        except TypeError:
            bad = next((t for t in input_ids if not isinstance(t, (int, np.integer))), input_ids) \
                if isinstance(input_ids, Sequence) else input_ids
            raise TypeError(f"request {rid!r}: input_ids must hold ints, got {type(bad).__name__}") from None
        except OverflowError:
            raise ValueError(f"request {rid!r}: input_ids holds a token id outside int64") from None
    if not ids:
        raise ValueError(f"request {rid!r}: input_ids is empty")
    return ids


def check_parts(req_to_token_pool, token_allocator, tree_cache) -> None:
    """Raises unless the three parts are of their kinds and belong together: the tree must cache into this
    pool's rows and this allocator's slots, or every step would fail or miscount."""
    if not isinstance(req_to_token_pool, ReqToTokenPool):
        raise TypeError(f"req_to_token_pool must be a ReqToTokenPool, got {type(req_to_token_pool).__name__}")
    if not isinstance(token_allocator, (TokenAllocator, PagedTokenAllocator)):
        raise TypeError(f"token_allocator must be a TokenAllocator or PagedTokenAllocator, got "
                        f"{type(token_allocator).__name__}")
    if not isinstance(tree_cache, RadixCache):
        raise TypeError(f"tree_cache must be a RadixCache, got {type(tree_cache).__name__}")
    if tree_cache.req_to_token_pool is not req_to_token_pool:
        raise ValueError("tree_cache was built over another req_to_token_pool than the one given")
    if tree_cache.token_allocator is not token_allocator:
        raise ValueError("tree_cache was built over another token_allocator than the one given")


class ScheduleBatch:
    """The requests of one forward step and the tensors a model runner needs.

    After `prepare_for_extend()` / `prepare_for_decode()`: `req_pool_indices`, `seq_lens`, `prefix_lens`,
    `extend_lens` ([bs] int64, on the CPU) and `out_cache_loc` ([num new tokens] int64, the slots this step
    writes, on the allocator's device); `attention_metadata()` gives FlashInfer's paged-KV arrays.
    """

    def __init__(self, reqs: list[Req], req_to_token_pool: ReqToTokenPool,
                 token_allocator: TokenAllocator | PagedTokenAllocator, tree_cache: RadixCache) -> None:
        check_parts(req_to_token_pool, token_allocator, tree_cache)
        self._setup(reqs, req_to_token_pool, token_allocator, tree_cache)

    @classmethod
    def _of(cls, reqs: list[Req], req_to_token_pool: ReqToTokenPool,
            token_allocator: TokenAllocator | PagedTokenAllocator, tree_cache: RadixCache, *,
            timer: PhaseTimer | NullTimer = NO_TIMER, cache_decode_pages: bool = False) -> ScheduleBatch:
        """A batch over parts already known to belong together (the Scheduler's, checked when it was built).
        timer: times "alloc" and "evict" (see Scheduler); cache_decode_pages: see `retract_decode`."""
        batch = cls.__new__(cls)
        batch._setup(reqs, req_to_token_pool, token_allocator, tree_cache)
        batch.timer = timer
        batch.cache_decode_pages = cache_decode_pages
        return batch

    def _setup(self, reqs, req_to_token_pool, token_allocator, tree_cache) -> None:
        self.reqs = reqs
        self.req_to_token_pool = req_to_token_pool
        self.token_allocator = token_allocator
        self.tree_cache = tree_cache
        self.page_size = token_allocator.page_size
        self.forward_mode: ForwardMode | None = None
        self.req_pool_indices = self.seq_lens = self.prefix_lens = self.extend_lens = _EMPTY
        self.out_cache_loc = _EMPTY
        self.retracted: list[Req] = []
        self.evicted_tokens = 0
        self.timer: PhaseTimer | NullTimer = NO_TIMER
        self.cache_decode_pages = False

    def batch_size(self) -> int:
        return len(self.reqs)

    def prepare_for_extend(self) -> bool:
        """Rows, prefix slots and `out_cache_loc` for every request's tokens kv_len..extend_end.

        New requests (no row yet) get a row and their matched prefix written into it; chunked requests
        continue in the row they have. Returns False, with nothing changed, if rows or slots are short
        even after evicting the shortfall from the tree. Raises, changing nothing, on an empty batch, a
        request twice, or a request with nothing to extend or past max_context_len.
        """
        reqs = self.reqs
        if not reqs:
            raise ValueError("the batch is empty: nothing to extend")
        if len(set(map(id, reqs))) != len(reqs):
            raise ValueError("the batch holds a request more than once")
        is_new, prefix, seq = self._extend_lens()
        if (seq <= prefix).any():
            i = int(np.flatnonzero(seq <= prefix)[0])
            raise ValueError(f"request {reqs[i].rid!r}: nothing to extend (kv_len {prefix[i]}, extend_end {seq[i]})")
        max_len = self.req_to_token_pool.max_context_len
        if (seq > max_len).any():
            i = int(np.flatnonzero(seq > max_len)[0])
            raise ValueError(f"request {reqs[i].rid!r}: extend_end {seq[i]} exceeds max_context_len {max_len}")
        return self._prepare_for_extend(is_new, prefix, seq)

    def _extend_lens(self) -> tuple[list[bool], np.ndarray, np.ndarray]:
        """Which requests are new (no row yet), and each request's tokens before and after this step."""
        reqs = self.reqs
        is_new = [r.status is not ReqStatus.RUNNING for r in reqs]
        prefix = np.fromiter((r.prefix_indices.numel() if n else r.kv_len for r, n in zip(reqs, is_new)),
                             dtype=np.int64, count=len(reqs))
        seq = np.fromiter((r.extend_end for r in reqs), dtype=np.int64, count=len(reqs))
        return is_new, prefix, seq

    def _prepare_for_extend(self, is_new: list[bool], prefix: np.ndarray, seq: np.ndarray) -> bool:
        """prepare_for_extend's body, for a batch known to be valid (the Scheduler's: see add_request). The
        allocator, the req_to_token writer and the metadata builders below trust what it hands them."""
        reqs = self.reqs
        new = list(compress(reqs, is_new))
        self.forward_mode = ForwardMode.EXTEND
        rows = self.req_to_token_pool.alloc(len(new)) if new else []
        if rows is None:
            return False
        last_loc = self._last_loc(prefix)
        out = self._alloc_with_eviction(lambda: self._alloc_extend(prefix, seq, last_loc),
                                        self._extend_need(prefix, seq), len(new))
        if out is None:
            if rows:
                self.req_to_token_pool.free(rows)
            return False
        for r, row in zip(new, rows):
            r.req_pool_idx = row
            r.cache_protected_len = r.prefix_indices.numel()
            r.status = ReqStatus.RUNNING
        if new:
            self.tree_cache.start_reqs(new)
        self._set_lens(prefix, seq, out)
        self.req_to_token_pool.write_extend(self.req_pool_indices.tolist(), prefix.tolist(), seq.tolist(), out,
                                            [r.prefix_indices if n else None for r, n in zip(reqs, is_new)])
        for r, s in zip(reqs, seq.tolist()):
            r.kv_len = s
        return True

    def prepare_for_decode(self) -> None:
        """One slot per running request for the token at position kv_len (its last sampled token).

        When slots are short it evicts the shortfall from the tree, then retracts requests (see
        `retract_decode`) until the rest fit; retracted requests are in `self.retracted`. Raises, changing
        nothing, for a request that is not running (never extended) or already holds max_context_len tokens.
        """
        for r in self.reqs:
            if r.status is not ReqStatus.RUNNING:
                raise ValueError(f"request {r.rid!r} is not running ({r.status.value}): extend it before decoding")
        prefix = self._kv_lens()
        max_len = self.req_to_token_pool.max_context_len
        if len(prefix) and prefix.max() >= max_len:
            i = int(np.argmax(prefix))
            raise ValueError(f"request {self.reqs[i].rid!r} holds max_context_len {max_len} tokens: no room to decode")
        self._prepare_for_decode(prefix)

    def _prepare_for_decode(self, prefix: np.ndarray | None = None) -> None:
        """prepare_for_decode's body, for running requests with room left (the Scheduler's: add_request checked
        that they fit max_context_len)."""
        if prefix is None:
            prefix = self._kv_lens()
        self.forward_mode = ForwardMode.DECODE
        tree = self.tree_cache
        tree.decode_step(self.reqs, prefix)
        need = self._decode_need(prefix)
        if not tree.can_fit(need):
            self.retracted = self.retract_decode()
            prefix = self._kv_lens()
            need = self._decode_need(prefix)
        if not tree.fits(need):
            self._evict(need)
        reqs = self.reqs
        seq = prefix + 1
        rows = np.fromiter((r.req_pool_idx for r in reqs), dtype=np.int64, count=len(reqs))
        if not reqs:
            self._set_lens(prefix, seq, _EMPTY, rows)
            return
        with self.timer.phase("alloc"):
            out = alloc_decode_slots(self.req_to_token_pool, self.token_allocator, prefix, rows)
        if out is None:  # cannot happen: retraction leaves room for every remaining request
            raise RuntimeError("decode allocation failed after eviction and retraction")
        for r in reqs:
            r.kv_len += 1
        self._set_lens(prefix, seq, out, rows)

    def attention_metadata(self) -> PagedKVMetadata:
        """FlashInfer's paged-KV arrays for this step (see `kvmem.attention`), on req_to_token's device.

        Decode: one query per request over its seq_lens tokens. Extend: queries are each request's tokens
        prefix_lens..seq_lens-1 (qo_indptr = cumsum of extend_lens), keys all seq_lens tokens. kv_indices
        lists each request's slots (page_size 1) or page ids, read from its req_to_token row. Raises
        RuntimeError before `prepare_for_extend()` / `prepare_for_decode()`.
        """
        # Imported here, as the kernels are below: Triton's import is a large share of a process that only
        # schedules (a replay, a sweep's workers), and only a model's steps need metadata.
        from kvmem.attention.metadata import decode_metadata, extend_metadata

        table = self.req_to_token_pool.req_to_token
        rows, seq = self.req_pool_indices.to(table.device), self.seq_lens.to(table.device)
        if self.forward_mode is ForwardMode.DECODE:
            return decode_metadata(table, rows, seq, self.page_size)
        if self.forward_mode is ForwardMode.EXTEND:
            return extend_metadata(table, rows, self.prefix_lens.to(table.device), seq, self.page_size)
        raise RuntimeError("attention_metadata() needs prepare_for_extend() or prepare_for_decode() first")

    def retract_decode(self) -> list[Req]:
        """Releases requests' memory until the remaining ones can decode one more token, counting the
        evictable part of the tree as free.

        Victims are the requests that generated least (least work lost), longest prompt first among equals;
        their own slots are freed and their cached prefix unlocked (evictable again); the caller evicts
        what is still short. They keep their outputs and resume by prefilling prompt + outputs. At least one
        request is kept. In a batch of a Scheduler that caches decode pages, a victim's full pages of output
        enter the tree first (evictable like its prefix), so that it resumes from them if they are still
        there, as a vLLM request preempted does.
        """
        order = sorted(self.reqs, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
        need, ps = self._decode_need(), self.page_size
        retracted = []
        # The need shrinks by each victim's own share, so one pass over the victims suffices.
        for victim in order[:-1]:
            if self.tree_cache.can_fit(need):
                break
            if ps == 1 or victim.kv_len % ps == 0:
                need -= ps
            self._retract(victim)
            retracted.append(victim)
        if retracted:
            gone = set(map(id, retracted))
            self.reqs[:] = [r for r in self.reqs if id(r) not in gone]
        return retracted

    def _retract(self, req: Req) -> None:
        if self.cache_decode_pages:
            self.tree_cache.cache_req(req, finished=False)
        self.tree_cache.release_req(req, cache=False)
        req.reset_for_retract()
        # Queued again: a policy that looks ahead learns it before the eviction that follows a retraction.
        self.tree_cache.request_waiting(req.rid, req.match_key(), req.namespace)

    def _kv_lens(self) -> np.ndarray:
        reqs = self.reqs
        return np.fromiter((r.kv_len for r in reqs), dtype=np.int64, count=len(reqs))

    def _decode_need(self, kv_lens: np.ndarray | None = None) -> int:
        """Slots one more decode token takes: one per request at page_size 1, else a page for every request
        whose pages are full."""
        if self.page_size == 1:
            return len(self.reqs)
        if kv_lens is None:
            kv_lens = self._kv_lens()
        return int(np.count_nonzero(kv_lens % self.page_size == 0)) * self.page_size

    def _extend_need(self, prefix: np.ndarray, seq: np.ndarray) -> int:
        return int(num_new_pages(prefix, seq, self.page_size).sum()) * self.page_size

    def _alloc_with_eviction(self, alloc, need: int, num_reqs: int):
        """alloc() once `need` new slots (and what `num_reqs` new requests hold per request) are free, evicting
        what is short; None, nothing allocated, when eviction cannot make the room."""
        if not self.tree_cache.fits(need, num_reqs):
            self._evict(need, num_reqs)
            if not self.tree_cache.fits(need, num_reqs):
                return None
        return alloc()

    def _evict(self, need: int, num_reqs: int = 0) -> None:
        """Evicts what the pools are short of for `need` new slots and `num_reqs` new requests."""
        with self.timer.phase("evict"):
            self.evicted_tokens += self.tree_cache.evict_for(need, num_reqs)

    def _alloc_extend(self, prefix: np.ndarray, seq: np.ndarray, last_loc: np.ndarray):
        with self.timer.phase("alloc"):
            if self.page_size == 1:
                return self.token_allocator.alloc(int((seq - prefix).sum()))
            return self.token_allocator.alloc_extend_unchecked(prefix, seq, last_loc)

    def _last_loc(self, prefix: np.ndarray) -> np.ndarray:
        """Slot of each request's token prefix-1 where that token ends a partial page (else -1): paged
        allocation continues that page. A new request's prefix comes from the tree in whole pages, so
        only rows already written (chunked and decoding requests) are read."""
        last = np.full(len(prefix), -1, dtype=np.int64)
        partial = np.flatnonzero(prefix % self.page_size)
        if len(partial):
            rows = np.fromiter((self.reqs[i].req_pool_idx for i in partial.tolist()), np.int64, len(partial))
            last[partial] = self.req_to_token_pool.slots_at(rows, prefix[partial] - 1)
        return last

    def _set_lens(self, prefix: np.ndarray, seq: np.ndarray, out: torch.Tensor, rows: np.ndarray | None = None) -> None:
        if rows is None:
            rows = np.fromiter((r.req_pool_idx for r in self.reqs), dtype=np.int64, count=len(self.reqs))
        self.req_pool_indices = torch.from_numpy(rows)
        self.prefix_lens = torch.from_numpy(prefix)
        self.seq_lens = torch.from_numpy(seq)
        self.extend_lens = torch.from_numpy(seq - prefix)
        self.out_cache_loc = out


def alloc_decode_slots(req_to_token_pool: ReqToTokenPool, token_allocator: TokenAllocator | PagedTokenAllocator,
                       kv_lens: np.ndarray, rows: np.ndarray) -> torch.Tensor | None:
    """Trusted: allocates each running request's slot for its token at position kv_lens[i] ([bs] int64; every
    request holds at least one token) and writes it into its req_to_token row rows[i]; returns the slots, or None
    (nothing changed) when they are short."""
    if token_allocator.page_size == 1:
        out = token_allocator.alloc(len(kv_lens))
    else:
        # Only the requests whose page has room use their last slot, but one gather reads every request's.
        last = req_to_token_pool.slots_at(rows, kv_lens - 1)
        out = token_allocator.alloc_decode_unchecked(kv_lens, last)
    if out is not None:
        req_to_token_pool.set_slots_at(rows, kv_lens, out)
    return out


def token_ids(next_token_ids, name: str = "next_token_ids") -> array:
    """Token ids (the sampled tokens, or a run's outputs) as an int64 array, converted in one C-level pass
    (a tensor read token by token costs a 0-d tensor and an int() per token). Raises TypeError for non-integer
    tokens."""
    if isinstance(next_token_ids, (list, tuple)):  # the common case, checked first
        if _holds_a_bool(next_token_ids):
            raise TypeError(f"{name} must hold int token ids, got a bool")  # array("q") would store 1
    elif isinstance(next_token_ids, torch.Tensor) and next_token_ids.device.type == "meta":
        raise ValueError(f"{name} is on the 'meta' device, which holds no values")
    elif isinstance(next_token_ids, (torch.Tensor, np.ndarray)):
        if next_token_ids.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(next_token_ids.shape)}")
        if next_token_ids.dtype in (torch.bool, np.bool_):
            raise TypeError(f"{name} must hold int token ids, got dtype {next_token_ids.dtype}")
        next_token_ids = next_token_ids.tolist()
    try:
        return array("q", next_token_ids)
    except TypeError as e:
        raise TypeError(f"{name} must hold int token ids ({e})") from None
    except OverflowError:
        raise ValueError(f"{name} holds a token id outside int64") from None


_BOOLS = frozenset((True, False))


def _holds_a_bool(ids: list | tuple) -> bool:
    # One set lookup per element in C, which finds the ints 1 and 0 too (True == 1): only then is each element's type
    # looked at.
    try:
        maybe = not _BOOLS.isdisjoint(ids)
    except TypeError:  # an unhashable element (a list, an array): look at every type
        maybe = True
    return maybe and any(type(t) is bool for t in ids)
