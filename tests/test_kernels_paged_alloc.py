import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kernels._dispatch import use_triton
from kernels.paged_alloc import (
    _alloc_extend_kernel, alloc_decode_slots, alloc_extend_slots, new_pages_per_request, num_new_pages)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRITON_RUNS = use_triton(_alloc_extend_kernel, DEVICE, None)
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not TRITON_RUNS, reason="no Triton here"))]


def t(values):
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def expected_slots(prefix_lens, seq_lens, last_loc, free_pages, ps):
    """The allocator's rule, token by token."""
    out, next_page = [], 0
    for p, s, last in zip(prefix_lens, seq_lens, last_loc):
        in_partial = min(s - p, -(-p // ps) * ps - p)
        out += [last + 1 + j for j in range(in_partial)]
        for k in range(s - p - in_partial):
            out.append(free_pages[next_page + k // ps] * ps + k % ps)
        next_page += -(-s // ps) - -(-p // ps)
    return out


def alloc(prefix_lens, seq_lens, last_loc, free_pages, ps, backend=None):
    return alloc_extend_slots(t(prefix_lens), t(seq_lens), t(last_loc), t(free_pages), ps, backend=backend).cpu()


@pytest.mark.parametrize("backend", BACKENDS)
def test_extend_fills_the_partial_page_then_takes_new_pages_in_order(backend):
    # Request 0 starts fresh; request 1 has 5 tokens (slot 28 holds token 4, 3 free slots follow in its
    # page); request 2 ends exactly on a page boundary, so its last_loc is not read.
    got = alloc([0, 5, 8], [6, 11, 9], [-1, 28, 99], [10, 11, 12, 13], 4, backend)
    assert got.tolist() == [40, 41, 42, 43, 44, 45, 29, 30, 31, 48, 49, 50, 52]
    assert got.dtype == torch.int64


@pytest.mark.parametrize("backend", BACKENDS)
def test_extend_that_stays_inside_the_partial_page_takes_no_page(backend):
    assert alloc([5], [7], [28], [], 4, backend).tolist() == [29, 30]
    assert num_new_pages(t([5]), t([7]), 4) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_page_size_one_takes_one_page_per_token(backend):
    assert alloc([0, 3], [2, 5], [-1, 7], [9, 4, 6, 8], 1, backend).tolist() == [9, 4, 6, 8]


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_extends_cross_blocks_intact(backend):
    prefix, seq, last = [3, 0], [3 + 2100, 1030], [16 * 7 + 2, -1]
    pages = list(range(1, 1 + num_new_pages(t(prefix), t(seq), 16)))
    assert alloc(prefix, seq, last, pages, 16, backend).tolist() == expected_slots(prefix, seq, last, pages, 16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_continues_the_last_page_or_starts_a_new_one(backend):
    # seq_lens count the new token: 5 -> token 4 starts page, 7 -> token 6 follows slot 25, 1 -> first token.
    got = alloc_decode_slots(t([5, 7, 1]), t([19, 25, -1]), t([3, 8]), 4, backend=backend).cpu()
    assert got.tolist() == [12, 26, 32]
    assert num_new_pages(t([4, 6, 0]), t([5, 7, 1]), 4) == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_and_empty_extends_give_no_slots(backend):
    assert alloc([], [], [], [], 4, backend).tolist() == []
    assert alloc([3, 4], [3, 4], [2, 3], [], 4, backend).tolist() == []


def test_new_pages_per_request_counts_whole_pages_past_the_prefix():
    assert new_pages_per_request(t([0, 5, 8, 3]), t([6, 11, 9, 4]), 4).tolist() == [2, 1, 1, 0]
    assert num_new_pages(t([0, 5, 8, 3]), t([6, 11, 9, 4]), 4) == 4


def test_extend_num_tokens_sizes_the_output_without_reading_lengths():
    got = alloc_extend_slots(t([0]), t([3]), t([-1]), t([2]), 4, extend_num_tokens=3)
    assert got.tolist() == [8, 9, 10]


@settings(max_examples=25, deadline=None)
@given(data=st.data(), ps=st.sampled_from([1, 2, 4, 16]))
def test_slots_match_the_rule_and_never_repeat(data, ps):
    bs = data.draw(st.integers(1, 5))
    prefix = data.draw(st.lists(st.integers(0, 300), min_size=bs, max_size=bs))
    seq = [p + data.draw(st.integers(0, 300)) for p in prefix]
    # Each request's partial page is its own (pages 1000 + i), as the allocator guarantees.
    last = [(1000 + i) * ps + (p - 1) % ps if p % ps else -1 for i, p in enumerate(prefix)]
    pages = data.draw(st.permutations(range(1, 1 + num_new_pages(t(prefix), t(seq), ps))))
    want = expected_slots(prefix, seq, last, pages, ps)
    for backend in ["torch"] + (["triton"] if TRITON_RUNS else []):
        assert alloc(prefix, seq, last, pages, ps, backend).tolist() == want
    assert len(set(want)) == len(want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("overrides, error, message", [
    (dict(seq_lens=torch.tensor([3])), ValueError, "prefix_lens must have"),
    (dict(last_loc=torch.tensor([1.0, 2.0])), TypeError, "last_loc must have dtype"),
    (dict(page_size=0), ValueError, "page_size must be a positive int"),
    (dict(prefix_lens=torch.tensor([0, 7])), ValueError, "request 1: need 0 <= prefix_lens <= seq_lens"),
    (dict(free_pages=torch.tensor([7])), ValueError, "free_pages has 1 pages, the extend needs 2"),
    (dict(last_loc=torch.tensor([-1, 11])), ValueError, "request 1: last_loc 11 is not the slot of token 2"),
    (dict(extend_num_tokens=4), ValueError, r"extend_num_tokens 4 != sum\(seq_lens - prefix_lens\) = 5"),
])
def test_bad_arguments_raise_naming_the_argument(backend, overrides, error, message):
    args = dict(prefix_lens=torch.tensor([0, 3]), seq_lens=torch.tensor([2, 6]), last_loc=torch.tensor([-1, 14]),
                free_pages=torch.tensor([7, 8]), page_size=4)
    args.update(overrides)
    with pytest.raises(error, match=message):
        alloc_extend_slots(**args, backend=backend)


def test_decode_rejects_lengths_without_the_new_token():
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 0"):
        alloc_decode_slots(torch.tensor([2, 0]), torch.tensor([5, -1]), torch.tensor([3]), 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_numpy_integer_page_size_works_on_every_backend(backend):
    want = alloc([0, 5], [6, 11], [-1, 28], [10, 11, 12], 4, backend)
    assert torch.equal(alloc([0, 5], [6, 11], [-1, 28], [10, 11, 12], np.int64(4), backend), want)


def test_a_strided_free_pages_is_refused_by_name():
    pages = t([10, 0, 11, 0])[::2]
    with pytest.raises(ValueError, match="free_pages must be contiguous"):
        alloc_extend_slots(t([0]), t([6]), t([-1]), pages, 4)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="values are checked on host tensors only")
@pytest.mark.parametrize("pages, message", [([0, 11], r"free_pages\[0\] = 0"), ([10, -3], r"free_pages\[1\] = -3")])
def test_free_pages_must_start_at_page_one(pages, message):
    with pytest.raises(ValueError, match=message):
        alloc([0], [8], [-1], pages, 4)
