"""Req and ScheduleBatch on their own: what a request holds, what each refusal says, and how a batch prepares,
evicts and retracts (tests/test_scheduler.py drives them through the Scheduler's loop)."""

import numpy as np
import pytest
import torch

from kvmem.allocator import PagedTokenAllocator, TokenAllocator
from kvmem.batch import ForwardMode, Req, ReqStatus, ScheduleBatch
from kvmem.radix_cache import RadixCache
from kvmem.req_to_token import ReqToTokenPool


def message_of(call, error=(ValueError, TypeError, RuntimeError)) -> str:
    with pytest.raises(error) as raised:
        call()
    return str(raised.value)


def parts(capacity=64, page_size=1, rows=4, max_context_len=64):
    pool = ReqToTokenPool(rows, max_context_len)
    alloc = TokenAllocator(capacity) if page_size == 1 else PagedTokenAllocator(capacity, page_size)
    return pool, alloc, RadixCache(pool, alloc, page_size=page_size)


def prefill(reqs, pool, alloc, tree):
    """Prefills `reqs` whole in one batch (no cached prefix) and samples token 7 for each: they are then running."""
    for r in reqs:
        r.extend_end = len(r.fill_ids)
    batch = ScheduleBatch(reqs, pool, alloc, tree)
    assert batch.prepare_for_extend()
    for r in reqs:
        r.output_ids.append(7)
    return batch


# ---- requests -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("input_ids, error, message", [
    (torch.tensor([1.0, 2.0]), TypeError, "request 'r': input_ids must hold ints, got dtype torch.float32"),
    (torch.tensor([1j]), TypeError, "request 'r': input_ids must hold ints, got dtype torch.complex64"),
    (torch.tensor([True]), TypeError, "request 'r': input_ids must hold ints, got dtype torch.bool"),
    (torch.empty(2, dtype=torch.int64, device="meta"), ValueError,
     "request 'r': input_ids is on the 'meta' device, which holds no values"),
    (np.ones((2, 2), dtype=np.int64), TypeError,
     "request 'r': input_ids must be a 1-D sequence of ints, got int64 of shape (2, 2)"),
    (np.array([1.0, 2.0]), TypeError,
     "request 'r': input_ids must be a 1-D sequence of ints, got float64 of shape (2,)"),
    (np.array([True]), TypeError, "request 'r': input_ids must be a 1-D sequence of ints, got bool of shape (1,)"),
    (np.array([1, 2**63], dtype=np.uint64), ValueError, "request 'r': input_ids holds a token id outside int64"),
    (np.array([], dtype=np.float64), ValueError, "request 'r': input_ids is empty"),
    (b"\x01\x02", TypeError, "request 'r': input_ids must be a sequence of ints, got bytes"),
    ("ab", TypeError, "request 'r': input_ids must be a sequence of ints, got str"),
    ([1, 2.5], TypeError, "request 'r': input_ids must hold ints, got float"),
    ([2**63], ValueError, "request 'r': input_ids holds a token id outside int64"),
    ([], ValueError, "request 'r': input_ids is empty"),
])
def test_a_bad_prompt_is_refused_naming_the_request(input_ids, error, message):
    assert message_of(lambda: Req("r", input_ids, 1), error) == message


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": 0}, "request 'r': max_new_tokens must be a positive int, got 0"),
    ({"priority": 2**63}, "request 'r': priority must be an int >= -9223372036854775808 (at most "
                          "9223372036854775807), got 9223372036854775808"),
    ({"priority": -(2**63) - 1}, "request 'r': priority must be an int >= -9223372036854775808 (at most "
                                 "9223372036854775807), got -9223372036854775809"),
    ({"namespace": 3}, "request 'r': namespace must be a str or None, got int"),
])
def test_bad_request_settings_are_refused_naming_the_request(kwargs, message):
    assert message_of(lambda: Req("r", [1, 2], **{"max_new_tokens": 1, **kwargs})) == message


@pytest.mark.parametrize("input_ids", [
    [5, -3, 2**63 - 1], np.array([5, -3, 2**63 - 1]), np.array([5, 2, 7], dtype=np.int32),
    np.array([5, 2**62, 7], dtype=np.uint64), np.arange(10, dtype=np.int64)[::3], torch.tensor([5, -3, 7]),
    torch.tensor([5, 2, 7], dtype=torch.int32)])
def test_a_prompt_of_any_integer_kind_is_kept_as_int64_token_ids(input_ids):
    req = Req("r", input_ids, 1)
    assert req.input_ids.typecode == "q" and req.input_ids.tolist() == list(np.asarray(input_ids).tolist())


def test_a_new_request_holds_nothing_yet():
    req = Req("r", [1, 2, 3], 4, namespace="tenant")
    assert (req.status, req.output_ids, req.req_pool_idx, req.kv_len, req.last_node) == (
        ReqStatus.NEW, [], None, 0, None)
    assert (req.prefix_indices.numel(), req.cache_protected_len, req.host_hit_len, req.storage_hit_len) == (0, 0, 0, 0)
    assert (req.prefetch, req.extend_end, req.num_retractions, req.priority, req.namespace) == (
        None, 0, 0, 0, "tenant")
    assert Req("r", [1], 1, priority=-(2**63)).priority == -(2**63) and Req("r", [1], 1, priority=2**63 - 1)
    assert repr(req) == "Req(rid='r', new, input=3, output=0/4, kv_len=0)"


def test_a_retracted_request_forgets_its_memory_but_keeps_its_outputs():
    pool, alloc, tree = parts()
    req = Req("r", [1, 2, 3], 4)
    prefill([req], pool, alloc, tree)
    for n in (1, 2):
        req.reset_for_retract()
        assert (req.status, req.req_pool_idx, req.kv_len, req.last_node, req.cache_protected_len, req.extend_end) == (
            ReqStatus.RETRACTED, None, 0, None, 0, 0)
        assert req.prefix_indices.numel() == 0 and req.num_retractions == n and req.output_ids == [7]
    assert req.fill_ids.tolist() == [1, 2, 3, 7] and req.is_chunked()  # it resumes by prefilling 4 tokens
    req.extend_end = 3
    assert req.is_chunked()
    req.extend_end = 4
    assert not req.is_chunked() and not req.finished()


# ---- batches: refusals ----------------------------------------------------------------------------------
def test_a_batch_refuses_parts_that_do_not_belong_together():
    pool, alloc, tree = parts()
    other_pool, other_alloc, _ = parts()
    assert message_of(lambda: ScheduleBatch([], None, alloc, tree)) == \
        "req_to_token_pool must be a ReqToTokenPool, got NoneType"
    assert message_of(lambda: ScheduleBatch([], pool, None, tree)) == \
        "token_allocator must be a TokenAllocator or PagedTokenAllocator, got NoneType"
    assert message_of(lambda: ScheduleBatch([], pool, alloc, None)) == "tree_cache must be a RadixCache, got NoneType"
    assert message_of(lambda: ScheduleBatch([], 4, alloc, tree)) == \
        "req_to_token_pool must be a ReqToTokenPool, got int"
    assert message_of(lambda: ScheduleBatch([], pool, "slots", tree)) == \
        "token_allocator must be a TokenAllocator or PagedTokenAllocator, got str"
    assert message_of(lambda: ScheduleBatch([], pool, alloc, [])) == "tree_cache must be a RadixCache, got list"
    assert message_of(lambda: ScheduleBatch([], other_pool, alloc, tree)) == \
        "tree_cache was built over another req_to_token_pool than the one given"
    assert message_of(lambda: ScheduleBatch([], pool, other_alloc, tree)) == \
        "tree_cache was built over another token_allocator than the one given"


def test_prepare_for_extend_names_the_request_that_cannot_extend():
    pool, alloc, tree = parts(max_context_len=8)
    a, b = Req("a", [1, 2, 3], 1), Req("b", [4, 5, 6], 1)
    a.extend_end, b.extend_end = 3, 0
    assert message_of(lambda: ScheduleBatch([a, b], pool, alloc, tree).prepare_for_extend()) == \
        "request 'b': nothing to extend (kv_len 0, extend_end 0)"
    a.extend_end, b.extend_end = 8, 9
    assert message_of(lambda: ScheduleBatch([a, b], pool, alloc, tree).prepare_for_extend()) == \
        "request 'b': extend_end 9 exceeds max_context_len 8"
    assert message_of(lambda: ScheduleBatch([], pool, alloc, tree).prepare_for_extend()) == \
        "the batch is empty: nothing to extend"
    assert message_of(lambda: ScheduleBatch([a, a], pool, alloc, tree).prepare_for_extend()) == \
        "the batch holds a request more than once"
    assert (pool.available_size(), alloc.available_size()) == (4, 64)


def test_prepare_for_decode_names_the_request_that_cannot_decode():
    pool, alloc, tree = parts(max_context_len=4)
    a, b = Req("a", [1, 2], 1), Req("b", [3, 4, 5, 6], 1)
    assert message_of(lambda: ScheduleBatch([a], pool, alloc, tree).prepare_for_decode()) == \
        "request 'a' is not running (new): extend it before decoding"
    prefill([a, b], pool, alloc, tree)
    assert message_of(lambda: ScheduleBatch([a, b], pool, alloc, tree).prepare_for_decode()) == \
        "request 'b' holds max_context_len 4 tokens: no room to decode"


def test_attention_metadata_before_a_prepare_says_what_to_call():
    pool, alloc, tree = parts()
    assert message_of(lambda: ScheduleBatch([], pool, alloc, tree).attention_metadata()) == \
        "attention_metadata() needs prepare_for_extend() or prepare_for_decode() first"


# ---- batches: what they prepare --------------------------------------------------------------------------
def test_a_new_batch_has_no_mode_no_tensors_and_nothing_evicted_or_retracted():
    pool, alloc, tree = parts()
    batch = ScheduleBatch([Req("a", [1], 1)], pool, alloc, tree)
    assert batch.forward_mode is None and batch.retracted == [] and batch.evicted_tokens == 0
    assert all(t.numel() == 0 for t in (batch.req_pool_indices, batch.seq_lens, batch.prefix_lens,
                                        batch.extend_lens, batch.out_cache_loc))


def test_an_extend_batch_s_tensors_are_int64_and_its_rows_hold_its_slots():
    pool, alloc, tree = parts()
    a, b = Req("a", [1, 2, 3], 2), Req("b", [4, 5], 2)
    batch = prefill([a, b], pool, alloc, tree)
    assert batch.forward_mode is ForwardMode.EXTEND
    for t in (batch.req_pool_indices, batch.seq_lens, batch.prefix_lens, batch.extend_lens, batch.out_cache_loc):
        assert t.dtype == torch.int64
    assert batch.seq_lens.tolist() == [3, 2] and batch.extend_lens.tolist() == [3, 2]
    assert pool.req_to_token[a.req_pool_idx, :3].tolist() == batch.out_cache_loc[:3].tolist()
    assert (a.status, a.kv_len, b.kv_len) == (ReqStatus.RUNNING, 3, 2)


def test_an_extend_with_no_row_left_returns_false_and_changes_nothing():
    pool, alloc, tree = parts(rows=1)
    prefill([Req("a", [1, 2], 1)], pool, alloc, tree)  # takes the only row
    req = Req("b", [3, 4], 1)
    req.extend_end = 2
    assert ScheduleBatch([req], pool, alloc, tree).prepare_for_extend() is False
    assert (req.status, req.req_pool_idx, alloc.available_size()) == (ReqStatus.NEW, None, 62)


def test_an_extend_short_by_one_slot_evicts_and_counts_what_it_evicted():
    pool, alloc, tree = parts(capacity=8)
    tree.insert([9, 9, 9], alloc.alloc(3))  # one evictable 3-token leaf
    alloc.alloc(alloc.available_size() - 4)  # 4 slots left
    req = Req("a", [1, 2, 3, 4, 5], 1)
    req.extend_end = 5
    batch = ScheduleBatch([req], pool, alloc, tree)
    assert batch.prepare_for_extend() and batch.evicted_tokens == 3 and tree.total_size() == 0


def test_an_empty_decode_batch_prepares_empty_tensors():
    pool, alloc, tree = parts()
    batch = ScheduleBatch([], pool, alloc, tree)
    batch.prepare_for_decode()
    assert batch.forward_mode is ForwardMode.DECODE and batch.retracted == []
    for t in (batch.req_pool_indices, batch.seq_lens, batch.prefix_lens, batch.out_cache_loc):
        assert t.numel() == 0 and t.dtype == torch.int64


def test_a_decode_short_of_slots_evicts_the_shortfall_and_retracts_nobody():
    pool, alloc, tree = parts(capacity=16)
    a, b = Req("a", [1, 2], 4), Req("b", [3, 4], 4)
    prefill([a, b], pool, alloc, tree)
    for token in (7, 8, 9):  # three evictable one-token leaves
        tree.insert([token], alloc.alloc(1))
    hoard = alloc.alloc(alloc.available_size() - 1)  # one slot free, two needed: 1 short
    batch = ScheduleBatch([a, b], pool, alloc, tree)
    batch.prepare_for_decode()
    assert batch.retracted == [] and batch.evicted_tokens == 1 and tree.total_size() == 2
    assert batch.out_cache_loc.numel() == 2
    assert (a.kv_len, b.kv_len) == (3, 3)
    alloc.free(hoard)


def test_a_decode_with_exactly_enough_slots_retracts_nobody():
    pool, alloc, tree = parts(capacity=8)
    a, b = Req("a", [1, 2], 4), Req("b", [3, 4], 4)
    prefill([a, b], pool, alloc, tree)
    alloc.alloc(alloc.available_size() - 2)
    batch = ScheduleBatch([a, b], pool, alloc, tree)
    batch.prepare_for_decode()
    assert batch.retracted == [] and batch.evicted_tokens == 0 and alloc.available_size() == 0


def test_a_decode_at_page_size_2_takes_pages_only_for_requests_at_a_page_boundary():
    # kv_len 3, 5 and 4: only the last needs a new page (2 slots); with one page free nobody is retracted.
    pool, alloc, tree = parts(capacity=32, page_size=2)
    reqs = [Req("a", [1, 2, 3], 4), Req("b", [4, 5, 6, 7, 8], 4), Req("c", [9, 10, 11, 12], 4)]
    prefill(reqs, pool, alloc, tree)
    alloc.alloc(alloc.available_size() - 2)
    batch = ScheduleBatch(reqs, pool, alloc, tree)
    batch.prepare_for_decode()
    assert batch.retracted == [] and alloc.available_size() == 0


@pytest.mark.parametrize("page_size", [1, 2])
def test_retraction_takes_the_least_advanced_longest_prompts_first_until_the_rest_fit(page_size):
    # Nothing free or evictable. Victims in order: a (fewest outputs), then c before b (as advanced, longer
    # prompt); d is the most advanced. At page size 2 only b (kv_len 2) and c (4) need a new page; a (kv_len 1)
    # gives a page back without needing one, so c must go too, as at page size 1.
    pool, alloc, tree = parts(capacity=32, page_size=page_size, rows=4)
    a, b, c, d = Req("a", [1], 8), Req("b", [2, 3], 8), Req("c", [4, 5, 6, 7], 8), Req("d", [8, 9, 10], 8)
    prefill([a, b, c, d], pool, alloc, tree)
    b.output_ids.append(7)
    c.output_ids.append(7)
    d.output_ids += [7, 7]
    hoard = alloc.alloc(alloc.available_size())
    batch = ScheduleBatch([a, b, c, d], pool, alloc, tree)
    batch.prepare_for_decode()
    assert batch.retracted == [a, c] and batch.reqs == [b, d]
    assert batch.out_cache_loc.numel() == 2 and (b.kv_len, d.kv_len) == (3, 4)
    alloc.free(hoard)


def test_retraction_may_take_every_request_but_the_most_advanced():
    pool, alloc, tree = parts(capacity=8)
    a, b, c = Req("a", [1], 8), Req("b", [2], 8), Req("c", [3], 8)
    prefill([a, b, c], pool, alloc, tree)
    c.output_ids.append(7)
    hoard = alloc.alloc(alloc.available_size())
    batch = ScheduleBatch([a, b, c], pool, alloc, tree)
    batch.prepare_for_decode()  # three need a slot each; each victim frees one
    assert batch.retracted == [a, b] and batch.reqs == [c] and c.kv_len == 2
    alloc.free(hoard)
