"""Unit tests of the radix prefix cache: matching, splits, locks, eviction order, paging, requests, bad input."""

from array import array

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem.allocator import PagedTokenAllocator, TokenAllocator
from kvmem.batch import Req
from kvmem.radix_cache import RadixCache
from kvmem.req_to_token import ReqToTokenPool


def make_cache(size=64, page_size=1, policy="lru"):
    alloc = TokenAllocator(size) if page_size == 1 else PagedTokenAllocator(size, page_size)
    return RadixCache(ReqToTokenPool(4, 64), alloc, page_size=page_size, eviction_policy=policy), alloc


def put(cache, tokens, priority=0):
    """Caches `tokens` as a finished request would: fresh slots, insert, free the duplicates. Returns the
    slots allocated for it (the tree keeps those past what was already cached)."""
    slots = cache.token_allocator.alloc(len(tokens))
    n = cache.insert(tokens, slots, priority=priority)
    if n:
        cache.token_allocator.free(slots[:n])
    return slots


def path_tokens(cache, node):
    parts = []
    while node is not cache.root_node:
        parts.append(node.token_ids())
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def tree_nodes(cache, namespace=None):
    """Every node of `namespace`'s tree (the default one: None), each with its path's tokens as a tuple."""
    stack = [(cache._root(namespace), ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            path = prefix + tuple(child.token_ids())
            yield child, path
            stack.append((child, path))


def cached_sequences(cache):
    """Every root-to-leaf token sequence in the tree, as tuples."""
    return {path for node, path in tree_nodes(cache) if not node.children}


def snapshot(cache):
    return (cache.evictable_size(), cache.protected_size(), cache.token_allocator.available_size(),
            cached_sequences(cache), len(cache._policy))


def sizes_add_up(cache):
    alloc = cache.token_allocator
    cache.check_invariants()
    return alloc.available_size() + cache.total_size() == alloc.size


# ---- match and insert -------------------------------------------------------------------------------
def test_match_on_an_empty_tree_returns_the_root_and_no_indices():
    cache, _ = make_cache()
    m = cache.match_prefix([1, 2, 3])
    assert m.last_node is cache.root_node
    assert m.indices.dtype == torch.int64 and len(m.indices) == 0


def test_insert_returns_how_many_leading_tokens_were_already_cached():
    cache, _ = make_cache()
    assert cache.insert([1, 2, 3], cache.token_allocator.alloc(3)) == 0
    dup = cache.token_allocator.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], dup) == 3
    cache.token_allocator.free(dup[:3])
    assert cache.total_size() == 5 and sizes_add_up(cache)


def test_match_returns_the_slots_of_the_longest_cached_prefix():
    cache, _ = make_cache()
    slots = put(cache, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 3, 4, 9, 9])
    assert m.indices.tolist() == slots.tolist()
    assert path_tokens(cache, m.last_node) == [1, 2, 3, 4]


def test_insert_of_a_diverging_key_splits_the_shared_edge():
    cache, _ = make_cache()
    a = put(cache, [1, 2, 3, 4])
    b = put(cache, [1, 2, 7, 8])
    assert len(cache.root_node.children) == 1
    shared = next(iter(cache.root_node.children.values()))
    assert shared.token_ids() == [1, 2]
    assert sorted(c.token_ids() for c in shared.children.values()) == [[3, 4], [7, 8]]
    assert cache.match_prefix([1, 2, 7, 8]).indices.tolist() == a[:2].tolist() + b[2:].tolist()
    assert sizes_add_up(cache)


def test_match_inside_an_edge_splits_it_so_last_node_covers_exactly_the_prefix():
    cache, _ = make_cache()
    slots = put(cache, [1, 2, 3, 4, 5, 6])
    m = cache.match_prefix([1, 2, 3, 9])
    assert m.indices.tolist() == slots[:3].tolist()
    assert path_tokens(cache, m.last_node) == [1, 2, 3]
    assert [c.token_ids() for c in m.last_node.children.values()] == [[4, 5, 6]]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).indices.tolist() == slots.tolist()
    assert sizes_add_up(cache)


def test_match_of_a_key_shorter_than_an_edge_splits_at_the_key_end():
    cache, _ = make_cache()
    slots = put(cache, [5, 6, 7, 8])
    m = cache.match_prefix([5, 6])
    assert m.indices.tolist() == slots[:2].tolist() and path_tokens(cache, m.last_node) == [5, 6]


def test_match_of_an_empty_key_matches_nothing():
    cache, _ = make_cache()
    put(cache, [1, 2])
    m = cache.match_prefix([])
    assert m.last_node is cache.root_node and len(m.indices) == 0


def test_match_across_many_nodes_concatenates_their_slots():
    cache, _ = make_cache(size=256)
    key = list(range(100, 200))
    slots = put(cache, key)
    for end in range(90, 0, -10):
        cache.match_prefix(key[:end])  # split into ten 10-token nodes
    m = cache.match_prefix(key + [1, 2])
    assert m.indices.tolist() == slots.tolist()
    assert path_tokens(cache, m.last_node) == key


@pytest.mark.parametrize("as_key", [list, tuple, lambda k: array("q", k), lambda k: array("i", k),
                                    torch.tensor, lambda k: torch.tensor(k, dtype=torch.int32), np.array])
def test_keys_may_be_lists_tuples_arrays_or_integer_tensors(as_key):
    cache, _ = make_cache()
    slots = put(cache, as_key([3, 1, 4, 1, 5]))
    assert cache.match_prefix(as_key([3, 1, 4, 1, 5, 9])).indices.tolist() == slots.tolist()


def test_large_token_ids_are_matched_exactly():
    cache, _ = make_cache()
    big = [2**40 + 1, 2**40 + 2]
    put(cache, big)
    assert len(cache.match_prefix([2**40 + 1, 2**40 + 3]).indices) == 1


def test_match_returns_indices_on_the_allocator_device_as_int64():
    cache, _ = make_cache()
    put(cache, [1, 2])
    put(cache, [1, 2, 3])
    m = cache.match_prefix([1, 2, 3])
    assert m.indices.dtype == torch.int64 and m.indices.device == cache.device


# ---- locks --------------------------------------------------------------------------------------
def test_locking_moves_the_path_from_evictable_to_protected():
    cache, _ = make_cache()
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 8])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(m.last_node)
    assert cache.protected_size() == 4 and cache.evictable_size() == 1
    cache.dec_lock_ref(m.last_node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 5
    assert sizes_add_up(cache)


def test_a_shared_prefix_stays_protected_until_its_last_lock_is_released():
    cache, _ = make_cache()
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 4])
    a, b = cache.match_prefix([1, 2, 3]).last_node, cache.match_prefix([1, 2, 4]).last_node
    cache.inc_lock_ref(a)
    cache.inc_lock_ref(b)
    cache.dec_lock_ref(a)
    assert cache.protected_size() == 3  # [1, 2] and [4]
    assert cache.evict(100) == 1  # only [3] can go
    cache.dec_lock_ref(b)
    assert cache.protected_size() == 0 and cache.evict(100) == 3


def test_locking_the_root_is_a_no_op():
    cache, _ = make_cache()
    put(cache, [1, 2])
    root = cache.match_prefix([7]).last_node
    cache.inc_lock_ref(root)
    cache.dec_lock_ref(root)
    assert cache.protected_size() == 0 and cache.evictable_size() == 2


def test_a_locked_leaf_becomes_evictable_again_when_unlocked():
    cache, _ = make_cache()
    put(cache, [1, 2])
    node = cache.match_prefix([1, 2]).last_node
    cache.inc_lock_ref(node)
    assert cache.evict(10) == 0
    cache.dec_lock_ref(node)
    assert cache.evict(10) == 2


# ---- eviction -------------------------------------------------------------------------------------
def test_evict_skips_locked_nodes():
    cache, _ = make_cache()
    put(cache, [1, 2, 3])
    put(cache, [4, 5, 6])
    cache.inc_lock_ref(cache.match_prefix([1, 2, 3]).last_node)
    assert cache.evict(100) == 3
    assert cached_sequences(cache) == {(1, 2, 3)}
    assert sizes_add_up(cache)


def test_evict_gives_slots_back_to_the_allocator():
    cache, alloc = make_cache(size=16)
    slots = put(cache, [1, 2, 3, 4])
    assert alloc.available_size() == 12
    assert cache.evict(4) == 4
    assert alloc.available_size() == 16 and not alloc.is_allocated(slots).any()


def test_evict_frees_whole_nodes_until_at_least_num_tokens():
    cache, _ = make_cache()
    put(cache, [1, 2, 3])
    put(cache, [4, 5, 6])
    assert cache.evict(1) == 3
    assert cache.total_size() == 3


def test_evict_reaches_a_parent_once_its_last_child_is_gone():
    cache, _ = make_cache()
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 4])
    assert cache.evict(2) == 2  # both leaves; [1, 2] becomes a leaf only after the second
    assert cached_sequences(cache) == {(1, 2)}
    assert cache.evict(1) == 2
    assert cache.total_size() == 0 and sizes_add_up(cache)


def test_evict_of_more_than_cached_frees_everything_evictable():
    cache, alloc = make_cache()
    put(cache, [1, 2, 3])
    put(cache, [1, 5])
    assert cache.evict(1000) == 4
    assert cache.total_size() == 0 and alloc.available_size() == alloc.size


def test_evict_of_zero_frees_nothing():
    cache, _ = make_cache()
    put(cache, [1])
    assert cache.evict(0) == 0 and cache.total_size() == 1


def test_lru_evicts_the_least_recently_matched_leaf_first():
    cache, _ = make_cache(policy="lru")
    put(cache, [1, 1])
    put(cache, [2, 2])
    put(cache, [3, 3])
    cache.match_prefix([1, 1])
    cache.evict(1)
    assert cached_sequences(cache) == {(1, 1), (3, 3)}


def test_lfu_evicts_the_least_hit_leaf_first():
    cache, _ = make_cache(policy="lfu")
    put(cache, [1, 1])
    put(cache, [2, 2])
    for _ in range(3):
        cache.match_prefix([1, 1])
    cache.match_prefix([2, 2])  # more recent, but fewer hits
    cache.evict(1)
    assert cached_sequences(cache) == {(1, 1)}


def test_fifo_evicts_the_oldest_insert_first_however_recently_used():
    cache, _ = make_cache(policy="fifo")
    put(cache, [1, 1])
    put(cache, [2, 2])
    cache.match_prefix([1, 1])
    cache.evict(1)
    assert cached_sequences(cache) == {(2, 2)}


def test_priority_evicts_the_lowest_priority_first():
    cache, _ = make_cache(policy="priority")
    put(cache, [1, 1], priority=5)
    put(cache, [2, 2], priority=1)
    put(cache, [3, 3], priority=3)
    cache.match_prefix([2, 2])  # recency does not beat priority
    cache.evict(1)
    assert cached_sequences(cache) == {(1, 1), (3, 3)}


def test_a_shared_prefix_keeps_the_highest_priority_inserted_through_it():
    cache, _ = make_cache(policy="priority")
    put(cache, [1, 2, 3], priority=0)
    put(cache, [1, 2, 4], priority=9)
    cache.evict(2)  # [3], then [4]: [1, 2] is a leaf now, with the 9 that [1, 2, 4] brought
    put(cache, [6], priority=5)
    cache.evict(1)
    assert cached_sequences(cache) == {(1, 2)}


def test_a_custom_policy_key_orders_eviction():
    def longest_first(node):
        return -node.num_tokens

    cache, _ = make_cache(policy=longest_first)
    put(cache, [1])
    put(cache, [2, 2, 2])
    cache.evict(1)
    assert cached_sequences(cache) == {(1,)}


def test_an_unknown_eviction_policy_is_rejected():
    with pytest.raises(ValueError, match="eviction_policy"):
        make_cache(policy="random")


# ---- pages ----------------------------------------------------------------------------------------
def test_paged_match_is_truncated_down_to_whole_pages():
    cache, _ = make_cache(size=64, page_size=4)
    slots = put(cache, list(range(10, 18)))
    m = cache.match_prefix(list(range(10, 17)))  # 7 tokens: one whole page
    assert m.indices.tolist() == slots[:4].tolist()
    assert cache.match_prefix([10, 11, 12]).last_node is cache.root_node  # shorter than a page


def test_paged_keys_diverging_mid_page_share_only_whole_pages():
    cache, _ = make_cache(size=64, page_size=4)
    a = put(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    b = put(cache, [1, 2, 3, 4, 5, 6, 0, 0])
    shared = next(iter(cache.root_node.children.values()))
    assert shared.token_ids() == [1, 2, 3, 4]
    assert sorted(c.token_ids() for c in shared.children.values()) == [[5, 6, 0, 0], [5, 6, 7, 8]]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7]).indices.tolist() == a[:4].tolist()
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 0, 0]).indices.tolist() == a[:4].tolist() + b[4:].tolist()
    assert sizes_add_up(cache)


def test_paged_insert_rejects_a_key_that_is_not_whole_pages():
    cache, alloc = make_cache(size=64, page_size=4)
    slots = alloc.alloc(8)
    with pytest.raises(ValueError, match="multiple of page_size"):
        cache.insert([1, 2, 3, 4, 5, 6], slots[:6])
    assert cache.total_size() == 0


def test_paged_insert_rejects_slots_that_are_not_whole_pages():
    cache, alloc = make_cache(size=64, page_size=4)
    slots = alloc.alloc(8)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="whole pages"):
        cache.insert([1, 2, 3, 4], slots[2:6])
    assert snapshot(cache) == before


def test_paged_evict_gives_whole_pages_back():
    cache, alloc = make_cache(size=32, page_size=4)
    put(cache, list(range(8)))
    put(cache, list(range(4)) + [9, 9, 9, 9])
    assert alloc.available_size() == 32 - 12
    assert cache.evict(1) == 4
    assert cache.evict(100) == 8 and alloc.available_size() == 32


# ---- requests -------------------------------------------------------------------------------------
def admit(cache, req, num_own):
    """What a scheduler does before a prefill: match, lock, take a row, write prefix + own slots."""
    m = cache.match_prefix(req.input_ids)
    cache.inc_lock_ref(m.last_node)
    req.prefix_indices, req.last_node, req.cache_protected_len = m.indices, m.last_node, len(m.indices)
    req.req_pool_idx = cache.req_to_token_pool.alloc(1)[0]
    own = cache.token_allocator.alloc(num_own)
    row = cache.req_to_token_pool.req_to_token[req.req_pool_idx]
    row[:len(m.indices)] = m.indices.to(torch.int32)
    row[len(m.indices):len(m.indices) + num_own] = own.to(torch.int32)
    return own


def test_cache_finished_req_caches_its_tokens_and_releases_its_memory():
    cache, alloc = make_cache(size=32)
    prefix = put(cache, [1, 2, 3])
    req = Req("a", [1, 2, 3, 4, 5], max_new_tokens=2)
    own = admit(cache, req, 3)  # tokens 4, 5 and the first output
    req.output_ids = [6, 7]
    req.kv_len = 6  # the last output has no KV yet
    row = req.req_pool_idx
    cache.cache_finished_req(req)
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert m.indices.tolist() == prefix.tolist() + own.tolist()
    assert req.req_pool_idx is None and cache.protected_size() == 0
    assert cache.req_to_token_pool.alloc(4) is not None and row is not None  # every row is free again
    assert alloc.available_size() == 32 - 6 and sizes_add_up(cache)


def test_cache_finished_req_frees_its_slots_that_duplicate_the_tree():
    cache, alloc = make_cache(size=32)
    put(cache, [1, 2])
    req = Req("a", [1, 2, 3, 4], max_new_tokens=1)
    admit(cache, req, 2)
    other = put(cache, [1, 2, 3, 4])  # another request cached the same tokens meanwhile
    req.output_ids, req.kv_len = [5], 4
    cache.cache_finished_req(req)
    assert cache.match_prefix([1, 2, 3, 4]).indices[2:].tolist() == other[2:].tolist()
    assert alloc.available_size() == 32 - 4 and sizes_add_up(cache)


def test_cache_finished_req_with_pages_frees_the_partial_tail_page():
    cache, alloc = make_cache(size=32, page_size=4)
    req = Req("a", list(range(10, 16)), max_new_tokens=1)
    admit(cache, req, 8)  # 6 prompt tokens + output in two pages
    req.output_ids, req.kv_len = [99], 6
    cache.cache_finished_req(req)
    assert cache.total_size() == 4 and alloc.available_size() == 28
    assert len(cache.match_prefix(list(range(10, 16))).indices) == 4 and sizes_add_up(cache)


def test_cache_unfinished_req_points_its_row_at_the_tree_and_moves_its_lock():
    cache, alloc = make_cache(size=32)
    put(cache, [1, 2])
    req = Req("a", [1, 2, 3, 4, 5, 6, 7, 8], max_new_tokens=1)
    old_node = cache.match_prefix([1, 2]).last_node
    admit(cache, req, 3)  # first chunk: tokens 3, 4, 5
    other = put(cache, [1, 2, 3, 4])  # tokens 3, 4 got cached by someone else meanwhile
    req.kv_len = 5
    cache.cache_unfinished_req(req)
    row = cache.req_to_token_pool.req_to_token[req.req_pool_idx, :5].tolist()
    tree = cache.match_prefix([1, 2, 3, 4, 5]).indices.tolist()
    assert row == tree and tree[2:4] == other[2:4].tolist()
    assert req.cache_protected_len == 5 and req.prefix_indices.tolist() == tree
    assert path_tokens(cache, req.last_node) == [1, 2, 3, 4, 5]
    assert req.last_node.lock_ref == 1 and old_node.lock_ref == 1  # through the new node only
    assert cache.protected_size() == 5
    assert alloc.available_size() + cache.total_size() == 32  # the duplicates went back
    cache.check_invariants()


def test_cache_unfinished_req_keeps_the_partial_page_with_the_request():
    cache, alloc = make_cache(size=32, page_size=4)
    req = Req("a", list(range(10, 20)), max_new_tokens=1)
    own = admit(cache, req, 8)
    req.kv_len = 6
    cache.cache_unfinished_req(req)
    assert req.cache_protected_len == 4 and cache.protected_size() == 4
    row = cache.req_to_token_pool.req_to_token[req.req_pool_idx, :6].tolist()
    assert row[4:6] == own[4:6].tolist() and alloc.is_allocated(own[4:]).all()
    cache.check_invariants()


def test_cache_finished_req_after_an_unfinished_one_releases_everything():
    cache, alloc = make_cache(size=32)
    req = Req("a", [1, 2, 3, 4, 5, 6], max_new_tokens=1)
    admit(cache, req, 6)
    req.kv_len = 3
    cache.cache_unfinished_req(req)
    req.output_ids, req.kv_len = [7], 6
    cache.cache_finished_req(req)
    assert cache.protected_size() == 0 and cache.total_size() == 6
    assert alloc.available_size() == 26 and sizes_add_up(cache)


def test_cache_finished_req_without_a_row_is_rejected():
    cache, _ = make_cache()
    req = Req("a", [1, 2], max_new_tokens=1)
    with pytest.raises(ValueError, match="no req_to_token row"):
        cache.cache_finished_req(req)


# ---- whole tree -----------------------------------------------------------------------------------
def test_reset_frees_every_cached_slot():
    cache, alloc = make_cache(size=16)
    put(cache, [1, 2, 3])
    put(cache, [1, 4])
    cache.reset()
    assert cache.total_size() == 0 and alloc.available_size() == 16
    assert cache.match_prefix([1, 2, 3]).last_node is cache.root_node
    put(cache, [1, 2])
    assert sizes_add_up(cache)


def test_reset_refuses_while_a_request_holds_a_lock():
    cache, _ = make_cache()
    put(cache, [1, 2])
    cache.inc_lock_ref(cache.match_prefix([1, 2]).last_node)
    before = snapshot(cache)
    with pytest.raises(RuntimeError, match="lock"):
        cache.reset()
    assert snapshot(cache) == before


def test_nodes_from_before_a_reset_cannot_be_locked():
    cache, _ = make_cache()
    put(cache, [1, 2])
    node = cache.match_prefix([1, 2]).last_node
    cache.reset()
    with pytest.raises(ValueError, match="no longer in the tree"):
        cache.inc_lock_ref(node)
    assert cache.protected_size() == 0


def test_check_invariants_detects_a_wrong_size_counter():
    cache, _ = make_cache()
    put(cache, [1, 2])
    cache._evictable_size += 1
    with pytest.raises(AssertionError, match="counters"):
        cache.check_invariants()


def test_check_invariants_detects_a_slot_freed_behind_the_trees_back():
    cache, alloc = make_cache()
    slots = put(cache, [1, 2])
    alloc.free(slots[:1])
    with pytest.raises(AssertionError, match="considers free"):
        cache.check_invariants()


def test_repr_summarises_the_sizes():
    cache, _ = make_cache()
    put(cache, [1, 2])
    assert "total=2" in repr(cache) and "evictable=2" in repr(cache)


# ---- bad input: a clear error and no state change -------------------------------------------------------
def bad_calls():
    """(name, call(cache, alloc), exception, message) for each kind of bad argument."""
    return [
        ("empty key", lambda c, a: c.insert([], torch.empty(0, dtype=torch.int64)), ValueError, "empty"),
        ("length mismatch", lambda c, a: c.insert([7, 8, 9], a.alloc(2)), ValueError, r"shape \[len\(key\)\]"),
        ("slot 0", lambda c, a: c.insert([7, 8], torch.tensor([0, int(a.alloc(1))])), ValueError, "padding"),
        ("free slots", lambda c, a: c.insert([7, 8], torch.tensor([60, 61])), ValueError, "not handed out"),
        ("out of range slot", lambda c, a: c.insert([7], torch.tensor([10**6])), ValueError, "not handed out"),
        ("slots the tree holds", lambda c, a: c.insert([9, 9], c.match_prefix([1, 2]).indices),
         ValueError, "already caches"),
        ("float value", lambda c, a: c.insert([7], torch.tensor([3.0])), TypeError, "integer"),
        ("list value", lambda c, a: c.insert([7], [3]), TypeError, "torch.Tensor"),
        ("2-D value", lambda c, a: c.insert([7, 8], a.alloc(2).reshape(1, 2)), ValueError, "1-D"),
        ("string key", lambda c, a: c.insert("ab", a.alloc(2)), TypeError, "sequence of int"),
        ("float tokens", lambda c, a: c.match_prefix([1.5, 2.0]), TypeError, "sequence of int"),
        ("token beyond int64", lambda c, a: c.match_prefix([2**70]), ValueError, "int64"),
        ("unlocking an unlocked node", lambda c, a: c.dec_lock_ref(c.match_prefix([1, 2]).last_node),
         ValueError, "not locked"),
        ("negative evict", lambda c, a: c.evict(-1), ValueError, "non-negative"),
        ("float evict", lambda c, a: c.evict(2.0), ValueError, "non-negative"),
        ("bool priority", lambda c, a: c.insert([7], a.alloc(1), priority=True), TypeError, "priority"),
    ]


@pytest.mark.parametrize("name,call,exc,msg", bad_calls(), ids=[b[0] for b in bad_calls()])
def test_bad_input_raises_a_clear_error_and_changes_nothing(name, call, exc, msg):
    cache, alloc = make_cache()
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 4])
    before_tree = (cache.evictable_size(), cache.protected_size(), cached_sequences(cache), len(cache._policy))
    with pytest.raises(exc, match=msg):
        call(cache, alloc)
    assert (cache.evictable_size(), cache.protected_size(), cached_sequences(cache),
            len(cache._policy)) == before_tree
    cache.check_invariants()


def test_a_rejected_insert_that_ends_mid_edge_does_not_split_it():
    cache, alloc = make_cache()
    put(cache, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="padding"):
        cache.insert([1, 2, 9], torch.tensor([5, 6, 0]))
    assert [c.token_ids() for c in cache.root_node.children.values()] == [[1, 2, 3, 4]]


def test_locking_an_evicted_node_raises():
    cache, _ = make_cache()
    put(cache, [1, 2])
    node = cache.match_prefix([1, 2]).last_node
    cache.evict(2)
    with pytest.raises(ValueError, match="no longer in the tree"):
        cache.inc_lock_ref(node)
    with pytest.raises(ValueError, match="no longer in the tree"):
        cache.dec_lock_ref(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 0


def test_page_size_must_match_the_allocator():
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(ReqToTokenPool(1, 8), PagedTokenAllocator(16, 4), page_size=2)


def test_prefix_len_equals_the_match_length_and_changes_nothing():
    cache, _ = make_cache(page_size=2)
    put(cache, [1, 2, 3, 4, 5, 6])
    leaf = next(iter(cache.root_node.children.values()))
    before = snapshot(cache), leaf.last_access, leaf.hit_count
    assert cache.prefix_len([1, 2, 3, 4, 9]) == 4
    assert cache.prefix_len([1, 2, 3]) == 2
    assert cache.prefix_len([7, 8]) == 0
    assert (snapshot(cache), leaf.last_access, leaf.hit_count) == before
    assert leaf.parent is cache.root_node  # not split
    assert len(cache.match_prefix([1, 2, 3, 4, 9]).indices) == 4


def test_a_memoryview_of_an_int64_array_is_a_key():
    cache, _ = make_cache()
    put(cache, [1, 2, 3, 4])
    key = memoryview(array("q", [1, 2, 3, 9]))[:-1]
    assert cache.prefix_len(key) == 3
    assert len(cache.match_prefix(key).indices) == 3


# ---- a waiting request's ranking walk, kept between steps ---------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_kept_walk_said_current_is_the_walk_a_fresh_descent_takes(data):
    from kvmem.radix_tree import key_bytes

    page_size = data.draw(st.sampled_from([1, 2]))
    cache, _ = make_cache(size=96, page_size=page_size)
    keys = [data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=12)) for _ in range(4)]
    views = [key_bytes("key", k) for k in keys]
    kept = []
    for _ in range(data.draw(st.integers(1, 12))):
        kept = [(v, cache.prefix_walk(v, None)) for v in views]
        kept = [(v, w, cache.next_page(v, w)) for v, w in kept]
        for _ in range(data.draw(st.integers(1, 3))):
            op = data.draw(st.sampled_from(["insert", "evict", "match"]))
            tokens = data.draw(st.lists(st.integers(1, 3), min_size=page_size, max_size=12))
            tokens = tokens[:len(tokens) // page_size * page_size]
            if op == "insert" and cache.token_allocator.available_size() >= len(tokens):
                put(cache, tokens)
            elif op == "evict":
                cache.evict(data.draw(st.integers(0, 12)))
            else:
                cache.match_prefix(tokens)  # may split an edge
        for view, walk, page in kept:
            if cache.walk_is_current(walk, page, None):
                fresh = cache.prefix_walk(view, None)
                assert (fresh.node, fresh.num_tokens) == (walk.node, walk.num_tokens)
        cache.check_invariants()


def test_a_kept_walk_goes_stale_when_its_end_is_evicted_or_the_tree_grows_past_it():
    from kvmem.radix_tree import key_bytes

    cache, _ = make_cache()
    put(cache, [1, 2, 3, 4])
    view = key_bytes("key", [1, 2, 3, 4, 5, 6])
    walk = cache.prefix_walk(view, None)
    page = cache.next_page(view, walk)
    assert walk.num_tokens == 4 and cache.walk_is_current(walk, page, None)
    put(cache, [1, 2, 3, 4, 5])  # a child with the key's next token
    assert not cache.walk_is_current(walk, page, None)
    walk = cache.prefix_walk(view, None)
    page = cache.next_page(view, walk)
    cache.evict(64)
    assert not cache.walk_is_current(walk, page, None) and cache.prefix_walk(view, None).num_tokens == 0


# ---- a request's tokens inserted from its locked prefix ------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 4])
def test_inserting_below_a_requests_prefix_node_builds_the_tree_an_insert_from_the_root_builds(page_size):
    trees = []
    for below in (False, True):
        cache, alloc = make_cache(size=256, page_size=page_size)
        put(cache, list(range(1, 17)))
        put(cache, list(range(1, 9)) + [50] * 8)
        m = cache.match_prefix(list(range(1, 13)))
        node, matched = m.last_node, len(m.indices)
        tokens = list(range(1, 13)) + [70] * 8 + list(range(13, 17))
        slots = alloc.alloc(len(tokens))
        if below:
            new, last = cache._insert(memoryview(array("q", tokens[matched:])).cast("B"), slots[matched:].numpy(), 0,
                                      None, node)
            new += matched
        else:
            new, last = cache._insert(memoryview(array("q", tokens)).cast("B"), slots.numpy(), 0, None,
                                      cache.root_node)
        alloc.free(slots[:new])  # what was cached already stays the caller's
        trees.append((new, path_tokens(cache, last), cached_sequences(cache), cache.evictable_size()))
        cache.check_invariants()
    assert trees[0] == trees[1]


# ---- what mutation testing found unpinned (scripts/mutation.py radix_cache) --------------------------------
def message_of(call) -> str:
    with pytest.raises((ValueError, TypeError, RuntimeError)) as raised:
        call()
    return str(raised.value)


def test_every_refusal_says_what_was_wrong_in_full():
    cache, alloc = make_cache(page_size=2)
    put(cache, [1, 2, 3, 4])
    slots = alloc.alloc(4)
    row = ReqToTokenPool(1, 8)
    assert message_of(lambda: cache.insert([], torch.empty(0, dtype=torch.int64))) == \
        "key is empty: there is nothing to insert"
    assert message_of(lambda: cache.insert([5, 6, 7], slots[:3])) == \
        "key has 3 tokens, not a multiple of page_size 2: insert whole pages (the partial tail belongs to the request)"
    assert message_of(lambda: cache.insert([5, 6], slots)) == "value must have shape [len(key)] = [2], got (4,)"
    assert message_of(lambda: cache.insert([5, 6], [1, 2])) == "value must be a torch.Tensor of slots, got list"
    assert message_of(lambda: cache.insert([5, 6], torch.tensor([1.0, 2.0]))) == \
        "value must hold integers, got dtype torch.float32"
    assert message_of(lambda: cache.insert([5, 6], torch.tensor([0, 1]))) == "value holds slot 0, the padding slot"
    assert message_of(lambda: cache.insert([5, 6], torch.tensor([40, 41]))) == \
        "value holds slot 40, which token_allocator has not handed out"
    assert message_of(lambda: cache.insert([5, 6, 7, 8, 9, 10], torch.cat((slots[2:], slots[:2], slots[2:])))) == \
        f"value holds slot {int(slots[2])} more than once"
    six = alloc.alloc(8)[1:7]  # three pages' worth, each starting mid-page
    assert message_of(lambda: cache.insert([5, 6, 7, 8, 9, 10], six)) == \
        "value must hold whole pages (page_size 2, each page's slots in order from its first), got " \
        f"{six[:4].tolist()}..."
    held = cache.match_prefix([1, 2, 3, 4]).indices
    assert message_of(lambda: cache.insert([5, 6], held[:2])) == \
        f"value holds slot {int(held[0])}, which the tree already caches for another prefix"
    assert message_of(lambda: cache.insert([5, 6], slots[:2], priority=1.5)) == "priority must be an int, got 1.5"
    assert message_of(lambda: cache.insert("ab", slots[:2])) == "key must be a sequence of int token ids, got str"
    assert message_of(lambda: cache.match_prefix(b"ab")) == "key must be a sequence of int token ids, got bytes"
    assert message_of(lambda: cache.prefix_len([1.5, 2.5])).startswith(
        "key must be a sequence of int token ids, got list (")
    assert message_of(lambda: cache.match_prefix([2**63, 1])) == "key holds a token id outside int64"
    assert message_of(lambda: cache.match_prefix(torch.tensor([1.0, 2.0]))) == \
        "key must hold integers, got dtype torch.float32"
    assert message_of(lambda: cache.match_prefix([1, 2], namespace=3)) == "namespace must be a str or None, got int"
    assert message_of(lambda: cache.evict(-1)) == "num_tokens must be a non-negative int, got -1"
    assert message_of(lambda: cache.inc_lock_ref("root")) == "node must be a TreeNode, got str"
    other, _ = make_cache()
    put(other, [1, 2])
    foreign = other.match_prefix([1, 2]).last_node
    assert message_of(lambda: cache.inc_lock_ref(foreign)) == \
        f"node {foreign.id} is not in this tree: it belongs to another tree"
    assert message_of(lambda: RadixCache(None, alloc)) == "req_to_token_pool must be a ReqToTokenPool, got NoneType"
    assert message_of(lambda: RadixCache([], alloc)) == "req_to_token_pool must be a ReqToTokenPool, got list"
    assert message_of(lambda: RadixCache(row, None)) == \
        "token_allocator must be a TokenAllocator or PagedTokenAllocator, got NoneType"
    assert message_of(lambda: RadixCache(row, [])) == \
        "token_allocator must be a TokenAllocator or PagedTokenAllocator, got list"
    assert message_of(lambda: RadixCache(row, TokenAllocator(8), pin_budget=-0.5)) == \
        "pin_budget must be a finite number >= 0, got -0.5"
    assert RadixCache(row, TokenAllocator(8), pin_budget=1.0)._pin_budget == 8  # the whole capacity may be pinned
    assert message_of(lambda: RadixCache(row, TokenAllocator(8), event_sink=3)) == \
        "event_sink must be callable (or None), got int"
    assert message_of(lambda: RadixCache(row, TokenAllocator(8), page_size=0)) == \
        "page_size must be a positive int, got 0"
    cache.inc_lock_ref(cache.match_prefix([1, 2]).last_node)
    assert message_of(cache.reset) == \
        "reset() while requests lock 2 cached tokens; release them (dec_lock_ref) first"


def test_a_request_s_row_is_checked_before_it_is_cached():
    cache, alloc = make_cache(size=32)
    req = Req("r1", [1, 2, 3], max_new_tokens=1)
    assert message_of(lambda: cache.cache_finished_req(req)) == \
        "request 'r1' has no req_to_token row (req_pool_idx is None)"
    admit(cache, req, 3)
    req.kv_len, req.cache_protected_len = 2, 3
    assert message_of(lambda: cache.cache_finished_req(req)) == \
        "request 'r1': need 0 <= cache_protected_len (3) <= kv_len (2) <= its 3 tokens"
    req.kv_len, req.cache_protected_len = 3, 0
    cache.req_to_token_pool.req_to_token[req.req_pool_idx, 2] = 30  # a slot nobody allocated
    assert message_of(lambda: cache.cache_finished_req(req)) == \
        "request 'r1': its row holds slot 30, which token_allocator has not handed out"


def test_a_finished_request_holding_only_its_cached_prefix_and_a_partial_page_releases_everything():
    cache, alloc = make_cache(size=32, page_size=4)
    put(cache, [1, 2, 3, 4])
    req = Req("a", [1, 2, 3, 4, 5, 6], max_new_tokens=1)
    admit(cache, req, 4)  # the prefix page is the tree's; tokens 5, 6 sit in the request's own page
    req.output_ids, req.kv_len = [7], 6
    cache.cache_finished_req(req)
    assert req.req_pool_idx is None and cache.protected_size() == 0 and cache.total_size() == 4
    assert alloc.available_size() == 28 and sizes_add_up(cache)


def test_a_finished_request_shorter_than_a_page_caches_nothing_and_frees_its_page():
    cache, alloc = make_cache(size=32, page_size=4)
    req = Req("a", [1, 2], max_new_tokens=1)
    admit(cache, req, 4)
    req.output_ids, req.kv_len = [3], 2
    cache.cache_finished_req(req)
    assert cache.total_size() == 0 and alloc.available_size() == 32 and req.req_pool_idx is None


def test_a_request_whose_tokens_are_all_its_prefix_is_released_without_a_change_to_the_tree():
    cache, alloc = make_cache(size=32)
    put(cache, [1, 2, 3])
    req = Req("a", [1, 2, 3, 4], max_new_tokens=1)
    m = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(m.last_node)
    req.prefix_indices, req.last_node, req.cache_protected_len = m.indices, m.last_node, 3
    req.req_pool_idx = cache.req_to_token_pool.alloc(1)[0]
    cache.req_to_token_pool.req_to_token[req.req_pool_idx, :3] = m.indices.to(torch.int32)
    req.kv_len = 3  # protected == kv_len: nothing of its own yet
    cache.cache_finished_req(req)
    assert cache.protected_size() == 0 and alloc.available_size() == 29 and sizes_add_up(cache)


def test_insert_in_a_namespace_is_matched_only_there():
    cache, alloc = make_cache()
    assert cache.insert([1, 2], alloc.alloc(2), namespace="tenant") == 0
    assert len(cache.match_prefix([1, 2], namespace="tenant").indices) == 2
    assert len(cache.match_prefix([1, 2]).indices) == 0


def test_insert_without_a_priority_inserts_at_priority_0_and_is_no_hit():
    cache, alloc = make_cache(policy="priority")
    cache.insert([1, 2], alloc.alloc(2))
    cache.insert([3, 4], alloc.alloc(2), priority=0)
    first = cache.root_node.children[array("q", [1]).tobytes()]
    assert (first.priority, first.hit_count) == (0, 0)  # an insert is no hit
    assert cache.evict(1) == 2 and cache.prefix_len([1, 2]) == 0  # equal priorities: least recently used first


def test_a_new_node_records_its_tick_its_first_hit_count_and_an_increasing_id():
    cache, _ = make_cache()
    put(cache, [1, 2])
    put(cache, [3, 4])
    a, b = (cache.match_prefix(k).last_node for k in ([1, 2], [3, 4]))
    assert (a.created, b.created) == (1, 2) and b.id > a.id
    assert (a.hit_count, b.hit_count) == (1, 1) and (a.priority, b.priority) == (0, 0)
    for _ in range(3):
        cache.match_prefix([1, 2])
    assert a.hit_count == 4


def test_fifo_keeps_the_age_of_a_split_node_for_its_head():
    cache, _ = make_cache(policy="fifo")
    put(cache, [1, 2, 3, 4])
    put(cache, [5, 6])
    cache.match_prefix([1, 2])  # splits [1, 2 | 3, 4]: the head is as old as the edge
    assert cache.evict(1) == 2 and cache.prefix_len([1, 2, 3, 4]) == 2  # [3, 4], the oldest leaf
    assert cache.evict(1) == 2 and cache.prefix_len([1, 2]) == 0 and cache.prefix_len([5, 6]) == 2


def test_a_policy_that_ties_every_node_evicts_in_creation_order_even_across_splits():
    cache, _ = make_cache(policy=lambda node: 0)
    put(cache, [1, 2, 3, 4])
    put(cache, [5, 6])
    cache.match_prefix([1, 2])  # the split head is a newer node than [5, 6]
    assert [cache.evict(1) for _ in range(3)] == [2, 2, 2]
    assert cache.prefix_len([5, 6]) == 0 and cache.total_size() == 0


def test_negative_and_large_token_ids_are_kept_exactly():
    cache, _ = make_cache(size=32)
    tokens = [-5, 2**62, -(2**63), 7]
    put(cache, tokens)
    node = cache.match_prefix(tokens).last_node
    assert node.token_ids() == tokens and cache.prefix_len(tokens) == 4
    req = Req("a", [-1, -2, -3], max_new_tokens=2)
    admit(cache, req, 4)
    req.output_ids, req.kv_len = [-4, -5], 4
    cache.cache_finished_req(req)
    assert cache.prefix_len([-1, -2, -3, -4]) == 4


def test_a_memoryview_key_of_another_item_type_or_shape_is_converted_or_refused():
    cache, _ = make_cache()
    put(cache, [1, 2, 3])
    assert cache.prefix_len(memoryview(array("i", [1, 2, 3]))) == 3
    square = memoryview(array("q", [1, 2, 3, 4])).cast("B").cast("q", shape=[2, 2])
    with pytest.raises((TypeError, ValueError, NotImplementedError)):
        cache.prefix_len(square)


def test_a_single_tier_cache_has_nothing_to_prefetch_or_write():
    cache, _ = make_cache()
    assert cache.prefetch([1, 2]) is None and cache.finish_prefetch(None) == 0 and cache.writing_check() == 0


def test_node_and_cache_reprs_name_their_parts():
    cache, _ = make_cache()
    put(cache, list(range(10, 20)))
    node = cache.match_prefix(list(range(10, 20))).last_node
    assert repr(node) == f"TreeNode(id={node.id}, tokens=[10, 11, 12, 13, 14, 15, 16, 17, '...'], num_tokens=10, " \
                         "lock_ref=0)"
    assert repr(cache) == "RadixCache(page_size=1, eviction_policy='lru', total=10, evictable=10, protected=0, " \
                          "evictable_leaves=1)"


@pytest.mark.parametrize("length, shown", [(8, "[1, 2, 3, 4, 5, 6, 7, 8]"), (9, "[1, 2, 3, 4, 5, 6, 7, 8, '...']")])
def test_a_node_repr_shows_up_to_eight_tokens(length, shown):
    cache, _ = make_cache()
    put(cache, list(range(1, length + 1)))
    node = cache.match_prefix(list(range(1, length + 1))).last_node
    assert repr(node) == f"TreeNode(id={node.id}, tokens={shown}, num_tokens={length}, lock_ref=0)"


def test_a_cache_repr_counts_pinned_leaves_among_the_evictable_ones():
    cache, _ = make_cache()
    for first in (10, 20):
        put(cache, list(range(first, first + 4)))
    cache.pin(list(range(10, 14)))
    assert repr(cache).endswith("evictable=8, protected=0, evictable_leaves=2)")


def corrupt(case):
    """A tree with one invariant broken by hand, and the message check_invariants must give."""
    cache, alloc = make_cache(size=16, page_size=2)
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 5, 6])
    head = cache.match_prefix([1, 2]).last_node
    leaf = cache.match_prefix([1, 2, 3, 4]).last_node
    root = cache.root_node
    if case == "root":
        root.lock_ref = 1
        return cache, "a root must have an empty key, no parent, no lock and no evictable entry"
    if case == "root key":
        root.key = b"x" * 16
        return cache, "a root must have an empty key, no parent, no lock and no evictable entry"
    if case == "root child":
        head.parent = leaf
        return cache, f"node {head.id}: parent is not node {root.id}, which lists it as a child"
    if case == "parent":
        leaf.parent = root
        return cache, f"node {leaf.id}: parent is not node {head.id}, which lists it as a child"
    if case == "child key":
        head.children[b"z" * 16] = head.children.pop(leaf.key[:16])
        return cache, f"node {leaf.id} is filed under a child key that is not its first page"
    if case == "whole pages":
        del head.children[leaf.key[:16]]
        leaf.key, leaf.value = leaf.key[:8], leaf.value[:1]
        head.children[leaf.key] = leaf
        return cache, f"node {leaf.id}: 8 key bytes (must be 1 > 0 tokens in whole pages of 2)"
    if case == "lock":
        leaf.lock_ref = -1
        return cache, f"node {leaf.id}: lock_ref -1 (parent 0) must be >= 0 and at most its parent's"
    if case == "slots":
        leaf.value = leaf.value[:1]
        return cache, f"node {leaf.id}: 2 tokens and 1 slots (must be equal)"
    if case == "entry":
        cache._remove_evictable(leaf)
        return cache, f"node {leaf.id} (lock_ref 0, 0 children) is not in the evictable set"
    if case == "extra entry":
        cache._add_evictable(head)
        return cache, f"node {head.id} (lock_ref 0, 2 children) is in the evictable set"
    if case == "stale entry":
        leaf.last_access += 100
        return cache, f"node {leaf.id}: its evictable entry is stale or missing from its lru set"
    if case == "counters":
        cache._protected_size += 2
        return cache, "counters say evictable 6, protected 2; the nodes hold 6 and 0"
    if case == "set size":
        cache._pinned.add((0, -1, None))
        return cache, "the evictable sets hold 3 entries for 2 unlocked leaves"
    if case == "slot 0":
        leaf.value = np.array([0, 1])
        return cache, "the tree holds slot 0 (slot 0 is padding)"
    if case == "twice":
        leaf.value = head.value.copy()
        return cache, "the tree holds a slot more than once"
    if case == "freed":
        alloc.free(torch.from_numpy(leaf.value))
        return cache, "the tree holds a slot that token_allocator has not marked cached (or considers free)"
    if case == "marked":
        alloc.mark_cached(alloc.alloc(2).numpy())
        return cache, "token_allocator marks 8 slots cached; the tree holds 6"
    if case == "depth":
        leaf.depth += 2
        return cache, f"node {leaf.id}: depth 4, but its parent's path ends at 2 tokens"
    cache._pin_budget = 16
    assert cache.pin([1, 2, 3, 4]) == 4
    if case == "pin mark":  # an internal node: no evictable entry to go stale first
        assert cache.pin([1, 2]) == 2
        head.pin = 0
        return cache, f"pinned node {head.id} is not marked, out of the tree, or not 2 tokens deep"
    if case == "pin depth":
        cache._pins[None, array("q", [1, 2, 3, 4]).tobytes()] = (leaf, 3)
        return cache, f"pinned node {leaf.id} is not marked, out of the tree, or not 3 tokens deep"
    if case == "pin counters":
        cache._pinned_tokens += 1
        return cache, "pins: 4 tokens on 1 nodes against counters 5 on 1 (budget 16)"
    if case == "pin budget":
        cache._pin_budget = 3
        return cache, "pins: 4 tokens on 1 nodes against counters 4 on 1 (budget 3)"
    if case == "pinned entry":
        cache._pinned.remove(leaf.entry)
        cache._pinned.add((leaf.pin, leaf.id + 100, leaf))
        return cache, f"node {leaf.id}: its evictable entry is stale or missing from its lru set"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["root", "root key", "root child", "parent", "child key", "whole pages", "lock",
                                  "slots", "entry", "extra entry", "stale entry", "counters", "set size", "slot 0",
                                  "twice", "freed", "marked", "depth", "pin mark", "pin depth", "pin counters",
                                  "pin budget", "pinned entry"])
def test_check_invariants_names_the_invariant_that_broke(case):
    cache, message = corrupt(case)
    with pytest.raises(AssertionError) as raised:
        cache.check_invariants()
    assert str(raised.value) == f"RadixCache invariant broken: {message}"


def test_two_pins_on_one_node_keep_it_pinned_until_both_are_released():
    cache, _ = make_cache()
    put(cache, [1, 2, 3, 4])
    put(cache, [7, 8, 9, 10])
    assert cache.pin([1, 2, 3, 4]) == 4 and cache.pin([1, 2, 3, 4, 99]) == 4  # both end at the same node
    assert cache.pinned_size() == 8
    assert cache.unpin([1, 2, 3, 4]) == 4 and cache.pinned_size() == 4
    cache.check_invariants()
    assert cache.evict(1) == 4 and cache.match_prefix([1, 2, 3, 4]).indices.numel() == 4  # still pinned: kept
    assert cache.unpin([1, 2, 3, 4, 99]) == 4 and cache.pinned_size() == 0
    cache.check_invariants()
    assert cache.evict(1) == 4 and cache.match_prefix([1, 2, 3, 4]).indices.numel() == 0


def test_unpin_refuses_what_pin_refuses_naming_the_argument():
    cache, _ = make_cache()
    put(cache, [1, 2, 3, 4])
    assert message_of(lambda: cache.unpin("ab")) == "key must be a sequence of int token ids, got str"
    assert message_of(lambda: cache.unpin([1, 2], namespace=3)) == "namespace must be a str or None, got int"
    assert cache.pin([1, 2, 3, 4], namespace="t") == 0 and cache.unpin([1, 2, 3, 4], namespace="t") == 0


def test_a_request_of_the_engine_s_own_class_is_named_by_its_repr_when_it_has_no_rid():
    # The cache takes any object with the CachedRequest fields; without an `rid` its errors show the object.
    from types import SimpleNamespace

    cache, _ = make_cache(size=32)
    req = SimpleNamespace(req_pool_idx=None, input_ids=[1, 2], output_ids=[], kv_len=0, cache_protected_len=0)
    assert message_of(lambda: cache.cache_finished_req(req)) == \
        f"request {req!r} has no req_to_token row (req_pool_idx is None)"
    req.req_pool_idx = 0
    assert message_of(lambda: cache.cache_finished_req(req)) == \
        f"request {req!r}: req_pool_idx 0 is not an allocated row of req_to_token_pool"
    req.req_pool_idx, req.cache_protected_len = cache.req_to_token_pool.alloc(1)[0], 1
    assert message_of(lambda: cache.cache_finished_req(req)) == \
        f"request {req!r}: need 0 <= cache_protected_len (1) <= kv_len (0) <= its 2 tokens"


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("finished", [True, False])
def test_the_scheduler_s_trusted_caching_builds_what_the_checked_one_builds(page_size, finished):
    # The Scheduler caches its own requests with cache_req, which checks nothing: the insert starts below the
    # locked prefix and the frees skip the allocator's checks. Tree, slots in use and the request's fields must come
    # out as the checked cache_finished_req / cache_unfinished_req leave them.
    outcomes = []
    for checked in (True, False):
        cache, alloc = make_cache(size=128, page_size=page_size)
        put(cache, list(range(1, 9)))
        put(cache, list(range(1, 5)) + [50, 51, 52, 53, 54, 55, 56, 57])
        req = Req("a", list(range(1, 11)) + [60, 61, 62], max_new_tokens=4)
        own = admit(cache, req, 12)  # 8 cached; 5 prompt tokens, 4 outputs, a page's slack
        req.output_ids, req.kv_len = [70, 71, 72, 73], 17
        cache_request(cache, req, finished, checked)
        cache.check_invariants()
        if not finished:  # its prefix is now its whole pages: the tree's slots, as many as cache_protected_len
            aligned = 17 // page_size * page_size
            assert req.cache_protected_len == aligned
            assert req.prefix_indices.tolist() == \
                cache.match_prefix(list(req.fill_ids)[:aligned] + [0]).indices.tolist()
        outcomes.append((cached_sequences(cache), alloc.available_size(), cache.evictable_size(),
                         cache.protected_size(), req.cache_protected_len, len(req.prefix_indices),
                         alloc.is_allocated(own).tolist()))
    assert outcomes[0] == outcomes[1]


def namespace_nodes(cache, namespace):
    """Every node of `namespace`'s tree as (its path's tokens, its priority, its hit count)."""
    return {(path, node.priority, node.hit_count) for node, path in tree_nodes(cache, namespace)}


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("finished", [True, False])
def test_the_scheduler_s_trusted_caching_keeps_priority_and_namespace_and_frees_what_a_twin_cached(page_size,
                                                                                                   finished):
    # As above, in a namespace, at a priority, and with a twin request that cached the same tokens while this
    # one ran: its own slots for them are duplicates, freed (or, unfinished, swapped for the tree's).
    outcomes = []
    for checked in (True, False):
        events = []  # with an event sink, pages are named after their namespace too
        alloc = TokenAllocator(128) if page_size == 1 else PagedTokenAllocator(128, page_size)
        cache = RadixCache(ReqToTokenPool(4, 64), alloc, page_size=page_size, event_sink=events.append)
        prompt = list(range(1, 13))
        cache.insert(prompt[:4], alloc.alloc(4), namespace="t")
        req = Req("a", prompt, max_new_tokens=4, priority=7, namespace="t")
        m = cache.match_prefix(prompt, "t")
        cache.inc_lock_ref(m.last_node)
        req.prefix_indices, req.last_node, req.cache_protected_len = m.indices, m.last_node, 4
        req.req_pool_idx = cache.req_to_token_pool.alloc(1)[0]
        own = alloc.alloc(12)  # prompt tokens 4..11 and 4 outputs
        row = cache.req_to_token_pool.req_to_token[req.req_pool_idx]
        row[:4], row[4:16] = m.indices.to(torch.int32), own.to(torch.int32)
        twin = alloc.alloc(12)
        assert cache.insert(prompt, twin, priority=2, namespace="t") == 4
        alloc.free(twin[:4])
        req.output_ids, req.kv_len = [70, 71, 72, 73], 16
        cache_request(cache, req, finished, checked)
        cache.check_invariants()
        if not finished:  # the row holds the tree's slots for its whole pages now
            assert row[:16].tolist() == cache.match_prefix(prompt + [70, 71, 72, 73, 0], "t").indices.tolist()
        outcomes.append((namespace_nodes(cache, "t"), cached_sequences(cache), alloc.available_size(),
                         cache.evictable_size(), cache.protected_size(), req.cache_protected_len,
                         list(events), alloc.is_allocated(own).tolist()))
    assert outcomes[0] == outcomes[1]
    nodes = outcomes[0][0]
    assert {priority for _, priority, _ in nodes} == {7} and outcomes[0][1] == set()  # nothing in the default
    assert not any(outcomes[0][-1][:8])  # the duplicates of the twin's tokens went back to the allocator


def test_an_insert_is_not_a_hit():
    cache, _ = make_cache()
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 3, 4])  # inserted again: still never matched
    assert {hits for _, _, hits in namespace_nodes(cache, None)} == {0}
    cache.match_prefix([1, 2, 3, 4, 5])
    assert {hits for _, _, hits in namespace_nodes(cache, None)} == {1}


def test_pins_are_named_by_their_whole_pages_and_evicted_oldest_pin_first():
    cache, _ = make_cache(size=64, page_size=4)
    put(cache, [9, 9, 9, 9])      # an older node (a smaller id) ...
    put(cache, [1, 2, 3, 4])
    assert cache.match_prefix([1, 2, 3, 4]).last_node.pin == 0  # not pinned
    assert message_of(lambda: cache.pin("ab")) == "key must be a sequence of int token ids, got str"
    assert cache.pin([1, 2, 3, 4, 5, 6]) == 4   # the partial page is not part of the pin
    assert cache.unpin([1, 2, 3, 4, 7]) == 4 and cache.pin([1, 2, 3, 4, 5, 6]) == 4  # the same pin
    assert cache.pin([9, 9, 9, 9]) == 4         # ... pinned later
    first, later = (cache.match_prefix(k).last_node for k in ([1, 2, 3, 4], [9, 9, 9, 9]))
    assert 0 < first.pin < later.pin
    assert cache.evict(1) == 4 and cached_sequences(cache) == {(9, 9, 9, 9)}  # the older pin went first
    assert cache.unpin([9, 9, 9, 9]) == 4 and cache.pinned_size() == 0
    assert first.pin == later.pin == 0  # evicted with its pin, or unpinned: a node's pin is 0 again


def cache_request(cache, req, finished, checked):
    if checked:
        (cache.cache_finished_req if finished else cache.cache_unfinished_req)(req)
    else:
        cache.cache_req(req, finished)


def test_the_scheduler_s_inserts_and_evictions_keep_the_allocators_page_states_exact():
    # Whoever inserts and evicts (the Scheduler's trusted path, or the checked API), the allocator's page states
    # say exactly which slots are whose: a checked insert refuses a slot the tree holds and takes
    # one it evicted, with no rebuild in between.
    from kvmem.scheduler import Scheduler

    tree, alloc = make_cache(64)
    sched = Scheduler(tree.req_to_token_pool, alloc, tree)
    sched.add_request(Req("a", list(range(1, 11)), 1))
    sched.process_batch_result(sched.step(), [99])  # finishes: 10 tokens cached through cache_req
    held = tree.match_prefix(list(range(1, 11))).indices
    assert len(held) == 10 and alloc.cached_mask(held.numpy()).all()
    with pytest.raises(ValueError, match="already caches for another prefix"):
        tree.insert([500, 501], held[:2])
    assert tree.evict(64) == 10 and tree.total_size() == 0
    assert alloc.cached_size() == 0 and not alloc.is_allocated(held).any()
    again = alloc.alloc(64)
    assert tree.insert([500, 501], again[:2]) == 0
    tree.check_invariants()
