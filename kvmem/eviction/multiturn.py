"""Multi-turn: the more turns a conversation has had, the longer its prefix stays.

Why: a chat's next turn sends the whole conversation again, so a finished turn's KV is worth keeping exactly
when its conversation goes on, and how likely that is grows with the turns it has had. On the Mooncake FAST'25
conversation trace (`scripts/trace_reuse.py`), 25% of first prompts get a next turn, 39% of second ones, 49%
of third ones and 79% from the eighth on, a median 120 s later: by then LRU has let most of them go at the
capacities a GPU has, and it spends as much room on a one-off prompt as on a long conversation.

The order: LRU with a head start per turn. A leaf's key is `last_access + turn_bonus * min(turn, max_turns)`
(clock ticks: the tree's clock advances once per match or insert), where `turn` is the highest conversation
turn of the requests that inserted through the node. No session id is needed: a request's turn is inferred
once, at its first insert, from what its admission matched (`request_turn`):
- its (device) match stops at a node, and the tokens after it are those of a ghost, a leaf this tier evicted
  from that very place (found by its parent and first page, as ARC's ghosts are, then checked over its first
  `ghost_tokens`: one page alone may be a BOS token or a chat template's header, which unrelated prompts
  share): the conversation came back after its history was evicted, and its turn is the ghost's + 1. The
  ghosts are the last `ghosts` evictions, the newest for each place.
- else, its match covers at least `continuation` of its prompt: it continues what went through that node,
  and its turn is the node's + 1. A shorter match is a shared system prompt or document, not a previous
  turn; a prompt sent again, or one that is mostly a shared prefix, counts as a later turn too: it is reused
  as often, and `max_turns` bounds what that buys.
- else 0: a first prompt.
As a host tier's policy (under a device policy that does not track turns) it ranks host-only leaves by the
turns and looks its ghosts up from where the device match stops, so a conversation whose history only the
host holds finds no ghost there (it is matched through the host tier instead); with multiturn in both tiers
the device policy's ghosts are the ones read. Only requests cached through `cache_unfinished_req` /
`cache_finished_req` (the Scheduler's) have a turn; keys inserted by `insert` alone have turn 0, and the
order is then LRU's. O(log n) per operation; the turn costs one dict lookup per request.

The defaults (1,500 ticks a turn, at most 4, continuation 0.7) were chosen on the Mooncake conversation trace;
docs/eviction.md shows what they buy there and on the other workloads. The idea of a conversation's turns as its
reuse signal comes from that trace's statistics; the ghosts from ARC (Megiddo and Modha, FAST 2003).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvmem._checks import check_int, check_number
from kvmem._paging import TOKEN_BYTES
from kvmem.eviction.base import KeyedPolicy, place_key

if TYPE_CHECKING:
    from kvmem.radix_tree import TreeNode

TURN_BONUS = 1500  # clock ticks per turn: about 100 s at 15 ticks a second (a replayed H100 serving the trace)
MAX_TURNS = 4
CONTINUATION = 0.7
GHOSTS = 65536
GHOST_TOKENS = 16


class MultiTurn(KeyedPolicy):
    """LRU with a head start of `turn_bonus` ticks per conversation turn, up to `max_turns` (see the module
    docstring). `continuation`: the share of its prompt a request must match to continue a conversation;
    `ghosts`: how many evicted leaves it remembers, to recognise a conversation whose history was evicted;
    `ghost_tokens`: how many of a ghost's first tokens (all of them, for a shorter leaf) a request's prompt
    must go on with."""

    tracks_turns = True

    def __init__(self, turn_bonus: int = TURN_BONUS, max_turns: int = MAX_TURNS,
                 continuation: float = CONTINUATION, ghosts: int = GHOSTS, ghost_tokens: int = GHOST_TOKENS) -> None:
        self.turn_bonus = check_int("turn_bonus", turn_bonus, minimum=0)
        self.max_turns = check_int("max_turns", max_turns, minimum=0)
        self.continuation = check_number("continuation", continuation, 0)
        if self.continuation > 1:
            raise ValueError(f"continuation must lie in [0, 1] (a share of the prompt), got {continuation!r}")
        self.max_ghosts = check_int("ghosts", ghosts, minimum=0)
        self.ghost_tokens = check_int("ghost_tokens", ghost_tokens, minimum=1)
        super().__init__(self._key, "multiturn")
        # (parent, first page) of an evicted leaf -> (its first ghost_tokens, as bytes; its turn)
        self._ghosts: OrderedDict[int, tuple[bytes, int]] = OrderedDict()

    def _key(self, node: TreeNode) -> int:
        return node.last_access + self.turn_bonus * min(self.turns.of(node), self.max_turns)

    def evicted(self, node: TreeNode) -> None:
        if self.max_ghosts:
            ghosts, name = self._ghosts, self._page_key(node)
            ghosts.pop(name, None)
            ghosts[name] = (node.key[:self.ghost_tokens * TOKEN_BYTES], self.turns.of(node))
            if len(ghosts) > self.max_ghosts:
                ghosts.popitem(last=False)

    def request_turn(self, node: TreeNode, rest: Sequence[int], matched: int, prompt_len: int) -> int:
        head = bytes(rest[:max(self._tree.page_size, self.ghost_tokens)])
        ghost = self._ghosts.get(place_key(node, head[:self._page_bytes]))
        # The name is one page; the ghost counts only if the key goes on with the leaf's first tokens too.
        if ghost is not None and head.startswith(ghost[0]):
            return ghost[1] + 1
        if node.parent is not None and matched >= self.continuation * prompt_len:
            return self.turns.of(node) + 1
        return 0

    def clear(self) -> None:
        super().clear()
        self._ghosts.clear()
