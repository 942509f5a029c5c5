"""Level 2 slot allocators: which KV slots (`out_cache_loc`) are free.

Slot 0 (page 0 when paged) is reserved as the padding slot, so usable slots are 1..size. The bookkeeping
lives on the host in numpy arrays: a scheduler decides on the CPU, and a numpy fancy index costs a fraction of
a torch one there, which pays for checking every free against double frees and still keeps up with an
allocator that checks nothing.
Returned slot tensors are int64 copies on `device`; they stay valid however the allocator changes later.

Each page is FREE, HELD (handed out) or CACHED (handed out, and marked by the prefix cache that holds it, so that
the cache refuses it when a caller hands it in again as a new slot). The public methods check their arguments;
kvmem's own layers, which checked them where they entered, call the trusted bodies: `alloc_extend_unchecked`,
`alloc_decode_unchecked`, `free_owned`, `mark_cached`, `allocated_mask` and `cached_mask`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from kvmem._checks import check_host_bytes, check_int
from kvmem._device import check_device
from kvmem._index import as_index_array
from kvmem._paging import num_new_pages
from kvmem._torch import torch


@dataclass(frozen=True)
class AllocatorState:
    """An opaque snapshot taken by `backup_state()`."""

    free_pages: np.ndarray
    allocated: np.ndarray  # each page's state (FREE, HELD, CACHED)


FREE, HELD, CACHED = 0, 1, 2  # a page's state: free, handed out, handed out and held by a prefix cache


class _FreeList:
    """A FIFO of free page ids: handed out oldest-freed first."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # Live free pages are buf[head:tail]; the buffer is twice the page count so that appends only
        # compact (move the live run to the front) once per num_pages frees: O(1) amortized.
        self._buf = np.empty(2 * num_pages, dtype=np.int64)
        self._head = self._tail = 0

    def reset(self, pages: np.ndarray) -> None:
        """Makes `pages` (distinct, at most num_pages) the whole list."""
        n = len(pages)
        self._buf[:n] = pages
        self._head = 0
        self._tail = n

    def num_free(self) -> int:
        return self._tail - self._head

    def take(self, n: int) -> np.ndarray:
        """Pops n <= num_free() pages: a view of the list, valid until the next push."""
        head = self._head
        self._head = head + n
        return self._buf[head:head + n]

    def push(self, pages: np.ndarray) -> None:
        """Appends pages (whose states, where kept, are cleared already)."""
        n = len(pages)
        if self._tail + n > len(self._buf):
            live = self._tail - self._head
            self._buf[:live] = self._buf[self._head:self._tail]
            self._head = 0
            self._tail = live
        self._buf[self._tail:self._tail + n] = pages
        self._tail += n

    def listed(self) -> np.ndarray:
        """A copy of the list, oldest first."""
        return self._buf[self._head:self._tail].copy()


class _PageStack(_FreeList):
    """Free page ids 1..num_pages, handed out oldest-freed first, with a state per page (FREE, HELD, CACHED)."""

    def __init__(self, num_pages: int) -> None:
        super().__init__(num_pages)
        # Entry num_pages + 1 is a sentinel that stays FREE like page 0: `take(mode="clip")` sends every
        # out-of-range page to one of the two, so a single gather checks range and ownership together.
        self._state = np.zeros(num_pages + 2, dtype=np.uint8)
        self._scratch = np.zeros(num_pages + 1, dtype=np.int64)
        self._arange = np.arange(num_pages + 1, dtype=np.int64)
        self.clear()

    def clear(self) -> None:
        self.reset(self._arange[1:])
        self._state[:] = FREE

    def pop(self, n: int) -> np.ndarray | None:
        if n > self._tail - self._head:
            return None
        if n < 0:  # a caller's arithmetic went wrong: popping "back" would invent free pages
            raise ValueError(f"cannot take {n} pages")
        pages = self._buf[self._head:self._head + n].copy()
        self._head += n
        self._state[pages] = HELD
        return pages

    def check_free(self, name: str, pages: np.ndarray) -> None:
        """Raises unless `pages` are distinct, in range and allocated. Changes nothing."""
        n = len(pages)
        # count_nonzero rather than min/max/all: the cheapest full reduction on a short array.
        if np.count_nonzero(self._state.take(pages, mode="clip")) != n:
            self._raise_not_freeable(name, pages)
        if self.has_repeats(pages):
            raise ValueError(f"{name} holds a page more than once")

    def has_repeats(self, pages: np.ndarray) -> bool:
        """Whether `pages` (each in 0..num_pages) lists a page twice, without sorting: in a scratch array the
        last write wins, so where a page repeats an earlier position reads back another position's number."""
        n = len(pages)
        if n < 2:
            return False
        if n > self.num_pages + 1:
            return True
        order = self._arange[:n]
        self._scratch[pages] = order
        return bool(np.count_nonzero(self._scratch[pages] != order))

    def _raise_not_freeable(self, name: str, pages: np.ndarray) -> None:
        low, high = pages.min(), pages.max()
        if low < 1:
            raise ValueError(f"{name}: slot/page {low} is {'the padding slot 0' if low == 0 else 'negative'}")
        if high > self.num_pages:
            raise IndexError(f"{name}: page {high} out of range [1, {self.num_pages}]")
        free = self._state[pages] == FREE
        raise ValueError(f"{name}: page {pages[free][0]} is not allocated (double free?)")

    def mark_free(self, pages: np.ndarray) -> None:
        """Marks allocated, distinct `pages` (checked by `check_free`, or owned by the caller) FREE."""
        self._state[pages] = FREE

    def mark_cached(self, pages: np.ndarray) -> None:
        """Marks held, distinct `pages` CACHED."""
        self._state[pages] = CACHED

    def unlisted(self, pages: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """[n] bool: True where pages[i] (each in 0..num_pages) is not among `starts`. Works in a scratch
        array, so it allocates nothing per call."""
        self._scratch[pages] = -1
        self._scratch[starts] = 0
        return self._scratch[pages] != 0

    def count(self, state: int) -> int:
        """Pages in `state`."""
        return int(np.count_nonzero(self._state == state))

    def states(self, pages: np.ndarray) -> np.ndarray:
        """[n] uint8: each page's state (FREE for one out of range)."""
        return self._state.take(pages, mode="clip")

    def backup(self) -> AllocatorState:
        return AllocatorState(self.listed(), self._state.copy())

    def restore(self, state: AllocatorState) -> None:
        self.reset(state.free_pages)
        self._state[:] = state.allocated


class _SlotAllocator:
    """What the token-granular and paged allocators share: sizes, frees, groups and snapshots."""

    def __init__(self, size: int, page_size: int, device: str | torch.device) -> None:
        size = check_int("size", size, minimum=1)
        page_size = check_int("page_size", page_size, minimum=1)
        if size % page_size:
            raise ValueError(f"size {size} must be a multiple of page_size {page_size}")
        self.device = check_device(device)
        # The host bookkeeping per page: the free ring (2 x 8 bytes), the flag, the scratch and arange arrays;
        # and the paged allocator's offsets within a page.
        check_host_bytes(f"an allocator of size {size}", (size // page_size + 2) * 33 + 8 * page_size)
        self.size = size
        self.page_size = page_size
        self._on_cpu = self.device.type == "cpu"  # cached: reading torch.device.type is a call per alloc
        self._pages = _PageStack(size // page_size)
        self._group: list[np.ndarray] | None = None

    def available_size(self) -> int:
        """Free slots (tokens)."""
        return self._pages.num_free() * self.page_size

    def _to_slots_tensor(self, slots: np.ndarray) -> torch.Tensor:
        out = torch.from_numpy(slots)
        return out if self._on_cpu else out.to(self.device)

    def free(self, slots: torch.Tensor) -> None:
        """Returns slots [n] (int tensor, any device). Double free, slot 0 or out-of-range raises, and
        then nothing is freed. Paged: frees every page whose slots are listed (see PagedTokenAllocator)."""
        slots_np = as_index_array("slots", slots)
        if len(slots_np) == 0:
            return
        pages = self._pages_of("slots", slots_np)
        self._pages.check_free("slots", pages)
        self._release_pages(pages)

    def free_owned(self, slots: np.ndarray) -> None:
        """free's trusted body, for an owner of `slots` ([n] host int64): the radix tree for its nodes, the
        scheduler for its requests' rows. The owner keeps them allocated and distinct, so they are not checked
        again; their states are kept exact all the same."""
        if len(slots):
            self._release_pages(self._pages_of("slots", slots))

    def _release_pages(self, pages: np.ndarray) -> None:
        self._pages.mark_free(pages)
        if self._group is None:
            self._pages.push(pages)
        else:
            self._group.append(pages.copy())  # the caller's array: it may reuse it before the group ends

    def _pages_of(self, name: str, slots: np.ndarray) -> np.ndarray:
        return slots

    @contextmanager
    def free_group(self) -> Iterator[None]:
        """Batches the frees inside the block into one push at its end. Each free is still checked (and
        raises) where it is called; the slots become allocatable when the block exits."""
        if self._group is not None:
            yield
            return
        self._group = []
        try:
            yield
        finally:
            group, self._group = self._group, None
            if group:
                self._pages.push(np.concatenate(group) if len(group) > 1 else group[0])

    def has_repeated_pages(self, slots: np.ndarray) -> bool:
        """Whether host slots [n] int64 (each in range) touch some page twice; for page_size > 1 the slots
        are taken to be whole pages, each listed from its first slot (as the radix tree checks)."""
        pages = slots if self.page_size == 1 else slots[::self.page_size] // self.page_size
        return self._pages.has_repeats(pages)

    def is_allocated(self, slots: torch.Tensor) -> torch.Tensor:
        """[n] bool: True where the slot is currently handed out (out-of-range and slot 0 are False)."""
        return torch.from_numpy(self.allocated_mask(as_index_array("slots", slots)))

    def allocated_mask(self, slots: np.ndarray) -> np.ndarray:
        """is_allocated of in-range host int64 slots, as a numpy array: for kvmem's own checks (the tree's, the
        host pools'), whose slots are arrays already."""
        return self._pages.states(slots if self.page_size == 1 else slots // self.page_size) != FREE

    def cached_size(self) -> int:
        """Slots (tokens) in pages marked cached: O(pages), for invariant checks."""
        return self._pages.count(CACHED) * self.page_size

    def cached_mask(self, slots: np.ndarray) -> np.ndarray:
        """[n] bool: True where a host int64 slot's page is marked cached (`mark_cached`)."""
        return self._pages.states(slots if self.page_size == 1 else slots // self.page_size) == CACHED

    def mark_cached(self, slots: np.ndarray) -> None:
        """Trusted: marks handed-out host int64 slots (whole pages, each listed from its first slot) as held by a
        prefix cache, which tells them from a request's when it checks what it is given. They free as any others.
        """
        self._pages.mark_cached(slots if self.page_size == 1 else slots[::self.page_size] // self.page_size)

    def backup_state(self) -> AllocatorState:
        """A snapshot to roll back to with `restore_state` (e.g. after a speculative step)."""
        if self._group is not None:
            raise RuntimeError("backup_state inside free_group(): the pending frees would be lost")
        return self._pages.backup()

    def restore_state(self, state: AllocatorState) -> None:
        if self._group is not None:
            # The group's pending frees would land on top of the restored free list: slots twice.
            raise RuntimeError("restore_state inside free_group(): the pending frees would double-free")
        if not isinstance(state, AllocatorState) or len(state.allocated) != self._pages.num_pages + 2:
            raise ValueError("state must come from backup_state() of an allocator of the same size")
        self._pages.restore(state)

    def clear(self) -> None:
        """Frees every slot."""
        self._pages.clear()
        self._group = None


class TokenAllocator(_SlotAllocator):
    """Token-granular allocator over slots 1..size.

    `alloc(n)` returns [n] int64 distinct slots, or None (nothing changed) when fewer than n are free.
    """

    def __init__(self, size: int, page_size: int = 1, device: str | torch.device = "cpu") -> None:
        if page_size != 1:
            raise ValueError(f"page_size must be 1 for TokenAllocator (use PagedTokenAllocator), got {page_size}")
        super().__init__(size, 1, device)

    def alloc(self, n: int) -> torch.Tensor | None:
        slots = self._pages.pop(check_int("n", n, minimum=1))
        return None if slots is None else self._to_slots_tensor(slots)


class PagedTokenAllocator(_SlotAllocator):
    """Page-granular allocator: page p holds slots p*page_size .. p*page_size + page_size - 1, pages 1..size/page_size.

    A request's tokens fill a page before it takes a new one, so every page belongs to one owner (the radix
    tree for whole cached pages, a request for its partial last page). `free(slots)` frees the pages that
    `slots` start: every page listed must be listed from its first slot (offset 0) on, as a tree node's
    slots or a request's tail are; a run that starts mid-page raises.

    >>> from kvmem import PagedTokenAllocator
    >>> alloc = PagedTokenAllocator(size=64, page_size=4)       # pages 1..16; page 0 holds padding slot 0
    >>> first = alloc.alloc_extend([0], [6], [-1])              # a 6-token prompt: pages 1 and 2
    >>> first.tolist()
    [4, 5, 6, 7, 8, 9]
    >>> alloc.alloc_extend([6], [8], [9]).tolist()              # 2 more tokens fill page 2 (after slot 9)
    [10, 11]
    >>> alloc.alloc_decode([9], [11]).tolist()                  # token 8 starts a new page
    [12]
    >>> alloc.available_size(), alloc.alloc(64)                 # 13 pages left; None when short
    (52, None)
    """

    def __init__(self, size: int, page_size: int, device: str | torch.device = "cpu") -> None:
        super().__init__(size, page_size, device)
        self._offsets = np.arange(page_size, dtype=np.int64)

    def alloc(self, n: int) -> torch.Tensor | None:
        """[n] int64 slots of n / page_size whole new pages; n must be a multiple of page_size."""
        n = check_int("n", n, minimum=1)
        if n % self.page_size:
            raise ValueError(f"n {n} must be a multiple of page_size {self.page_size}")
        ps = self.page_size
        pages = self._pages.pop(n // ps)
        if pages is None:
            return None
        return self._to_slots_tensor(pages if ps == 1 else (pages[:, None] * ps + self._offsets).reshape(-1))

    def alloc_extend(self, prefix_lens, seq_lens, last_loc) -> torch.Tensor | None:
        """Slots for tokens prefix_lens[i]..seq_lens[i]-1 of each request, concatenated: [sum(seq - prefix)] int64.

        Each request first fills its partial last page (the slots after last_loc[i], the slot of its token
        prefix_lens[i]-1), then takes whole new pages. None (nothing changed) when the pages are short.
        """
        prefix, seq, last = self._check_extend_args(prefix_lens, seq_lens, last_loc)
        if np.count_nonzero(seq - prefix > self.size):  # more than the pool holds: short, and never summed
            return None
        return self.alloc_extend_unchecked(prefix, seq, last)

    def alloc_decode(self, seq_lens, last_loc) -> torch.Tensor | None:
        """One slot per request for its token seq_lens[i]-1 (seq_lens count the new token): [bs] int64, or None.

        The same slots as alloc_extend(seq_lens - 1, seq_lens, last_loc).
        """
        seq = as_index_array("seq_lens", seq_lens)
        last = as_index_array("last_loc", last_loc)
        if len(seq) != len(last):
            raise ValueError(
                f"seq_lens and last_loc must have one entry per request, got lengths {len(seq)}, {len(last)}")
        if len(seq) == 0:
            raise ValueError("seq_lens is empty: nothing to allocate")
        if np.count_nonzero(seq < 1):
            i = int(np.flatnonzero(seq < 1)[0])
            raise ValueError(f"request {i}: seq_lens must be >= 1, got {seq[i]}")
        self._check_last_loc(seq - 1, last)
        return self.alloc_decode_unchecked(seq - 1, last)

    def alloc_decode_unchecked(self, kv_lens: np.ndarray, last: np.ndarray) -> torch.Tensor | None:
        """alloc_decode's body (int64 arrays, checked by the caller): a request holding kv_lens[i] tokens gets the
        slot after last[i], or the first slot of a new page when its pages are full (in batch order)."""
        ps = self.page_size
        if ps == 1:  # every token starts a page
            pages = self._pages.pop(len(kv_lens))
            return None if pages is None else self._to_slots_tensor(pages)
        full = kv_lens % ps == 0
        pages = self._pages.pop(int(np.count_nonzero(full)))
        if pages is None:
            return None
        out = last + 1
        out[full] = pages * ps
        return self._to_slots_tensor(out)

    def alloc_extend_unchecked(self, prefix: np.ndarray, seq: np.ndarray, last: np.ndarray) -> torch.Tensor | None:
        """alloc_extend's body, for a caller that checked its arguments (ScheduleBatch): int64 arrays."""
        pages = self._pages.pop(int(num_new_pages(prefix, seq, self.page_size).sum()))
        if pages is None:
            return None
        return self._to_slots_tensor(_paged_slots(prefix, seq, last, pages, self.page_size))

    def _pages_of(self, name: str, slots: np.ndarray) -> np.ndarray:
        ps = self.page_size
        if ps == 1:
            return slots
        pages = slots // ps
        is_start = slots % ps == 0
        if np.count_nonzero(is_start) == len(slots):
            return pages
        # No scatter in the common case: a slot that is not a page start but follows the slot listed before
        # it lies in that slot's page, so when the first slot starts a page every page is listed from its start.
        if is_start[0] and np.count_nonzero(is_start[1:] | (slots[1:] == slots[:-1] + 1)) == len(slots) - 1:
            return pages[is_start]
        starts = pages[is_start]
        if len(starts) == 0:
            raise ValueError(f"{name} must list pages from their first slot; slot {slots[0]} starts mid-page")
        # Every slot must belong to a page whose first slot is listed.
        inside = (pages >= 0) & (pages <= self._pages.num_pages)
        if not inside.all():
            raise IndexError(f"{name}: slot {slots[~inside][0]} out of range [{ps}, {self.size + ps})")
        orphans = self._pages.unlisted(pages, starts)
        if orphans.any():
            raise ValueError(f"{name} must list pages from their first slot; slot {slots[orphans][0]} starts mid-page")
        return starts

    def _check_extend_args(self, prefix_lens, seq_lens, last_loc):
        prefix = as_index_array("prefix_lens", prefix_lens)
        seq = as_index_array("seq_lens", seq_lens)
        last = as_index_array("last_loc", last_loc)
        if not len(prefix) == len(seq) == len(last):
            raise ValueError(
                f"prefix_lens, seq_lens and last_loc must have one entry per request, got lengths "
                f"{len(prefix)}, {len(seq)}, {len(last)}")
        if len(seq) == 0:
            raise ValueError("seq_lens is empty: nothing to allocate")
        if (prefix < 0).any() or (seq <= prefix).any():
            i = int(np.flatnonzero((prefix < 0) | (seq <= prefix))[0])
            raise ValueError(f"request {i}: need 0 <= prefix_lens < seq_lens, got {prefix[i]} and {seq[i]}")
        self._check_last_loc(prefix, last)
        return prefix, seq, last

    def _check_last_loc(self, prefix: np.ndarray, last: np.ndarray) -> None:
        """A request that continues a partial page must give the slot of its token prefix-1, in an
        allocated page."""
        ps = self.page_size
        partial = prefix % ps != 0
        bad = partial & ((last + 1) % ps != prefix % ps)
        if np.count_nonzero(bad):
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"request {i}: last_loc {last[i]} is not the slot of token {prefix[i] - 1} "
                f"(offset {last[i] % ps} in its page, expected {(prefix[i] - 1) % ps})")
        pages = last[partial] // ps
        held = self._pages.states(pages) == HELD  # a partial page is a request's, never the tree's
        if np.count_nonzero(held) != len(held):
            i = int(np.flatnonzero(partial)[~held][0])
            raise ValueError(f"request {i}: last_loc {last[i]} is not the slot of token {prefix[i] - 1} in an "
                             f"allocated page: slot {last[i]} is not in an allocated page")
        # A partial page belongs to one request: two requests continuing it would both get its next slots.
        if self._pages.has_repeats(pages):
            values, counts = np.unique(pages, return_counts=True)
            raise ValueError(f"last_loc continues page {values[counts > 1][0]} for more than one request; a "
                             "partial page belongs to one request")


def _paged_slots(prefix: np.ndarray, seq: np.ndarray, last: np.ndarray, pages: np.ndarray, ps: int) -> np.ndarray:
    """The slot of every token prefix[i]..seq[i]-1 of each request, requests concatenated: first the rest
    of its partial page (the slots after last[i]), then its share of `pages`, taken in batch order.

    The j-th new token of request i goes to last[i] + 1 + j while j < fill[i] (the free slots of its
    partial page), else to slot k % ps of page pages[base[i] + k // ps], k = j - fill[i].
    """
    if ps == 1:  # a token per page, handed out in batch order
        return pages
    extend = seq - prefix
    total = int(extend.sum())
    if not np.count_nonzero(prefix % ps):
        # Every request starts a page (a prefix from the tree is whole pages): its tokens fill its share of the
        # new pages from the first slot, so the slots are the pages' slots less each one's unused tail.
        slots = (pages[:, None] * ps + np.arange(ps, dtype=np.int64)).reshape(-1)
        new_pages = num_new_pages(prefix, seq, ps)
        if len(slots) == total:
            return slots
        starts = (np.cumsum(new_pages) - new_pages) * ps
        # A slice per request (leaving the tail of its last page): cheaper than a mask built with numpy for
        # the batch sizes a scheduler builds.
        return np.concatenate([slots[s:s + n] for s, n in zip(starts.tolist(), extend.tolist())])
    fill = np.minimum(extend, -prefix % ps)
    new_pages = num_new_pages(prefix, seq, ps)
    base = np.cumsum(new_pages) - new_pages
    owner = np.repeat(np.arange(len(extend)), extend)
    j = np.arange(total, dtype=np.int64) - (np.cumsum(extend) - extend)[owner]
    k = j - fill[owner]
    in_partial = last[owner] + 1 + j
    if len(pages) == 0:
        return in_partial
    k_new = np.maximum(k, 0)
    # Clipped so that partial-page tokens (whose value np.where discards) never index past the pages.
    on_page = pages.take(base[owner] + k_new // ps, mode="clip") * ps + k_new % ps
    return np.where(k < 0, in_partial, on_page)
