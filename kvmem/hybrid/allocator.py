"""The paired allocator of a sliding-window model: a full slot and a window slot for every token.

The full pool (the full-attention layers' KV) holds every token a request or the tree keeps; the window pool (the
sliding layers' KV) holds only the tokens still inside some window, so it is much smaller. `req_to_token` holds full
slots only, and window layers read and write through `full_to_window`: each full page is paired with a window page at
allocation (same offsets, so at page size > 1 a request's partial page continues in both), and the pairing is dropped
when the window page is freed before the full one: a token that left every window keeps its full KV (a tree
tombstone, or the old part of a long request's row).

Pairing is kept per page in a host int64 array (0 = no window page), the same numpy bookkeeping as the allocators'.
A window page keeps no state of its own: it is handed out while a full page is paired with it, and held by the prefix
cache when that full page is. A full page freed with its window page keeps the pairing (it is *parked*): free full
pages form two lists, the parked ones, handed out first with no new pairing to write, and the unpaired ones, which
take their window pages from the window pool's free list (window pages freed alone). So at page size 1, where every
token is a page, a hand-out or a free writes one state per token, as the full-attention allocator does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from kvmem._checks import check_host_bytes, check_int
from kvmem._index import as_index_array
from kvmem._torch import torch
from kvmem.allocator import CACHED, FREE, HELD, AllocatorState, PagedTokenAllocator, _FreeList, _PageStack


@dataclass(frozen=True)
class HybridAllocatorState(AllocatorState):
    """A `HybridTokenAllocator.backup_state()` snapshot: the full pages' (the unpaired free ones in `free_pages`), the
    parked full pages, the window pool's free list and the pairing."""

    parked: np.ndarray | None = None
    window_free: np.ndarray | None = None
    window_pages: np.ndarray | None = None
    num_window_pages: int = 0


class _PairedPages(_PageStack):
    """Full pages that hold a window page each while handed out (`window_page[full page]`, 0 = none). This stack's
    own free list holds the unpaired free full pages; `parked` the free ones that kept their window page; `window`
    the window pages paired with no full page."""

    def __init__(self, num_pages: int, num_window_pages: int) -> None:
        self.window = _FreeList(num_window_pages)
        self.parked = _FreeList(num_pages)
        self.window_page = np.zeros(num_pages + 2, dtype=np.int64)
        super().__init__(num_pages)

    def clear(self) -> None:
        super().clear()
        # A fresh pool parks window page i on full page i: hand-outs then take pages 1, 2, ... in both pools.
        paired = min(self.num_pages, self.window.num_pages)
        self.window_page[:] = 0
        self.window_page[1:paired + 1] = self._arange[1:paired + 1]
        self.parked.reset(self._arange[1:paired + 1])
        self.take(paired)
        self.window.reset(np.arange(paired + 1, self.window.num_pages + 1, dtype=np.int64))

    def num_free(self) -> int:
        return self._tail - self._head + self.parked._tail - self.parked._head

    def window_free(self) -> int:
        """Window pages free: parked or listed alone."""
        return self.window._tail - self.window._head + self.parked._tail - self.parked._head

    def pop(self, n: int) -> np.ndarray | None:
        parked = self.parked
        head = parked._head
        if n <= parked._tail - head:
            if n < 0:
                raise ValueError(f"cannot take {n} pages")
            pages = parked._buf[head:head + n].copy()
            parked._head = head + n
            self._state[pages] = HELD
            return pages
        fresh = n - (parked._tail - head)  # unpaired full pages, each taking a window page
        if fresh > self._tail - self._head or fresh > self.window._tail - self.window._head:
            return None
        pages = np.concatenate((parked.take(n - fresh), self.take(fresh)))
        self.window_page[pages[n - fresh:]] = self.window.take(fresh)
        self._state[pages] = HELD
        return pages

    def pop_tail_paired(self, n: int, paired: int) -> np.ndarray | None:
        """n full pages, only the last `paired` of them with a window page (0 <= paired <= n)."""
        if n > self.num_free() or paired > self.window_free():
            return None
        bare = n - paired
        plain = min(bare, self._tail - self._head)
        head = self.take(plain)
        if plain < bare:  # parked pages give their window page back to serve as bare ones
            unparked = self.parked.take(bare - plain)
            self.window.push(self.window_page[unparked])
            self.window_page[unparked] = 0
            head = np.concatenate((head, unparked))
        else:
            head = head.copy()
        self._state[head] = HELD
        # Cannot come up short: if the bare pages emptied the unpaired list, the parked pages left are at least
        # `paired` (n fit in all free pages); else the unpaired ones still cover what the parked do not, and the
        # window pages free alone cover those (`paired` fit in all free window pages).
        return np.concatenate((head, self.pop(paired)))

    def push(self, pages: np.ndarray) -> None:
        peers = self.window_page[pages]
        paired = np.count_nonzero(peers)
        if paired == len(pages):
            self.parked.push(pages)
        elif paired == 0:
            super().push(pages)
        else:
            mask = peers != 0
            self.parked.push(pages[mask])
            super().push(pages[~mask])

    def backup(self) -> HybridAllocatorState:
        full = super().backup()
        return HybridAllocatorState(full.free_pages, full.allocated, self.parked.listed(), self.window.listed(),
                                    self.window_page.copy(), self.window.num_pages)

    def restore(self, state: HybridAllocatorState) -> None:
        super().restore(state)
        self.parked.reset(state.parked)
        self.window.reset(state.window_free)
        self.window_page[:] = state.window_pages


class HybridTokenAllocator(PagedTokenAllocator):
    """Full slots 1..size, each handed out with a window slot of 1..window_size (see the module docstring).

    Every allocation (`alloc`, `alloc_extend`, `alloc_decode`) takes whole full pages and as many window pages, or
    returns None, changing nothing, when either pool is short. `available_size()` and `size` are the full pool's
    (the tokens a request can hold); `window_available_size()` and `window_size` the window pool's. `free(slots)`
    frees the full pages and their window peers; `free_window(slots)` only the window peers (the full KV stays).
    Works at page size 1 too.

    >>> import torch
    >>> from kvmem.hybrid import HybridTokenAllocator
    >>> alloc = HybridTokenAllocator(size=64, window_size=16, page_size=4)
    >>> slots = alloc.alloc_extend([0], [6], [-1])          # full pages 1 and 2, window pages 1 and 2
    >>> alloc.window_slots(slots).tolist()
    [4, 5, 6, 7, 8, 9]
    >>> alloc.free_window(slots[:4])                         # the first page left the window: its full KV stays
    >>> alloc.window_slots(slots).tolist(), alloc.window_available_size()
    ([0, 0, 0, 0, 8, 9], 12)
    >>> alloc.alloc(16) is None                              # 3 window pages left: short, nothing changed
    True
    """

    def __init__(self, size: int, window_size: int, page_size: int = 1, device: str | torch.device = "cpu") -> None:
        window_size = check_int("window_size", window_size, minimum=1)
        super().__init__(size, page_size, device)
        if window_size % page_size:
            raise ValueError(f"window_size {window_size} must be a multiple of page_size {page_size}")
        # The window pool's free list (2 x 8 bytes a window page), and per full page the parked list (2 x 8) and the
        # pairing (8), beside what the full pages' allocator counted.
        check_host_bytes(f"a window pool of size {window_size}",
                         (window_size // page_size) * 16 + (size // page_size + 2) * 24)
        self.window_size = window_size
        self._pages = _PairedPages(size // page_size, window_size // page_size)
        self._window_group: list[np.ndarray] | None = None

    def alloc_window_tail(self, n: int, window_tokens: int) -> torch.Tensor | None:
        """[n] int64 slots of n / page_size whole new full pages, of which only the last window_tokens (whole pages)
        take window slots: for tokens whose window KV nobody will write or read (a prompt's head that a request
        received from elsewhere holds beyond its window). None, changing nothing, when either pool is short."""
        n = check_int("n", n, minimum=1)
        window_tokens = check_int("window_tokens", window_tokens, minimum=0, maximum=n)
        ps = self.page_size
        for name, value in (("n", n), ("window_tokens", window_tokens)):
            if value % ps:
                raise ValueError(f"{name} {value} must be a multiple of page_size {ps}")
        pages = self._pages.pop_tail_paired(n // ps, window_tokens // ps)
        if pages is None:
            return None
        return self._to_slots_tensor((pages[:, None] * ps + self._offsets).reshape(-1))

    # ---- sizes and translation -------------------------------------------------------------------------
    def window_available_size(self) -> int:
        """Free window slots (tokens)."""
        return self._pages.window_free() * self.page_size

    def window_cached_size(self) -> int:
        """Window slots paired with full pages marked cached (held by the prefix cache): O(pages), for invariant
        checks."""
        full = self._pages
        return int(np.count_nonzero(full.window_page[full._state == CACHED])) * self.page_size

    def window_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """The window slot of each full slot in `slots` ([n] integer tensor, any device): [n] int64 on this
        allocator's device, 0 (the padding slot) where the token has no window slot. What a sliding layer reads and
        writes for the tokens that a full layer finds at `slots`."""
        full = as_index_array("slots", slots)
        if len(full) and (full.min() < 0 or full.max() >= self.size + self.page_size):
            raise IndexError(f"slots: slot {full.min() if full.min() < 0 else full.max()} out of range "
                             f"[0, {self.size + self.page_size})")
        window = self.window_slots_of(full)
        window[~self.allocated_mask(full)] = 0  # a free full page may keep its window page (parked) for its next owner
        return self._to_slots_tensor(window)

    def window_slots_of(self, slots: np.ndarray) -> np.ndarray:
        """Trusted: window_slots of host int64 full slots (each in range)."""
        ps = self.page_size
        if ps == 1:
            return self._pages.window_page[slots]
        peer = self._pages.window_page[slots // ps]
        return np.where(peer != 0, peer * ps + slots % ps, 0)

    def window_pages_of(self, pages: np.ndarray) -> np.ndarray:
        """Trusted: the window page paired with each full page (0 = none)."""
        return self._pages.window_page[pages]

    # ---- frees -------------------------------------------------------------------------------------
    def free_window(self, slots: torch.Tensor) -> None:
        """Frees the window slots paired with full slots `slots` ([n] integer tensor, whole pages listed from their
        first slot at page size > 1); the full slots stay allocated. Raises, freeing nothing, for a slot that is not
        allocated or has no window slot (freed already), or a page listed twice."""
        slots_np = as_index_array("slots", slots)
        if len(slots_np) == 0:
            return
        pages = self._pages_of("slots", slots_np)
        self._pages.check_free("slots", pages)
        missing = self._pages.window_page[pages] == 0
        if np.count_nonzero(missing):
            raise ValueError(f"slots: slot {pages[missing][0] * self.page_size} has no window slot (freed already?)")
        self._release_window_pages(pages)

    def free_window_pages(self, pages: np.ndarray) -> int:
        """Trusted: frees the window pages paired with full `pages` ([n] host int64, distinct, allocated); those
        without one are skipped. Returns the window tokens freed."""
        return self._release_window_pages(pages) * self.page_size

    def _release_window_pages(self, pages: np.ndarray) -> int:
        window_page = self._pages.window_page
        peers = window_page[pages]
        paired = np.count_nonzero(peers)
        if paired:
            peers = peers[peers != 0] if paired != len(peers) else peers
            if self._window_group is None:
                self._pages.window.push(peers)
            else:
                self._window_group.append(peers)  # a fresh array: the gather above copied it
            window_page[pages] = 0
        return paired

    def move_window_pages(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Trusted: full pages `dst` take the window pages of full pages `src` (same length, each src paired, each dst
        unpaired): a tree node whose window KV was freed takes a request's copy of the same tokens' window KV, while
        the request's full duplicates are freed after."""
        window_page = self._pages.window_page
        window_page[dst] = window_page[src]
        window_page[src] = 0

    def pages_cached(self, pages: np.ndarray) -> np.ndarray:
        """Trusted: [n] bool, True where full page `pages[i]` (and so its window peer) is held by the prefix cache."""
        return self._pages.states(pages) == CACHED

    @contextmanager
    def free_group(self) -> Iterator[None]:
        """Batches the frees of both pools inside the block (see `PagedTokenAllocator.free_group`)."""
        if self._group is not None:
            yield
            return
        self._window_group = []
        try:
            with super().free_group():
                yield
        finally:
            group, self._window_group = self._window_group, None
            if group:
                self._pages.window.push(np.concatenate(group))

    def restore_state(self, state: AllocatorState) -> None:
        if not isinstance(state, HybridAllocatorState) or state.window_pages is None or \
                state.num_window_pages != self._pages.window.num_pages:
            raise ValueError("state must come from backup_state() of a HybridTokenAllocator of the same sizes")
        super().restore_state(state)

    def clear(self) -> None:
        super().clear()
        self._window_group = None

    def check_pairing(self) -> None:
        """Raises AssertionError unless the pairing is one to one: every window page is paired with one full page
        (handed out, or free and parked) or listed free alone, never both; a free full page keeps one only while
        parked."""
        full = self._pages
        window_page, state = full.window_page, full._state
        parked = full.parked.listed()
        if np.count_nonzero(state[parked]) or np.count_nonzero(window_page[parked] == 0):
            raise AssertionError("HybridTokenAllocator: a parked full page is handed out or keeps no window page")
        free = np.flatnonzero(state[1:-1] == FREE) + 1
        if np.count_nonzero(window_page[free]) != len(parked):
            raise AssertionError("HybridTokenAllocator: a free full page keeps a window page but is not parked")
        peers = window_page[window_page != 0]
        if len(np.unique(peers)) != len(peers):
            raise AssertionError("HybridTokenAllocator: a window page is paired with two full pages")
        window = full.window
        in_free_list = np.zeros(window.num_pages + 1, dtype=bool)
        in_free_list[window.listed()] = True
        if len(peers) + window.num_free() != window.num_pages or np.count_nonzero(in_free_list[peers]):
            raise AssertionError(f"HybridTokenAllocator: {len(peers)} window pages paired, {window.num_free()} free "
                                 f"alone, of {window.num_pages}")
