"""What each eviction policy promises, in a few steps each; pins; and the scheduler's lookahead seam.

Every policy also runs the radix-cache state machines (test_radix_cache_model, test_hiradix_cache); these
tests pin down the order each one is for.
"""

import pytest

from kvmem import HiRadixCache, PagedTokenAllocator, Req, ReqToTokenPool, Scheduler, SchedulerConfig, TokenAllocator
from kvmem.eviction import ARC, EVICTION_POLICIES, GDSF, S3FIFO, KeyedPolicy, Lookahead, MultiTurn, TwoQ, make_policy
from kvmem.eviction.base import lru
from kvmem.eviction.turns import TurnTable
from kvmem.radix_cache import RadixCache
from kvmem.tiers import HostSlotPool
from tests.test_radix_cache import cached_sequences, make_cache, put, tree_nodes


def seq(start, n=4):
    return list(range(start, start + n))


# ---- the registry ---------------------------------------------------------------------------------------------
def test_every_registered_online_policy_builds_a_fresh_object_each_time():
    for name in EVICTION_POLICIES:
        if name == "belady":
            continue
        a, b = make_policy(name), make_policy(name)
        assert a is not b and a.name == name


def test_belady_is_refused_outside_the_replay_with_a_clear_error():
    with pytest.raises(ValueError, match="offline optimum.*only a trace replay"):
        make_cache(policy="belady")


def test_a_policy_object_serves_one_cache_only():
    policy = S3FIFO()
    make_cache(policy=policy)
    with pytest.raises(ValueError, match="already orders another tier"):
        make_cache(policy=policy)


def test_a_tiered_cache_with_a_policy_object_needs_a_host_policy_too():
    alloc = TokenAllocator(16)
    with pytest.raises(ValueError, match="host_eviction_policy"):
        HiRadixCache(ReqToTokenPool(2, 8), alloc, HostSlotPool(32, 1), eviction_policy=ARC())
    cache = HiRadixCache(ReqToTokenPool(2, 8), alloc, HostSlotPool(32, 1), eviction_policy=ARC(),
                         host_eviction_policy=TwoQ())
    assert (cache.eviction_policy, cache._host_policy.name) == ("arc", "2q")


def test_a_key_that_reads_the_node_size_stays_current_across_a_split():
    cache, _ = make_cache(policy=lambda node: -node.num_tokens)
    put(cache, seq(0, 8))
    cache.match_prefix(seq(0, 3))  # splits the leaf: it is 5 tokens now
    cache.check_invariants()


# ---- S3-FIFO --------------------------------------------------------------------------------------------------
def test_s3fifo_lets_a_one_hit_prefix_go_before_one_reused_while_on_probation():
    cache, _ = make_cache(policy="s3fifo")
    put(cache, seq(0))
    put(cache, seq(10))
    cache.match_prefix(seq(0))  # reused: it moves to the main queue when it reaches the head
    cache.evict(1)
    assert cached_sequences(cache) == {tuple(seq(0))}


def test_s3fifo_readmits_a_recently_evicted_prefix_to_the_main_queue():
    cache, _ = make_cache(policy="s3fifo")
    put(cache, seq(0))
    put(cache, seq(10))
    cache.evict(1)  # seq(0) leaves its name in the ghost list
    put(cache, seq(0))  # recomputed while remembered: main queue
    put(cache, seq(20))
    cache.evict(8)
    assert cached_sequences(cache) == {tuple(seq(0))}


# ---- ARC ------------------------------------------------------------------------------------------------------
def test_arc_keeps_a_reused_prefix_over_newer_ones_seen_once():
    cache, _ = make_cache(policy="arc")
    put(cache, seq(0))
    cache.match_prefix(seq(0))  # T2
    put(cache, seq(10))
    put(cache, seq(20))  # T1, newer
    cache.evict(8)
    assert cached_sequences(cache) == {tuple(seq(0))}


def test_arc_grows_its_recency_target_when_a_prefix_evicted_from_t1_comes_back():
    cache, _ = make_cache(policy="arc")
    put(cache, seq(0))
    cache.evict(4)
    assert cache._policy.target == 0
    put(cache, seq(0))
    assert cache._policy.target >= 4


def test_arc_moves_its_target_by_the_ghost_lists_ratio_with_the_returning_prefix_counted():
    alloc = TokenAllocator(8192)
    arc = ARC()
    cache = RadixCache(ReqToTokenPool(2, 4096), alloc, eviction_policy=arc)
    x, y, z = ([k] + list(range(1000 * k, 1000 * k + n - 1)) for k, n in ((1, 100), (2, 500), (3, 2000)))
    for key in (x, y, z):
        cache.insert(key, alloc.alloc(len(key)))
    cache.match_prefix(y)
    cache.match_prefix(z)  # y and z in T2
    cache.evict(100)       # x to B1
    cache.evict(500)       # y to B2
    cache.insert(x, alloc.alloc(len(x)))
    # FAST'03: p += max(|B2| / |B1|, 1) * |x| with x still in B1: 500 / 100 * 100. It was 2600, all the cache.
    assert arc.target == 500


@pytest.mark.parametrize("name", ["s3fifo", "arc", "2q", "lookahead+s3fifo"])
def test_a_pinned_leaf_let_go_leaves_no_state_behind_in_the_policy(name):
    alloc = TokenAllocator(4096)
    policy = make_policy(name)
    cache = RadixCache(ReqToTokenPool(2, 64), alloc, eviction_policy=policy, pin_budget=0.5)
    for i in range(20):
        key = [10000 + i] + list(range(7))
        cache.insert(key, alloc.alloc(8))
        cache.pin(key)
        cache.evict(8)  # nothing unpinned to evict: the pinned leaf goes
    base = policy.base if isinstance(policy, Lookahead) else policy
    assert cache.total_size() == 0 and not base._state  # held each evicted node, its key and slots, for good


# ---- 2Q -------------------------------------------------------------------------------------------------------
def test_2q_ignores_hits_on_probation_and_promotes_what_comes_back_from_the_ghost_queue():
    cache, _ = make_cache(policy="2q")
    put(cache, seq(0))
    put(cache, seq(10))
    cache.match_prefix(seq(0))  # a correlated re-reference: no promotion
    cache.evict(1)
    assert cached_sequences(cache) == {tuple(seq(10))}
    put(cache, seq(0))  # back from A1out: Am
    put(cache, seq(20))
    cache.evict(8)
    assert cached_sequences(cache) == {tuple(seq(0))}


# ---- GDSF -----------------------------------------------------------------------------------------------------
def test_gdsf_keeps_the_deeper_page_when_recency_and_frequency_are_equal():
    cache, _ = make_cache(size=64, policy=GDSF(attention_crossover=4))
    put(cache, seq(100, 16) + seq(0))  # a page at depth 16
    put(cache, seq(10))               # the same size at depth 0, inserted later
    cache.evict(1)
    assert cached_sequences(cache) == {tuple(seq(100, 16) + seq(0))}


def test_gdsf_raises_its_inflation_to_each_victims_priority_so_old_frequency_ages_out():
    cache, _ = make_cache(policy="gdsf")
    put(cache, seq(0))
    for _ in range(3):
        cache.match_prefix(seq(0))
    put(cache, seq(10))
    cache.evict(1)
    assert cached_sequences(cache) == {tuple(seq(0))} and cache._policy.inflation > 1


# ---- lookahead ------------------------------------------------------------------------------------------------
def test_lookahead_keeps_what_a_waiting_request_will_match_until_it_is_admitted():
    cache, _ = make_cache(policy="lookahead")
    put(cache, seq(0))
    put(cache, seq(10))
    cache.request_waiting("r", seq(0) + [99])
    cache.evict(1)  # seq(0) is the least recent, but a queued request needs it
    assert cached_sequences(cache) == {tuple(seq(0))}
    put(cache, seq(10))
    cache.request_admitted("r")
    cache.evict(1)
    assert cached_sequences(cache) == {tuple(seq(10))}


def test_lookahead_follows_the_tree_as_it_grows_along_a_waiting_request():
    cache, _ = make_cache(policy="lookahead")
    put(cache, seq(0))
    cache.request_waiting("r", seq(0) + seq(10) + seq(20) + [99])  # queued while only seq(0) is cached
    put(cache, seq(0) + seq(10))       # the previous turn finishes: the tree grows along r's key ...
    put(cache, seq(0) + seq(10) + seq(20))
    put(cache, seq(50))                # ... and a newer prefix nobody waits for
    cache.evict(1)
    assert cached_sequences(cache) == {tuple(seq(0) + seq(10) + seq(20))}
    cache.check_invariants()


def test_lookahead_keeps_a_prefix_a_waiting_request_matches_partway_and_only_in_its_namespace():
    cache, _ = make_cache(policy="lookahead")
    put(cache, seq(0, 8))
    put(cache, seq(20))
    message = pytest.raises(TypeError, cache.request_waiting, "r", "ab").value
    assert str(message) == "key must be a sequence of int token ids, got str"
    cache.request_waiting("r", seq(0) + [99])  # ends inside seq(0, 8)'s edge: that node is what it needs
    cache.evict(1)
    assert cached_sequences(cache) == {tuple(seq(0, 8))}
    cache.request_admitted("r")
    cache.insert(seq(30), cache.token_allocator.alloc(4), namespace="t")
    cache.insert(seq(40), cache.token_allocator.alloc(4), namespace="t")
    cache.request_waiting("s", seq(30) + [99], "t")  # the older prefix of namespace t
    cache.request_waiting("u", seq(40) + [99])        # the default namespace holds no seq(40)
    assert cache.evict(12) == 12  # seq(0, 8) first, then t's seq(40): nobody there waits for it
    assert cached_sequences(cache) == set() and cache.match_prefix(seq(30) + [1], "t").indices.numel() == 4
    assert cache.match_prefix(seq(40) + [1], "t").indices.numel() == 0


def test_a_split_head_keeps_its_place_in_a_queued_policy():
    cache, _ = make_cache(policy="s3fifo")
    put(cache, seq(0, 8))                 # first in the probation queue
    put(cache, seq(0) + seq(50))          # splits it: the head seq(0) is seq(0, 8)'s front, as old
    put(cache, seq(20))
    cache.evict(4)                        # seq(0, 8)'s back half
    cache.evict(4)                        # seq(50): the head is a leaf now, in its old place ...
    cache.evict(4)                        # ... before seq(20)
    assert cached_sequences(cache) == {tuple(seq(20))}
    cache.check_invariants()


def test_a_pin_alone_past_the_budget_pins_nothing():
    cache = RadixCache(ReqToTokenPool(4, 64), TokenAllocator(40), eviction_policy="lru", pin_budget=0.2)  # 8
    put(cache, seq(0, 12))
    assert cache.pin(seq(0, 12)) == 0 and cache.pinned_size() == 0
    assert cache.pin(seq(0, 8)) == 8 and cache.pinned_size() == 8


def test_a_pin_alone_past_the_budget_leaves_the_other_pins_alone():
    cache = RadixCache(ReqToTokenPool(4, 64), TokenAllocator(40), eviction_policy="lru", pin_budget=0.2)  # 8
    put(cache, seq(0, 4))
    put(cache, seq(20, 12))
    assert cache.pin(seq(0, 4)) == 4
    assert cache.pin(seq(20, 12)) == 0 and cache.pinned_size() == 4  # it used to drop every older pin first
    assert cache.unpin(seq(0, 4)) == 4


def test_lookahead_composes_with_a_base_policy():
    policy = Lookahead(S3FIFO())
    cache, _ = make_cache(policy=policy)
    assert cache.eviction_policy == "lookahead+s3fifo"
    put(cache, seq(0))
    put(cache, seq(10))
    cache.request_waiting(1, seq(0))
    cache.evict(4)
    assert cached_sequences(cache) == {tuple(seq(0))}
    cache.check_invariants()


def test_the_scheduler_tells_the_cache_what_its_queue_will_match():
    pool, alloc = ReqToTokenPool(4, 64), TokenAllocator(24)
    cache = RadixCache(pool, alloc, eviction_policy="lookahead")
    sched = Scheduler(pool, alloc, cache)
    put(cache, seq(0, 8))
    put(cache, seq(10, 8))
    sched.add_request(Req("a", seq(0, 8) + [50], max_new_tokens=1))  # will match seq(0, 8)
    cache.evict(8)
    assert cached_sequences(cache) == {tuple(seq(0, 8))}
    sched.process_batch_result(sched.step(), [7])
    assert cache._policy._target == {}  # admitted: its lock protects the prefix now


# ---- multiturn ------------------------------------------------------------------------------------------------
def serve(sched, req):
    """Runs `req` alone to its end, every token sampled as 7; returns the conversation turn the cache inferred for
    it (None when no policy of the cache tracks turns)."""
    turns, seen = sched.tree_cache._turns, {}
    if turns is not None:
        record = turns.set_request
        turns.set_request = lambda r, turn: (seen.__setitem__(r, turn), record(r, turn))
    sched.add_request(req)
    while not sched.is_idle():
        batch = sched.step()
        sched.process_batch_result(batch, [7] * batch.batch_size())
    if turns is not None:
        del turns.set_request
    return seen.get(req)


def multiturn_scheduler(policy=None, size=64):
    pool, alloc = ReqToTokenPool(4, 64), TokenAllocator(size)
    cache = RadixCache(pool, alloc, eviction_policy=MultiTurn() if policy is None else policy)
    return Scheduler(pool, alloc, cache), cache


def test_multiturn_counts_a_conversations_turns_and_keeps_a_later_turn_over_a_newer_first_prompt():
    sched, cache = multiturn_scheduler()
    first = serve(sched, Req("a", seq(10, 12), max_new_tokens=2))
    second = serve(sched, Req("b", seq(10, 12) + seq(30, 4), max_new_tokens=2))  # matches 12 of 16 tokens
    other = serve(sched, Req("c", seq(50, 12), max_new_tokens=2))                 # newer, a first prompt
    assert (first, second, other) == (0, 1, 0)
    # a's output (b went another way after a's prompt), then c's output and prompt, though c came last
    assert cache.evict(14) == 14
    assert cache.match_prefix(seq(50, 12)).indices.numel() == 0
    assert cache.match_prefix(seq(10, 12) + seq(30, 4)).indices.numel() == 16
    cache.check_invariants()


def test_multiturn_a_short_match_is_a_shared_system_prompt_not_a_previous_turn():
    sched, _ = multiturn_scheduler()
    serve(sched, Req("a", seq(0, 4) + seq(10, 12), max_new_tokens=1))
    assert serve(sched, Req("b", seq(0, 4) + seq(50, 12), max_new_tokens=1)) == 0  # 4 of 16 matched


def test_multiturn_recognises_a_conversation_whose_history_was_evicted_by_its_ghost():
    sched, cache = multiturn_scheduler()
    serve(sched, Req("a", seq(10, 24), max_new_tokens=2))
    serve(sched, Req("b", seq(10, 24) + seq(40, 8), max_new_tokens=2))
    cache.evict(1000)  # the conversation's whole history goes
    assert cache.total_size() == 0
    back = serve(sched, Req("c", seq(10, 24) + seq(40, 8) + seq(60, 4), max_new_tokens=1))
    assert back == 2  # its evicted history was at turn 1
    sched, cache = multiturn_scheduler()
    serve(sched, Req("a", seq(10, 24), max_new_tokens=1))
    cache.evict(1000)
    # A prompt that starts with the same page is not that conversation: its 16 first tokens are checked.
    assert serve(sched, Req("x", [10] + seq(900, 30), max_new_tokens=1)) == 0
    sched, cache = multiturn_scheduler(MultiTurn(ghosts=0))
    serve(sched, Req("a", seq(10, 24), max_new_tokens=2))
    serve(sched, Req("b", seq(10, 24) + seq(40, 8), max_new_tokens=2))
    cache.evict(1000)
    assert serve(sched, Req("c", seq(10, 24) + seq(40, 8) + seq(60, 4), max_new_tokens=1)) == 0


def test_multiturn_counts_turns_on_through_continuations_and_caps_the_head_start():
    sched, cache = multiturn_scheduler()
    prompt, turns = seq(10, 12), []
    for k in range(3):
        prompt = prompt + seq(100 + 10 * k, 4)
        turns.append(serve(sched, Req(k, prompt, max_new_tokens=1)))
    assert turns == [0, 1, 2]
    policy = MultiTurn(turn_bonus=100, max_turns=2)
    node = next(node for node, _ in tree_nodes(cache))
    policy.turns = TurnTable()
    policy.turns.stamp(node, 5)
    node.last_access = 7
    assert policy._key(node) == 7 + 2 * 100


def test_multiturn_forgets_its_ghosts_on_reset_and_other_policies_never_infer_turns():
    sched, cache = multiturn_scheduler()
    serve(sched, Req("a", seq(10, 24), max_new_tokens=2))
    cache.evict(1000)
    assert cache._policy._ghosts
    cache.reset()
    assert not cache._policy._ghosts
    sched, cache = multiturn_scheduler("lru")
    serve(sched, Req("a", seq(10, 12), max_new_tokens=2))
    assert serve(sched, Req("b", seq(10, 12) + seq(30, 4), max_new_tokens=2)) is None and cache._turns is None


def test_multiturn_counts_turns_with_pages_and_chunked_prefill():
    pool, alloc = ReqToTokenPool(4, 128), PagedTokenAllocator(128, 4)
    cache = RadixCache(pool, alloc, page_size=4, eviction_policy="multiturn")
    sched = Scheduler(pool, alloc, cache, SchedulerConfig(chunked_prefill_size=8))
    prompt, turns = seq(10, 22), []
    for k in range(3):  # each turn's prompt is the last one's and 6 tokens more; chunks of 8 tokens
        prompt = prompt + seq(100 + 10 * k, 6)
        turns.append(serve(sched, Req(k, prompt, max_new_tokens=3)))
    assert turns == [0, 1, 2]
    cache.evict(1000)
    assert serve(sched, Req("back", prompt + seq(200, 6), max_new_tokens=1)) == 3  # by its ghost
    cache.check_invariants()


def test_multiturn_checks_a_ghost_against_the_whole_prompt_not_the_first_chunk():
    pool, alloc = ReqToTokenPool(4, 64), TokenAllocator(64)
    cache = RadixCache(pool, alloc, eviction_policy="multiturn")
    sched = Scheduler(pool, alloc, cache, SchedulerConfig(chunked_prefill_size=8))
    put(cache, seq(10, 24))
    cache.evict(1000)  # a 24-token leaf: its ghost holds 16 tokens, more than the first chunk's 8
    assert serve(sched, Req("back", seq(10, 24) + seq(40, 8), max_new_tokens=1)) == 1


def test_multiturn_serves_a_host_tier_too():
    pool, alloc = ReqToTokenPool(4, 64), TokenAllocator(64)
    cache = HiRadixCache(pool, alloc, HostSlotPool(256, 1), eviction_policy="lru", host_eviction_policy="multiturn")
    sched = Scheduler(pool, alloc, cache)
    serve(sched, Req("a", seq(10, 12), max_new_tokens=2))
    assert serve(sched, Req("b", seq(10, 12) + seq(30, 4), max_new_tokens=2)) == 1
    cache.check_invariants()
    # A device leaf that leaves with no host copy leaves its ghost with the host tier's policy.
    pool, alloc = ReqToTokenPool(4, 64), TokenAllocator(64)
    cache = HiRadixCache(pool, alloc, HostSlotPool(256, 1), eviction_policy="lru", host_eviction_policy="multiturn",
                         write_policy="write_through_selective")
    sched = Scheduler(pool, alloc, cache)
    serve(sched, Req("a", seq(10, 24), max_new_tokens=2))
    serve(sched, Req("b", seq(10, 24) + seq(40, 8), max_new_tokens=2))
    cache.evict(1000)
    assert serve(sched, Req("c", seq(10, 24) + seq(40, 8) + seq(60, 4), max_new_tokens=1)) == 2
    cache.check_invariants()


def test_lookahead_over_multiturn_leaves_a_ghost_of_a_prefix_a_waiting_request_needed():
    cache, _ = make_cache(policy="lookahead+multiturn")
    put(cache, seq(10, 24))
    cache.request_waiting("r", seq(10, 24) + [99])
    assert cache.evict(1000) == 24 and len(cache._policy.base._ghosts) == 1


def test_lookahead_over_multiturn_infers_turns_through_its_base():
    sched, cache = multiturn_scheduler("lookahead+multiturn")
    serve(sched, Req("a", seq(10, 12), max_new_tokens=2))
    assert serve(sched, Req("b", seq(10, 12) + seq(30, 4), max_new_tokens=2)) == 1
    assert cache._policy.tracks_turns and not Lookahead().tracks_turns
    cache.check_invariants()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"turn_bonus": -1}, "turn_bonus"), ({"max_turns": 1.5}, "max_turns"),
    ({"continuation": 1.5}, "continuation must lie in"), ({"continuation": -0.1}, "continuation"),
    ({"ghosts": -1}, "ghosts"), ({"ghost_tokens": 0}, "ghost_tokens")])
def test_multiturn_rejects_bad_arguments_by_name(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        MultiTurn(**kwargs)


# ---- pins -----------------------------------------------------------------------------------------------------
def test_a_pinned_prefix_goes_only_when_nothing_unpinned_is_left():
    cache, _ = make_cache(policy="lru")
    put(cache, seq(0))
    put(cache, seq(10))
    assert cache.pin(seq(0)) == 4 and cache.pinned_size() == 4
    cache.evict(1)
    assert cached_sequences(cache) == {tuple(seq(0))}
    assert cache.evictable_size() == 4  # still evictable: a pin never blocks a request that needs memory
    assert cache.evict(4) == 4 and cache.total_size() == 0 and cache.pinned_size() == 0
    cache.check_invariants()


def test_a_pinned_leaf_that_goes_leaves_its_parent_an_ordinary_evictable_leaf():
    cache, _ = make_cache(policy="lru")
    put(cache, [2, 0])
    put(cache, [2, 1, 5, 6])
    assert cache.pin([2, 0]) == 2
    assert cache.evict(3) == 3 and cached_sequences(cache) == {(2, 0)}  # the unpinned branch first
    assert cache.evict(1) == 1  # nothing unpinned is left: the pinned leaf goes, and its pin with it
    assert cached_sequences(cache) == {(2,)} and cache.pinned_size() == 0 and cache.evictable_size() == 1
    cache.check_invariants()
    assert cache.evict(1) == 1 and cache.total_size() == 0


def test_pins_past_the_budget_degrade_oldest_first():
    alloc = TokenAllocator(40)
    cache = RadixCache(ReqToTokenPool(4, 64), alloc, eviction_policy="lru", pin_budget=0.2)  # 8 tokens
    for start in (0, 10, 20):
        put(cache, seq(start))
    cache.pin(seq(0))
    cache.pin(seq(10))
    cache.pin(seq(20))  # 12 > 8: seq(0)'s pin degrades
    assert cache.pinned_size() == 8 and cache.unpin(seq(0)) == 0
    cache.evict(1)
    assert tuple(seq(0)) not in cached_sequences(cache)
    cache.check_invariants()


def test_pinning_again_refreshes_the_pin_and_unpin_returns_what_it_held():
    alloc = TokenAllocator(40)
    cache = RadixCache(ReqToTokenPool(4, 64), alloc, eviction_policy="lru", pin_budget=0.2)
    for start in (0, 10):
        put(cache, seq(start))
    cache.pin(seq(0))
    cache.pin(seq(10))
    cache.pin(seq(0))  # newest now
    put(cache, seq(20))
    cache.pin(seq(20))
    assert cache.unpin(seq(10)) == 0 and cache.unpin(seq(0)) == 4 and cache.pinned_size() == 4
    assert cache.pin([7, 7, 7]) == 0  # nothing of it is cached


def test_a_pin_covers_what_is_cached_of_its_key_and_splits_there():
    cache, _ = make_cache(policy="lru")
    put(cache, seq(0, 8))
    assert cache.pin(seq(0, 3) + [99]) == 3
    put(cache, seq(20))
    cache.evict(100)
    assert cache.total_size() == 0
    cache.check_invariants()


def test_pin_budget_out_of_range_is_rejected():
    with pytest.raises(ValueError, match="pin_budget"):
        RadixCache(ReqToTokenPool(1, 8), TokenAllocator(8), pin_budget=1.5)


def test_pins_hold_the_device_part_of_a_tiered_prefix():
    alloc = TokenAllocator(16)
    cache = HiRadixCache(ReqToTokenPool(2, 8), alloc, HostSlotPool(64, 1), eviction_policy="lru", pin_budget=0.5)
    put(cache, seq(0))
    put(cache, seq(10))
    assert cache.pin(seq(0)) == 4
    cache.evict(1)
    assert cache.match_prefix(seq(0)).indices.numel() == 4
    cache.check_invariants()


@pytest.mark.parametrize("policy", [KeyedPolicy(lru), S3FIFO(), ARC(), TwoQ(), GDSF(), Lookahead(), MultiTurn()],
                         ids=lambda p: p.name)
def test_every_policy_empties_the_cache_when_asked_to_evict_everything(policy):
    cache, alloc = make_cache(policy=policy)
    for start in (0, 10, 20):
        put(cache, seq(start, 6))
    cache.match_prefix(seq(0, 3))
    assert cache.evict(1000) == 18 and alloc.available_size() == alloc.size and len(cache._policy) == 0


def test_gdsf_prunes_its_inflation_history_without_changing_any_leafs_priority():
    policy = GDSF()
    policy._min_history = policy._prune_at = 8  # prune early and often
    cache, _ = make_cache(size=64, policy=policy)
    for i in range(200):
        put(cache, seq(100 * i, 3 + i % 5))
        if i % 3 == 0:
            cache.match_prefix(seq(100 * (i - 3), 2))
        cache.evict(6)
        cache.check_invariants()  # every entry's priority recomputes to the same value
    assert policy._pruned and len(policy._ticks) < 100
