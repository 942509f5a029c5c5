import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvmem.allocator import PagedTokenAllocator, TokenAllocator


def test_alloc_returns_distinct_slots_and_never_slot_zero():
    a = TokenAllocator(16)
    slots = a.alloc(16)
    assert sorted(slots.tolist()) == list(range(1, 17))
    assert slots.dtype == torch.int64 and a.available_size() == 0


def test_alloc_beyond_capacity_returns_none_and_changes_nothing():
    a = TokenAllocator(8)
    a.alloc(5)
    assert a.alloc(4) is None
    assert a.available_size() == 3


@pytest.mark.parametrize("n", [0, -3, 2.0, True])
def test_alloc_of_zero_or_negative_raises(n):
    a = TokenAllocator(8)
    with pytest.raises(ValueError, match="n must be a positive int"):
        a.alloc(n)
    assert a.available_size() == 8


def test_returned_slots_survive_later_frees_and_allocs():
    a = TokenAllocator(4)
    x = a.alloc(2)
    snapshot = x.clone()
    a.free(a.alloc(2))
    a.free(x)
    a.alloc(4)
    assert torch.equal(x, snapshot)


@pytest.mark.parametrize("bad,err,msg", [
    ([0], ValueError, "padding slot 0"),
    ([-2], ValueError, "negative"),
    ([9], IndexError, "out of range"),
    ([3, 3], ValueError, "more than once"),
])
def test_bad_free_raises_and_frees_nothing(bad, err, msg):
    a = TokenAllocator(8)
    a.alloc(8)
    with pytest.raises(err, match=msg):
        a.free(torch.tensor([1] + bad))
    assert a.available_size() == 0
    assert a.is_allocated(torch.tensor([1])).item()


def test_free_listing_a_slot_more_times_than_the_pool_has_slots_raises():
    a = TokenAllocator(4)
    a.alloc(4)
    with pytest.raises(ValueError, match="more than once"):
        a.free(torch.tensor([1] * 6))
    assert a.available_size() == 0


def test_is_allocated_sees_slots_right_after_alloc():
    a = TokenAllocator(8)
    x = a.alloc(3)
    assert a.is_allocated(x).all()
    assert not a.is_allocated(torch.tensor([0, -1, 9, 100])).any()


def test_double_free_raises():
    a = TokenAllocator(8)
    x = a.alloc(3)
    a.free(x)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(x[:1])
    assert a.available_size() == 8


def test_free_rejects_float_and_2d_slots():
    a = TokenAllocator(8)
    a.alloc(4)
    with pytest.raises(TypeError):
        a.free(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="1-D"):
        a.free(torch.tensor([[1]]))


def test_free_group_defers_reuse_until_the_block_ends():
    a = TokenAllocator(4)
    x = a.alloc(4)
    with a.free_group():
        a.free(x[:2])
        a.free(x[2:])
        assert a.available_size() == 0
        with pytest.raises(ValueError):
            a.free(x[:1])  # still caught inside the group
    assert a.available_size() == 4


def test_slots_allocated_inside_a_free_group_stay_allocated_after_it():
    a = TokenAllocator(4)
    x, y = a.alloc(2), a.alloc(2)
    a.free(x)
    a.free(a.alloc(2))  # the free list now ends at the end of its buffer: the group's push compacts it
    with a.free_group():
        a.free(y)
        z = a.alloc(2)
    assert a.is_allocated(z).all()
    a.free(z)
    assert a.available_size() == 4


def test_snapshots_are_refused_inside_a_free_group():
    # A restore there would put the group's pending frees on top of the restored list: slots twice.
    a = TokenAllocator(4)
    x = a.alloc(2)
    state = a.backup_state()
    with a.free_group():
        a.free(x)
        with pytest.raises(RuntimeError,
                           match=r"^backup_state inside free_group\(\): the pending frees would be lost$"):
            a.backup_state()
        with pytest.raises(RuntimeError,
                           match=r"^restore_state inside free_group\(\): the pending frees would double-free$"):
            a.restore_state(state)
    assert a.available_size() == 4 and sorted(a.alloc(4).tolist()) == [1, 2, 3, 4]


def test_backup_and_restore_roll_back_allocations():
    a = TokenAllocator(8)
    x = a.alloc(2)
    state = a.backup_state()
    y = a.alloc(5)
    a.restore_state(state)
    assert a.available_size() == 6
    assert not a.is_allocated(y).any()
    a.free(x)  # what was allocated at the backup still is
    assert a.available_size() == 8


def test_token_allocator_refuses_page_size():
    with pytest.raises(ValueError, match="page_size must be 1"):
        TokenAllocator(8, page_size=4)


def test_paged_alloc_returns_whole_pages():
    a = PagedTokenAllocator(16, 4)
    slots = a.alloc(8)
    assert slots.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="multiple of page_size"):
        a.alloc(3)
    assert a.available_size() == 8


def test_paged_size_must_be_whole_pages():
    with pytest.raises(ValueError, match="multiple of page_size"):
        PagedTokenAllocator(10, 4)


def test_alloc_extend_fills_partial_last_page_first():
    a = PagedTokenAllocator(64, 4)
    first = a.alloc_extend([0, 0], [5, 3], [-1, -1])
    assert first.tolist() == [4, 5, 6, 7, 8, 12, 13, 14]
    # request 0 holds 5 tokens (last slot 8, page 2 offset 0); request 1 holds 3 (last slot 14)
    more = a.alloc_extend([5, 3], [7, 6], [8, 14])
    assert more.tolist() == [9, 10, 15, 16, 17]
    assert a.available_size() == 64 - 16


def test_alloc_decode_takes_a_new_page_only_at_page_boundaries():
    a = PagedTokenAllocator(64, 4)
    s = a.alloc_extend([0, 0], [4, 2], [-1, -1])  # pages 1 (full) and 2 (2 tokens)
    d = a.alloc_decode([5, 3], [s[3], s[5]])
    assert d.tolist() == [12, 10]


@pytest.mark.parametrize("seq,last,msg", [
    ([5, 6], [4], "one entry per request"),
    ([], [], "empty"),
    ([0], [6], "seq_lens must be >= 1"),  # token -1 would sit at offset 3, after slot 6
    ([3], [4], "not the slot of token 1"),  # token 2 at offset 2 follows slot 5, not 4
    ([3], [41], "not the slot of token 1 in an allocated page"),
])
def test_bad_alloc_decode_arguments_raise_and_change_nothing(seq, last, msg):
    a = PagedTokenAllocator(64, 4)
    a.alloc(4)  # page 1: slots 4..7
    with pytest.raises(ValueError, match=msg):
        a.alloc_decode(seq, last)
    assert a.available_size() == 60


def test_alloc_decode_shortage_returns_none_and_changes_nothing():
    a = PagedTokenAllocator(8, 4)
    s = a.alloc(8)
    assert a.alloc_decode([5, 3], [s[3], s[5]]) is None  # request 0 needs a page, none is left
    assert a.available_size() == 0


def test_alloc_extend_shortage_returns_none_and_changes_nothing():
    a = PagedTokenAllocator(8, 4)
    assert a.alloc_extend([0], [9], [-1]) is None
    assert a.available_size() == 8


@pytest.mark.parametrize("prefix,seq,last,msg", [
    ([0, 0], [4], [-1], "one entry per request"),
    ([2], [2], [5], "prefix_lens < seq_lens"),
    ([-1], [2], [5], "prefix_lens < seq_lens"),
    ([2], [5], [6], "not the slot of token 1"),
    ([2], [5], [41], "not in an allocated page"),
])
def test_misaligned_paged_arguments_raise(prefix, seq, last, msg):
    a = PagedTokenAllocator(64, 4)
    a.alloc(4)  # page 1: slots 4..7
    with pytest.raises(ValueError, match=msg):
        a.alloc_extend(prefix, seq, last)
    assert a.available_size() == 60


def test_paged_free_releases_pages_listed_from_their_first_slot():
    a = PagedTokenAllocator(16, 4)
    s = a.alloc_extend([0], [6], [-1])  # slots 4..9: page 1 whole, page 2 partial
    with pytest.raises(ValueError, match="mid-page"):
        a.free(s[5:])
    a.free(s)
    assert a.available_size() == 16


def test_paged_free_accepts_slots_in_any_order_or_page_starts_alone():
    a = PagedTokenAllocator(32, 4)
    s = a.alloc(12)  # pages 1..3
    a.free(s[[9, 0, 11, 2, 8, 1, 10, 3]])  # pages 1 and 3, shuffled
    a.free(s[4:5])  # page 2 by its first slot alone
    assert a.available_size() == 32


@pytest.mark.parametrize("bad,err", [([4], ValueError), ([40], IndexError), ([8, 9], ValueError), ([13], ValueError)])
def test_paged_free_mixing_held_and_bad_pages_frees_nothing(bad, err):
    a = PagedTokenAllocator(32, 4)
    s = a.alloc(8)  # pages 1 and 2: slots 4..11
    a.free(s[:4])  # page 1 is free again
    with pytest.raises(err):
        a.free(torch.tensor([8, 9] + bad))  # page 2 is fine; page 1 freed twice, page 10 past the pool,
    assert a.available_size() == 28     # page 2 listed twice, slot 13 mid-page of a page not listed
    assert a.is_allocated(s[4:]).all()


def test_paged_double_free_of_a_page_raises():
    a = PagedTokenAllocator(16, 4)
    s = a.alloc(8)
    a.free(s[:4])
    with pytest.raises(ValueError, match="not allocated"):
        a.free(s)
    assert a.available_size() == 12


class AllocatorModel(RuleBasedStateMachine):
    """Random alloc/free sequences against a set of held slots."""

    @initialize(page_size=st.sampled_from([1, 4]), pages=st.integers(1, 12))
    def setup(self, page_size, pages):
        self.ps = page_size
        self.size = pages * page_size
        self.a = TokenAllocator(self.size) if page_size == 1 else PagedTokenAllocator(self.size, page_size)
        self.held: list[list[int]] = []
        self.snapshot = None

    @rule(n=st.integers(1, 20))
    def alloc(self, n):
        n *= self.ps
        free_before = self.a.available_size()
        out = self.a.alloc(n)
        if n > free_before:
            assert out is None
        else:
            slots = out.tolist()
            assert len(slots) == n
            assert not set(slots) & {s for run in self.held for s in run}
            assert all(1 * self.ps <= s < self.size + self.ps for s in slots)
            self.held.append(slots)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100), reverse=st.booleans())
    def free(self, i, reverse):
        run = self.held.pop(i % len(self.held))
        self.a.free(torch.tensor(run[::-1] if reverse else run))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100), n=st.integers(1, 3), then_free=st.booleans())
    def owned_frees(self, i, n, then_free):
        # The tree's and the scheduler's trusted frees keep the flags exact: a checked call after any number of them
        # refuses a slot freed that way and takes one that is held.
        freed = []
        for _ in range(min(n, len(self.held))):
            run = self.held.pop(i % len(self.held))
            self.a.free_owned(np.asarray(run, dtype=np.int64))
            freed.append(run)
        with pytest.raises(ValueError, match="not allocated"):
            self.a.free(torch.tensor(freed[-1][:self.ps]))
        if then_free and self.held:
            self.a.free(torch.tensor(self.held.pop()))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100), bad=st.sampled_from(["padding", "past_end", "repeat"]))
    def rejected_free_changes_nothing(self, i, bad):
        run = self.held[i % len(self.held)]
        extra = {"padding": 0, "past_end": self.size + self.ps, "repeat": run[0]}[bad]
        free_before = self.a.available_size()
        with pytest.raises((ValueError, IndexError)):
            self.a.free(torch.tensor(run + [extra]))
        assert self.a.available_size() == free_before

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100), n=st.integers(1, 4))
    def alloc_inside_free_group(self, i, n):
        with self.a.free_group():
            self.a.free(torch.tensor(self.held.pop(i % len(self.held))))
            out = self.a.alloc(n * self.ps)
            if out is not None:
                self.held.append(out.tolist())

    @rule()
    def backup(self):
        self.snapshot = self.a.backup_state(), [list(r) for r in self.held]

    @precondition(lambda self: self.snapshot is not None)
    @rule()
    def restore(self):
        state, held = self.snapshot
        self.a.restore_state(state)
        self.held = [list(r) for r in held]

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def double_free_is_refused(self, i):
        run = self.held[i % len(self.held)]
        self.a.free(torch.tensor(run))
        with pytest.raises(ValueError):
            self.a.free(torch.tensor(run[:self.ps]))
        self.held.remove(run)

    @invariant()
    def free_plus_held_is_total(self):
        if hasattr(self, "a"):
            assert self.a.available_size() + sum(len(r) for r in self.held) == self.size
            held = [s for r in self.held for s in r]
            assert self.a.is_allocated(torch.tensor(held, dtype=torch.int64)).all()
            free = sorted(set(range(self.ps, self.size + self.ps)) - set(held))
            assert not self.a.is_allocated(torch.tensor(free, dtype=torch.int64)).any()


TestAllocatorModel = AllocatorModel.TestCase
TestAllocatorModel.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_alloc_extend_gives_each_token_a_distinct_slot_in_its_requests_pages(data):
    ps = data.draw(st.sampled_from([1, 2, 4, 16]))
    a = PagedTokenAllocator(512 * ps, ps)
    bs = data.draw(st.integers(1, 6))
    prefix = data.draw(st.lists(st.integers(0, 40), min_size=bs, max_size=bs))
    ext = data.draw(st.lists(st.integers(1, 40), min_size=bs, max_size=bs))
    rows = []
    last = []
    for p in prefix:  # give each request its prefix first
        row = a.alloc_extend([0], [p], [-1]).tolist() if p else []
        rows.append(row)
        last.append(row[-1] if row else -1)
    out = a.alloc_extend(prefix, [p + e for p, e in zip(prefix, ext)], last).tolist()
    off = 0
    everything = [s for r in rows for s in r] + out
    assert len(set(everything)) == len(everything)
    for row, e in zip(rows, ext):
        row += out[off:off + e]
        off += e
        # positions map to slots page by page: token t sits at offset t % ps of its page
        assert all(s % ps == t % ps for t, s in enumerate(row))
        assert all(row[t] // ps == row[t - t % ps] // ps for t in range(len(row)))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_alloc_decode_gives_the_same_slots_as_a_one_token_extend(data):
    ps = data.draw(st.sampled_from([1, 4, 16]))
    lens = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=8))
    pages = data.draw(st.integers(sum(lens), sum(lens) + 8))  # sometimes too few for the step: None
    twins = [PagedTokenAllocator(pages * ps, ps) for _ in range(2)]
    for a in twins:
        last = [a.alloc_extend([0], [n], [-1])[-1].item() for n in lens]
    seq = [n + 1 for n in lens]
    decode = twins[0].alloc_decode(seq, last)
    extend = twins[1].alloc_extend(lens, seq, last)
    assert (decode is None and extend is None) or decode.tolist() == extend.tolist()
    assert twins[0].available_size() == twins[1].available_size()


@pytest.mark.parametrize("page_size", [1, 4])
def test_an_owned_free_of_one_page_or_of_nothing(page_size):
    import numpy as np

    alloc = TokenAllocator(64) if page_size == 1 else PagedTokenAllocator(64, page_size)
    slots = alloc.alloc(page_size)
    alloc.free_owned(np.empty(0, dtype=np.int64))
    assert alloc.available_size() == 64 - page_size
    alloc.free_owned(slots.numpy().astype(np.int64)[:1])  # a page is named by its first slot
    assert alloc.available_size() == 64 and not alloc.is_allocated(slots).any()


@pytest.mark.parametrize("page_size", [1, 4])
def test_owned_free_gives_slots_back_like_free(page_size):
    import numpy as np

    alloc = TokenAllocator(64) if page_size == 1 else PagedTokenAllocator(64, page_size)
    slots = alloc.alloc(16)
    alloc.free_owned(slots.numpy().astype(np.int64))
    assert alloc.available_size() == 64
    assert not alloc.is_allocated(slots).any()
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(slots)
    again = alloc.alloc(64)
    assert sorted(again.tolist()) == list(range(page_size, 64 + page_size))


# ---- every refusal names the argument, the request and the value -------------------------------------------
# The messages are the user's only clue to a bad call, so each is pinned whole.
def paged_with_page_1():
    a = PagedTokenAllocator(64, 4)
    a.alloc(4)  # page 1: slots 4..7
    return a


@pytest.mark.parametrize("call, error, message", [
    (lambda a: a.alloc_extend([0.5], [2], [-1]), TypeError, "prefix_lens must hold integers, got dtype float64"),
    (lambda a: a.alloc_extend([0], [2.5], [-1]), TypeError, "seq_lens must hold integers, got dtype float64"),
    (lambda a: a.alloc_extend([0], [2], [-1.5]), TypeError, "last_loc must hold integers, got dtype float64"),
    (lambda a: a.alloc_extend([], [], []), ValueError, "seq_lens is empty: nothing to allocate"),
    (lambda a: a.alloc_extend([0, 4], [4, 3], [-1, 7]), ValueError,
     "request 1: need 0 <= prefix_lens < seq_lens, got 4 and 3"),
    (lambda a: a.alloc_extend([2], [5], [6]), ValueError,
     "request 0: last_loc 6 is not the slot of token 1 (offset 2 in its page, expected 1)"),
    (lambda a: a.alloc_extend([0, 3, 3], [4, 5, 6], [-1, 6, 6]), ValueError,
     "last_loc continues page 1 for more than one request; a partial page belongs to one request"),
    (lambda a: a.alloc_decode([2.5], [4]), TypeError, "seq_lens must hold integers, got dtype float64"),
    (lambda a: a.alloc_decode([2], [4.5]), TypeError, "last_loc must hold integers, got dtype float64"),
    (lambda a: a.alloc_decode([], []), ValueError, "seq_lens is empty: nothing to allocate"),
    (lambda a: a.alloc_decode([1, 0], [-1, 4]), ValueError, "request 1: seq_lens must be >= 1, got 0"),
    (lambda a: a.alloc(0), ValueError, "n must be a positive int, got 0"),
    (lambda a: a.free(torch.tensor([4.0])), TypeError, "slots must hold integers, got dtype torch.float32"),
    (lambda a: a.free(torch.tensor([4, 9])), ValueError, "slots must list pages from their first slot; slot 9 "
                                                         "starts mid-page"),
    (lambda a: a.free(torch.tensor([4, 1001])), IndexError, "slots: slot 1001 out of range [4, 68)"),
    (lambda a: a.free(torch.tensor([4, 2])), ValueError,
     "slots must list pages from their first slot; slot 2 starts mid-page"),
    (lambda a: a.free(torch.tensor([8])), ValueError, "slots: page 2 is not allocated (double free?)"),
    (lambda a: a.is_allocated(torch.tensor([4.0])), TypeError, "slots must hold integers, got dtype torch.float32"),
    (lambda a: a.restore_state(object()), ValueError,
     "state must come from backup_state() of an allocator of the same size"),
    (lambda a: a.restore_state(TokenAllocator(8).backup_state()), ValueError,
     "state must come from backup_state() of an allocator of the same size"),
    (lambda a: a._pages.pop(-1), ValueError, "cannot take -1 pages"),
])
def test_bad_paged_calls_raise_naming_the_argument_and_change_nothing(call, error, message):
    a = paged_with_page_1()
    with pytest.raises(error) as raised:
        call(a)
    assert str(raised.value) == message
    assert a.available_size() == 60 and a.is_allocated(torch.tensor([4, 5, 6, 7])).all()


@pytest.mark.parametrize("slots, message", [([0], "slots: slot/page 0 is the padding slot 0"),
                                            ([-1], "slots: slot/page -1 is negative")])
def test_freeing_the_padding_slot_or_a_negative_one_says_which(slots, message):
    a = TokenAllocator(8)
    a.alloc(8)
    with pytest.raises(ValueError) as raised:
        a.free(torch.tensor(slots))
    assert str(raised.value) == message


@pytest.mark.parametrize("make, message", [
    (lambda: TokenAllocator(0), "size must be a positive int, got 0"),
    (lambda: TokenAllocator(2.0), "size must be a positive int, got 2.0"),
    (lambda: PagedTokenAllocator(8, 0), "page_size must be a positive int, got 0"),
    (lambda: PagedTokenAllocator(8, "4"), "page_size must be a positive int, got '4'"),
])
def test_bad_allocator_sizes_raise_naming_the_argument(make, message):
    with pytest.raises(ValueError) as raised:
        make()
    assert str(raised.value) == message


def test_the_host_memory_check_counts_33_bytes_a_page(monkeypatch):
    # Two pages of slack for page 0 and the sentinel; the ring (16), flag (1), scratch (8) and arange (8); and
    # the offsets within a page (8 bytes a slot of one page).
    memory = (100 + 2) * 33 + 8 * 4
    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_PAGE_SIZE": 1, "SC_PHYS_PAGES": memory}[name])
    PagedTokenAllocator(400, 4)  # 100 pages: exactly what the machine has
    with pytest.raises(ValueError) as raised:
        PagedTokenAllocator(404, 4)
    assert str(raised.value).startswith("an allocator of size 404 needs 0.0 GiB of host memory; this machine has ")


def test_a_new_request_with_a_page_aligned_prefix_needs_no_last_loc():
    a = PagedTokenAllocator(64, 4)
    assert a.alloc_extend([16], [18], [-1]).tolist() == [4, 5]  # its first 16 tokens are cached pages


def test_the_first_decode_of_a_request_with_no_tokens_yet_takes_a_new_page():
    a = PagedTokenAllocator(8, 1)
    assert a.alloc_decode([1], [-1]).tolist() == [1]
    assert a.alloc(1).tolist() == [2] and a.available_size() == 6


def test_an_extend_longer_than_the_pool_is_a_shortage_whatever_the_sum():
    a = PagedTokenAllocator(64, 4)
    assert a.alloc_extend([0, 0], [65, 2**62], [-1, -1]) is None
    assert a.available_size() == 64


def test_clear_frees_every_slot_and_ends_a_pending_free_group():
    a = TokenAllocator(8)
    x = a.alloc(5)
    a.clear()
    assert a.available_size() == 8 and not a.is_allocated(x).any()
    a.free(a.alloc(8))  # frees go to the list at once again
    assert a.available_size() == 8


@pytest.mark.parametrize("page_size, slots, repeated", [
    (1, [3, 1, 2], False), (1, [3, 1, 3], True), (2, [2, 3, 6, 7], False), (2, [2, 3, 6, 7, 2, 3], True),
    (4, [4, 5, 6, 7], False)])
def test_has_repeated_pages_reads_one_slot_a_page(page_size, slots, repeated):
    a = TokenAllocator(8) if page_size == 1 else PagedTokenAllocator(8, page_size)
    assert a.has_repeated_pages(np.array(slots, dtype=np.int64)) is repeated


@pytest.mark.parametrize("page_size, slots, orphan", [(4, [8, 7], 7), (4, [4, 9], 9), (3, [3, 5, 7], 7)])
def test_a_slot_whose_page_is_not_listed_from_its_start_is_refused_wherever_it_sits(page_size, slots, orphan):
    # Slot `orphan` lies in a page none of whose listed slots starts: freeing it would free the wrong page.
    a = PagedTokenAllocator(24, page_size)
    a.alloc(24)
    with pytest.raises(ValueError) as raised:
        a.free(torch.tensor(slots))
    assert str(raised.value) == f"slots must list pages from their first slot; slot {orphan} starts mid-page"
    assert a.available_size() == 0


def test_is_allocated_reads_slots_as_pages_at_every_page_size():
    a = PagedTokenAllocator(8, 2)  # pages 1..4: slots 2..9
    a.alloc(2)
    assert a.is_allocated(torch.tensor([2, 3, 4, 1, 9])).tolist() == [True, True, False, False, False]


def test_two_requests_continuing_one_partial_page_are_refused_naming_that_page():
    a = PagedTokenAllocator(64, 4)
    a.alloc(8)  # pages 1 and 2
    with pytest.raises(ValueError) as raised:
        a.alloc_extend([1, 1, 1], [2, 2, 2], [4, 8, 8])  # page 1 once, page 2 twice
    assert str(raised.value) == ("last_loc continues page 2 for more than one request; a partial page belongs to one "
                                 "request")


def test_extends_whose_page_count_would_overflow_are_a_shortage():
    a = PagedTokenAllocator(64, 1)
    assert a.alloc_extend([0, 0], [2**62, 2**62], [-1, -1]) is None and a.available_size() == 64


@pytest.mark.parametrize("as_numpy", [False, True])
def test_a_free_group_frees_the_slots_given_even_if_the_caller_reuses_its_array(as_numpy):
    alloc = TokenAllocator(8)
    buf = alloc.alloc(4).clone()
    if as_numpy:
        buf = buf.numpy()
    with alloc.free_group():
        alloc.free(torch.from_numpy(buf) if as_numpy else buf)
        taken = alloc.alloc(4)
        buf[:] = taken.numpy() if as_numpy else taken  # a persistent out_cache_loc buffer, refilled
    assert sorted(alloc.alloc(4).tolist()) == [1, 2, 3, 4]
    assert alloc.is_allocated(torch.arange(1, 9)).all()


def test_a_page_size_too_large_for_this_machine_is_refused_by_name():
    with pytest.raises(ValueError, match="an allocator of size"):
        PagedTokenAllocator(2**40, 2**40)
