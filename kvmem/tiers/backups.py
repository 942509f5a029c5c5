"""A host tier's write policies: when a device node gets its host copy, and the copies in flight.

Write policies: "write_through" backs a node up as soon as it is inserted, "write_through_selective" once a
match has reached it twice, "write_back" only when device eviction would otherwise drop it.

Backups are asynchronous on CUDA: a node being copied stays locked on device until its copy completes, and
copies complete in the order they were issued. `writing_check()` (the Scheduler calls it every step) finishes
them; with `tp_group`, a copy counts as complete only once every tensor-parallel rank has finished it
(`all_reduce(MIN)` over the completed count, as SGLang does), so that all ranks take the same decisions. A
copy that fails releases its host slots, and those of every backup issued after it (they may back up its
descendants), and the nodes stay on device only: a fault costs hits, never correctness.

`HostBackups` is a part of `HiRadixCache` (a mixin over its tree and tiers), kept apart as one concept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvmem._torch import torch
from kvmem.events.schema import MEDIUM_CPU_PINNED
from kvmem.tiers.host_pool import Transfer

if TYPE_CHECKING:
    from kvmem.tiers.tree_node import HiTreeNode

_SELECTIVE_HITS = 2  # write_through_selective backs a node up once this many matches reached it


@dataclass(eq=False)
class Backup:
    """One device -> host copy in flight: the nodes it backs up (root first; a split puts its new head before
    its tail), the node whose lock keeps their device copies alive until it completes, its token count."""

    transfer: Transfer
    nodes: list[HiTreeNode]
    lock_node: HiTreeNode
    tokens: int
    discard: bool = False  # an earlier backup failed: this one may back up that one's descendants


class HostBackups:
    """HiRadixCache's backups: device -> host copies, started by the write policy, completed in order."""

    def _backup_hot_path(self, node: HiTreeNode) -> None:
        """write_through_selective: backs up root..(the deepest node a match reached twice) below `node`."""
        while node.parent is not None and node.hit_count < _SELECTIVE_HITS:
            node = node.parent
        if node.parent is not None:
            self._backup_path(node)

    def _unbacked_path(self, node: HiTreeNode) -> list[HiTreeNode]:
        """The device nodes from the first without a host copy down to `node`, root side first."""
        nodes = []
        while node.parent is not None and node.host_value is None:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes

    def _start_backup(self, nodes: list[HiTreeNode]) -> tuple[Transfer, np.ndarray] | None:
        """Host slots for `nodes` (evicting host-only leaves when short) and the copy into them; None when the
        host is short or the copy failed at once (nothing changed)."""
        tokens = sum(n.num_tokens for n in nodes)
        host = self._alloc_host(tokens)
        if host is None:
            return None
        device = np.concatenate([n.value for n in nodes]) if len(nodes) > 1 else nodes[0].value
        transfer = self.host_pool.backup(host, self._to_device(device))
        if transfer.failed:
            self.host_allocator.free(host)
            self.stats.failed_transfers += 1
            return None
        host = host.numpy()
        offset = 0
        for node in nodes:
            node.host_value = host[offset:offset + node.num_tokens].copy()
            offset += node.num_tokens
        self._host_protected_size += tokens
        return transfer, host

    def _backup_path(self, node: HiTreeNode) -> None:
        """Starts backing up root..node's nodes that have no host copy; they stay locked on device until the
        copy completes (`writing_check`)."""
        nodes = self._unbacked_path(node)
        started = self._start_backup(nodes) if nodes else None
        if started is None:
            return
        record = Backup(started[0], nodes, node, sum(n.num_tokens for n in nodes))
        # While a failed backup's later ones are still in flight, an ancestor's host copy here may be one of
        # theirs, to be released when it lands: this one goes with them (re-backed up later, if wanted).
        record.discard = any(r.discard for r in self._pending)
        for n in nodes:
            n.backup = record
        self.lock(node)
        self._pending.append(record)
        self.writing_check(local_only=True)

    def _backup_now(self, node: HiTreeNode) -> None:
        """write_back, while `node` (an unlocked device leaf) is being evicted: backs up its unbacked path and
        waits, so that it can stay as host-only; on failure nothing changes (it is then dropped)."""
        nodes = self._unbacked_path(node)
        started = self._start_backup(nodes) if nodes else None
        if started is None:
            return
        transfer, _ = started
        transfer.wait()
        if transfer.failed:
            self._release_host_copies(nodes)
            self.stats.failed_transfers += 1
            return
        self.stats.backed_up_tokens += sum(n.num_tokens for n in nodes)
        self._report_backed_up(nodes)

    def writing_check(self, *, local_only: bool = False) -> int:
        """Completes the backups whose copies have finished, in the order they were issued; with `tp_group`,
        only those finished on every rank (unless `local_only`, which only finishes copies that cannot differ
        between ranks: none on CUDA). Returns how many completed. Also releases the host slots of prefetches
        taken too late, once their reads have ended."""
        if self.storage_link is not None and not local_only:
            self._reap_prefetches()
        done = 0
        for record in self._pending:
            if not record.transfer.done():
                break
            done += 1
        if self.tp_group is not None:
            if local_only:
                return 0
            done = all_reduce_min(done, self.tp_group)
        if done == 0:
            return 0
        records = [self._pending.popleft() for _ in range(done)]
        ok = [not r.transfer.failed for r in records]
        if self.tp_group is not None:
            ok = all_reduce_min(ok, self.tp_group)
        for record, good in zip(records, ok):
            if not good:
                self.stats.failed_transfers += 1
                for later in self._pending:
                    later.discard = True
            if good and not record.discard:
                for node in record.nodes:
                    node.backup = None
                self.stats.backed_up_tokens += record.tokens
                self._report_backed_up(record.nodes)
            else:
                self.stats.discarded_backups += record.discard
                for node in record.nodes:
                    node.backup = None
                self._release_host_copies(record.nodes)
            self.unlock(record.lock_node)
        return done

    def _complete_backup(self, record: Backup) -> None:
        """Waits for `record`'s copy and those issued before it, and completes them (writing_check)."""
        for pending in self._pending:
            pending.transfer.wait()
            if pending is record:
                break
        while record.nodes[0].backup is record:  # writing_check completes it, with or without its host copy
            self.writing_check()

    def _release_host_copies(self, nodes: list[HiTreeNode]) -> None:
        """Drops the host copies of device nodes (a failed or discarded backup): they stay device-only."""
        values = [n.host_value for n in nodes if n.host_value is not None]
        for n in nodes:
            n.host_value = None
        if values:
            slots = np.concatenate(values)
            self._host_protected_size -= len(slots)
            self.host_allocator.free(torch.from_numpy(slots))

    def _report_backed_up(self, nodes: list[HiTreeNode]) -> None:
        """Backups of `nodes` completed: report them on host, and hand their pages to the storage tier."""
        for node in nodes:
            self._report_stored(node, MEDIUM_CPU_PINNED)
        if self.storage_link is not None and not self.storage_link.closed:
            unstored = [n for n in nodes if not n.stored]
            if unstored:
                self.storage_link.write(b"".join(n.page_digests for n in unstored),
                                        np.concatenate([n.host_value for n in unstored]))
                for node in unstored:
                    node.stored = True


def check_tp_group(tp_group) -> None:
    """Raises unless `tp_group` is None or a torch.distributed process group: anything else would fail only at
    the first all-reduce, with a backup already in flight that no later check could complete."""
    if tp_group is None:
        return
    import torch.distributed as dist

    if not dist.is_available() or not isinstance(tp_group, dist.ProcessGroup):
        raise TypeError(f"tp_group must be a torch.distributed ProcessGroup or None, got {type(tp_group).__name__}")


def all_reduce_min(values, group):
    """The element-wise minimum of `values` (an int or a list of bools) over the ranks of `group`."""
    import torch.distributed as dist

    scalar = isinstance(values, int)
    tensor = torch.tensor([values] if scalar else [int(v) for v in values], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return int(tensor[0]) if scalar else [bool(v) for v in tensor.tolist()]
