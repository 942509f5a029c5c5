"""HybridRadixCache's behaviours, one by one: window validity, tombstones, window locks and evictions; states,
copy on write, state locks and evictions; bad input."""

import numpy as np
import pytest
import torch

from kvmem import PagedTokenAllocator, Req, ReqToTokenPool, TokenAllocator
from kvmem.hybrid import HybridRadixCache, HybridTokenAllocator, StatePool, StateSlotPool

KEY = list(range(100, 116))  # 16 tokens


def window_cache(window=5, size=64, window_size=48, page_size=1, context=128):
    """A cache with a window of `window` (keep = window - 1 previous tokens), freeing window slots page by page."""
    alloc = HybridTokenAllocator(size, window_size, page_size)
    cache = HybridRadixCache(ReqToTokenPool(4, context), alloc, page_size, window=window,
                             window_free_interval=page_size)
    return cache, alloc


def tombstone_all_but_tail(cache, key):
    """Inserts `key` and makes everything before its window tail a tombstone: lock the whole key (its tail becomes
    window-protected), evict every other window token, unlock."""
    cache.insert(key, cache.token_allocator.alloc(len(key)))
    node = cache.match_prefix(key).last_node
    cache.inc_lock_ref(node)
    cache.evict_window(len(key))
    cache.dec_lock_ref(node)
    cache.check_invariants()


# ---- window: which matches are usable ------------------------------------------------------------------

def test_a_match_ends_where_its_last_keep_tokens_still_have_window_kv():
    cache, _ = window_cache(window=5)  # keep 4
    tombstone_all_but_tail(cache, KEY)
    assert cache.window_evictable_size() == 4 and cache.total_size() == 16
    assert len(cache.match_prefix(KEY).indices) == 16  # [12, 16) is live: a whole window before position 16
    assert len(cache.match_prefix(KEY[:14]).indices) == 0  # [12, 14) is 2 < 4 live tokens after a tombstone
    cache.check_invariants()


def test_a_short_path_with_no_tombstone_is_usable_at_any_length():
    cache, alloc = window_cache(window=9)
    cache.insert(KEY[:3], alloc.alloc(3))
    assert len(cache.match_prefix(KEY[:3]).indices) == 3


def test_a_window_of_one_needs_no_previous_token():
    cache, _ = window_cache(window=1)
    tombstone_all_but_tail(cache, KEY)
    assert cache.window_evictable_size() == 0  # the whole key was evictable: nothing is kept for a window of 1
    assert len(cache.match_prefix(KEY).indices) == 16


# ---- window: locks cover the tail only ------------------------------------------------------------------

def test_a_lock_protects_the_full_path_but_only_the_window_tail():
    cache, alloc = window_cache(window=5, page_size=2)  # keep 4: the tail is [12, 16)
    cache.insert(KEY, alloc.alloc(16))
    node = cache.match_prefix(KEY).last_node
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 16
    assert cache.window_protected_size() == 4 and cache.window_evictable_size() == 12
    cache.check_invariants()


def test_the_tail_starts_on_a_page_boundary():
    cache, alloc = window_cache(window=4, page_size=2)  # keep 3: [13, 16) rounds down to [12, 16)
    cache.insert(KEY, alloc.alloc(16))
    cache.inc_lock_ref(cache.match_prefix(KEY).last_node)
    assert cache.window_protected_size() == 4


def test_an_unlock_after_splits_releases_exactly_what_the_lock_counted():
    cache, alloc = window_cache(window=7)  # keep 6: the tail of 16 is [10, 16)
    cache.insert(KEY, alloc.alloc(16))
    node = cache.match_prefix(KEY).last_node
    cache.inc_lock_ref(node)
    for cut in (13, 4, 11, 15):  # splits inside the tail and before it
        cache.match_prefix(KEY[:cut])
    other = cache.match_prefix(KEY[:13]).last_node  # a second lock, ending inside the first one's tail
    cache.inc_lock_ref(other)
    cache.dec_lock_ref(node)
    assert cache.window_protected_size() == 6  # other's tail [7, 13) only
    cache.dec_lock_ref(other)
    assert cache.window_protected_size() == 0 and cache.window_evictable_size() == 16
    cache.check_invariants()


# ---- window: eviction -----------------------------------------------------------------------------------

def test_window_eviction_tombstones_locked_and_inner_nodes_and_deletes_unlocked_leaves():
    cache, alloc = window_cache(window=5)  # keep 4
    a = KEY[:8]
    b = KEY[:4] + [7, 7, 7, 7]
    cache.insert(a, alloc.alloc(8))
    b_slots = alloc.alloc(8)
    assert cache.insert(b, b_slots) == 4  # [0, 4) inner, two leaves of 4
    alloc.free(b_slots[:4])
    cache.inc_lock_ref(cache.match_prefix(a).last_node)  # a's tail is its leaf [4, 8)
    assert cache.evict_window(100) == 8  # b's leaf goes whole, the inner [0, 4) becomes a tombstone
    assert cache.total_size() == 8 and cache.window_evictable_size() == 0 and cache.window_protected_size() == 4
    assert len(cache.match_prefix(a).indices) == 8  # still usable: its last 4 tokens are live
    assert len(cache.match_prefix(b).indices) == 0  # b's leaf is gone, and [0, 4) alone is a tombstone
    assert alloc.available_size() == 64 - 8
    cache.check_invariants()


def test_full_eviction_takes_the_tombstone_leaves_it_leaves_behind():
    cache, alloc = window_cache(window=5)
    tombstone_all_but_tail(cache, KEY)  # [0, 12) tombstone, [12, 16) live
    assert cache.evict(1) == 16  # the leaf, then its tombstone parent, now a leaf that no match can end at
    assert cache.total_size() == 0 and alloc.available_size() == 64 and alloc.window_available_size() == 48
    cache.check_invariants()


def test_window_eviction_frees_least_recently_matched_tails_last():
    cache, alloc = window_cache(window=3)  # keep 2
    cache.insert(KEY, alloc.alloc(16))
    other = [9] * 8
    cache.insert(other, alloc.alloc(8))
    cache.match_prefix(KEY)  # KEY's tail is used now; other is older
    cache.inc_lock_ref(cache.match_prefix(KEY).last_node)
    assert cache.evict_window(2) == 6  # other went first: all but its last window tail (W - 1 = 2 tokens)
    assert len(cache.match_prefix(other).indices) == 8  # a match still ends at its end
    assert len(cache.match_prefix(KEY).indices) == 16
    assert cache.window_evictable_size() == 14 + 2 and cache.window_protected_size() == 2
    cache.check_invariants()


def test_window_eviction_keeps_lru_order_through_many_matches_and_full_evictions():
    # Each match re-ranks a leaf and each full eviction unlists one: the window LRU's stale entries pile up (three
    # rounds of matches leave more stale entries than live ones, twice) and are dropped in rebuilds, which must keep
    # every live node's place.
    cache, alloc = window_cache(window=2, size=512, window_size=512)  # keep 1: one-token leaves go whole
    leaves = [[7, i] for i in range(200)]
    for key in leaves:
        cache.insert(key, alloc.alloc(2) if key[1] == 0 else torch.cat((cache.match_prefix([7]).indices,
                                                                         alloc.alloc(1))))
    rng = np.random.default_rng(0)
    for _ in range(3):
        order = rng.permutation(200)
        for i in order:
            cache.match_prefix(leaves[i])
        cache.check_invariants()
    assert cache.evict_window(40) == 40  # the 40 least recently matched leaves go whole (unlocked, childless)
    cache.check_invariants()
    assert cache.evict(40) == 40  # full eviction: the next 40
    cache.check_invariants()
    gone = sorted(i for i in range(200) if len(cache.match_prefix(leaves[i]).indices) < 2)  # (matches re-rank)
    assert gone == sorted(order[:80])


def test_window_eviction_cuts_a_long_node_before_its_tail_and_takes_the_tail_last():
    cache, alloc = window_cache(window=5)  # keep 4
    cache.insert(KEY, alloc.alloc(16))
    assert cache.evict_window(1) == 12 and cache.window_evictable_size() == 4
    assert len(cache.match_prefix(KEY).indices) == 16 and len(cache.match_prefix(KEY[:8]).indices) == 0
    assert cache.evict_window(1) == 4  # the tail, a leaf nobody locks, goes whole: full KV too
    assert cache.total_size() == 0 and alloc.available_size() == 64 and alloc.window_available_size() == 48
    cache.check_invariants()


# ---- window: inserts with freed window KV -----------------------------------------------------------------

def test_a_requests_window_freed_tokens_enter_as_a_tombstone_before_a_live_leaf():
    cache, alloc = window_cache(window=5)
    slots = alloc.alloc(12)
    alloc.free_window(slots[:4])  # the request's window left its first 4 tokens
    assert cache.insert(KEY[:12], slots) == 0
    assert cache.window_evictable_size() == 8 and cache.total_size() == 12
    assert len(cache.match_prefix(KEY[:12]).indices) == 12
    assert len(cache.match_prefix(KEY[:6]).indices) == 0  # [4, 6) is too short a run
    cache.check_invariants()


def test_an_insert_revives_a_tombstone_with_the_window_kv_it_still_holds():
    cache, alloc = window_cache(window=5)
    tombstone_all_but_tail(cache, KEY)
    fresh = alloc.alloc(16)
    window_of_fresh = alloc.window_slots(fresh[:12]).clone()
    assert cache.insert(KEY, fresh) == 16  # all cached: the caller frees its duplicates...
    alloc.free(fresh)  # ...whose window slots the tombstone took
    assert cache.window_evictable_size() == 16
    assert torch.equal(alloc.window_slots(cache.match_prefix(KEY[:12]).indices), window_of_fresh)
    assert len(cache.match_prefix(KEY[:6]).indices) == 6
    cache.check_invariants()


def test_a_partly_window_freed_insert_revives_only_the_tombstone_tokens_it_holds():
    cache, alloc = window_cache(window=5, page_size=2)
    tombstone_all_but_tail(cache, KEY)  # [0, 12) tombstone
    fresh = alloc.alloc(16)
    alloc.free_window(fresh[:6])  # this request freed its first 3 pages
    cache.insert(KEY, fresh)
    alloc.free(fresh)
    assert cache.window_evictable_size() == 10  # [6, 12) revived, [12, 16) live already
    assert len(cache.match_prefix(KEY[:10]).indices) == 10
    assert len(cache.match_prefix(KEY[:8]).indices) == 0
    cache.check_invariants()


# ---- states -------------------------------------------------------------------------------------------

GRID = 64


def state_cache(slots=4, size=512, page_size=1, window=None):
    pool = ReqToTokenPool(4, 512)
    alloc = (HybridTokenAllocator(size, 256, page_size) if window else
             TokenAllocator(size) if page_size == 1 else PagedTokenAllocator(size, page_size))
    states = StatePool(slots, 1, (1,), (1,), torch.float64, torch.float64)
    return HybridRadixCache(pool, alloc, page_size, window=window, state_pool=states), alloc, states


def admit(cache, req):
    """What the Scheduler does for a request: match, lock, a row with the prefix and new slots, a state slot."""
    m = cache.match_prefix(req.match_key())
    req.prefix_indices, req.last_node, req.cache_protected_len = m.indices, m.last_node, len(m.indices)
    cache.lock(m.last_node)
    n = len(req.input_ids) - len(m.indices)
    assert cache.fits(n, 1) or cache.evict_for(n, 1) >= 0
    row = cache.req_to_token_pool.alloc(1)[0]
    cache.req_to_token_pool.write((row, slice(0, len(req.input_ids))),
                                  torch.cat([m.indices, cache.token_allocator.alloc(n)]))
    req.req_pool_idx, req.kv_len = row, len(req.input_ids)
    cache.start_reqs([req])
    return cache.req_state_slots([row])[0]


def computed(states, slot, tokens):
    """The model wrote the state of `tokens` into `slot` (here: their count)."""
    states.ssm_states[0][slot, 0] = len(tokens)


def finished(cache, states, req):
    """`req` admitted, its state computed, and finished into the tree."""
    computed(states, admit(cache, req), req.input_ids)
    cache.release_req(req, cache=True)


def test_a_request_that_finishes_on_the_grid_hands_its_state_to_the_tree():
    cache, _, states = state_cache()
    finished(cache, states, Req("a", list(range(2 * GRID)), 1))
    assert cache.state_evictable_size() == 1 and cache.state_available_size() == 4 - 1
    again = Req("b", list(range(2 * GRID)) + [5], 1)
    slot = admit(cache, again)
    assert len(again.prefix_indices) == 2 * GRID and states.ssm_states[0][slot, 0] == 2 * GRID  # copied
    assert cache.state_copies == 1
    cache.check_invariants()


def test_a_request_that_ends_off_the_grid_leaves_no_state_and_a_match_finds_none():
    cache, _, states = state_cache()
    finished(cache, states, Req("a", list(range(GRID + 5)), 1))
    assert cache.state_evictable_size() == 0 and cache.total_size() == GRID + 5
    assert len(cache.match_prefix(list(range(GRID + 5))).indices) == 0  # full KV, but nothing to resume from


def test_a_match_ending_inside_a_node_splits_it_and_the_new_head_has_no_state():
    cache, _, states = state_cache()
    finished(cache, states, Req("a", list(range(2 * GRID)), 1))
    m = cache.match_prefix(list(range(GRID)))
    assert len(m.indices) == 0 and cache.state_evictable_size() == 1


def test_a_running_requests_state_is_copied_into_the_tree_at_a_chunk_end_on_the_grid():
    cache, _, states = state_cache()
    req = Req("a", list(range(GRID)) + [1, 2, 3], 4)
    slot = admit(cache, req)
    req.kv_len = GRID  # its first chunk
    computed(states, slot, req.input_ids[:GRID])
    cache.cache_req(req, finished=False)
    assert cache.state_copies == 1 and cache.state_protected_size() == 1  # its lock moved there
    node = req.last_node
    assert node.state != slot and states.ssm_states[0][node.state, 0] == GRID
    cache.check_invariants()


def test_a_matched_state_stays_while_the_request_holds_its_lock():
    cache, _, states = state_cache(slots=3)
    finished(cache, states, Req("a", list(range(GRID)), 1))
    user = Req("b", list(range(GRID)) + [9], 1)
    admit(cache, user)
    assert cache.evict_states(5) == 0 and cache.state_protected_size() == 1
    cache.release_req(user, cache=False)
    assert cache.evict_states(5) == 1
    cache.check_invariants()


def test_state_eviction_frees_the_least_recently_matched_state_first():
    cache, _, states = state_cache(slots=4)
    for rid, first in (("a", 1000), ("b", 2000)):
        finished(cache, states, Req(rid, list(range(first, first + GRID)), 1))
    cache.match_prefix(list(range(1000, 1000 + GRID)) + [0])  # a is used again: b is older
    cache.evict_states(1)
    assert len(cache.match_prefix(list(range(1000, 1000 + GRID)) + [0]).indices) == GRID
    assert len(cache.match_prefix(list(range(2000, 2000 + GRID)) + [0]).indices) == 0


def test_a_request_that_computes_a_cached_states_prefix_again_refreshes_that_state():
    cache, _, states = state_cache(slots=4)
    for rid, first in (("a", 1000), ("b", 2000), ("c", 1000)):  # c's match (all but its last token) finds no state
        finished(cache, states, Req(rid, list(range(first, first + GRID)), 1))
    assert cache.state_evictable_size() == 2 and cache.evict_states(1) == 1  # b's is the older one now (as SGLang)
    assert len(cache.match_prefix(list(range(1000, 1000 + GRID)) + [0]).indices) == GRID
    assert len(cache.match_prefix(list(range(2000, 2000 + GRID)) + [0]).indices) == 0
    cache.check_invariants()


def test_full_eviction_frees_the_states_of_the_nodes_it_deletes():
    cache, alloc, states = state_cache()
    finished(cache, states, Req("a", list(range(GRID)), 1))
    assert cache.evict(1) == GRID
    assert cache.state_available_size() == 4 and cache.state_evictable_size() == 0
    cache.check_invariants()


def test_reset_frees_states_and_window_slots():
    cache, alloc, states = state_cache(window=5)
    finished(cache, states, Req("a", list(range(GRID)), 1))
    cache.reset()
    assert cache.state_available_size() == 4 and alloc.window_available_size() == 256
    assert alloc.available_size() == 512
    cache.check_invariants()


# ---- bad input -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    (dict(window=0), ValueError, "window must be a positive int"),
    (dict(window=129), ValueError, "window 129 is larger than the context"),
    (dict(window=None), ValueError, "give window, state_pool or both"),
    (dict(window=5, state_pool=StateSlotPool(1)), ValueError, "state_pool has 1 slot: too small for one request"),
    (dict(window=5, state_pool=object()), TypeError, "state_pool must be a StatePool"),
    (dict(window=5, window_free_interval=0), ValueError, "window_free_interval"),
    (dict(window=65), ValueError, "token_allocator.window_size 48 is too small for window 65"),
])
def test_a_bad_argument_is_named_and_changes_nothing(kwargs, error, match):
    alloc = HybridTokenAllocator(64, 48)
    with pytest.raises(error, match=match):
        HybridRadixCache(ReqToTokenPool(4, 128), alloc, **kwargs)
    assert alloc.available_size() == 64 and alloc.window_available_size() == 48


def test_a_window_needs_a_paired_allocator_and_a_paired_allocator_a_window():
    with pytest.raises(TypeError, match="token_allocator must be a HybridTokenAllocator"):
        HybridRadixCache(ReqToTokenPool(4, 128), TokenAllocator(64), window=4)
    with pytest.raises(ValueError, match="token_allocator pairs window slots, but window is None"):
        HybridRadixCache(ReqToTokenPool(4, 128), HybridTokenAllocator(64, 48), state_pool=StateSlotPool(4))


def test_a_state_pool_serves_one_cache():
    states = StateSlotPool(4)
    cache = HybridRadixCache(ReqToTokenPool(4, 128), TokenAllocator(64), state_pool=states)
    with pytest.raises(ValueError, match="already serves another"):
        HybridRadixCache(ReqToTokenPool(4, 128), TokenAllocator(64), state_pool=states)
    del cache


def test_bad_eviction_counts_are_refused_and_change_nothing():
    cache, alloc = window_cache()
    cache.insert(KEY, alloc.alloc(16))
    for call in (cache.evict_window, cache.evict):
        with pytest.raises(ValueError, match="num_tokens"):
            call(-1)
    assert cache.window_evictable_size() == 16 and cache.total_size() == 16
    states_cache, _, _ = state_cache()
    with pytest.raises(ValueError, match="num_states"):
        states_cache.evict_states(-1)


def test_window_slots_of_out_of_range_slots_are_refused():
    alloc = HybridTokenAllocator(8, 8)
    with pytest.raises(IndexError, match="slot 9 out of range"):
        alloc.window_slots(torch.tensor([9]))
    assert alloc.window_slots(np.array([0, 8])).tolist() == [0, 0]
