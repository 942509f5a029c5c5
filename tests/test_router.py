"""The event-fed block index and the four routing policies, each against its documented rule."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem.events import MEDIUM_CPU_PINNED, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, EventCollector
from kvmem.page_hash import page_hashes
from kvmem.router import POLICIES, BlockIndex, ReplicaLoad, Router

IDLE = ReplicaLoad()


def stored(hashes, medium="GPU"):
    return BlockStored(hashes, None, [0] * len(hashes), 1, medium=medium)


def index_with(*replica_blocks):
    index = BlockIndex(len(replica_blocks))
    for r, hashes in enumerate(replica_blocks):
        if hashes:
            index.apply_event(r, stored(hashes))
    return index


# ---- the index ---------------------------------------------------------------------------------------
def test_index_tracks_blocks_per_replica_and_medium():
    index = BlockIndex(2)
    index.apply(0, EventBatch(0.0, [stored([1, 2]), stored([3], MEDIUM_CPU_PINNED),
                                    BlockStored([4], None, [0], 1, medium=None)]))
    index.apply(1, EventBatch(0.0, [stored([2])]))
    assert index.blocks(0) == {1, 2, 4}                       # no medium: older vLLM, the GPU
    assert index.blocks(0, MEDIUM_CPU_PINNED) == {3}
    index.apply(0, EventBatch(0.0, [BlockRemoved([2]), BlockRemoved([3], MEDIUM_CPU_PINNED)]))
    assert index.blocks(0) == {1, 4} and index.num_blocks(0, MEDIUM_CPU_PINNED) == 0
    assert index.prefix_overlaps([2]) == [0, 1]
    index.apply_event(0, AllBlocksCleared())
    assert index.num_blocks(0) == 0 and index.blocks(1) == {2}


def test_removing_an_unknown_block_is_counted_and_ignored():
    index = index_with([1])
    index.apply_event(0, BlockRemoved([1, 9]))
    assert index.unknown_removals == 1 and index.num_blocks(0) == 0


def test_prefix_overlap_stops_at_the_first_missing_block():
    index = index_with([1, 2, 3], [1, 3, 4], [], [2, 3])
    assert index.prefix_overlaps([1, 2, 3, 4]) == [3, 1, 0, 0]
    assert index.prefix_overlaps([]) == [0, 0, 0, 0]
    assert index.prefix_overlaps([1, 2, 3], medium=MEDIUM_CPU_PINNED) == [0, 0, 0, 0]


def test_a_block_no_replica_holds_ends_every_replicas_prefix_even_where_later_blocks_are_held():
    index = index_with([1, 2, 3, 4], [1, 3, 4])
    assert index.prefix_overlaps([1, 9, 2, 3, 4]) == [1, 1]  # 9 is nobody's: what follows it is no prefix
    assert index.prefix_overlaps([9, 1, 2]) == [0, 0]
    router = Router("cache-aware", 2, index=index_with([1, 2, 3, 4, 7, 8], [5, 6]))
    assert router.route([1, 9, 2, 3, 4], [IDLE, IDLE]) == 1  # 1 block of 5 <= 0.3: the smaller tree, not "4 of 5"


replica_events = st.lists(st.tuples(st.integers(0, 2), st.one_of(
    st.builds(stored, st.lists(st.integers(0, 9), min_size=1, max_size=4),
              st.sampled_from(["GPU", MEDIUM_CPU_PINNED])),
    st.builds(BlockRemoved, st.lists(st.integers(0, 9), min_size=1, max_size=4),
              st.sampled_from(["GPU", MEDIUM_CPU_PINNED])),
    st.just(AllBlocksCleared()))), max_size=40)


@settings(deadline=None)  # as the other property tests: a busy machine is not a failure
@given(replica_events, st.lists(st.integers(0, 9), max_size=6), st.integers(0, 2))
def test_index_equals_a_set_per_replica_and_medium_model(events, request_hashes, cleared):
    index = BlockIndex(3)
    model = [{"GPU": set(), MEDIUM_CPU_PINNED: set()} for _ in range(3)]
    for r, event in events:
        index.apply_event(r, event)
        if isinstance(event, AllBlocksCleared):
            model[r] = {m: set() for m in model[r]}
        elif isinstance(event, BlockStored):
            model[r][event.medium].update(event.block_hashes)
        else:
            model[r][event.medium].difference_update(event.block_hashes)
    index.clear(cleared)
    model[cleared] = {m: set() for m in model[cleared]}
    for r in range(3):
        for medium, blocks in model[r].items():
            assert index.blocks(r, medium) == blocks
    expected = []
    for r in range(3):
        n = 0
        while n < len(request_hashes) and request_hashes[n] in model[r]["GPU"]:
            n += 1
        expected.append(n)
    assert index.prefix_overlaps(request_hashes) == expected


def test_an_index_fed_by_a_caches_events_matches_a_requests_cached_prefix():
    from kvmem import RadixCache, ReqToTokenPool, TokenAllocator
    alloc, sink = TokenAllocator(64), EventCollector()
    cache = RadixCache(ReqToTokenPool(2, 8), alloc, page_size=1, event_sink=sink)
    cache.insert([5, 6, 7, 8], alloc.alloc(4))
    index = BlockIndex(2)
    index.apply(1, sink.take_batch())
    request = [5, 6, 7, 1, 2]
    assert index.prefix_overlaps(page_hashes(request, 1)) == [0, cache.prefix_len(request)]


# ---- policies ----------------------------------------------------------------------------------------
def test_round_robin_takes_replicas_in_turn():
    router = Router("round-robin", 3)
    assert [router.route([1], [IDLE] * 3) for _ in range(5)] == [0, 1, 2, 0, 1]


def test_least_load_takes_the_fewest_running_requests_lowest_number_on_ties():
    router = Router("least-load", 3)
    assert router.route([], [ReplicaLoad(4), ReplicaLoad(2), ReplicaLoad(2)]) == 1


def test_cache_aware_routes_to_the_longest_match_above_the_threshold():
    router = Router("cache-aware", 3, index=index_with([1], [1, 2, 3], [1, 2]))
    assert router.route([1, 2, 3, 4], [IDLE] * 3) == 1                     # 3/4 > 0.3


def test_cache_aware_below_the_threshold_takes_the_replica_caching_least():
    router = Router("cache-aware", 3, index=index_with([1, 7, 8], [9], [5, 6]))
    assert router.route([1, 2, 3, 4], [IDLE] * 3) == 1                     # 1/4 <= 0.3: smallest tree


def test_cache_aware_measures_the_match_against_the_whole_request_its_partial_page_included():
    # block_size 16, a 60-token request: 3 whole pages and 12 tokens. Replica 0 holds its first page.
    router = Router("cache-aware", 2, index=index_with([1, 7, 8], []), block_size=16)
    assert router.route([1, 2, 3], [IDLE, IDLE], 60) == 1                  # 16/60 <= 0.3: smallest tree
    assert router.route([1, 2, 3], [IDLE, IDLE], 48) == 0                  # 16/48 > 0.3


def test_cache_aware_equal_matches_go_to_the_less_loaded_replica():
    router = Router("cache-aware", 2, index=index_with([1, 2], [1, 2]))
    assert router.route([1, 2], [ReplicaLoad(3), ReplicaLoad(1)]) == 1


@pytest.mark.parametrize("loads, expected", [
    ((100, 10), 1),    # 90 > 64 and 100 > 15: imbalanced, least load wins over the cache
    ((100, 70), 0),    # 30 <= 64: balanced, the cache wins
    ((1000, 900), 0),  # 100 > 64 but 1000 <= 1350: balanced
])
def test_cache_aware_switches_to_least_load_only_when_both_thresholds_are_passed(loads, expected):
    router = Router("cache-aware", 2, index=index_with([1, 2, 3], []))
    assert router.route([1, 2, 3], [ReplicaLoad(n) for n in loads]) == expected


@pytest.mark.parametrize("loads, expected", [
    ((74, 10), 0),     # 64 apart: not more than balance_abs_threshold, so balanced
    ((75, 10), 1),
    ((300, 200), 0),   # 300 is exactly 1.5 x 200: not more, so balanced
    ((301, 200), 1),
])
def test_cache_aware_thresholds_are_strict_at_their_boundaries(loads, expected):
    router = Router("cache-aware", 2, index=index_with([1, 2, 3], []))
    assert router.route([1, 2, 3], [ReplicaLoad(n) for n in loads]) == expected


def test_a_match_of_exactly_the_cache_threshold_is_not_enough():
    router = Router("cache-aware", 2, index=index_with([1, 2, 7, 8], [9]), cache_threshold=0.5)
    assert router.route([1, 2, 3, 4], [IDLE, IDLE]) == 1     # 2/4 is not above 0.5: the smaller tree
    assert router.route([1, 2, 3], [IDLE, IDLE], 3) == 0      # 2/3 is


def test_cache_aware_thresholds_are_sglangs_by_default_and_settable():
    default = Router("cache-aware", 2)._policy
    assert (default.cache_threshold, default.balance_abs_threshold, default.balance_rel_threshold) == (0.3, 64, 1.5)
    strict = Router("cache-aware", 2, index=index_with([1, 2, 3], [9]), cache_threshold=0.9)
    assert strict.route([1, 2, 3, 4], [IDLE, IDLE]) == 1                     # 3/4 <= 0.9: smallest tree


def test_kv_overlap_minimises_dynamos_cost():
    # block_size 4, a 16-token request; replica 0 caches 3 of its 4 blocks but decodes 10 blocks already.
    router = Router("kv-overlap", 2, index=index_with([1, 2, 3], []), block_size=4)
    loads = [ReplicaLoad(active_blocks=10), ReplicaLoad(active_blocks=2, prefill_tokens=4)]
    costs = router._policy.costs(router, [1, 2, 3, 4], loads, 16)
    assert costs == [1.0 * (0 + 16 - 12) / 4 + 10 + 4, 1.0 * (4 + 16 - 0) / 4 + 2 + 4]   # [15.0, 11.0]
    assert router.route([1, 2, 3, 4], loads) == 1
    heavy = Router("kv-overlap", 2, index=router.index, block_size=4, overlap_score_weight=3.0)
    assert heavy.route([1, 2, 3, 4], loads) == 0                            # 3*1 + 14 = 17 < 3*5 + 6 = 21


def test_kv_overlap_counts_a_partial_last_page_in_num_tokens():
    router = Router("kv-overlap", 2, index=index_with([1], []), block_size=4)
    costs = router._policy.costs(router, [1], [IDLE, IDLE], 6)
    assert costs == [(6 - 4) / 4 + 2, 6 / 4 + 2]


# ---- bad input -----------------------------------------------------------------------------------------
def test_an_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'.*round-robin, least-load"):
        Router("fastest", 2)
    assert POLICIES == ("round-robin", "least-load", "cache-aware", "kv-overlap")


def test_zero_replicas_is_a_clear_error():
    with pytest.raises(ValueError, match="num_replicas must be a positive int, got 0"):
        Router("round-robin", 0)
    with pytest.raises(ValueError, match="num_replicas"):
        BlockIndex(0)


@pytest.mark.parametrize("call, error, match", [
    (lambda r: r.route([1], [IDLE]), ValueError, "loads has 1 entries for 2 replicas"),
    (lambda r: r.route([1], [IDLE, (0, 0, 0)]), TypeError, "loads\\[1\\]"),
    (lambda r: r.route([1], [IDLE, ReplicaLoad(-1)]), ValueError, "running_requests"),
    (lambda r: r.route([1.5], [IDLE, IDLE]), TypeError, "block_hashes"),
    (lambda r: r.route(b"ab", [IDLE, IDLE]), TypeError, "block_hashes"),
    (lambda r: r.route([1, 2], [IDLE, IDLE], num_tokens=1), ValueError, "num_tokens"),
])
def test_bad_route_arguments_raise_naming_them(call, error, match):
    with pytest.raises(error, match=match):
        call(Router("cache-aware", 2))


def test_bad_router_and_index_arguments_raise_naming_them():
    with pytest.raises(TypeError, match="'cache-aware'.*threshold"):
        Router("cache-aware", 2, threshold=0.5)
    with pytest.raises(ValueError, match="cache_threshold"):
        Router("cache-aware", 2, cache_threshold=1.5)
    with pytest.raises(ValueError, match="overlap_score_weight"):
        Router("kv-overlap", 2, overlap_score_weight=-1)
    with pytest.raises(ValueError, match="index has 3 replicas"):
        Router("kv-overlap", 2, index=BlockIndex(3))
    with pytest.raises(ValueError, match="replica"):
        BlockIndex(2).apply_event(2, AllBlocksCleared())
    with pytest.raises(TypeError, match="EventBatch"):
        BlockIndex(2).apply(0, [AllBlocksCleared()])


def test_a_block_index_shows_each_replicas_gpu_blocks():
    index = BlockIndex(2)
    index.apply(1, EventBatch(0.0, [BlockStored([11, 12], None, list(range(8)), 4)]))
    assert repr(index) == "BlockIndex(num_replicas=2, gpu_blocks=[0, 2])"
