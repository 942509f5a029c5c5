import pytest
import torch

from kvmem.req_to_token import ReqToTokenPool


def test_alloc_hands_out_distinct_rows_until_empty():
    pool = ReqToTokenPool(4, 16)
    rows = pool.alloc(3)
    assert len(set(rows)) == 3 and pool.available_size() == 1
    assert pool.alloc(2) is None and pool.available_size() == 1
    assert pool.req_to_token.shape == (4, 16) and pool.req_to_token.dtype == torch.int32


def test_free_returns_rows_for_reuse():
    pool = ReqToTokenPool(2, 8)
    rows = pool.alloc(2)
    pool.free(rows[0])
    assert pool.alloc(1) == [rows[0]]
    pool.free(torch.tensor(rows))
    assert pool.available_size() == 2


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_alloc_rejects_non_positive_counts(bad):
    pool = ReqToTokenPool(2, 8)
    with pytest.raises(ValueError, match="n must be a positive int"):
        pool.alloc(bad)
    assert pool.available_size() == 2


def test_double_free_raises_and_changes_nothing():
    pool = ReqToTokenPool(3, 8)
    rows = pool.alloc(2)
    pool.free(rows[0])
    with pytest.raises(ValueError, match="already free"):
        pool.free([rows[1], rows[0]])
    assert pool.available_size() == 2  # rows[1] was not freed either


def test_out_of_range_and_repeated_rows_raise():
    pool = ReqToTokenPool(3, 8)
    rows = pool.alloc(2)
    with pytest.raises(IndexError, match="out of range"):
        pool.free(7)
    with pytest.raises(ValueError, match="repeated"):
        pool.free([rows[0], rows[0]])
    with pytest.raises(TypeError):
        pool.free(torch.tensor([0.5]))
    assert pool.available_size() == 1


def test_write_fills_a_row_slice_and_refuses_free_rows():
    pool = ReqToTokenPool(2, 8)
    (row,) = pool.alloc(1)
    pool.write((row, slice(2, 5)), torch.tensor([7, 8, 9]))
    assert pool.req_to_token[row, 2:5].tolist() == [7, 8, 9]
    with pytest.raises(IndexError, match="not an allocated row"):
        pool.write((1 - row, slice(0, 1)), torch.tensor([1]))


@pytest.mark.parametrize("size,ctx", [(0, 8), (2, 0), (-1, 4)])
def test_constructor_rejects_bad_sizes(size, ctx):
    with pytest.raises(ValueError):
        ReqToTokenPool(size, ctx)
