"""The order a capped store evicts its pages in: least recently used first, each prefix chain kept whole.

A lookup stops at a chain's first missing page, so dropping a chain's root first would leave the rest of it
unreachable. Hence the two rules every capped store here follows (the file store and the simulated store alike,
so that a simulated replay evicts what a file store would):

- a call's pages (a chain, root first) count as used deepest first, root last (`use`): the root is evicted last;
- a write never makes room by evicting a page of its own chain (`make_room` with `keep`): it stores the leading
  pages that fit, and stops at the first that does not.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Iterable


class PageLRU:
    """Pages by recency: `entries` maps a page's key to a value (what the store keeps for it), least recently
    used first; `size_of(value)` is what the page counts against a capacity, and `used` their sum."""

    def __init__(self, size_of: Callable[[int], int]) -> None:
        self.entries: OrderedDict[Hashable, int] = OrderedDict()
        self.used = 0
        self._size_of = size_of

    def __contains__(self, key) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key):
        return self.entries.get(key)

    def add(self, key, value: int) -> None:
        """Adds (or replaces) a page, as the most recently used."""
        old = self.entries.pop(key, None)
        if old is not None:
            self.used -= self._size_of(old)
        self.entries[key] = value
        self.used += self._size_of(value)

    def remove(self, key):
        """Drops a page; its value, or None if it was not there."""
        value = self.entries.pop(key, None)
        if value is not None:
            self.used -= self._size_of(value)
        return value

    def use(self, chain: Iterable) -> None:
        """Marks the pages of `chain` (root first) used now: the deepest first, the root last."""
        entries = self.entries
        for key in reversed(list(chain)):
            if key in entries:
                entries.move_to_end(key)

    def make_room(self, size: int, capacity: int | None, keep: Collection = ()) -> tuple[list, bool]:
        """Evicts least recently used pages until `size` more fits in `capacity` (None: unbounded). Returns the
        evicted (key, value) pairs, and False when it cannot make the room: the page is larger than the capacity,
        or the next page to go is in `keep` (the chain being written; what was evicted before it stays evicted)."""
        if capacity is None:
            return [], True
        if size > capacity:
            return [], False
        evicted, entries = [], self.entries
        while self.used + size > capacity and entries:
            key = next(iter(entries))
            if key in keep:
                return evicted, False
            value = entries.pop(key)
            self.used -= self._size_of(value)
            evicted.append((key, value))
        return evicted, True
