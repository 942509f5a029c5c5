"""What each eviction policy promises, in a few steps each; pins; and the scheduler's lookahead seam.

Every policy also runs the radix-cache state machines (test_radix_cache_model, test_hiradix_cache); these
tests pin down the order each one is for.
"""

import pytest

from kvmem import HiRadixCache, PagedTokenAllocator, Req, ReqToTokenPool, Scheduler, SchedulerConfig, TokenAllocator
from kvmem.eviction import ARC, EVICTION_POLICIES, GDSF, S3FIFO, KeyedPolicy, Lookahead, MultiTurn, TwoQ, make_policy
from kvmem.eviction.base import lru
from kvmem.eviction.queues import QueuedPolicy
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


@pytest.mark.parametrize("policy", ["lfu", "priority"])
def test_lfu_and_priority_break_ties_by_recency(policy):
    cache, _ = make_cache(policy=policy)
    put(cache, seq(0))
    put(cache, seq(10))
    cache.match_prefix(seq(10))
    cache.match_prefix(seq(0))  # the same hits and priority: the older use goes
    cache.evict(1)
    assert cached_sequences(cache) == {tuple(seq(0))}


def test_a_key_functions_policy_is_named_after_the_function_or_its_class():
    def newest_first(node):
        return -node.last_access

    class Deepest:
        def __call__(self, node):
            return -node.depth

    assert [KeyedPolicy(key).name for key in (newest_first, Deepest())] == ["newest_first", "Deepest"]
    assert make_cache(policy=newest_first)[0].eviction_policy == "newest_first"
    assert KeyedPolicy(newest_first, "mine").name == "mine"


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


@pytest.mark.parametrize("max_freq, kept", [(3, seq(0)), (2, seq(0)), (1, seq(10))])
def test_s3fifo_gives_a_node_in_the_main_queue_one_more_round_per_hit_up_to_max_freq(max_freq, kept):
    cache, _ = make_cache(policy=S3FIFO(max_freq=max_freq))
    for start in (0, 10, 20):
        put(cache, seq(start))
    cache.match_prefix(seq(0))
    cache.match_prefix(seq(10))
    cache.evict(4)  # seq(0) and seq(10) were reused on probation: main queue; seq(20) goes
    for _ in range(3):
        cache.match_prefix(seq(0))
    cache.match_prefix(seq(10))
    # seq(0) (3 hits) gets min(3, max_freq) rounds, one fewer each time it reaches the head; seq(10) (1 hit) one.
    cache.evict(4)
    assert cached_sequences(cache) == {tuple(kept)}
    cache.check_invariants()


def test_s3fifo_counts_only_the_hits_since_a_node_reached_the_main_queue():
    cache, _ = make_cache(policy="s3fifo")
    for start in (0, 10, 20):
        put(cache, seq(start))
    for _ in range(3):
        cache.match_prefix(seq(0))
    cache.match_prefix(seq(10))
    cache.evict(4)  # both reused on probation: main queue, their counts restarted; seq(20) goes
    cache.match_prefix(seq(10))
    cache.evict(4)  # seq(0)'s three hits were spent getting there: it goes, seq(10) gets its round
    assert cached_sequences(cache) == {tuple(seq(10))}


def test_s3fifo_remembers_only_what_left_the_small_queue_and_only_within_its_ghost_budget():
    cache, _ = make_cache(policy="s3fifo")
    put(cache, seq(0))
    put(cache, seq(10))
    cache.match_prefix(seq(0))
    cache.evict(4)  # seq(0) to the main queue, seq(10) out of the small one
    cache.evict(4)  # seq(0) out of the main queue: no ghost
    put(cache, seq(0))
    put(cache, seq(20))
    cache.evict(4)  # seq(0) came back on probation, the oldest there
    assert cached_sequences(cache) == {tuple(seq(20))}
    # The ghost list holds (1 - small_ratio) of the most tokens held: 8 of 16 here, two 4-token prefixes.
    cache, _ = make_cache(policy=S3FIFO(small_ratio=0.5))
    for start in (0, 10, 20, 30):
        put(cache, seq(start))
    cache.evict(12)  # seq(0), seq(10), seq(20) leave the small queue; seq(0)'s name is trimmed
    put(cache, seq(0))
    put(cache, seq(40))
    cache.evict(8)  # seq(30), then seq(0): back on probation, not remembered
    assert cached_sequences(cache) == {tuple(seq(40))}


def test_s3fifo_takes_from_the_small_queue_while_it_holds_at_least_its_share():
    cache, _ = make_cache(policy=S3FIFO(small_ratio=0.5))
    put(cache, seq(0))
    cache.match_prefix(seq(0))
    put(cache, seq(10))
    cache.evict(4)  # seq(0) to the main queue; seq(10) is then exactly half of what is held: it goes
    assert cached_sequences(cache) == {tuple(seq(0))}
    put(cache, seq(20))
    cache.evict(4)  # again exactly half
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


def test_arc_puts_a_returning_ghost_in_t2_and_takes_t1_only_while_it_is_above_the_target():
    cache, _ = make_cache(policy="arc")
    put(cache, seq(0))
    cache.evict(4)
    put(cache, seq(0))  # back from B1: in T2, and the target is 4 tokens
    assert cache._policy.target == 4
    put(cache, seq(10))
    put(cache, seq(20))
    cache.evict(4)      # T1 holds 8 > 4: its least recently used
    assert cached_sequences(cache) == {tuple(seq(0)), tuple(seq(20))}
    cache.evict(4)      # T1 holds exactly the target now: T2's
    assert cached_sequences(cache) == {tuple(seq(20))}
    cache.reset()
    assert cache._policy.target == 0


def test_arcs_target_never_exceeds_the_most_tokens_held():
    alloc = TokenAllocator(8192)
    arc = ARC()
    cache = RadixCache(ReqToTokenPool(2, 4096), alloc, eviction_policy=arc)
    x, w, y = ([k] + list(range(10000 * k, 10000 * k + n - 1)) for k, n in ((1, 100), (2, 100), (3, 500)))
    for key in (x, w, y):
        cache.insert(key, alloc.alloc(len(key)))
    cache.match_prefix(y)  # y in T2
    cache.evict(700)       # x, w to B1; y to B2
    cache.insert(x, alloc.alloc(len(x)))
    assert arc.target == 250  # 500 / 200 x 100
    cache.insert(w, alloc.alloc(len(w)))
    assert arc.target == 700  # 250 + 500 / 100 x 100, capped at the 700 tokens held at most


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


def test_arc_shrinks_its_target_by_the_ghost_lists_ratio_when_a_prefix_evicted_from_t2_comes_back():
    alloc = TokenAllocator(8192)
    arc = ARC()
    cache = RadixCache(ReqToTokenPool(2, 4096), alloc, eviction_policy=arc)
    a, w, y = ([k] + list(range(10000 * k, 10000 * k + n - 1)) for k, n in ((1, 2000), (2, 300), (3, 100)))
    for key in (a, w, y):
        cache.insert(key, alloc.alloc(len(key)))
    cache.match_prefix(y)  # y in T2
    cache.evict(2300)      # a, then w, to B1
    cache.evict(100)       # y to B2
    cache.insert(a, alloc.alloc(len(a)))
    assert arc.target == 2000  # B1 hit: + max(|B2| / |B1|, 1) * |a| = 1 * 2000
    cache.insert(y, alloc.alloc(len(y)))
    assert arc.target == 1700  # B2 hit: - max(|B1| / |B2|, 1) * |y| = 300 / 100 * 100, y counted in B2
    cache.check_invariants()


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


def test_2q_main_queue_is_lru_and_a1in_gives_way_only_above_its_share():
    cache, _ = make_cache(policy=TwoQ(kin=0.5))
    put(cache, seq(0))
    put(cache, seq(10))
    cache.evict(4)  # seq(0) leaves A1in: a ghost
    put(cache, seq(0))  # back: Am
    cache.check_invariants()  # each leaf's entry is current: its queue, order and tokens
    cache.evict(4)  # A1in holds exactly kin of the tokens, not more: Am's seq(0) goes
    assert cached_sequences(cache) == {tuple(seq(10))}
    cache.check_invariants()
    cache, _ = make_cache(policy="2q")
    put(cache, seq(0))
    put(cache, seq(10))
    cache.evict(4)
    put(cache, seq(0))  # Am
    cache.evict(4)      # A1in's seq(10) goes: a ghost
    put(cache, seq(10))  # Am, after seq(0)
    cache.match_prefix(seq(0))
    cache.evict(4)      # A1in is empty: Am's least recently used
    assert cached_sequences(cache) == {tuple(seq(0))}


def test_2q_a1in_is_fifo_a_prefix_used_and_released_on_probation_keeps_its_place():
    cache, _ = make_cache(policy="2q")
    put(cache, seq(0))
    put(cache, seq(10))
    node = cache.match_prefix(seq(0)).last_node
    cache.inc_lock_ref(node)  # a request uses it: it leaves the evictable set ...
    cache.dec_lock_ref(node)  # ... and comes back, under its first place in A1in
    cache.evict(4)
    assert cached_sequences(cache) == {tuple(seq(10))}


def test_2q_remembers_only_what_left_a1in_and_only_within_kout():
    cache, _ = make_cache(policy="2q")
    put(cache, seq(0))
    put(cache, seq(10))
    cache.evict(4)
    put(cache, seq(0))  # Am
    cache.evict(4)      # seq(10) from A1in
    cache.evict(4)      # seq(0) from Am: no ghost
    put(cache, seq(0))
    put(cache, seq(20))
    cache.evict(4)      # seq(0) came back to A1in, the oldest there
    assert cached_sequences(cache) == {tuple(seq(20))}
    # A1out holds kout (0.5) of the most tokens held: 8 of 16 here, two 4-token prefixes.
    cache, _ = make_cache(policy="2q")
    for start in (0, 10, 20, 30):
        put(cache, seq(start))
    cache.evict(12)  # seq(0), seq(10), seq(20) leave A1in; seq(0)'s name is trimmed
    put(cache, seq(0))
    put(cache, seq(40))
    cache.evict(8)   # seq(30), then seq(0): back in A1in, not remembered
    assert cached_sequences(cache) == {tuple(seq(40))}


# ---- GDSF -----------------------------------------------------------------------------------------------------
def test_gdsf_keeps_the_deeper_page_when_recency_and_frequency_are_equal():
    cache, _ = make_cache(size=64, policy=GDSF(attention_crossover=4))
    put(cache, seq(100, 16) + seq(0))  # a page at depth 16
    put(cache, seq(10))               # the same size at depth 0, inserted later
    cache.evict(1)
    assert cached_sequences(cache) == {tuple(seq(100, 16) + seq(0))}


def test_gdsf_prices_a_token_by_its_depth_plus_half_its_node():
    # cost / size = 1 + (depth + n / 2) / crossover: a 4-token leaf at depth 16 is worth more than one at the root;
    # an 8-token root leaf (1 + 4 / 4) less than a 1-token leaf at depth 6 (1 + 6.5 / 4).
    cache, _ = make_cache(size=64, policy=GDSF(attention_crossover=4))
    put(cache, seq(100, 16))
    put(cache, seq(100, 16) + seq(0))
    put(cache, seq(10))
    cache.evict(1)
    assert cached_sequences(cache) == {tuple(seq(100, 16) + seq(0))}
    cache, _ = make_cache(size=64, policy=GDSF(attention_crossover=4))
    put(cache, seq(0, 8))
    put(cache, seq(200, 6))
    put(cache, seq(200, 6) + [300])
    cache.evict(1)
    assert cached_sequences(cache) == {tuple(seq(200, 6) + [300])}


def test_gdsf_ranks_a_leaf_by_the_inflation_of_its_last_access_and_never_lowers_the_inflation():
    cache, _ = make_cache(size=64, policy=GDSF(attention_crossover=4))
    put(cache, seq(0) + seq(10))
    put(cache, seq(0) + seq(20))  # seq(0) is internal, last used now, at inflation 0
    put(cache, seq(40))
    cache.evict(4)                # seq(40): H = 1.5, the inflation rises to it
    put(cache, seq(60))           # H = 1.5 + 1.5
    cache.evict(8)                # the two branches (H = 1 + 6 / 4): the inflation is 2.5
    assert cache._policy.inflation == 2.5
    cache.evict(4)                # seq(0), a leaf now, at the inflation of its last use: 0 + 1.5 < 3
    assert cached_sequences(cache) == {tuple(seq(60))} and cache._policy.inflation == 2.5
    cache.check_invariants()


def test_gdsf_evictions_after_an_access_in_the_same_clock_tick_do_not_inflate_it():
    cache, _ = make_cache(size=64, policy=GDSF(attention_crossover=4))
    put(cache, seq(40))
    for _ in range(3):
        cache.match_prefix(seq(40))  # H = 4 x 1.5
    put(cache, seq(60, 8))           # H = 2, at this tick
    (node,) = (n for n, path in tree_nodes(cache) if path == tuple(seq(60, 8)))
    cache.inc_lock_ref(node)
    cache.evict(4)                   # seq(40) goes in this same tick: the inflation is 6 from now on
    cache.dec_lock_ref(node)         # seq(60, 8) is ranked again: its access came before that eviction
    put(cache, seq(80))              # H = 6 + 1.5
    cache.evict(8)
    assert cached_sequences(cache) == {tuple(seq(80))}


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


@pytest.mark.parametrize("extra, followed", [(4, True), (3, False)])
def test_lookahead_follows_a_key_that_goes_on_by_exactly_one_more_page_and_not_by_less(extra, followed):
    cache, _ = make_cache(page_size=4, policy="lookahead")
    put(cache, seq(0))
    cache.request_waiting("r", seq(0) + seq(10, extra))  # the key ends at a page boundary, or a token short of it
    put(cache, seq(0) + seq(10))  # the tree grows by that page: the mark moves down to it only if r will match it
    put(cache, seq(50))
    cache.evict(4)
    # Not followed, the new page is nobody's: it goes, and the marked seq(0) is a leaf again.
    assert cached_sequences(cache) == ({tuple(seq(0) + seq(10))} if followed else {tuple(seq(0)), tuple(seq(50))})
    cache.check_invariants()


def test_lookahead_keeps_a_prefix_until_the_last_request_waiting_for_it_is_admitted():
    cache, _ = make_cache(policy="lookahead")
    put(cache, seq(0))
    put(cache, seq(10))
    cache.request_waiting("r", seq(0) + [99])
    cache.request_waiting("s", seq(0) + [98])
    cache.request_admitted("r")
    cache.evict(4)  # s still waits for seq(0)
    assert cached_sequences(cache) == {tuple(seq(0))}


def test_lookahead_a_request_queued_again_drops_its_old_mark():
    cache, _ = make_cache(policy="lookahead")
    put(cache, seq(10))
    put(cache, seq(0))
    cache.request_waiting("r", seq(0) + [99])
    cache.request_waiting("r", seq(10) + [99])  # queued again, now for seq(10)
    cache.evict(4)
    assert cached_sequences(cache) == {tuple(seq(10))}


def test_lookahead_does_not_follow_a_key_that_leaves_the_edge_it_ends_in():
    cache, _ = make_cache(policy="lookahead")
    put(cache, seq(0, 8))
    cache.request_waiting("r", seq(0) + [77, 78, 79, 80] + seq(20))  # leaves seq(0, 8)'s edge after 4 tokens
    put(cache, seq(0, 8) + seq(20))  # not what r will match, though it goes on with r's next tokens
    put(cache, seq(50))
    cache.evict(4)
    assert cached_sequences(cache) == {tuple(seq(0, 8)), tuple(seq(50))}


def test_lookahead_keeps_no_state_for_what_was_evicted_or_admitted():
    cache, _ = make_cache(policy="lookahead")
    put(cache, seq(0))
    cache.request_waiting("r", seq(0) + seq(10) + seq(20) + [99])
    put(cache, seq(0) + seq(10))  # r's mark moves down a node, and waits for the next one
    cache.request_waiting("s", seq(30) + seq(40) + [99])  # nothing cached: waits at the root for seq(30)
    policy = cache._policy
    assert len(policy._follow) == 2 and all(policy._follow.values())  # where r and s wait, nothing else
    cache.evict(1000)  # the marked node goes too, at last
    cache.request_admitted("r")
    cache.request_admitted("s")
    assert (policy._follow, policy._follow_at, policy._expected, policy._target, policy._keys) == ({}, {}, {}, {}, {})


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


def test_a_split_head_keeps_its_own_place_when_its_child_gets_a_second_chance():
    cache, _ = make_cache(policy="s3fifo")
    put(cache, seq(0, 8))
    put(cache, seq(20))
    put(cache, seq(0) + seq(50))  # splits seq(0, 8): the head seq(0) keeps the probation place it had
    cache.match_prefix(seq(0, 8))  # both halves reused
    cache.match_prefix(seq(20))
    cache.evict(4)  # the back half, then seq(20), to the main queue; seq(50) goes. The head stays on probation,
    cache.evict(4)  # where it lands when the back half goes.
    cache.evict(4)  # So it gets its own second chance, and seq(20), not reused in the main queue, goes.
    assert cached_sequences(cache) == {tuple(seq(0))}
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


def test_multiturn_a_match_of_exactly_the_continuation_share_continues_the_conversation():
    sched, _ = multiturn_scheduler(MultiTurn(continuation=0.5))
    serve(sched, Req("a", seq(10, 8), max_new_tokens=1))
    assert serve(sched, Req("b", seq(10, 8) + seq(30, 8), max_new_tokens=1)) == 1  # 8 of 16
    assert serve(sched, Req("c", seq(10, 7) + seq(50, 9), max_new_tokens=1)) == 0  # 7 of 16


def test_multiturn_at_continuation_zero_a_prompt_that_matches_nothing_is_still_a_first_prompt():
    sched, _ = multiturn_scheduler(MultiTurn(continuation=0))
    assert serve(sched, Req("a", seq(10, 8), max_new_tokens=1)) == 0
    assert serve(sched, Req("b", seq(10, 2) + seq(30, 8), max_new_tokens=1)) == 1


@pytest.mark.parametrize("ghosts, remembered", [(1, "c"), (2, "bc")])
def test_multiturn_remembers_the_last_ghosts_evictions(ghosts, remembered):
    sched, cache = multiturn_scheduler(MultiTurn(ghosts=ghosts), size=128)
    prompts = {name: seq(100 * k, 24) for k, name in enumerate("abc", start=1)}
    for name, prompt in prompts.items():
        serve(sched, Req(name, prompt, max_new_tokens=1))
    cache.evict(1000)  # a, b, c in that order
    turns = {name: serve(sched, Req(name + "'", prompt + seq(900, 4), max_new_tokens=1))
             for name, prompt in prompts.items()}
    assert turns == {name: int(name in remembered) for name in "abc"}


def test_multiturn_finds_a_ghost_by_its_whole_first_page_when_pages_are_longer_than_ghost_tokens():
    pool, alloc = ReqToTokenPool(4, 128), PagedTokenAllocator(128, 8)
    cache = RadixCache(pool, alloc, page_size=8, eviction_policy=MultiTurn(ghost_tokens=4))
    sched = Scheduler(pool, alloc, cache)
    serve(sched, Req("a", seq(10, 24), max_new_tokens=1))
    cache.evict(1000)
    assert serve(sched, Req("b", seq(10, 24) + seq(40, 8), max_new_tokens=1)) == 1


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


# ---- bad constructor arguments --------------------------------------------------------------------------------
def queued_policy(**kwargs):
    """The queue-based policies' common base, with its abstract parts stubbed: only its constructor runs."""
    return type("Stub", (QueuedPolicy,), {"add": None, "pop": None, "is_current": None})(**kwargs)


@pytest.mark.parametrize(("make", "error", "name"), [
    (lambda: S3FIFO(max_freq="3"), TypeError, "max_freq"),
    (lambda: S3FIFO(max_freq=None), TypeError, "max_freq"),
    (lambda: S3FIFO(max_freq=2.0), TypeError, "max_freq"),
    (lambda: S3FIFO(max_freq=-1), ValueError, "max_freq"),
    (lambda: S3FIFO(max_freq=0), ValueError, "max_freq"),
    (lambda: S3FIFO(small_ratio="0.1"), ValueError, "small_ratio"),
    (lambda: S3FIFO(small_ratio=None), ValueError, "small_ratio"),
    (lambda: S3FIFO(small_ratio=1.0), ValueError, "small_ratio"),
    (lambda: S3FIFO(small_ratio=float("nan")), ValueError, "small_ratio"),
    (lambda: TwoQ(kin="0.25"), ValueError, "kin"),
    (lambda: TwoQ(kin=True), ValueError, "kin"),
    (lambda: TwoQ(kin=0), ValueError, "kin"),
    (lambda: TwoQ(kin=1), ValueError, "kin"),
    (lambda: TwoQ(kout=None), ValueError, "kout"),
    (lambda: TwoQ(kout=0), ValueError, "kout"),
    (lambda: TwoQ(kout=float("inf")), ValueError, "kout"),
    (lambda: GDSF("32768"), ValueError, "attention_crossover"),
    (lambda: GDSF(None), ValueError, "attention_crossover"),
    (lambda: GDSF(True), ValueError, "attention_crossover"),
    (lambda: GDSF(-1.0), ValueError, "attention_crossover"),
    (lambda: KeyedPolicy(None), TypeError, "key"),
    (lambda: KeyedPolicy("lru"), TypeError, "key"),
    (lambda: KeyedPolicy(lru, 5), TypeError, "name"),
    (lambda: Lookahead("lru"), TypeError, "base"),
    (lambda: Lookahead(lru), TypeError, "base"),
    (lambda: Lookahead(Lookahead()), ValueError, "base must not look ahead"),
    (lambda: MultiTurn(turn_bonus="1500"), TypeError, "turn_bonus"),
    (lambda: MultiTurn(ghost_tokens=None), TypeError, "ghost_tokens"),
    (lambda: queued_policy(queues="2", ghosts=1), TypeError, "queues"),
    (lambda: queued_policy(queues=0, ghosts=1), ValueError, "queues"),
    (lambda: queued_policy(queues=2, ghosts=-1), ValueError, "ghosts"),
])
def test_policy_constructors_refuse_a_parameter_of_the_wrong_type_or_sign_by_name(make, error, name):
    with pytest.raises(error, match=name):
        make()


def test_lookahead_refuses_a_base_that_already_serves_a_tier():
    base = S3FIFO()
    make_cache(policy=base)
    with pytest.raises(ValueError, match="base: this 's3fifo' policy already orders"):
        Lookahead(base)


def test_policy_defaults_are_the_papers():
    s3, two_q = S3FIFO(), TwoQ()
    assert (s3.small_ratio, s3.max_freq) == (0.1, 3) and (two_q.kin, two_q.kout) == (0.25, 0.5)


def test_a_turn_table_forgets_a_request_it_never_saw_or_already_forgot():
    table, req = TurnTable(), object()
    table.forget_request(req)
    table.set_request(req, 2)
    assert table.request(req) == 2
    table.forget_request(req)
    table.forget_request(req)
    assert table.request(req) is None


@pytest.mark.parametrize("make", [S3FIFO, TwoQ])
def test_an_entry_the_policy_has_moved_on_from_is_not_current_though_still_queued(make):
    # What check_invariants relies on to find a stale entry: the queue and order the policy now gives the node.
    policy = make()
    cache, _ = make_cache(policy=policy)
    put(cache, seq(0))
    node = next(n for n, _ in tree_nodes(cache) if n.entry is not None)
    assert policy.is_current(node, node.entry)
    state = policy._state[node]
    state[0] = 1 - state[0]  # the policy has moved it to the other queue; its entry has not followed
    assert not policy.is_current(node, node.entry)


def test_gdsf_ranks_a_leaf_used_before_its_pruned_history_at_the_oldest_level_it_kept():
    policy = GDSF(attention_crossover=4)
    policy._min_history = 1  # prune from the second level on (the default waits for 1,024)
    cache, _ = make_cache(size=64, policy=policy)
    put(cache, seq(500))
    (held,) = (n for n, path in tree_nodes(cache) if path == tuple(seq(500)))
    cache.inc_lock_ref(held)         # used at the start, then held while the inflation rises
    for k in range(1, 13):
        put(cache, seq(100 * k))
        cache.evict(4)
    assert policy._pruned and policy._ticks[0] > held.last_access and policy._levels[0] < policy._levels[-1]
    cache.dec_lock_ref(held)         # ranked again: its access is older than every level kept
    assert policy._priority(held) == policy._levels[0] + 1.5
    cache.check_invariants()
