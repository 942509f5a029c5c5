import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem.kernels._dispatch import use_triton
from kvmem.kernels.kv_indices import _create_kv_indices_kernel, create_kv_indices, create_kv_indptr, kv_last_page_len

# On a GPU box the same tests run the kernels on CUDA tensors; on the CPU through the interpreter.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRITON_RUNS = use_triton(_create_kv_indices_kernel, DEVICE, None)
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not TRITON_RUNS, reason="no Triton here"))]


def make_table(num_rows=6, max_context_len=2200, seed=0):
    # Multiples of 16, so that every entry starts a page for the page sizes tested (1, 2, 4, 16).
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 1 << 20, (num_rows, max_context_len), generator=g, dtype=torch.int32) * 16).to(DEVICE)


def expected_indices(req_to_token, rows, lens, starts, page_size):
    out = []
    for r, n, s in zip(rows.tolist(), lens.tolist(), starts.tolist()):
        num_pages = -(-n // page_size)
        out += [req_to_token[r, s + p * page_size].item() // page_size for p in range(num_pages)]
    return torch.tensor(out, dtype=torch.int32)


def run(req_to_token, rows, lens, starts=None, page_size=1, backend=None):
    rows = torch.tensor(rows, dtype=torch.int64, device=DEVICE)
    lens = torch.tensor(lens, dtype=torch.int64, device=DEVICE)
    starts = None if starts is None else torch.tensor(starts, dtype=torch.int64, device=DEVICE)
    kv_indptr = create_kv_indptr(lens, page_size)
    return create_kv_indices(req_to_token, rows, lens, kv_indptr, starts, page_size, backend=backend).cpu()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("length", [1, 511, 512, 513, 1023, 1024, 1025, 2049])
def test_token_indices_cross_block_boundaries_intact(backend, length):
    table = make_table()
    got = run(table, [4, 1], [length, 7], backend=backend)
    want = expected_indices(table.cpu(), torch.tensor([4, 1]), torch.tensor([length, 7]), torch.tensor([0, 0]), 1)
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [4, 16])
def test_page_indices_are_the_page_of_each_page_start(backend, page_size):
    table = make_table()
    lens, starts = [1, page_size, page_size + 1, 600 * page_size // 16 + 3], [0, page_size, 3 * page_size, 0]
    got = run(table, [0, 2, 5, 3], lens, starts, page_size, backend)
    want = expected_indices(table.cpu(), torch.tensor([0, 2, 5, 3]), torch.tensor(lens), torch.tensor(starts),
                            page_size)
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_start_idx_offsets_each_requests_range(backend):
    table = make_table()
    got = run(table, [1, 1], [5, 3], [10, 0], backend=backend)
    row = table[1].cpu()
    assert torch.equal(got, torch.cat([row[10:15], row[0:3]]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_length_request_takes_no_entries(backend):
    table = make_table()
    got = run(table, [0, 3, 2], [4, 0, 2], backend=backend)
    assert torch.equal(got, torch.cat([table[0, :4], table[2, :2]]).cpu())


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_gives_empty_indices(backend):
    got = run(make_table(), [], [], backend=backend)
    assert got.shape == (0,) and got.dtype == torch.int32


@pytest.mark.parametrize("backend", BACKENDS)
def test_given_output_buffer_is_filled_at_kv_indptr_and_returned(backend):
    table = make_table()
    lens = torch.tensor([3, 2], device=DEVICE)
    kv_indptr = torch.tensor([5, 8, 10], dtype=torch.int32, device=DEVICE)
    buf = torch.full((12,), -7, dtype=torch.int32, device=DEVICE)
    out = create_kv_indices(table, torch.tensor([2, 0], device=DEVICE), lens, kv_indptr, kv_indices=buf,
                            backend=backend)
    assert out is buf
    want = torch.cat([torch.full((5,), -7), table[2, :3].cpu(), table[0, :2].cpu(), torch.full((2,), -7)])
    assert torch.equal(buf.cpu(), want.to(torch.int32))


@pytest.mark.skipif(not TRITON_RUNS, reason="no Triton here")
@settings(max_examples=20, deadline=None)
@given(data=st.data(), page_size=st.sampled_from([1, 2, 16]), with_start=st.booleans())
def test_triton_and_torch_agree_on_random_batches(data, page_size, with_start):
    table = make_table(num_rows=5, max_context_len=1600, seed=data.draw(st.integers(0, 100)))
    bs = data.draw(st.integers(1, 5))
    rows = data.draw(st.lists(st.integers(0, 4), min_size=bs, max_size=bs))
    starts = [page_size * data.draw(st.integers(0, 20)) if with_start else 0 for _ in range(bs)]
    lens = [data.draw(st.integers(0, 1600 - s)) for s in starts]
    args = (table, rows, lens, starts if with_start else None, page_size)
    assert torch.equal(run(*args, backend="triton"), run(*args, backend="torch"))


def as_int32(v):
    return (v + (1 << 31)) % (1 << 32) - (1 << 31)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("page_size", [1, 2, 16])
def test_page_ids_truncate_toward_zero_and_wrap_to_int32_like_the_kernel(backend, dtype, page_size):
    # Real slots are small and non-negative; these values pin the exact integer semantics the fallback
    # shares with the kernel: division truncates, and int64 entries are narrowed after dividing.
    # Each row starts with a page-start slot (64, 0), as the value check requires.
    values = [64, -33, -1, 5, 17, (1 << 33) + 48, -(1 << 40) - 7, 3] * 6 + [0]
    table = torch.tensor([values, values[::-1]], dtype=torch.int64).to(dtype).to(DEVICE)
    got = run(table, [1, 0], [len(values), 21], page_size=page_size, backend=backend)
    want = []
    for row, n in ((1, len(values)), (0, 21)):
        for v in table[row, :n:page_size].tolist():
            want.append(as_int32(-(-v // page_size) if v < 0 else v // page_size))
    assert got.tolist() == want


def test_triton_is_the_default_where_it_runs():
    assert use_triton(_create_kv_indices_kernel, DEVICE, None) == TRITON_RUNS
    assert not use_triton(_create_kv_indices_kernel, DEVICE, "torch")


def test_forcing_triton_where_it_cannot_run_raises():
    with pytest.raises(RuntimeError, match="backend='triton' cannot run"):
        use_triton(None, torch.device("cpu"), "triton")
    with pytest.raises(ValueError, match="backend must be one of"):
        use_triton(_create_kv_indices_kernel, DEVICE, "cuda")


def test_kv_indptr_counts_pages_per_request():
    lens = torch.tensor([0, 1, 16, 17, 40])
    assert create_kv_indptr(lens, 16).tolist() == [0, 0, 1, 2, 4, 7]
    assert create_kv_indptr(lens).tolist() == [0, 0, 1, 17, 34, 74]
    assert create_kv_indptr(lens).dtype == torch.int32


def test_last_page_len_is_between_1_and_page_size_and_0_for_empty_requests():
    lens = torch.tensor([0, 1, 15, 16, 17, 32])
    assert kv_last_page_len(lens, 16).tolist() == [0, 1, 15, 16, 1, 16]
    assert kv_last_page_len(lens, 1).tolist() == [0, 1, 1, 1, 1, 1]
    assert kv_last_page_len(lens, 16).dtype == torch.int32


def bad_call(**overrides):
    args = dict(req_to_token=torch.zeros(4, 64, dtype=torch.int32), req_pool_indices=torch.tensor([0, 1]),
                kv_lens=torch.tensor([3, 5]), kv_indptr=torch.tensor([0, 3, 8], dtype=torch.int32),
                kv_start_idx=None, page_size=1)
    args.update(overrides)
    return args


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("overrides, error, message", [
    (dict(kv_lens=torch.tensor([3])), ValueError,
     "kv_lens must have one per request, len(req_pool_indices) (2) entries, got 1"),
    (dict(kv_indptr=torch.tensor([0, 3], dtype=torch.int32)), ValueError,
     "kv_indptr must have batch size + 1 (3) entries, got 2"),
    (dict(kv_lens=torch.tensor([3.0, 5.0])), TypeError, "kv_lens must have dtype int32 or int64, got torch.float32"),
    (dict(kv_indptr=torch.tensor([0.0, 3.0, 8.0])), TypeError,
     "kv_indptr must have dtype int32 or int64, got torch.float32"),
    (dict(req_pool_indices=torch.tensor([0.0, 1.0])), TypeError,
     "req_pool_indices must have dtype int32 or int64, got torch.float32"),
    (dict(req_to_token=torch.zeros(4, 64)), TypeError,
     "req_to_token must have dtype int32 or int64, got torch.float32"),
    (dict(req_to_token=torch.zeros(64, dtype=torch.int32)), ValueError, "req_to_token must be 2-D, got shape (64,)"),
    (dict(req_pool_indices=[0, 1]), TypeError, "req_pool_indices must be a torch.Tensor, got list"),
    (dict(req_pool_indices=torch.empty(2, dtype=torch.int64, device="meta")), ValueError,
     "req_pool_indices is on the 'meta' device, which holds no values"),
    (dict(page_size=0), ValueError, "page_size must be a positive int (at most 2147483647), got 0"),
    (dict(page_size=-4), ValueError, "page_size must be a positive int (at most 2147483647), got -4"),
    (dict(page_size=True), ValueError, "page_size must be a positive int (at most 2147483647), got True"),
    (dict(page_size=2**31), ValueError, "page_size must be a positive int (at most 2147483647), got 2147483648"),
    (dict(kv_start_idx=torch.tensor([0.0, 1.0])), TypeError,
     "kv_start_idx must have dtype int32 or int64, got torch.float32"),
    (dict(kv_start_idx=torch.tensor([0])), ValueError,
     "kv_start_idx must have one per request, len(req_pool_indices) (2) entries, got 1"),
    (dict(page_size=4, kv_indptr=torch.tensor([0, 1, 3]), kv_start_idx=torch.tensor([4, 2])), ValueError,
     "kv_start_idx[1] = 2 is not a multiple of page_size 4"),
    (dict(kv_start_idx=torch.tensor([0, -2])), ValueError, "kv_start_idx[1] = -2 is negative"),
    (dict(req_pool_indices=torch.tensor([0, 4])), IndexError, "req_pool_indices[1] = 4 is out of range [0, 4)"),
    (dict(req_pool_indices=torch.tensor([-1, 0])), IndexError, "req_pool_indices[0] = -1 is out of range [0, 4)"),
    (dict(kv_start_idx=torch.tensor([0, 60])), IndexError,
     "request 1: tokens up to 65 exceed req_to_token's max_context_len 64"),
    (dict(kv_lens=torch.tensor([3, 65]), kv_indptr=torch.tensor([0, 3, 68])), IndexError,
     "request 1: tokens up to 65 exceed req_to_token's max_context_len 64"),
    (dict(kv_lens=torch.tensor([-1, 5]), kv_indptr=torch.tensor([0, 0, 5])), ValueError, "kv_lens[0] = -1 is negative"),
    (dict(kv_indptr=torch.tensor([-1, 2, 7])), ValueError, "kv_indptr[0] = -1 is negative"),
    (dict(kv_indptr=torch.tensor([0, 4, 8])), ValueError,
     "kv_indptr[1] - kv_indptr[0] = 4 must equal the request's page count ceil(kv_lens[0] / page_size) = 3"),
    (dict(kv_indptr=torch.tensor([0, 3, 9])), ValueError,
     "kv_indptr[2] - kv_indptr[1] = 6 must equal the request's page count ceil(kv_lens[1] / page_size) = 5"),
    (dict(kv_indices=torch.zeros(8, dtype=torch.int64)), TypeError,
     "kv_indices must have dtype int32 (FlashInfer's index type), got torch.int64"),
    (dict(kv_indices=torch.zeros(7, dtype=torch.int32)), ValueError, "kv_indices has 7 entries, kv_indptr[-1] needs 8"),
])
def test_bad_arguments_raise_naming_the_argument(backend, overrides, error, message):
    with pytest.raises(error) as raised:
        create_kv_indices(**bad_call(**overrides), backend=backend)
    assert str(raised.value) == message


@pytest.mark.parametrize("call, error, message", [
    (lambda: create_kv_indptr(torch.tensor([1.5])), TypeError,
     "kv_lens must have dtype int32 or int64, got torch.float32"),
    (lambda: create_kv_indptr(torch.tensor([1]), 0), ValueError,
     "page_size must be a positive int (at most 2147483647), got 0"),
    (lambda: kv_last_page_len(torch.tensor([1.5]), 4), TypeError,
     "kv_lens must have dtype int32 or int64, got torch.float32"),
    (lambda: kv_last_page_len(torch.tensor([[1]]), 4), ValueError, "kv_lens must be 1-D, got shape (1, 1)"),
    (lambda: kv_last_page_len(torch.tensor([1]), 0), ValueError,
     "page_size must be a positive int (at most 2147483647), got 0"),
    (lambda: kv_last_page_len(torch.tensor([3, -5]), 4), ValueError, "kv_lens[1] = -5 is negative"),
    (lambda: create_kv_indptr(torch.tensor([2**31 - 1, 2**31 - 1], dtype=torch.int32)), ValueError,
     "kv_lens: 4294967294 pages in all, more than kv_indptr's int32 offsets hold (2147483647)"),
])
def test_the_page_count_helpers_refuse_bad_arguments_naming_them(call, error, message):
    with pytest.raises(error) as raised:
        call()
    assert str(raised.value) == message


@pytest.mark.skipif(DEVICE.type != "cpu", reason="values are checked on host tensors only")
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_whose_first_slot_does_not_start_a_page_is_refused(backend):
    table = torch.tensor([[5, 6, 7, 8, 9, 0, 0, 0], [8, 9, 10, 11, 0, 0, 0, 0]], dtype=torch.int32).to(DEVICE)
    with pytest.raises(ValueError, match="request 1: its first slot 5 does not start a page of 4"):
        run(table, [1, 0], [4, 5], page_size=4, backend=backend)
    assert run(table, [1], [4], page_size=4, backend=backend).tolist() == [2]


@pytest.mark.parametrize("name", ["req_pool_indices", "kv_lens", "kv_indptr", "kv_indices"])
def test_strided_1d_arguments_are_refused_by_name(name):
    # The kernels index 1-D arguments densely; a strided view would be read wrongly (and written past its end).
    table = make_table()
    args = {"req_pool_indices": torch.tensor([0, 1]), "kv_lens": torch.tensor([3, 2]),
            "kv_indptr": torch.tensor([0, 3, 5]), "kv_indices": torch.empty(5, dtype=torch.int32)}
    args[name] = torch.stack([args[name], args[name]], 1)[:, 0]
    assert not args[name].is_contiguous()
    with pytest.raises(ValueError, match=f"{name} must be contiguous"):
        create_kv_indices(table.cpu(), args["req_pool_indices"], args["kv_lens"], args["kv_indptr"],
                          kv_indices=args["kv_indices"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_numpy_integer_page_size_works_on_every_backend(backend):
    table = make_table()
    want = run(table, [0, 2], [5, 33], page_size=2, backend=backend)
    assert torch.equal(run(table, [0, 2], [5, 33], page_size=np.int64(2), backend=backend), want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_a_page_size_near_int32s_top_counts_the_page_of_any_length(backend, dtype):
    # kv_len + page_size - 1 passes 2**31 - 1: computed in int32 it wrapped negative and the kernel wrote nothing.
    table = torch.zeros(1, 8, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([5], dtype=dtype, device=DEVICE)
    kv_indptr = create_kv_indptr(lens, 2**31 - 1)
    out = torch.full((1,), -1, dtype=torch.int32, device=DEVICE)
    got = create_kv_indices(table, torch.tensor([0], device=DEVICE), lens, kv_indptr, None, 2**31 - 1, out,
                            backend=backend)
    assert got.tolist() == [0]


def test_kv_indptr_refuses_negative_lengths():
    with pytest.raises(ValueError, match=r"kv_lens\[1\] = -2 is negative"):
        create_kv_indptr(torch.tensor([3, -2, 4]), 2)


# ---- what mutation testing found unpinned (scripts/mutation.py kernels) ------------------------------------
def host(values):
    return torch.tensor(values, dtype=torch.int64)


def dev(values):
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_written_into_the_middle_of_a_given_buffer_fills_exactly_its_range(backend):
    table = make_table(num_rows=3, max_context_len=64)
    rows, lens = dev([2, 0]), dev([9, 16])
    indptr = create_kv_indptr(lens, 4) + 3  # the batch's pages start at entry 3 of a longer buffer
    out = torch.full((int(indptr[-1]),), -7, dtype=torch.int32, device=DEVICE)  # exactly kv_indptr[-1] entries
    got = create_kv_indices(table, rows, lens, indptr, None, 4, out, backend=backend)
    assert got is out and out[:3].tolist() == [-7, -7, -7]
    assert out[3:].tolist() == expected_indices(table, rows, lens, dev([0, 0]), 4).tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_requests_with_no_tokens_take_no_pages_and_their_rows_are_not_read(backend):
    table = make_table(num_rows=3, max_context_len=32)
    table[1, 0] = 5  # a row a request with no tokens names: its first slot starts no page and must not matter
    for lens in ([0, 0], [0, 8]):
        rows, lens = dev([1, 2]), dev(lens)
        got = create_kv_indices(table, rows, lens, create_kv_indptr(lens, 4), None, 4, backend=backend)
        assert got.tolist() == expected_indices(table, rows, lens, dev([0, 0]), 4).tolist()


def test_a_request_may_reach_the_last_column_of_its_row():
    table = make_table(num_rows=2, max_context_len=16).cpu()
    lens, starts = host([16, 8]), host([0, 8])
    got = create_kv_indices(table, host([0, 1]), lens, create_kv_indptr(lens, 2), starts, 2)
    assert got.tolist() == expected_indices(table, host([0, 1]), lens, starts, 2).tolist()


@pytest.mark.parametrize("call, error, message", [
    (lambda table: create_kv_indptr(host([0, -1, 3])), ValueError, "kv_lens[1] = -1 is negative"),
    (lambda table: create_kv_indices(table, host([0, 1]), host([0, -2]), host([0, 0, 0])), ValueError,
     "kv_lens[1] = -2 is negative"),
    (lambda table: create_kv_indices(table, host([0, 1]), host([16, 17]), host([0, 16, 33])), IndexError,
     "request 1: tokens up to 17 exceed req_to_token's max_context_len 16"),
])
def test_a_refusal_names_the_first_request_that_is_wrong(call, error, message):
    with pytest.raises(error) as raised:
        call(make_table(num_rows=2, max_context_len=16).cpu())
    assert str(raised.value) == message


@pytest.mark.parametrize("lens, starts, bad", [
    ([4, 4], None, 1),      # page 2: row 1's first slot is odd
    ([4, 1], None, 1),      # a request of a single token is checked too
    ([2, 2], [0, 2], 1),    # the check reads each request's own start column, not column 0
])
def test_a_range_that_does_not_start_a_page_is_refused_at_page_size_2(lens, starts, bad):
    table = make_table(num_rows=2, max_context_len=16).cpu()
    table[1, 0 if starts is None else starts[1]] = 7
    lens = host(lens)
    with pytest.raises(ValueError) as raised:
        create_kv_indices(table, host([0, 1]), lens, create_kv_indptr(lens, 2),
                          None if starts is None else host(starts), 2)
    assert str(raised.value) == f"request {bad}: its first slot 7 does not start a page of 2 slots, so its page " \
                                "id would be wrong"


@pytest.mark.parametrize("backend", BACKENDS)
def test_page_ids_of_an_int64_table_are_divided_before_they_are_narrowed_to_int32(backend):
    table = torch.zeros(1, 8, dtype=torch.int64, device=DEVICE)
    table[0, 0], table[0, 4] = 2**32, 2**33 - 4  # page ids 2**30 and 2**31 - 1 fit int32; their slots do not
    lens = dev([8])
    got = create_kv_indices(table, dev([0]), lens, create_kv_indptr(lens, 4), None, 4, backend=backend)
    assert got.tolist() == [2**30, 2**31 - 1]


@pytest.mark.skipif(TRITON_RUNS, reason="Triton runs here")
def test_asking_for_triton_where_it_cannot_run_says_how_to_get_it():
    table, lens = make_table(num_rows=1, max_context_len=8).cpu(), host([4])
    with pytest.raises(RuntimeError) as raised:
        create_kv_indices(table, host([0]), lens, create_kv_indptr(lens), backend="triton")
    assert str(raised.value) == ("backend='triton' cannot run on cpu tensors: Triton needs CUDA tensors, or CPU "
                                 "tensors with TRITON_INTERPRET=1 set before the kernels module is imported")
