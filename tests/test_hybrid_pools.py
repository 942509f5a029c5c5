"""The hybrid pools: the paired full/window allocator, the state pool, the per-layer pool map, and sizing by layer
kind."""

import math
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem import MHAKVPool, sizing
from kvmem.hybrid import HybridKVPool, HybridTokenAllocator, StatePool, StateSlotPool

# ---- the paired allocator ------------------------------------------------------------------------------


def test_every_token_gets_a_full_slot_and_a_window_slot():
    alloc = HybridTokenAllocator(16, 8)
    slots = alloc.alloc(5)
    window = alloc.window_slots(slots)
    assert len(set(window.tolist())) == 5 and 0 not in window.tolist()
    assert alloc.available_size() == 11 and alloc.window_available_size() == 3


def test_pages_pair_at_the_same_offsets_so_a_partial_page_continues_in_both():
    alloc = HybridTokenAllocator(32, 16, page_size=4)
    first = alloc.alloc_extend([0], [6], [-1])
    more = alloc.alloc_extend([6], [8], [int(first[-1])])
    last = alloc.alloc_decode([9], [int(more[-1])])
    full = torch.cat([first, more, last])
    window = alloc.window_slots(full)
    assert (window % 4 == full % 4).all()
    assert (window[:8] // 4).unique().numel() == 2 and (window[8:] // 4).unique().numel() == 1


def test_allocation_short_in_either_pool_returns_none_and_changes_nothing():
    alloc = HybridTokenAllocator(16, 4)
    before = (alloc.available_size(), alloc.window_available_size())
    assert alloc.alloc(5) is None  # the window pool has 4
    paged = HybridTokenAllocator(16, 8, page_size=4)
    assert paged.alloc_extend([0], [12], [-1]) is None
    assert paged.alloc_decode([1, 1, 1], [-1, -1, -1]) is None
    assert (alloc.available_size(), alloc.window_available_size()) == before
    assert (paged.available_size(), paged.window_available_size()) == (16, 8)


def test_alloc_window_tail_pairs_only_the_last_pages_and_refuses_what_does_not_fit():
    alloc = HybridTokenAllocator(32, 8, page_size=4)
    slots = alloc.alloc_window_tail(20, 8)  # five full pages, window pages for the last two only
    assert alloc.window_slots(slots).ne(0).tolist() == [False] * 12 + [True] * 8
    assert (alloc.available_size(), alloc.window_available_size()) == (12, 0)
    alloc.check_pairing()
    assert alloc.alloc_window_tail(4, 4) is None  # the window pool is empty: nothing taken
    assert alloc.alloc_window_tail(4, 0).numel() == 4 and alloc.available_size() == 8
    for n, window, match in ((8, 12, r"window_tokens must be a non-negative int \(at most 8\)"),
                             (6, 4, "n 6 must be a multiple of page_size"),
                             (8, 2, "window_tokens 2 must be a multiple of page_size")):
        with pytest.raises(ValueError, match=match):
            alloc.alloc_window_tail(n, window)
    alloc.free(slots)  # full pages, and the two window pages paired with them
    assert (alloc.available_size(), alloc.window_available_size()) == (28, 8)
    alloc.check_pairing()


def test_free_releases_the_window_peers_and_free_window_only_them():
    alloc = HybridTokenAllocator(16, 8, page_size=2)
    slots = alloc.alloc(6)
    alloc.free_window(slots[:2])
    assert alloc.window_slots(slots[:2]).tolist() == [0, 0] and alloc.window_available_size() == 4
    assert alloc.available_size() == 10  # the full slots stay
    alloc.free(slots)  # full pages, and the window pages still paired
    assert (alloc.available_size(), alloc.window_available_size()) == (16, 8)
    alloc.check_pairing()


def test_free_window_refuses_a_slot_without_a_window_slot_and_frees_nothing():
    alloc = HybridTokenAllocator(16, 8)
    slots = alloc.alloc(3)
    alloc.free_window(slots[:1])
    with pytest.raises(ValueError, match="has no window slot"):
        alloc.free_window(slots)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free_window(torch.tensor([9]))
    assert alloc.window_available_size() == 6 and alloc.window_slots(slots[1:]).ne(0).all()


def test_backup_and_restore_cover_both_pools_and_the_pairing():
    alloc = HybridTokenAllocator(16, 8, page_size=2)
    kept = alloc.alloc(4)
    state = alloc.backup_state()
    alloc.free_window(kept[:2])
    alloc.alloc(4)
    alloc.restore_state(state)
    assert alloc.available_size() == 12 and alloc.window_available_size() == 4
    assert alloc.window_slots(kept).ne(0).all()
    with pytest.raises(ValueError, match="HybridTokenAllocator of the same sizes"):
        alloc.restore_state(HybridTokenAllocator(16, 4, page_size=2).backup_state())


def test_a_free_group_batches_both_pools_frees():
    alloc = HybridTokenAllocator(8, 8)
    slots = alloc.alloc(8)
    with alloc.free_group():
        alloc.free(slots[:4])
        assert alloc.available_size() == 0 and alloc.window_available_size() == 0  # pending until the block ends
    assert alloc.available_size() == 4 and alloc.window_available_size() == 4


def test_a_freed_full_page_parks_its_window_page_and_is_handed_out_first_with_it():
    alloc = HybridTokenAllocator(8, 4)
    slots = alloc.alloc(4)  # a fresh pool pairs full page i with window page i
    assert alloc.window_slots(slots).tolist() == [1, 2, 3, 4]
    alloc.free_window(slots[:2])  # full pages 1 and 2 lose theirs; 3 and 4 keep theirs
    alloc.free(slots)
    assert alloc.window_slots(slots).tolist() == [0, 0, 0, 0]  # free slots have none, parked or not
    assert (alloc.available_size(), alloc.window_available_size()) == (8, 4)
    assert type(alloc.available_size()) is int and type(alloc.window_available_size()) is int  # reports: JSON
    alloc.check_pairing()
    again = alloc.alloc(3)  # the parked pages 3 and 4 first, then a bare page that takes a freed window page
    assert again.tolist() == [3, 4, 5] and alloc.window_slots(again).tolist() == [3, 4, 1]
    assert (alloc.available_size(), alloc.window_available_size()) == (5, 1)
    alloc.check_pairing()
    assert alloc.alloc(2) is None  # one window page left: nothing taken
    assert (alloc.available_size(), alloc.window_available_size()) == (5, 1)


def test_alloc_window_tail_unparks_pages_when_bare_ones_run_out():
    alloc = HybridTokenAllocator(8, 8, page_size=2)  # every free page parked
    slots = alloc.alloc_window_tail(6, 2)  # two bare pages: they give their window pages back
    assert alloc.window_slots(slots).ne(0).tolist() == [False] * 4 + [True] * 2
    assert (alloc.available_size(), alloc.window_available_size()) == (2, 6)
    alloc.check_pairing()
    rest = alloc.alloc(2)
    assert alloc.window_slots(rest).ne(0).all() and alloc.window_available_size() == 4
    alloc.free(slots)
    alloc.free(rest)
    assert (alloc.available_size(), alloc.window_available_size()) == (8, 8)
    alloc.check_pairing()


def test_backup_and_restore_cover_the_parked_pages():
    alloc = HybridTokenAllocator(16, 8)
    slots = alloc.alloc(6)
    alloc.free_window(slots[:3])
    alloc.free(slots)
    state = alloc.backup_state()
    first = alloc.alloc(8)
    pairs = alloc.window_slots(first).tolist()
    alloc.restore_state(state)
    alloc.check_pairing()
    again = alloc.alloc(8)
    assert again.tolist() == first.tolist() and alloc.window_slots(again).tolist() == pairs


@pytest.mark.parametrize("corrupt, match", [
    (lambda p: p.window_page.__setitem__(p.parked.listed()[0], 0), "parked full page"),
    (lambda p: p.window_page.__setitem__(p.listed()[0], 7), "not parked|paired with two"),
    (lambda p: p.window.push(np.array([p.window_page[p.parked.listed()[0]]])), "window pages paired"),
])
def test_check_pairing_catches_a_broken_pairing(corrupt, match):
    alloc = HybridTokenAllocator(16, 8)
    alloc.free(alloc.alloc(4))
    alloc.check_pairing()
    corrupt(alloc._pages)
    with pytest.raises(AssertionError, match=match):
        alloc.check_pairing()


def test_the_host_memory_check_counts_the_window_free_list_the_parked_list_and_the_pairing(monkeypatch):
    # 16 bytes a window page (its free list); 24 a full page, with page 0 and the sentinel (parked list, pairing).
    memory = 1000 * 16 + (100 + 2) * 24
    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_PAGE_SIZE": 1, "SC_PHYS_PAGES": memory}[name])
    HybridTokenAllocator(100, 1000)  # exactly what the machine has
    with pytest.raises(ValueError) as raised:
        HybridTokenAllocator(100, 1001)
    assert str(raised.value).startswith("a window pool of size 1001 needs 0.0 GiB of host memory; this machine has ")


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 2, 4]), st.lists(st.tuples(st.sampled_from(["alloc", "alloc_tail", "free", "free_window"]),
                                                      st.integers(1, 3)), max_size=40))
def test_random_allocations_keep_the_pairing_one_to_one(page_size, ops):
    alloc = HybridTokenAllocator(32, 16, page_size=page_size)
    held: list[torch.Tensor] = []  # whole pages each
    for op, n in ops:
        if op in ("alloc", "alloc_tail"):  # alloc_tail: window pages for all but the first page
            slots = alloc.alloc(n * page_size) if op == "alloc" else \
                alloc.alloc_window_tail(n * page_size, (n - 1) * page_size)
            if slots is not None:
                held.append(slots)
        elif held:
            slots = held.pop(n % len(held))
            if op == "free":
                alloc.free(slots)
                assert alloc.window_slots(slots).eq(0).all()  # a freed slot has no window slot
                continue
            if alloc.window_slots(slots).ne(0).all():
                alloc.free_window(slots)
            held.append(slots)
        alloc.check_pairing()
        paired = sum(int(alloc.window_slots(s).ne(0).sum()) for s in held)
        assert alloc.window_available_size() + paired == 16
        assert alloc.available_size() + sum(len(s) for s in held) == 32


# ---- the state pool ------------------------------------------------------------------------------------


def test_a_state_pool_copies_and_zeroes_every_layers_conv_and_ssm_state():
    pool = StatePool(3, num_layers=2, conv_shape=(4, 3), ssm_shape=(2, 2), conv_dtype=torch.bfloat16)
    a, b = pool.allocator.alloc(2).tolist()
    for buf in pool.conv_states + pool.ssm_states:
        buf[a] = 7
    pool.copy(torch.tensor([a]), torch.tensor([b]))
    assert all(bool(buf[b].eq(7).all()) for buf in pool.conv_states + pool.ssm_states)
    pool.zero(torch.tensor([a]))
    assert all(bool(buf[a].eq(0).all()) for buf in pool.conv_states + pool.ssm_states)
    assert pool.ssm_states[0].dtype == torch.float32 and pool.conv_states[1].shape == (4, 4, 3)
    assert pool.mem_usage_bytes() == 4 * pool.bytes_per_slot


@pytest.mark.parametrize("call, match", [
    (lambda p: p.copy(torch.tensor([0]), torch.tensor([1])), "slot 0, out of range"),
    (lambda p: p.copy(torch.tensor([1]), torch.tensor([4])), "slot 4, out of range"),
    (lambda p: p.copy(torch.tensor([1, 2]), torch.tensor([3, 3])), "dst lists a slot more than once"),
    (lambda p: p.copy(torch.tensor([1]), torch.tensor([2, 3])), "same length"),
    (lambda p: p.zero([1]), "slots must be a torch.Tensor"),
])
def test_a_state_pool_refuses_bad_slots_and_changes_nothing(call, match):
    pool = StatePool(3, 1, (2,), (2,), torch.float32)
    pool.ssm_states[0][1:] = 5
    with pytest.raises((ValueError, IndexError, TypeError), match=match):
        call(pool)
    assert bool(pool.ssm_states[0][1:].eq(5).all())


@pytest.mark.parametrize("kwargs, match", [
    (dict(size=0), "size"), (dict(num_layers=0), "num_layers"), (dict(conv_shape=()), "conv_shape"),
    (dict(ssm_shape=(2, 0)), r"ssm_shape\[1\]"), (dict(conv_dtype="bf16"), "conv_dtype"),
])
def test_a_state_pool_names_a_bad_argument(kwargs, match):
    args = dict(size=2, num_layers=1, conv_shape=(2,), ssm_shape=(2,), conv_dtype=torch.float32) | kwargs
    with pytest.raises((ValueError, TypeError), match=match):
        StatePool(**args)


def test_a_state_slot_pool_has_slots_and_no_tensors():
    pool = StateSlotPool(4)
    assert pool.allocator.alloc(4).tolist() == [1, 2, 3, 4]
    pool.copy_slots(np.array([1]), np.array([2]))  # nothing to move


# ---- pools by layer ------------------------------------------------------------------------------------

def kv(layers, page_size=1):
    return MHAKVPool(16, page_size, torch.float32, head_num=1, head_dim=4, layer_num=layers)


def test_each_layer_finds_its_pool_and_its_index_there():
    states = StatePool(2, 3, (2,), (2,), torch.float32)
    pools = HybridKVPool(["linear_attention"] * 3 + ["full_attention"], kv(1), state_pool=states)
    assert [(p.kind, p.index) for p in map(pools.layer, range(4))] == [
        ("linear_attention", 0), ("linear_attention", 1), ("linear_attention", 2), ("full_attention", 0)]
    assert pools.layer(2).pool is states and pools.num_layers == 4
    with pytest.raises(IndexError, match="layer_id 4"):
        pools.layer(4)


@pytest.mark.parametrize("kinds, pools, match", [
    (["sliding_attention", "full_attention"], dict(window_pool=None), "1 sliding or chunked layers, but window_pool"),
    (["sliding_attention"] * 3 + ["full_attention"], dict(window_pool=kv(2)), "3 sliding or chunked layers, but "
                                                                               "window_pool has 2"),
    (["full_attention", "full_attention"], dict(), "2 full_attention layers, but full_pool has 1"),
    (["full_attention", "mamba"], dict(), r"layer_types\[1\] is 'mamba'"),
    ("full_attention", dict(), "layer_types must be a list"),
    (["sliding_attention", "full_attention"], dict(window_pool=kv(1, page_size=2)), "page size"),
])
def test_a_layer_kind_list_that_does_not_match_the_pools_is_refused(kinds, pools, match):
    with pytest.raises((ValueError, TypeError), match=match):
        HybridKVPool(kinds, kv(1), **pools)


# ---- sizing by layer kind ---------------------------------------------------------------------------------

def test_window_aware_bytes_per_token_split_by_layer_kind():
    gemma = sizing.get_hybrid_model_config("gemma-3-27b")
    assert len(gemma.full_layers) == 10 and len(gemma.window_layers) == 52
    assert sizing.full_bytes_per_token(gemma) == 10 * 2 * 16 * 128 * 2 == 81920
    assert sizing.window_bytes_per_token(gemma) == 52 * 8192
    assert sizing.bytes_per_token(sizing.full_attention_config(gemma)) == 62 * 8192
    qwen = sizing.get_hybrid_model_config("qwen3-next-80b")
    assert sizing.window_bytes_per_token(qwen) == 0
    assert sizing.state_bytes(qwen) == 36 * (8192 * 4 * 2 + 32 * 128 * 128 * 4) == 77856768


def test_window_pool_tokens_count_running_windows_cached_tails_and_a_chunk():
    gpt = sizing.get_hybrid_model_config("gpt-oss-120b")
    tail = 128  # W - 1 = 127, in whole pages of 16
    assert sizing.window_pool_tokens(gpt, 16, max_running_requests=4, chunked_prefill_size=1000, cached_windows=2) \
        == 4 * (tail + 64 + 32) + 2 * (tail + 16) + 1008
    assert sizing.window_pool_tokens(sizing.get_hybrid_model_config("qwen3-next-80b"), 16, 4, 1000) == 0


def test_hybrid_capacity_fills_the_budget_left_after_the_window_pool_and_the_states():
    qwen = sizing.get_hybrid_model_config("qwen3-next-80b")
    cap = sizing.hybrid_capacity(qwen, gpu_mem_gb=20, page_size=16, max_running_requests=8)
    assert cap.state_slots == 16 and cap.window_tokens == 0
    assert cap.bytes <= 20 * sizing.GIB < cap.bytes + 16 * sizing.full_bytes_per_token(qwen)
    assert cap.bytes == (cap.full_tokens + 16) * 24576 + 17 * sizing.state_bytes(qwen)


@pytest.mark.parametrize("name, gain", [("gpt-oss-120b", 1.9), ("gemma-3-27b", 3.0)])
def test_window_aware_pools_hold_the_issues_gains_over_full_attention_pools(name, gain):
    # 8 x H100 (80 GB each) less the weights, at 128 running requests: the issue's goals.
    config = sizing.get_hybrid_model_config(name)
    budget = 8 * 80 * 10**9 - {"gpt-oss-120b": 65, "gemma-3-27b": 55}[name] * 10**9
    aware = sizing.hybrid_capacity(config, budget, page_size=16, max_running_requests=128).full_tokens
    full = sizing.tokens_for_budget(sizing.full_attention_config(config), budget, page_size=16)
    assert aware >= gain * full


def test_a_budget_too_small_for_the_window_pool_gives_no_capacity():
    gemma = sizing.get_hybrid_model_config("gemma-3-27b")
    assert sizing.hybrid_capacity(gemma, 10**6, max_running_requests=4) == (0, 0, 0, 0)


def test_a_hybrid_config_is_read_from_a_transformers_config():
    from transformers import GptOssConfig, Qwen3NextConfig

    gpt = sizing.hybrid_config_from_hf(GptOssConfig(num_hidden_layers=4, sliding_window=32))
    assert gpt.layer_types == ("sliding_attention", "full_attention") * 2 and gpt.sliding_window == 32
    qwen = sizing.hybrid_config_from_hf(Qwen3NextConfig(num_hidden_layers=4, linear_num_key_heads=2,
                                                        linear_num_value_heads=4, linear_key_head_dim=8,
                                                        linear_value_head_dim=8))
    assert qwen.linear_layers == (0, 1, 2) and qwen.conv_state_shape == (2 * 2 * 8 + 4 * 8, 4)
    assert qwen.ssm_state_shape == (4, 8, 8)


@pytest.mark.parametrize("kwargs, match", [
    (dict(sliding_window=0), "sliding_window must be a positive int"),
    (dict(sliding_window=5000, max_position_embeddings=4096), "larger than the context"),
    (dict(sliding_window=None), "sliding_window is None, but layer_types has a sliding"),
    (dict(layer_types=("sliding_attention",)), "no full_attention layer"),
    (dict(layer_types=("full_attention", "local")), r"layer_types\[1\] is 'local'"),
    (dict(layer_types="full_attention"), "layer_types must be a list"),
    (dict(conv_state_shape=(4,)), "conv_state_shape is \\(4,\\), but layer_types has no linear_attention"),
    (dict(dtype="fp8"), "dtype must be one of"),
])
def test_a_bad_hybrid_config_names_its_argument(kwargs, match):
    args = dict(layer_types=("sliding_attention", "full_attention"), num_kv_heads=2, head_dim=8,
                sliding_window=16) | kwargs
    with pytest.raises((ValueError, TypeError), match=match):
        sizing.HybridConfig(**args)


def test_a_linear_layer_needs_both_state_shapes():
    with pytest.raises(ValueError, match="ssm_state_shape is \\(\\), but layer_types has a linear_attention"):
        sizing.HybridConfig(("linear_attention", "full_attention"), 2, 8, conv_state_shape=(4, 4))


def test_the_presets_match_their_config_json_layer_counts():
    counts = {name: (len(c.full_layers), len(c.window_layers), len(c.linear_layers))
              for name, c in sizing.HYBRID_MODEL_CONFIGS.items()}
    assert counts == {"gpt-oss-20b": (12, 12, 0), "gpt-oss-120b": (18, 18, 0), "gemma-3-27b": (10, 52, 0),
                      "llama-4-scout": (12, 36, 0), "qwen3-next-80b": (12, 0, 36)}
    assert math.lcm(sizing.STATE_GRID, 16) == 64
