import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem.kernels._dispatch import use_triton
from kvmem.kernels.req_to_token import (
    _write_req_to_token,
    _write_req_to_token_kernel,
    _write_req_to_token_vectorized,
    write_req_to_token,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRITON_RUNS = use_triton(_write_req_to_token_kernel, DEVICE, None)
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not TRITON_RUNS, reason="no Triton here"))]


def t(values):
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def expected_table(table, rows, prefix_lens, seq_lens, out_cache_loc, prefix_indices=None, prefix_indptr=None):
    table = table.clone().cpu()
    e = 0
    for i, (r, p, s) in enumerate(zip(rows, prefix_lens, seq_lens)):
        if prefix_indptr is not None:
            segment = prefix_indices[prefix_indptr[i]:prefix_indptr[i + 1]]
            table[r, :len(segment)] = torch.tensor(segment, dtype=table.dtype)
        table[r, p:s] = torch.tensor(out_cache_loc[e:e + s - p], dtype=table.dtype)
        e += s - p
    return table


def write(table, rows, prefix_lens, seq_lens, out_cache_loc, prefix_indices=None, prefix_indptr=None,
          backend=None):
    table = table.clone()
    prefix = None if prefix_indptr is None else (t(prefix_indices), t(prefix_indptr))
    write_req_to_token(table, t(rows), t(prefix_lens), t(seq_lens), t(out_cache_loc), *(prefix or ()),
                       backend=backend)
    return table.cpu()


@pytest.mark.parametrize("backend", BACKENDS)
def test_extend_slots_land_after_each_prefix(backend):
    table = torch.zeros(4, 16, dtype=torch.int32, device=DEVICE)
    got = write(table, [2, 0], [3, 0], [5, 4], [11, 12, 21, 22, 23, 24], backend=backend)
    assert got[2].tolist()[:6] == [0, 0, 0, 11, 12, 0]
    assert got[0].tolist()[:5] == [21, 22, 23, 24, 0]
    assert got[1].count_nonzero() == 0 and got[3].count_nonzero() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_slots_fill_the_front_of_each_row(backend):
    table = torch.full((3, 12), -1, dtype=torch.int32, device=DEVICE)
    # Request 0 brings a 2-token prefix; request 1 is a chunked request whose prefix is already in row 1.
    got = write(table, [0, 1], [2, 3], [4, 5], [7, 8, 9, 10], prefix_indices=[5, 6], prefix_indptr=[0, 2, 2],
                backend=backend)
    assert got[0].tolist()[:5] == [5, 6, 7, 8, -1]
    assert got[1].tolist()[:6] == [-1, -1, -1, 9, 10, -1]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("extend", [511, 1024, 1025, 2100])
def test_long_extends_are_written_whole(backend, extend):
    table = torch.zeros(3, 2200, dtype=torch.int32, device=DEVICE)
    slots = list(range(1, extend + 4))
    got = write(table, [1, 2], [0, 50], [3, 50 + extend], slots, prefix_indices=list(range(100, 150)),
                prefix_indptr=[0, 0, 50], backend=backend)
    assert torch.equal(got, expected_table(table, [1, 2], [0, 50], [3, 50 + extend], slots,
                                           list(range(100, 150)), [0, 0, 50]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_and_empty_extends_write_nothing(backend):
    table = torch.zeros(2, 8, dtype=torch.int32, device=DEVICE)
    assert write(table, [], [], [], [], backend=backend).count_nonzero() == 0
    assert write(table, [1], [3], [3], [], backend=backend).count_nonzero() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_int64_table_and_int32_inputs_are_accepted(backend):
    table = torch.zeros(2, 8, dtype=torch.int64, device=DEVICE)
    write_req_to_token(table, t([1]).int(), t([0]).int(), t([2]).int(), t([9, 8]).int(), backend=backend)
    assert table[1, :3].tolist() == [9, 8, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_unchecked_int64_slots_wrap_into_an_int32_table_alike_on_both_backends(backend):
    # The unchecked body (what the CUDA path amounts to, where values are not read back): the kernel and
    # its fallback narrow alike.
    table = torch.zeros(2, 6, dtype=torch.int32, device=DEVICE)
    _write_req_to_token(table, t([1]), t([1]), t([3]), t([(1 << 33) + 5, -(1 << 35) - 3]), t([(1 << 32) + 1]),
                        t([0, 1]), backend=backend)
    assert table[1].tolist() == [1, 5, -3, 0, 0, 0]


@pytest.mark.skipif(DEVICE.type != "cpu", reason="values are checked on host tensors only")
@pytest.mark.parametrize("slots, prefix", [([(1 << 33) + 5, 1], None), ([1, 2], [(1 << 32) + 1]), ([-3, 1], None)])
def test_slots_that_would_wrap_in_the_table_are_refused(slots, prefix):
    table = torch.zeros(2, 6, dtype=torch.int32)
    with_prefix = () if prefix is None else (t(prefix), t([0, 1]))
    with pytest.raises(ValueError, match="out_cache_loc|prefix_indices"):
        write_req_to_token(table, t([1]), t([1]), t([3]), t(slots), *with_prefix)
    assert table.count_nonzero() == 0


@pytest.mark.skipif(not TRITON_RUNS, reason="no Triton here")
@settings(max_examples=20, deadline=None)
@given(data=st.data(), with_prefix=st.booleans())
def test_triton_and_torch_agree_on_random_batches(data, with_prefix):
    bs = data.draw(st.integers(1, 5))
    rows = data.draw(st.lists(st.integers(0, 5), min_size=bs, max_size=bs, unique=True))
    seq_lens = data.draw(st.lists(st.integers(0, 1300), min_size=bs, max_size=bs))
    prefix_lens = [data.draw(st.integers(0, s)) for s in seq_lens]
    out_cache_loc = list(range(1, 1 + sum(seq_lens) - sum(prefix_lens)))
    prefix_indices = prefix_indptr = None
    if with_prefix:
        counts = [data.draw(st.sampled_from([0, p])) for p in prefix_lens]
        prefix_indptr = [0]
        for c in counts:
            prefix_indptr.append(prefix_indptr[-1] + c)
        prefix_indices = list(range(5000, 5000 + prefix_indptr[-1]))
    table = torch.zeros(6, 1300, dtype=torch.int32, device=DEVICE)
    args = (table, rows, prefix_lens, seq_lens, out_cache_loc, prefix_indices, prefix_indptr)
    got = write(*args, backend="triton")
    assert torch.equal(got, write(*args, backend="torch"))
    assert torch.equal(got, expected_table(*args))


def bad_call(**overrides):
    args = dict(req_to_token=torch.zeros(4, 8, dtype=torch.int32), req_pool_indices=torch.tensor([0, 1]),
                prefix_lens=torch.tensor([0, 2]), seq_lens=torch.tensor([3, 4]),
                out_cache_loc=torch.arange(1, 6))
    args.update(overrides)
    return args


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("overrides, error, message", [
    (dict(req_to_token=torch.zeros(4, 8)), TypeError, "req_to_token must have dtype int32 or int64, got torch.float32"),
    (dict(req_to_token=torch.zeros(8, dtype=torch.int32)), ValueError, "req_to_token must be 2-D, got shape (8,)"),
    (dict(req_pool_indices=torch.tensor([0.0, 1.0])), TypeError,
     "req_pool_indices must have dtype int32 or int64, got torch.float32"),
    (dict(prefix_lens=torch.tensor([0.0, 2.0])), TypeError,
     "prefix_lens must have dtype int32 or int64, got torch.float32"),
    (dict(seq_lens=torch.tensor([3.0, 4.0])), TypeError, "seq_lens must have dtype int32 or int64, got torch.float32"),
    (dict(out_cache_loc=torch.arange(1.0, 6.0)), TypeError,
     "out_cache_loc must have dtype int32 or int64, got torch.float32"),
    (dict(prefix_lens=torch.tensor([0])), ValueError,
     "prefix_lens must have one per request, len(req_pool_indices) (2) entries, got 1"),
    (dict(seq_lens=torch.tensor([3])), ValueError,
     "seq_lens must have one per request, len(req_pool_indices) (2) entries, got 1"),
    (dict(req_pool_indices=torch.tensor([0, 4])), IndexError, "req_pool_indices[1] = 4 is out of range [0, 4)"),
    (dict(req_pool_indices=torch.tensor([1, 1])), ValueError, "req_pool_indices names row 1 more than once"),
    (dict(req_pool_indices=torch.tensor([0, 3, 3]), prefix_lens=torch.tensor([0, 2, 0]),
          seq_lens=torch.tensor([3, 4, 0])), ValueError, "req_pool_indices names row 3 more than once"),
    (dict(prefix_lens=torch.tensor([4, 2])), ValueError, "request 0: need 0 <= prefix_lens <= seq_lens, got 4 and 3"),
    (dict(prefix_lens=torch.tensor([0, -1]), out_cache_loc=torch.arange(1, 9)), ValueError,
     "request 1: need 0 <= prefix_lens <= seq_lens, got -1 and 4"),
    (dict(seq_lens=torch.tensor([3, 9]), out_cache_loc=torch.arange(10)), IndexError,
     "seq_lens[1] = 9 exceeds req_to_token's max_context_len 8"),
    (dict(out_cache_loc=torch.arange(4)), ValueError, "out_cache_loc has 4 slots, sum(seq_lens - prefix_lens) = 5"),
    (dict(prefix_indices=torch.arange(3)), ValueError,
     "prefix_indices and prefix_indptr must be given together, got prefix_indices=a tensor and prefix_indptr=None"),
    (dict(prefix_indptr=torch.tensor([0, 0, 2])), ValueError,
     "prefix_indices and prefix_indptr must be given together, got prefix_indices=None and prefix_indptr=a tensor"),
    (dict(prefix_indices=torch.arange(3.0), prefix_indptr=torch.tensor([0, 0, 2])), TypeError,
     "prefix_indices must have dtype int32 or int64, got torch.float32"),
    (dict(prefix_indices=torch.arange(3), prefix_indptr=torch.tensor([0.0, 0.0, 2.0])), TypeError,
     "prefix_indptr must have dtype int32 or int64, got torch.float32"),
    (dict(prefix_indices=torch.arange(3), prefix_indptr=torch.tensor([0, 3])), ValueError,
     "prefix_indptr must have batch size + 1 (3) entries, got 2"),
    (dict(prefix_indices=torch.arange(3), prefix_indptr=torch.tensor([0, 1, 3])), ValueError,
     "request 0: prefix_indptr gives 1 prefix slots, need 0..prefix_lens = 0"),
    (dict(prefix_indices=torch.arange(3), prefix_indptr=torch.tensor([0, 0, -1])), ValueError,
     "request 1: prefix_indptr gives -1 prefix slots, need 0..prefix_lens = 2"),
    (dict(prefix_indices=torch.arange(1), prefix_indptr=torch.tensor([0, 0, 2])), ValueError,
     "prefix_indptr spans [0, 2), outside prefix_indices' 1 entries"),
    (dict(prefix_indices=torch.arange(3), prefix_indptr=torch.tensor([-1, 0, 2])), ValueError,
     "prefix_indptr spans [-1, 2), outside prefix_indices' 3 entries"),
    (dict(out_cache_loc=torch.tensor([1, 2, 3, 4, 1 << 33])), ValueError,
     "out_cache_loc holds slot 8589934592, outside [0, 2147483647] of req_to_token's torch.int32"),
    (dict(out_cache_loc=torch.tensor([1, -3, 3, 4, 5])), ValueError,
     "out_cache_loc holds slot -3, outside [0, 2147483647] of req_to_token's torch.int32"),
    (dict(prefix_indices=torch.tensor([1, (1 << 32) + 1]), prefix_indptr=torch.tensor([0, 0, 2])), ValueError,
     "prefix_indices holds slot 4294967297, outside [0, 2147483647] of req_to_token's torch.int32"),
])
def test_bad_arguments_raise_and_write_nothing(backend, overrides, error, message):
    args = bad_call(**overrides)
    with pytest.raises(error) as raised:
        write_req_to_token(**args, backend=backend)
    assert str(raised.value) == message
    assert args["req_to_token"].count_nonzero() == 0


@settings(max_examples=40, deadline=None)
@given(data=st.data(), with_prefix=st.booleans(), table_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_the_device_fallback_writes_what_the_host_one_does(data, with_prefix, table_dtype):
    # The fallback a GPU without Triton runs: on the CPU too it must write exactly what the host path writes.
    bs = data.draw(st.integers(1, 5))
    rows = data.draw(st.permutations(range(6)))[:bs]
    seq_lens = [data.draw(st.integers(0, 40)) for _ in range(bs)]
    prefix_lens = [data.draw(st.integers(0, s)) for s in seq_lens]
    out_cache_loc = list(range(1, 1 + sum(seq_lens) - sum(prefix_lens)))
    prefix_indices = prefix_indptr = None
    if with_prefix:
        prefix_indptr = [0]
        for p in prefix_lens:
            prefix_indptr.append(prefix_indptr[-1] + data.draw(st.sampled_from([0, p])))
        prefix_indices = list(range(5000, 5000 + prefix_indptr[-1]))

    def tensor(values):
        return None if values is None else torch.tensor(values, dtype=torch.int64)

    table = torch.zeros(6, 48, dtype=table_dtype)
    _write_req_to_token_vectorized(table, tensor(rows), tensor(prefix_lens), tensor(seq_lens), tensor(out_cache_loc),
                                   tensor(prefix_indices), tensor(prefix_indptr))
    args = (torch.zeros(6, 48, dtype=table_dtype), rows, prefix_lens, seq_lens, out_cache_loc, prefix_indices,
            prefix_indptr)
    assert torch.equal(table, expected_table(*args))


# ---- what mutation testing found unpinned (scripts/mutation.py kernels) ------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_three_requests_each_with_prefix_slots_are_written_whole(backend):
    table = torch.full((4, 12), -1, dtype=torch.int32, device=DEVICE)
    args = (table, [3, 0, 2], [2, 3, 1], [4, 5, 3], [7, 8, 9, 10, 11, 12],
            [21, 22, 31, 32, 33, 41], [0, 2, 5, 6])
    assert torch.equal(write(*args, backend=backend), expected_table(*args))


def test_the_last_column_and_the_largest_slot_of_the_table_are_in_range():
    table = torch.zeros(2, 8, dtype=torch.int32, device=DEVICE)
    write_req_to_token(table, t([1]), t([6]), t([8]), t([5, 2**31 - 1]))
    assert table[1].tolist() == [0] * 6 + [5, 2**31 - 1]


@pytest.mark.parametrize("overrides, error, message", [
    (dict(seq_lens=torch.tensor([8, 9]), out_cache_loc=torch.arange(1, 16)), IndexError,
     "seq_lens[1] = 9 exceeds req_to_token's max_context_len 8"),
    (dict(out_cache_loc=torch.tensor([0, 1, 2, 3, 2**31])), ValueError,
     "out_cache_loc holds slot 2147483648, outside [0, 2147483647] of req_to_token's torch.int32"),
])
def test_a_refusal_names_the_value_that_is_out_of_range(overrides, error, message):
    args = bad_call(**overrides)
    with pytest.raises(error) as raised:
        write_req_to_token(**args)
    assert str(raised.value) == message


def test_the_device_fallback_reads_prefix_slots_from_where_prefix_indptr_starts():
    args = (t([1, 0]), t([2, 1]), t([3, 2]), t([8, 9]), t([99, 21, 22, 31]), t([1, 3, 4]))
    host_table, fallback_table = (torch.zeros(2, 4, dtype=torch.int32, device=DEVICE) for _ in range(2))
    write_req_to_token(host_table, *args)
    _write_req_to_token_vectorized(fallback_table, *args)
    assert torch.equal(fallback_table, host_table) and host_table.tolist() == [[31, 9, 0, 0], [21, 22, 8, 0]]


@pytest.mark.skipif(TRITON_RUNS, reason="Triton runs here")
def test_asking_for_triton_where_it_cannot_run_is_refused_before_writing():
    args = bad_call()
    with pytest.raises(RuntimeError, match="^backend='triton' cannot run on cpu tensors"):
        write_req_to_token(**args, backend="triton")
    assert args["req_to_token"].count_nonzero() == 0
