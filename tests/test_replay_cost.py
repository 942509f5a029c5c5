"""The roofline cost model at the edges a capacity planner reaches: a GPU whose memory leaves exactly one page of KV,
links so slow that a load would dominate, bandwidths in decimal gigabytes, a decode step that is compute-bound.
(Its worked examples at ordinary sizes are in test_replay_sim.py.)"""

import numpy as np
import pytest

from kvmem.replay.cost import RooflineCost, kv_copies

# llama-3-8b on one H100: 0.9 x 80 GB of memory, 2 x 8.03e9 bytes of weights, so 55.94 GB left for KV.
LEFT = 80e9 * 0.9 - 8.03e9 * 2
EXACT = 1e-12  # tighter than any float rounding of these formulas, looser than a changed constant


def test_memory_that_leaves_exactly_one_page_beside_the_weights_holds_that_page_and_a_byte_more_none():
    assert LEFT == 55_940_000_000
    assert RooflineCost("H100", "llama-3-8b", kv_bytes_per_token=55_940_000_000).kv_capacity_tokens() == 1
    with pytest.raises(ValueError, match="leave no room for a KV cache"):
        RooflineCost("H100", "llama-3-8b", kv_bytes_per_token=55_940_000_001).kv_capacity_tokens()
    # At page 16 the page, not the token, must fit: 16 tokens of 3,496,250,000 bytes fill it exactly.
    assert RooflineCost("H100", "llama-3-8b", kv_bytes_per_token=3_496_250_000).kv_capacity_tokens(16) == 16
    one_more = RooflineCost("H100", "llama-3-8b", kv_bytes_per_token=3_496_250_001)
    assert one_more.kv_capacity_tokens(1) == 15
    with pytest.raises(ValueError, match="leave no room for a KV cache"):
        one_more.kv_capacity_tokens(16)


def test_a_prefill_that_loads_nothing_costs_no_load_time_however_slow_the_links():
    slow = RooflineCost("H100", "llama-3-8b", h2d_gbps=1e-9, storage_gbps=1e-9)
    fast = RooflineCost("H100", "llama-3-8b")
    prefix, seq = np.array([0]), np.array([1])
    assert slow.extend_seconds(prefix, seq) == fast.extend_seconds(prefix, seq) < 0.01
    assert slow.extend_seconds(prefix, seq, loaded_tokens=1) > 100


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_link_bandwidths_are_in_decimal_gigabytes_per_second_exactly(tp):
    cost = RooflineCost("H100", "llama-3-8b", tp=tp, h2d_gbps=1.0, storage_gbps=1.0, storage_latency_us=250.0)
    n = 10**6  # tokens of 131072 bytes (split over the GPUs), one new token: the load is the step
    prefix, seq = np.array([n]), np.array([n + 1])
    h2d = 131072 * n / (tp * 1e9)
    assert cost.extend_seconds(prefix, seq, loaded_tokens=n) == pytest.approx(h2d, rel=EXACT)
    assert cost.extend_seconds(prefix, seq, loaded_tokens=n, storage_tokens=n) == \
        pytest.approx(h2d + 131072 * n / 1e9 + 250e-6, rel=EXACT)


def test_a_compute_bound_decode_step_counts_the_attention_of_every_kv_token():
    cost = RooflineCost("H100", "llama-3-8b", mfu=0.5, mbu=0.8)
    # 10**5 requests over 10**6 KV tokens: 2 x 8.03e9 FLOPs each through the weights, and 2 x 256 x 32 heads x
    # 32 layers FLOPs per (query, key) pair, at half of 989.5 TFLOP/s; its bytes take under a fiftieth of that.
    flops = 2 * 8.03e9 * 10**5 + 2 * 256 * 32 * 32 * 10**6
    assert cost.decode_seconds(10**5, 10**6) == pytest.approx(flops / (0.5 * 989.5e12))
    assert cost.decode_seconds(10**5, 10**6) > cost.decode_seconds(10**5, 0)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"gpu": "B200"}, ValueError, "^gpu must be one of H100, H200, A100, L40S, got 'B200'$"),
    ({"model": "gpt-5"}, ValueError, "^model must be one of llama-3-8b, llama-3-70b, qwen2.5-7b, mistral-7b, "
                                     "deepseek-v3, got 'gpt-5'$"),
    ({"tp": 0}, ValueError, "^tp must be"), ({"tp": 2.0}, TypeError, "^tp must be"),
    ({"mfu": 0.0}, ValueError, "^mfu must be in"), ({"mbu": 0.0}, ValueError, "^mbu must be in"),
    ({"mfu": "0.5"}, ValueError, "^mfu must be a finite number"), ({"mbu": 1.0 + 1e-9}, ValueError, "^mbu must be in")])
def test_a_roofline_names_what_it_refuses_at_the_edges_of_each_range(kwargs, error, match):
    with pytest.raises(error, match=match):
        RooflineCost(**{"gpu": "H100", "model": "llama-3-8b", **kwargs})


def test_the_kv_copies_of_tensor_parallel_gpus_are_a_whole_number():
    assert [kv_copies("llama-3-8b", tp) for tp in (1, 4, 8, 16, 32)] == [1, 1, 1, 2, 4]
    assert all(type(kv_copies("llama-3-8b", tp)) is int for tp in (16, 32))
