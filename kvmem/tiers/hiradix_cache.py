"""The hierarchical radix cache (HiCache-style): a radix tree whose nodes hold device slots, host slots or both.

A node is *on device* (its `value` holds device slots) and/or *backed up* (its `host_value` holds host slots
whose copy has completed). Two rules keep every path simple, and every operation local:

- The device tier is prefix-closed: a node on device has its whole path on device. So a path is some device
  nodes from the root, then host-only nodes; `match_prefix` returns the device part's slots and how many
  tokens beyond it the host holds (`host_hit_length`).
- The backed-up set is prefix-closed too: a node is backed up only after (or together with) its ancestors.
  So a node that is not backed up has no host-only descendants, and removing it never orphans one.

Device eviction pops the least valuable *device leaf* (on device, unlocked, no child on device) from an ordered
set: a backed-up one stays in the tree as host-only, any other leaves it. Host eviction pops host-only leaves
(unlocked, childless) from a second ordered set. Both are O(k log n) for k nodes, never a scan: SGLang's
hierarchical cache collects every device leaf with a tree walk on each evict.

Write policies and backups (`kvmem.tiers.backups`) decide when a device node gets its host copy; the storage
tier under the host (`kvmem.tiers.storage_prefetch`) stores backed-up pages and reads a prompt's pages ahead of
its admission. A failed load leaves its nodes host-only and frees the device slots it took.

Events (`event_sink`): a page is reported stored on "GPU" when it gets device slots (inserted, loaded back,
revived by an insert) and removed when it leaves them; stored on "CPU_PINNED" when its host copy completes (or a
storage prefetch hangs it in the tree) and removed when the host tier evicts it. The storage tier reports nothing:
a store is shared (a directory or a Mooncake cluster that every replica reads), so its pages are no replica's.
Reported as the writer's "DISK" pages, they would draw every later request on that prefix to the writer, when any
replica would read them at the same cost; and the writer could not report their removal (the store evicts them,
and other replicas write the same keys), so a router's index would keep pages the store has dropped. A router
that weighs the shared pool asks the store (`batch_exists`), the same answer for every replica. SGLang 0.5.23
names "DISK" and "EXTERNAL" media but reports events only for its device and host tiers; vLLM 0.33 reports its
storage tiers' pages as "STORAGE" with a `locality` (LOCAL or REMOTE) for a router to tell them apart.

Host tier sizes: `host_evictable_size()` counts host-only unlocked tokens, `host_protected_size()` every other
host copy the tree holds (copies of device nodes, locked or loading host-only nodes, backups in flight), and
`host_available_size() + host_evictable_size() + host_protected_size() == host_total_size()`.
"""

from __future__ import annotations

import weakref
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvmem._checks import check_int, check_number, fail_invariant
from kvmem._torch import torch
from kvmem.allocator import PagedTokenAllocator, TokenAllocator
from kvmem.events.schema import MEDIUM_CPU_PINNED, AllBlocksCleared, KVCacheEvent
from kvmem.eviction import EvictionPolicy, EvictionPolicySpec, make_policy
from kvmem.hybrid.allocator import HybridTokenAllocator
from kvmem.radix_cache import MatchResult, RadixCache
from kvmem.radix_tree import TOKEN_BYTES, TreeNode
from kvmem.req_to_token import ReqToTokenPool
from kvmem.tiers.backups import Backup, HostBackups, check_tp_group
from kvmem.tiers.storage_link import PREFETCH_POLICIES, Prefetch, StorageLink
from kvmem.tiers.storage_prefetch import StoragePrefetch
from kvmem.tiers.tree_node import NO_SLOTS, HiTreeNode

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


@dataclass
class TierStats:
    """Tokens moved between tiers since the cache was built."""

    loaded_tokens: int = 0          # host -> device (load_back)
    backed_up_tokens: int = 0       # device -> host (completed backups)
    host_evicted_tokens: int = 0    # host copies dropped by evict_host
    failed_transfers: int = 0       # copies that failed (their nodes stayed in their old tier)
    discarded_backups: int = 0      # backups released because an earlier one failed


class HiRadixCache(HostBackups, StoragePrefetch, RadixCache):
    """A radix cache over a device slot allocator and a host pool (see the module docstring).

    Args:
        req_to_token_pool, token_allocator, page_size, eviction_policy, event_sink, pin_budget: as for RadixCache.
        host_pool: a `HostKVPool` (or `HostSlotPool`) with the same page size, larger than the device.
        write_policy: "write_through", "write_through_selective" or "write_back".
        host_eviction_policy: the host tier's eviction policy (default: a new one of the device's kind; pass
            one when eviction_policy is a policy object, which serves one tier only).
        tp_group: a torch.distributed process group of tensor-parallel ranks running the same cache.
        storage: a storage tier under the host (`kvmem.storage.FileStore`, `MooncakeStore`): pages are written
            to it once backed up to the host, and `prefetch` reads a prompt's pages beyond the tree from it.
        prefetch_policy: "best_effort", "wait_complete" or "timeout" (see kvmem.tiers.storage_link);
            prefetch_timeout_s: the wait of "timeout". With tp_group every prefetch is waited for, so that all
            ranks attach the same pages.
    """

    node_class = HiTreeNode

    def __init__(self, req_to_token_pool: ReqToTokenPool, token_allocator: TokenAllocator | PagedTokenAllocator,
                 host_pool, *, page_size: int = 1, eviction_policy: EvictionPolicySpec = "lru",
                 write_policy: str = "write_through", host_eviction_policy: EvictionPolicySpec | None = None,
                 tp_group=None, event_sink: Callable[[KVCacheEvent], None] | None = None, storage=None,
                 prefetch_policy: str = "best_effort", prefetch_timeout_s: float = 0.05,
                 pin_budget: float = 0.2) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        host_allocator = getattr(host_pool, "allocator", None)
        if not isinstance(host_allocator, (TokenAllocator, PagedTokenAllocator)) or not callable(
                getattr(host_pool, "backup", None)) or not callable(getattr(host_pool, "load", None)):
            raise TypeError(f"host_pool must be a HostKVPool or HostSlotPool, got {type(host_pool).__name__}")
        if isinstance(token_allocator, HybridTokenAllocator):
            raise TypeError("token_allocator is a HybridTokenAllocator: a hybrid model's pools (full KV, window KV, "
                            "states) stay on the device, with no host tier; use kvmem.hybrid.HybridRadixCache")
        if host_allocator.page_size != page_size:
            raise ValueError(f"host_pool's page size {host_allocator.page_size} != page_size {page_size}")
        if host_allocator.size <= token_allocator.size:
            raise ValueError(f"host_pool ({host_allocator.size} tokens) must be larger than the device "
                             f"({token_allocator.size} tokens)")
        if getattr(host_pool, "device_pool", None) is not None and host_pool.device_pool.size != token_allocator.size:
            raise ValueError(f"host_pool backs a device pool of {host_pool.device_pool.size} tokens, but "
                             f"token_allocator has {token_allocator.size}")
        check_tp_group(tp_group)
        if prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"prefetch_policy must be one of {PREFETCH_POLICIES}, got {prefetch_policy!r}")
        check_number("prefetch_timeout_s", prefetch_timeout_s, 0)
        owner = getattr(host_pool, "_cache", None)
        if owner is not None and owner() is not None:
            # Each cache hands out the pool's slots through its allocator as if it were alone: two would
            # overwrite each other's host copies.
            raise ValueError("host_pool already backs another HiRadixCache; give each cache its own host pool")
        if host_eviction_policy is None:
            if isinstance(eviction_policy, EvictionPolicy):
                raise ValueError("host_eviction_policy is needed when eviction_policy is a policy object: a policy "
                                 "object orders one tier's leaves")
            host_eviction_policy = eviction_policy
        self._host_policy = make_policy(host_eviction_policy)
        # Host slots reading pages for prefetches, not yet the tree's, and those prefetches not yet finished:
        # both outlive reset(), since a read in flight still writes into its slots.
        self._prefetch_held = 0
        self._prefetches: dict[int, Prefetch] = {}  # by id; held, so that no other object takes the id
        link = None if storage is None else StorageLink(
            storage, host_pool, "wait_complete" if tp_group is not None else prefetch_policy, prefetch_timeout_s)
        super().__init__(req_to_token_pool, token_allocator, page_size, eviction_policy, event_sink, pin_budget)
        self._host_policy.bind(self)
        self.storage_link = link
        self._track_turns([self._host_policy])
        self._names = self._names or link is not None  # storage keys are page digests
        self.host_pool = host_pool
        host_pool._cache = weakref.ref(self)
        self.host_allocator = host_allocator
        self.write_policy = write_policy
        self.tp_group = tp_group
        self.stats = TierStats()

    def _init_root(self) -> None:
        super()._init_root()
        self._host_policy.clear()
        self._host_evictable_size = 0
        self._host_protected_size = 0
        self._pending: deque[Backup] = deque()

    # ---- sizes --------------------------------------------------------------------------------------
    def device_evictable_size(self) -> int:
        """Device tokens in unlocked nodes (`evictable_size()`)."""
        return self._evictable_size

    def host_evictable_size(self) -> int:
        """Host tokens of unlocked host-only nodes: what `evict_host` can free."""
        return self._host_evictable_size

    def host_protected_size(self) -> int:
        """Host tokens the tree holds that `evict_host` cannot free: copies of device nodes, locked host-only
        nodes and backups in flight."""
        return self._host_protected_size

    def host_total_size(self) -> int:
        """Host tokens held by the tree."""
        return self._host_evictable_size + self._host_protected_size

    def host_available_size(self) -> int:
        return self.host_allocator.available_size()

    # ---- match --------------------------------------------------------------------------------------
    def match_prefix(self, key, namespace: str | None = None) -> MatchResult:
        """The longest cached prefix of `key` in either tier (whole pages).

        `indices` and `last_node` cover its device part (lock `last_node` to keep it on device); the next
        `host_hit_length` tokens are on host only, down to `last_host_node` (`load_back(last_host_node,
        host_hit_length)` brings them to the device). A match ending inside an edge splits that node.
        """
        return super().match_prefix(key, namespace)

    def _matched(self, node: HiTreeNode) -> MatchResult:
        device_node, host_tokens = self._device_ancestor(node)
        if device_node.entry is not None:
            self._rekey(device_node)
        if node.host_entry is not None:
            self._host_rekey(node)
        if self.write_policy == "write_through_selective" and device_node.parent is not None:
            self._backup_hot_path(device_node)
        if host_tokens == 0:
            return MatchResult(self._path_indices(node), node)
        return MatchResult(self._path_indices(device_node), device_node, host_tokens, node)

    def _device_ancestor(self, node: HiTreeNode) -> tuple[HiTreeNode, int]:
        """The deepest node on device on root..node, and the tokens of the host-only nodes below it."""
        tokens = 0
        while node.parent is not None and not len(node.value):
            tokens += node.num_tokens
            node = node.parent
        return node, tokens

    # ---- insert (reviving host-only nodes) ----------------------------------------------------------
    def _device_gap(self, walk) -> int:
        """Tokens of the host-only nodes a walk went through (they end its path: the device is prefix-closed):
        an insert takes value's slots for them (the tokens' KV is the same)."""
        _, tokens = self._device_ancestor(walk.node)
        if walk.child is not None and not len(walk.child.value):
            tokens += walk.into_child // TOKEN_BYTES
        return tokens

    def _revive_path(self, last: HiTreeNode, slots: np.ndarray) -> None:
        """Puts the host-only nodes at the end of root..last back on device, in `slots` (their tokens, root
        side first)."""
        nodes = []
        node = last
        while node.parent is not None and not len(node.value):
            nodes.append(node)
            node = node.parent
        offset = 0
        for node in reversed(nodes):
            n = node.num_tokens
            self._to_device_tier(node, slots[offset:offset + n].copy())
            offset += n

    def _inserted(self, last: HiTreeNode) -> None:
        if self.write_policy == "write_through":
            self._backup_path(last)

    def _to_device_tier(self, node: HiTreeNode, slots: np.ndarray) -> None:
        """A host-only node whose parent is on device gets device slots (its host copy stays)."""
        n = len(slots)
        node.value = slots
        self._own(slots)
        parent = node.parent
        parent.device_children += 1
        if parent.entry is not None:  # no longer a device leaf
            self._remove_evictable(parent)
        if node.host_entry is not None:
            self._remove_host_evictable(node)
        if node.lock_ref:
            self._protected_size += n  # its host copy was protected as a locked node, and stays so
        else:
            self._evictable_size += n
            self._host_evictable_size -= n
            self._host_protected_size += n
            if node.device_children == 0:
                self._add_evictable(node)
        self._report_stored(node)

    # ---- locks and leaves, per tier -----------------------------------------------------------------
    def _add_leaf(self, parent: HiTreeNode, key: bytes, value: np.ndarray, priority: int) -> HiTreeNode:
        leaf = super()._add_leaf(parent, key, value, priority)
        parent.device_children += 1
        return leaf

    def _protect(self, node: HiTreeNode) -> None:
        if len(node.value):
            super()._protect(node)
            return
        n = node.num_tokens
        self._host_evictable_size -= n
        self._host_protected_size += n
        if node.host_entry is not None:
            self._remove_host_evictable(node)

    def _unprotect(self, node: HiTreeNode) -> None:
        n = len(node.value)
        if n:
            self._protected_size -= n
            self._evictable_size += n
            if node.device_children == 0:
                self._add_evictable(node)
            return
        n = node.num_tokens
        self._host_protected_size -= n
        self._host_evictable_size += n
        if not node.children:
            self._add_host_evictable(node)

    def _split(self, child: HiTreeNode, into_child: int) -> HiTreeNode:
        host, backup = child.host_value, child.backup
        head = super()._split(child, into_child)
        k = into_child // TOKEN_BYTES
        if host is not None:
            head.host_value, child.host_value = host[:k].copy(), host[k:].copy()
        head.device_children = 1 if len(child.value) else 0
        head.backup = backup
        head.stored = child.stored
        if backup is not None:  # root first, as its events report them: a parent's pages before its child's
            backup.nodes.insert(backup.nodes.index(child), head)
        self._host_policy.split(head, child)
        if child.host_entry is not None:
            self._host_rekey(child)
        return head

    def _add_host_evictable(self, node: HiTreeNode) -> None:
        node.host_entry = self._host_policy.add(node)

    def _remove_host_evictable(self, node: HiTreeNode) -> None:
        self._host_policy.remove(node, node.host_entry)
        node.host_entry = None

    def _host_rekey(self, node: HiTreeNode) -> None:
        node.host_entry = self._host_policy.update(node, node.host_entry)

    def _pin_target(self, node: HiTreeNode) -> HiTreeNode:
        return self._device_ancestor(node)[0]

    def _looks_ahead(self) -> bool:
        return self._policy.looks_ahead or self._host_policy.looks_ahead

    def _note_waiting(self, rid, node: HiTreeNode, key: memoryview) -> None:
        """The device policy learns the deepest device node of the request's prefix, the host policy its
        deepest node."""
        if self._policy.looks_ahead:
            self._policy.waiting(rid, self._device_ancestor(node)[0], key)
        if self._host_policy.looks_ahead:
            self._host_policy.waiting(rid, node, key)

    def request_admitted(self, rid) -> None:
        self._policy.admitted(rid)
        self._host_policy.admitted(rid)

    # ---- device eviction: backed-up leaves stay as host-only ----------------------------------------
    def _leave_device(self, node: HiTreeNode) -> None:
        if node.host_value is None and self.write_policy == "write_back":
            self._backup_now(node)
        if node.host_value is not None and node.backup is None:
            self._demote(node)
            return
        parent = node.parent
        if self._turn_policy is self._host_policy:  # it leaves the tree without reaching the host tier
            self._host_policy.evicted(node)
        super()._leave_device(node)
        parent.device_children -= 1
        if parent.device_children == 0 and parent.entry is None and parent.lock_ref == 0 \
                and parent.parent is not None and len(parent.value):
            self._add_evictable(parent)  # its remaining children, if any, are host-only

    def _demote(self, node: HiTreeNode) -> None:
        """A backed-up device leaf (unlocked) gives its device slots up (its caller frees them) and stays."""
        node.value = NO_SLOTS
        parent = node.parent
        parent.device_children -= 1
        if parent.device_children == 0 and parent.entry is None and parent.lock_ref == 0 \
                and parent.parent is not None:
            self._add_evictable(parent)
        n = node.num_tokens
        self._host_protected_size -= n
        self._host_evictable_size += n
        if not node.children:
            self._add_host_evictable(node)

    def evict_host(self, num_tokens: int) -> int:
        """Frees at least `num_tokens` host tokens from unlocked host-only leaves in policy order (or all there
        are); returns the number freed. O(k log n) for k nodes freed."""
        num_tokens = check_int("num_tokens", num_tokens, minimum=0)
        freed, values, removed = 0, [], []
        while freed < num_tokens:
            node = self._host_policy.pop()
            if node is None:
                break
            self._host_policy.evicted(node)
            node.host_entry = None
            parent = node.parent
            del parent.children[node.key[:self._page_bytes]]
            node.parent = None
            self._forget(node)
            values.append(node.host_value)
            removed.append(node)
            freed += node.num_tokens
            if parent.parent is not None and not parent.children and parent.lock_ref == 0 \
                    and not len(parent.value):
                self._add_host_evictable(parent)
        if values:
            self._host_evictable_size -= freed
            self.host_allocator.free(torch.from_numpy(np.concatenate(values)))
            self.stats.host_evicted_tokens += freed
            self._report_removed(removed, MEDIUM_CPU_PINNED)
        return freed

    def _alloc_host(self, tokens: int) -> torch.Tensor | None:
        short = tokens - self.host_allocator.available_size()
        if short > 0:
            self.evict_host(short)
        return self.host_allocator.alloc(tokens)

    # ---- load back ----------------------------------------------------------------------------------
    def load_back(self, node: HiTreeNode, host_hit_length: int) -> torch.Tensor | None:
        """Brings the host-only nodes at the end of root..node (`host_hit_length` tokens, as `match_prefix`
        returned them) to the device: allocates device slots (evicting if short), copies, and returns the
        slots of the whole prefix root..node ([prefix_len] int64). None, with nothing changed, when the device
        is short (free + evictable below `host_hit_length`); None when the copy fails, and then what was evicted
        to make room stays evicted. Raises if `node` is not in the tree or the length does not match."""
        self._check_node(node)
        host_hit_length = check_int("host_hit_length", host_hit_length, minimum=1)
        device_node, tokens = self._device_ancestor(node)
        if tokens != host_hit_length:
            raise ValueError(f"host_hit_length {host_hit_length} != the {tokens} host-only tokens ending at node "
                             f"{node.id}: match again")
        nodes = []
        walker = node
        while walker is not device_node:
            nodes.append(walker)
            walker = walker.parent
        nodes.reverse()
        self.lock(node)  # the device prefix stays, and the host nodes cannot be host-evicted
        try:
            short = tokens - self.token_allocator.available_size()
            if short > self.evictable_size():
                return None  # before evicting: a load that cannot happen must not cost other prefixes
            if short > 0:
                self.evict(short)
            device = self.token_allocator.alloc(tokens)
            if device is None:
                return None
            host = np.concatenate([n.host_value for n in nodes]) if len(nodes) > 1 else nodes[0].host_value
            transfer = self.host_pool.load(device, torch.from_numpy(host))
            transfer.wait()
            if transfer.failed:
                self.stats.failed_transfers += 1
                self.token_allocator.free(device)
                return None
            slots, offset = device.cpu().numpy(), 0
            for n in nodes:
                self._to_device_tier(n, slots[offset:offset + n.num_tokens].copy())
                offset += n.num_tokens
            self.stats.loaded_tokens += tokens
            return self._path_indices(node)
        finally:
            self.unlock(node)

    # ---- whole tree ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """Empties both tiers, once the backups in flight have completed. Raises RuntimeError, changing
        nothing, while a request locks any node (on device or host)."""
        # A backup in flight locks its path too: only locks beyond those are requests'.
        backups = Counter(_top_node(record.lock_node) for record in self._pending)
        if any(child.lock_ref > backups[child] for root in self._roots.values() for child in root.children.values()):
            raise RuntimeError("reset() while requests lock cached tokens; release them (dec_lock_ref) first")
        for record in self._pending:
            record.transfer.wait()
        while self._pending:
            self.writing_check()
        if self.storage_link is not None:
            self.storage_link.drain_writes()
        nodes = self._detach_all()
        device = [n.value for n in nodes if len(n.value)]
        host = [n.host_value for n in nodes if n.host_value is not None]
        if device:
            self._release(device)
        if host:
            self.host_allocator.free(torch.from_numpy(np.concatenate(host)))
        self._init_root()
        if self._event_sink is not None:
            self._event_sink(AllBlocksCleared())

    def check_invariants(self) -> None:
        """RadixCache's checks over the device tier, then the host tier's: every node on device or host, both
        tiers prefix-closed, device-child counts, the host-evictable set (exactly the unlocked, childless
        host-only nodes, each under its current key), the host counters, and the host slots (distinct,
        allocated, and with the free ones and those prefetches read into summing to the host pool's size)."""
        super().check_invariants()
        nodes = self._all_nodes()
        host_evictable = host_protected = leaves = 0
        host_values = []
        for node in nodes:
            on_device = len(node.value) > 0
            parent = node.parent
            if on_device and parent.parent is not None and not len(parent.value):
                fail_invariant(f"node {node.id} is on device under a host-only parent")
            if node.host_value is not None and parent.parent is not None and parent.host_value is None and not (
                    node.backup is not None and node.backup.discard):  # in flight, to be released when it lands
                fail_invariant(f"node {node.id} has a host copy but its parent {parent.id} has none")
            if not on_device and node.host_value is None:
                fail_invariant(f"node {node.id} is in neither tier")
            device_children = sum(1 for c in node.children.values() if len(c.value))
            if device_children != node.device_children:
                fail_invariant(f"node {node.id}: device_children {node.device_children}, counted {device_children}")
            if node.host_value is not None:
                if len(node.host_value) != node.num_tokens:
                    fail_invariant(f"node {node.id}: {len(node.host_value)} host slots for {node.num_tokens} tokens")
                host_values.append(node.host_value)
                if not on_device and node.lock_ref == 0:
                    host_evictable += node.num_tokens
                else:
                    host_protected += node.num_tokens
            should = not on_device and node.lock_ref == 0 and not node.children
            if should != (node.host_entry is not None):
                fail_invariant(f"node {node.id} is {'' if node.host_entry else 'not '}in the host-evictable set")
            if should and not self._host_policy.is_current(node, node.host_entry):
                fail_invariant(f"node {node.id}: host-evictable entry is stale")
            leaves += should
        for root in self._roots.values():
            if root.device_children != sum(1 for c in root.children.values() if len(c.value)):
                fail_invariant("a root's device_children count is wrong")
        if leaves != len(self._host_policy):
            fail_invariant(f"the host-evictable set has {len(self._host_policy)} entries for {leaves} host-only leaves")
        if (host_evictable, host_protected) != (self._host_evictable_size, self._host_protected_size):
            fail_invariant(f"host counters say evictable {self._host_evictable_size}, protected "
                           f"{self._host_protected_size}; the nodes hold {host_evictable} and {host_protected}")
        slots = np.concatenate(host_values) if host_values else NO_SLOTS
        if len(np.unique(slots)) != len(slots):
            fail_invariant("the tree holds a host slot more than once")
        if len(slots) and not self.host_allocator.allocated_mask(slots).all():
            fail_invariant("the tree holds a host slot that the host allocator considers free")
        free = self.host_allocator.available_size()
        if self.storage_link is not None:
            reading = sum(p.host_slots.size for p in self._prefetches.values()) + self.storage_link.late_tokens()
            if reading != self._prefetch_held:
                fail_invariant(f"{self._prefetch_held} host slots counted as prefetching, {reading} held by reads")
        if free + len(slots) + self._prefetch_held != self.host_allocator.size:
            fail_invariant(f"host: free {free} + held by the tree {len(slots)} + prefetching {self._prefetch_held} != "
                           f"{self.host_allocator.size}")

    def _node_device_tokens(self, node: HiTreeNode) -> int:
        n = len(node.value)
        if n not in (0, node.num_tokens):
            fail_invariant(f"node {node.id}: {n} device slots for {node.num_tokens} tokens (all or none)")
        return n

    def _is_evictable_leaf(self, node: HiTreeNode) -> bool:
        return node.lock_ref == 0 and len(node.value) > 0 and node.device_children == 0


def _top_node(node: TreeNode) -> TreeNode:
    """The ancestor of `node` just below its root (`node` itself at that depth)."""
    while node.parent.parent is not None:
        node = node.parent
    return node
