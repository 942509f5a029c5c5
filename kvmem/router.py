"""Routing requests across engine replicas: an index of which replica caches which blocks, built from their
KV events alone, and the routing policies that read it.

Policies (`Router(policy, num_replicas)`; ties always go to the lowest replica number):

- "round-robin": replicas in turn, ignoring caches and load.
- "least-load": the replica with the fewest running requests (`ReplicaLoad.running_requests`): SGLang
  router's shortest-queue rule.
- "cache-aware": SGLang's router (sgl-router `policies/cache_aware.rs`, now the SGLang Model Gateway). The
  load is imbalanced when both `max - min > balance_abs_threshold` and `max > min * balance_rel_threshold`
  (running requests); then it routes to the least-loaded replica. Otherwise it takes the replica with the
  longest cached prefix of the request, if that prefix is more than `cache_threshold` of the request, and
  else the replica caching the fewest blocks (SGLang's "smallest tree": the most room). Defaults are
  SGLang's: cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5. Differences: SGLang
  matches characters against an approximate tree of the requests it routed; here the match is whole
  blocks against what the replicas report they cache (device tier), and equal matches go to the less
  loaded replica.
- "kv-overlap": Dynamo's KV router (its default worker selector; `--router-kv-overlap-score-weight`,
  temperature 0): the lowest `overlap_score_weight * prefill_blocks + decode_blocks`, where
  prefill_blocks = (prefill_tokens queued on the replica + request tokens - cached prefix blocks *
  block_size) / block_size and decode_blocks = the replica's active blocks + the request's blocks.
  Default overlap_score_weight 1.0, Dynamo's.

The "cached prefix" of a request on a replica is the number of its leading block hashes that the replica
holds, stopping at the first one it does not: block hashes chain, so a later block without its
predecessors would not be used by a prefix match.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvmem._checks import check_int, check_number
from kvmem.events.schema import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    _hash_tuple,
)

POLICIES = ("round-robin", "least-load", "cache-aware", "kv-overlap")


class BlockIndex:
    """Which blocks each of `num_replicas` replicas holds, per medium, as their events describe it.

    `BlockStored` adds its hashes to (replica, medium), `BlockRemoved` takes them out, `AllBlocksCleared`
    empties the replica in every medium. A missing medium (older vLLM) means "GPU". Removing a block the
    index does not hold is counted (`unknown_removals`) and otherwise ignored: it happens after a
    subscriber lost batches and cleared the replica.

    >>> from kvmem.events import BlockStored, EventBatch
    >>> index = BlockIndex(2)
    >>> index.apply(1, EventBatch(0.0, [BlockStored([11, 12], None, [5, 6, 7, 8], 2)]))
    >>> index.prefix_overlaps([11, 12, 13]), index.num_blocks(1)
    ([0, 2], 2)
    """

    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = check_int("num_replicas", num_replicas, minimum=1)
        self._blocks: list[dict[str, set]] = [{} for _ in range(self.num_replicas)]
        self._holders: dict[str, dict[BlockHash, set[int]]] = {}  # medium -> hash -> replicas holding it
        self.unknown_removals = 0

    # ---- updates ----------------------------------------------------------------------------------
    def apply(self, replica: int, batch: EventBatch) -> None:
        """Applies the events of `batch` from `replica`, in order."""
        replica = self._check_replica(replica)
        if not isinstance(batch, EventBatch):
            raise TypeError(f"batch must be an EventBatch, got {type(batch).__name__}")
        for event in batch.events:
            self._apply(replica, event)

    def apply_event(self, replica: int, event: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        """Applies one event from `replica`."""
        replica = self._check_replica(replica)
        if not isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared)):
            raise TypeError(f"event must be BlockStored, BlockRemoved or AllBlocksCleared, got "
                            f"{type(event).__name__}")
        self._apply(replica, event)

    def clear(self, replica: int) -> None:
        """Forgets every block of `replica` (an `AllBlocksCleared`, or a subscriber resynchronising)."""
        self._clear(self._check_replica(replica))

    def _apply(self, replica: int, event) -> None:
        if type(event) is AllBlocksCleared:
            self._clear(replica)
            return
        medium = event.medium or MEDIUM_GPU
        blocks = self._blocks[replica].setdefault(medium, set())
        holders = self._holders.setdefault(medium, {})
        if type(event) is BlockStored:
            blocks.update(event.block_hashes)
            for h in event.block_hashes:
                holders.setdefault(h, set()).add(replica)
            return
        for h in event.block_hashes:
            if h not in blocks:
                self.unknown_removals += 1
                continue
            blocks.remove(h)
            owners = holders[h]
            owners.discard(replica)
            if not owners:
                del holders[h]

    def _clear(self, replica: int) -> None:
        for medium, blocks in self._blocks[replica].items():
            holders = self._holders[medium]
            for h in blocks:
                owners = holders[h]
                owners.discard(replica)
                if not owners:
                    del holders[h]
        self._blocks[replica] = {}

    # ---- queries ----------------------------------------------------------------------------------
    def blocks(self, replica: int, medium: str = MEDIUM_GPU) -> frozenset:
        """The hashes `replica` holds in `medium`."""
        return frozenset(self._blocks[self._check_replica(replica)].get(medium, ()))

    def num_blocks(self, replica: int, medium: str = MEDIUM_GPU) -> int:
        """How many blocks `replica` holds in `medium`."""
        return len(self._blocks[self._check_replica(replica)].get(medium, ()))

    def prefix_overlaps(self, block_hashes: Sequence[BlockHash], medium: str = MEDIUM_GPU) -> list[int]:
        """For each replica, how many leading blocks of `block_hashes` (a request's chained page hashes)
        it holds in `medium`, up to the first it lacks. O(len(prefix matched) * replicas matching)."""
        return self._prefix_overlaps(_hash_tuple(block_hashes), medium)

    def _prefix_overlaps(self, block_hashes: Sequence[BlockHash], medium: str = MEDIUM_GPU) -> list[int]:
        overlaps = [0] * self.num_replicas
        holders = self._holders.get(medium, {})
        alive: set[int] | None = None
        for depth, h in enumerate(block_hashes, start=1):
            owners = holders.get(h)
            if not owners:
                break
            alive = set(owners) if alive is None else alive & owners
            if not alive:
                break
            for r in alive:
                overlaps[r] = depth
        return overlaps

    def _check_replica(self, replica: int) -> int:
        return check_int("replica", replica, minimum=0, maximum=self.num_replicas - 1)

    def __repr__(self) -> str:
        sizes = [self.num_blocks(r) for r in range(self.num_replicas)]
        return f"BlockIndex(num_replicas={self.num_replicas}, gpu_blocks={sizes})"


class ReplicaLoad(NamedTuple):
    """A replica's load as the router sees it: `running_requests` (SGLang's worker load: requests routed
    there and not finished), `active_blocks` (Dynamo's decode blocks: KV blocks its running requests
    hold) and `prefill_tokens` (prompt tokens routed there and not yet prefilled)."""

    running_requests: int = 0
    active_blocks: int = 0
    prefill_tokens: int = 0


# ---- policies -------------------------------------------------------------------------------------
class _RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def choose(self, router: Router, block_hashes, loads, num_tokens: int) -> int:
        replica = self._next % router.num_replicas
        self._next = replica + 1
        return replica


class _LeastLoad:
    def choose(self, router: Router, block_hashes, loads, num_tokens: int) -> int:
        return min(range(router.num_replicas), key=lambda r: loads[r].running_requests)


class _CacheAware:
    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5) -> None:
        self.cache_threshold = check_number("cache_threshold", cache_threshold, 0)
        if self.cache_threshold > 1:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold!r}")
        self.balance_abs_threshold = check_int("balance_abs_threshold", balance_abs_threshold, minimum=0)
        self.balance_rel_threshold = check_number("balance_rel_threshold", balance_rel_threshold, 0)

    def choose(self, router: Router, block_hashes, loads, num_tokens: int) -> int:
        running = [load.running_requests for load in loads]
        most, least = max(running), min(running)
        replicas = range(router.num_replicas)
        if most - least > self.balance_abs_threshold and most > least * self.balance_rel_threshold:
            return min(replicas, key=running.__getitem__)
        overlaps = router.index._prefix_overlaps(block_hashes)
        best = min(replicas, key=lambda r: (-overlaps[r], running[r]))
        # The share of the request's tokens, its partial last page included (SGLang: matched chars / request chars).
        if num_tokens and overlaps[best] * router.block_size / num_tokens > self.cache_threshold:
            return best
        return min(replicas, key=lambda r: (router.index.num_blocks(r), running[r]))


class _KVOverlap:
    def __init__(self, overlap_score_weight: float = 1.0) -> None:
        self.overlap_score_weight = check_number("overlap_score_weight", overlap_score_weight, 0)

    def choose(self, router: Router, block_hashes, loads, num_tokens: int) -> int:
        costs = self.costs(router, block_hashes, loads, num_tokens)
        return min(range(router.num_replicas), key=costs.__getitem__)

    def costs(self, router: Router, block_hashes, loads, num_tokens: int) -> list[float]:
        bs = router.block_size
        overlaps = router.index._prefix_overlaps(block_hashes)
        request_blocks = -(-num_tokens // bs)
        return [self.overlap_score_weight * (load.prefill_tokens + num_tokens - overlap * bs) / bs
                + load.active_blocks + request_blocks for load, overlap in zip(loads, overlaps)]


_POLICY_CLASSES = {"round-robin": _RoundRobin, "least-load": _LeastLoad, "cache-aware": _CacheAware,
                   "kv-overlap": _KVOverlap}


class Router:
    """Picks a replica for each request by `policy` (one of `POLICIES`, see the module docstring), over
    `index` (a `BlockIndex` the replicas' event streams feed; default: a new one).

    Args:
        policy: "round-robin", "least-load", "cache-aware" or "kv-overlap".
        num_replicas: how many replicas there are (>= 1).
        index: the block index (its num_replicas must match); default a new `BlockIndex(num_replicas)`.
        block_size: tokens per block (the replicas' page size), for token counts and kv-overlap's cost.
        **params: the policy's parameters (cache-aware: cache_threshold, balance_abs_threshold,
            balance_rel_threshold; kv-overlap: overlap_score_weight).

    >>> router = Router("cache-aware", 2)
    >>> from kvmem.events import BlockStored, EventBatch
    >>> router.index.apply(1, EventBatch(0.0, [BlockStored([7, 8], None, [1, 2], 1)]))
    >>> router.route([7, 8, 9], [ReplicaLoad(), ReplicaLoad()])       # 2 of 3 blocks cached on replica 1
    1
    """

    def __init__(self, policy: str, num_replicas: int, *, index: BlockIndex | None = None, block_size: int = 1,
                 **params) -> None:
        if policy not in _POLICY_CLASSES:
            raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.num_replicas = check_int("num_replicas", num_replicas, minimum=1)
        if index is None:
            index = BlockIndex(self.num_replicas)
        elif not isinstance(index, BlockIndex):
            raise TypeError(f"index must be a BlockIndex, got {type(index).__name__}")
        elif index.num_replicas != self.num_replicas:
            raise ValueError(f"index has {index.num_replicas} replicas, not num_replicas {self.num_replicas}")
        self.index = index
        self.block_size = check_int("block_size", block_size, minimum=1)
        self.policy = policy
        try:
            self._policy = _POLICY_CLASSES[policy](**params)
        except TypeError as e:
            raise TypeError(f"routing policy {policy!r}: {e}") from None

    def route(self, block_hashes: Sequence[BlockHash], loads: Sequence[ReplicaLoad],
              num_tokens: int | None = None) -> int:
        """The replica for a request whose whole pages hash to `block_hashes` (`kvmem.page_hash.page_hashes`
        of its prompt), given each replica's `loads`; `num_tokens` is the prompt length (default:
        len(block_hashes) * block_size)."""
        block_hashes = _hash_tuple(block_hashes)
        loads = list(loads)
        if len(loads) != self.num_replicas:
            raise ValueError(f"loads has {len(loads)} entries for {self.num_replicas} replicas")
        for r, load in enumerate(loads):
            if not isinstance(load, ReplicaLoad):
                raise TypeError(f"loads[{r}] must be a ReplicaLoad, got {type(load).__name__}")
            for name, value in zip(load._fields, load):
                check_int(f"loads[{r}].{name}", value, minimum=0)
        if num_tokens is None:
            num_tokens = len(block_hashes) * self.block_size
        else:
            num_tokens = check_int("num_tokens", num_tokens, minimum=len(block_hashes) * self.block_size)
        return self._policy.choose(self, block_hashes, loads, num_tokens)

    def __repr__(self) -> str:
        return f"Router(policy={self.policy!r}, num_replicas={self.num_replicas}, block_size={self.block_size})"
