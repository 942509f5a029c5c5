"""The storage tier under a host tier: backed-up pages written to a store, a prompt's pages read ahead of its
admission (prefetch) and hung in the tree as host-only nodes.

The storage tier reports no KV events: a store is shared (a directory or a Mooncake cluster that every replica
reads), so its pages are no replica's. Reported as the writer's "DISK" pages, they would draw every later request
on that prefix to the writer, when any replica would read them at the same cost; and the writer could not report
their removal (the store evicts them, and other replicas write the same keys), so a router's index would keep
pages the store has dropped. A router that weighs the shared pool asks the store (`batch_exists`), the same
answer for every replica. SGLang 0.5.23 names "DISK" and "EXTERNAL" media but reports events only for its device
and host tiers; vLLM 0.33 reports its storage tiers' pages as "STORAGE" with a `locality` (LOCAL or REMOTE) for a
router to tell them apart.

`StoragePrefetch` is a part of `HiRadixCache` (a mixin over its tree and tiers), kept apart as one concept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmem._paging import TOKEN_BYTES
from kvmem._torch import torch
from kvmem.events.schema import MEDIUM_CPU_PINNED
from kvmem.page_hash import DIGEST_BYTES, chain_page_digests, namespace_prefix
from kvmem.radix_tree import key_bytes
from kvmem.tiers.backups import all_reduce_min
from kvmem.tiers.storage_link import Prefetch
from kvmem.tiers.tree_node import NO_SLOTS

if TYPE_CHECKING:
    pass

class StoragePrefetch:
    """HiRadixCache's storage tier: prefetches of a prompt's pages, and closing the link."""

    def prefetch(self, key, namespace: str | None = None) -> Prefetch | None:
        """Starts reading, from the storage tier into host slots, the whole pages of `key` after the prefix
        the tree holds (in any tier); None when there is no storage tier or it has none of them. Take the pages
        with `finish_prefetch` before matching the request (the Scheduler does both). None after close()."""
        if self.storage_link is None or self.storage_link.closed:
            return None
        view = key_bytes("key", key)
        nbytes = len(view) - len(view) % self._page_bytes
        walk = self._descend(view, nbytes, self._root(namespace))
        start = walk.num_tokens
        if start * TOKEN_BYTES >= nbytes:
            return None
        digests = chain_page_digests(namespace_prefix(namespace), self._digest_at(walk),
                                     view[start * TOKEN_BYTES:nbytes], self._page_bytes)
        pages = self.storage_link.lookup(digests)
        if self.tp_group is not None:
            pages = all_reduce_min(pages, self.tp_group)
        if not pages:
            return None
        # The prefix the pages will hang from is locked while host room is made: evicting it would waste the read.
        held = walk.node if walk.child is None else walk.child
        if held.parent is not None:
            self.lock(held)
        try:
            host = self._alloc_host(pages * self.page_size)
        finally:
            if held.parent is not None:
                self.unlock(held)
        if host is None:
            return None
        host = host.numpy()
        self._prefetch_held += len(host)
        end = (start + pages * self.page_size) * TOKEN_BYTES
        prefetch = self.storage_link.read(namespace, view[:end].tobytes(), start, digests[:pages * DIGEST_BYTES],
                                          host)
        self._prefetches[id(prefetch)] = prefetch
        return prefetch

    def finish_prefetch(self, prefetch: Prefetch | None) -> int:
        """Attaches the pages of `prefetch` that arrived (by the prefetch policy) as host-only nodes, where the
        tree's prefix still leads to them; returns the tokens attached. Pages the tree gained meanwhile, or whose
        prefix left it, are released. Raises, changing nothing, for a prefetch this cache did not start or has
        finished already (its slots are no longer the prefetch's)."""
        if prefetch is None:
            return 0
        if not isinstance(prefetch, Prefetch):
            raise TypeError(f"prefetch must be a Prefetch (from prefetch()) or None, got {type(prefetch).__name__}")
        if self._prefetches.get(id(prefetch)) is not prefetch:
            raise ValueError("prefetch was not started by this cache's prefetch(), or was finished already")
        del self._prefetches[id(prefetch)]
        got, reading = self.storage_link.arrived(prefetch)
        if self.tp_group is not None:
            got = all_reduce_min(got, self.tp_group)
        ps = self.page_size
        # The pages of a chunk still being read stay held until the read ends (writing_check reaps them).
        self._prefetch_held -= (prefetch.pages - int(reading.sum())) * ps
        attached = self._attach(prefetch, got)
        unused = ~reading
        unused[attached[0]:attached[1]] = False
        if unused.any():
            self.host_allocator.free(torch.from_numpy(prefetch.host_slots.reshape(-1, ps)[unused].ravel()))
        tokens = (attached[1] - attached[0]) * ps
        self.storage_link.stats.prefetched_tokens += tokens
        self.storage_link.stats.dropped_prefetch_tokens += got * ps - tokens
        return tokens

    def _attach(self, prefetch: Prefetch, got: int) -> tuple[int, int]:
        """Hangs pages [skip, got) of `prefetch` under the node where the tree's prefix ends; returns (skip,
        end) in pages ((0, 0) when nothing could be attached)."""
        ps, page_bytes = self.page_size, self._page_bytes
        if got == 0:
            return 0, 0
        view = memoryview(prefetch.key)
        end_tokens = prefetch.start + got * ps
        walk = self._descend(view, end_tokens * TOKEN_BYTES, self._root(prefetch.namespace))
        now = walk.num_tokens
        if now < prefetch.start or now >= end_tokens:
            return 0, 0  # the prefix the pages hang from left the tree, or the tree has them all by now
        skip = (now - prefetch.start) // ps
        parent = self._walk_to_node(walk)
        if parent.parent is not None:
            if parent.host_value is None:
                self._backup_path(parent)  # a host-only child needs a parent with a host copy (prefix-closed)
            if parent.backup is not None:  # in flight: it may fail or be discarded, so wait until it lands
                self._complete_backup(parent.backup)
            if parent.host_value is None:
                return 0, 0
        node = self.node_class(view[now * TOKEN_BYTES:end_tokens * TOKEN_BYTES].tobytes(), NO_SLOTS, parent,
                               self._clock, next(self._ids))
        node.host_value = prefetch.host_slots[skip * ps:got * ps].copy()
        node.page_digests = prefetch.digests[skip * DIGEST_BYTES:got * DIGEST_BYTES]
        node.stored = True
        parent.children[node.key[:page_bytes]] = node
        if parent.host_entry is not None:
            self._remove_host_evictable(parent)
        self._host_evictable_size += node.num_tokens
        self._add_host_evictable(node)
        self._report_stored(node, MEDIUM_CPU_PINNED)
        return skip, got

    def _digest_at(self, walk) -> bytes | None:
        """The digest of the page that ends where `walk` stopped (None at a root)."""
        if walk.child is not None:
            pages = walk.into_child // self._page_bytes
            return walk.child.page_digests[(pages - 1) * DIGEST_BYTES:pages * DIGEST_BYTES]
        return None if walk.node.parent is None else walk.node.page_digests[-DIGEST_BYTES:]

    def close(self) -> None:
        """Waits for the storage tier's queued writes and reads and stops its worker (a no-op without one); the
        cache goes on with its device and host tiers, writing nothing more to storage and prefetching nothing."""
        if self.storage_link is not None:
            self.storage_link.close()
            self._reap_prefetches()

    def _reap_prefetches(self) -> None:
        for slots in self.storage_link.reap():
            self._prefetch_held -= len(slots)
            self.host_allocator.free(torch.from_numpy(slots))
