"""The sink a cache reports its events to, and the batching of those events per scheduler step."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvmem._checks import check_int
from kvmem.events.schema import _EVENT_TYPES, EventBatch, KVCacheEvent


class EventCollector:
    """An `event_sink` for a cache: it keeps the events the cache reports, in order, and hands them out
    as one `EventBatch` per scheduler step.

    Args:
        data_parallel_rank: stamped on every batch (None: left for the publisher to set).
        clock: the batch timestamp source, seconds since the epoch (float).

    >>> from kvmem.events import AllBlocksCleared, EventCollector
    >>> sink = EventCollector(clock=lambda: 12.5)
    >>> sink(AllBlocksCleared())                  # what RadixCache.reset() reports
    >>> batch = sink.take_batch()                 # at the end of the step
    >>> batch.ts, len(batch.events), sink.take_batch()
    (12.5, 1, None)
    """

    def __init__(self, data_parallel_rank: int | None = None, clock: Callable[[], float] = time.time) -> None:
        if data_parallel_rank is not None:
            data_parallel_rank = check_int("data_parallel_rank", data_parallel_rank, minimum=0)
        if not callable(clock):
            raise TypeError(f"clock must be callable, got {type(clock).__name__}")
        self.data_parallel_rank = data_parallel_rank
        self.clock = clock
        self._events: list[KVCacheEvent] = []

    def __call__(self, event: KVCacheEvent) -> None:
        """Records one event (the cache calls this)."""
        if not isinstance(event, _EVENT_TYPES):
            raise TypeError(f"event must be BlockStored, BlockRemoved or AllBlocksCleared, got "
                            f"{type(event).__name__}")
        self._events.append(event)

    def __len__(self) -> int:
        """Events recorded since the last `take_batch`."""
        return len(self._events)

    def take_batch(self) -> EventBatch | None:
        """The events recorded since the last call, as one batch stamped now; None if there were none
        (a step that changed no cache sends nothing). If the clock raises (or gives no number), so does this,
        and the events stay for the next call."""
        if not self._events:
            return None
        batch = EventBatch(self.clock(), self._events, self.data_parallel_rank)
        self._events = []
        return batch
