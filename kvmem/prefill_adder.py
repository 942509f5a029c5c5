"""Admission's room budget for one extend step (SGLang's PrefillAdder): what a request costs and whether the
next one still fits.

A step admits waiting requests while rows are left in the running batch, prefill tokens are left in the step's
budget (`chunked_prefill_size`), and no prompt is being prefilled in chunks; a request fits when its charge
(`admission_charge`) is at most the room: free plus evictable KV slots, less what is kept for the running
requests' future output tokens (`new_token_ratio` x the tokens they still owe) and for the requests admitted
before it in this step. A tree with more components than the token pool (`kvmem.hybrid`) adds its own budget
(`RadixCache.admission_budget`), which must fit too and may shorten what a step prefills; a chunk that stops short of
its prompt's end ends on the tree's `chunk_grid`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmem._paging import round_up

if TYPE_CHECKING:
    from kvmem.allocator import PagedTokenAllocator, TokenAllocator
    from kvmem.batch import Req
    from kvmem.radix_cache import RadixCache


def admission_charge(req: Req, start: int, page_size: int, new_token_ratio: float) -> int:
    """Room admission keeps for `req`: slots (whole pages) for the rest of its prompt from token `start`, plus its
    share of future output tokens; never more than the request can ever take (which `Scheduler.add_request`
    checked fits the pool), so an idle scheduler always admits its queue's head."""
    fill, left = len(req.fill_ids), req.max_new_tokens - len(req.output_ids)
    done = round_up(start, page_size)
    return min(round_up(fill, page_size) - done + int(left * new_token_ratio),
               round_up(fill + left, page_size) - done)


class PrefillAdder:
    """The requests one extend step takes, and the room they leave.

    rows_left: requests the running batch can still take; budget: prefill tokens of the step (inf: no cap);
    reserved: KV slots kept for the running requests' output tokens. `reqs` are the requests added, `chunked` the
    one whose prompt this step leaves partly prefilled (then nothing more is added).
    """

    def __init__(self, token_allocator: TokenAllocator | PagedTokenAllocator, tree_cache: RadixCache, *,
                 rows_left: int, budget: float, reserved: int, new_token_ratio: float) -> None:
        self.token_allocator = token_allocator
        self.tree_cache = tree_cache
        self.page_size = token_allocator.page_size
        self.rows_left = rows_left
        self.components = tree_cache.admission_budget(reserved, new_token_ratio)
        self.budget = budget if self.components is None else min(budget, self.components.max_extend)
        self.grid = tree_cache.chunk_grid
        self.reserved = reserved
        self.new_token_ratio = new_token_ratio
        self.reqs: list[Req] = []
        self.chunked: Req | None = None

    def can_add(self) -> bool:
        """Whether the step may take another request (it still has to fit `room()`)."""
        return self.rows_left > 0 and self.budget > 0 and self.chunked is None

    def room(self) -> int:
        """KV slots a request admitted now may take: free and evictable, less those kept. Read live: a tiered
        cache's match loads pages back, which takes device slots."""
        return self.token_allocator.available_size() - self.reserved + self.tree_cache.evictable_size()

    def charge(self, req: Req, start: int) -> int:
        return admission_charge(req, start, self.page_size, self.new_token_ratio)

    def fits(self, req: Req, start: int) -> bool:
        """Whether `req`, from token `start` (its cached prefix), fits what is left: its charge in `room()`, and
        the tree's other components' charges in their budgets."""
        if self.charge(req, start) > self.room():
            return False
        return self.components is None or self.components.fits(req, start, self._end(req, start))

    def add(self, req: Req, start: int) -> None:
        """Takes `req` from token `start` (its cached prefix, or where its last chunk ended): sets how far this
        step prefills it (`extend_end`) and charges the budget and the room for it."""
        end = self._end(req, start)
        req.extend_end = end
        if req.is_chunked():
            self.chunked = req
        self.budget -= end - start
        self.reserved += self.charge(req, start)
        self.rows_left -= 1
        self.reqs.append(req)
        if self.components is not None:
            self.components.add(req, start, end)

    def _end(self, req: Req, start: int) -> int:
        """Where this step's prefill of `req` from `start` ends: its prompt's end, or what the budget leaves, on the
        chunk grid (at least one grid step, from a start on the grid)."""
        fill = len(req.fill_ids)
        end = min(fill, start + self.budget)
        grid = self.grid
        if grid > 1 and end < fill:
            end = max(end - end % grid, min(fill, start + grid))
        return int(end)
