"""The replay's cost models: worked examples of the fixed step and the roofline at ordinary sizes, then the edges a
capacity planner reaches (a GPU whose memory leaves exactly one page of KV, links so slow that a load would dominate,
bandwidths in decimal gigabytes, a decode step that is compute-bound), then hybrid models priced by layer kind."""

import dataclasses

import numpy as np
import pytest

from kvmem import sizing
from kvmem.replay.config import ReplayConfig
from kvmem.replay.cost import GPUS, MODEL_COMPUTE, RooflineCost, StepCost, cost_model, kv_copies
from kvmem.replay.simulator import replay
from kvmem.replay.traces import TraceRequest

# ---- worked examples at ordinary sizes -------------------------------------------------------------------------

def test_the_fixed_step_cost_is_the_replays_original_clock():
    cost = StepCost()
    assert cost.extend_seconds(np.array([0, 10]), np.array([100, 60])) == 0.03 + 150 / 50_000
    assert cost.decode_seconds(64, 10**6) == 0.03 and cost.prefill_seconds_saved(500) == 0.01
    assert cost_model(ReplayConfig(capacity_tokens=10, max_context_len=10)) == StepCost()


def test_every_sizing_model_has_a_compute_shape():
    assert set(MODEL_COMPUTE) == set(sizing.MODEL_CONFIGS) | set(sizing.HYBRID_MODEL_CONFIGS)


def test_a_long_prefill_is_compute_bound_and_a_decode_step_bandwidth_bound():
    cost = RooflineCost("H100", "llama-3-8b", tp=1, mfu=0.5, mbu=0.8)
    h100 = GPUS["H100"]
    # 4096 new tokens: 2 x 8.03e9 FLOPs each through the weights, plus 4096 x 4097 / 2 causal pairs at
    # 2 x (128 + 128) x 32 heads x 32 layers FLOPs each, at half of 989.5 TFLOP/s.
    flops = 2 * 8.03e9 * 4096 + 4096 * 4097 / 2 * 2 * 256 * 32 * 32
    assert cost.extend_seconds(np.array([0]), np.array([4096])) == pytest.approx(flops / (0.5 * 989.5e12))
    # 64 requests of 2048 tokens: the weights (16.06 GB) and 131072 tokens x 131072 bytes of KV at 80% of 3.35 TB/s.
    moved = 8.03e9 * 2 + 64 * 2048 * 131072
    assert cost.decode_seconds(64, 64 * 2048) == pytest.approx(moved / (0.8 * h100.memory_tbps * 1e12))
    # A cached prefix saves its linear FLOPs and the attention among its own tokens.
    assert cost.prefill_seconds_saved(4096) == pytest.approx(cost.extend_seconds(np.array([0]), np.array([4096])))
    two = RooflineCost("H100", "llama-3-8b", tp=2)
    assert two.decode_seconds(64, 64 * 2048) == pytest.approx(cost.decode_seconds(64, 64 * 2048) / 2)


def test_loads_from_the_host_overlap_the_prefill_they_feed():
    cost = RooflineCost("H100", "llama-3-8b", h2d_gbps=50.0)
    compute = cost.extend_seconds(np.array([20000]), np.array([20100]))
    loaded = cost.extend_seconds(np.array([20000]), np.array([20100]), loaded_tokens=20000)
    assert loaded == pytest.approx(max(compute, 20000 * 131072 / 50e9)) and loaded > compute


def test_a_prefill_after_a_cached_prefix_and_a_huge_decode_batch_are_priced_by_the_roofline():
    cost = RooflineCost("H100", "llama-3-8b", mfu=0.5, mbu=0.8)
    flops_per_s, bytes_per_s = 0.5 * 989.5e12, 0.8 * 3.35e12
    # Queries 1000..5095 attend to keys 1..1001 .. 1..5096: (5096 x 5097 - 1000 x 1001) / 2 pairs.
    flops = 2 * 8.03e9 * 4096 + (5096 * 5097 - 1000 * 1001) / 2 * 2 * 256 * 32 * 32
    assert cost.extend_seconds(np.array([1000]), np.array([5096])) == pytest.approx(flops / flops_per_s)
    # One new token after 10**6 cached ones: bandwidth-bound, it reads the weights and every token's KV once.
    moved = 8.03e9 * 2 + (10**6 + 1) * 131072
    assert cost.extend_seconds(np.array([10**6]), np.array([10**6 + 1])) == pytest.approx(moved / bytes_per_s)
    # 10**5 requests decoding with no KV: compute-bound, every one through the weights.
    assert cost.decode_seconds(10**5, 0) == pytest.approx(2 * 8.03e9 * 10**5 / flops_per_s)


def test_cost_models_take_the_edges_of_their_ranges_and_each_gpus_own_host_link():
    assert StepCost(decode_step_s=0).extend_seconds(np.array([0]), np.array([500])) == 0.01
    full = RooflineCost("H100", "llama-3-8b", mfu=1.0, mbu=1.0)
    assert full.decode_seconds(1, 0) == pytest.approx(8.03e9 * 2 / 3.35e12)
    assert [RooflineCost(gpu, "llama-3-8b").h2d_gbps for gpu in ("H100", "A100", "L40S")] == [50.0, 25.0, 25.0]


@pytest.mark.parametrize("model, tp, copies", [("llama-3-8b", 2, 1), ("llama-3-8b", 16, 2), ("deepseek-v3", 8, 8)])
def test_under_tensor_parallelism_each_gpu_loads_its_share_of_the_kv_over_its_own_host_link(model, tp, copies):
    # llama-3-8b's 8 KV heads split over 2 GPUs, or each kept twice over 16; deepseek-v3's latent whole on all 8.
    cost = RooflineCost("H100", model, tp=tp, h2d_gbps=50.0, storage_gbps=10.0)
    n, kv = 10**6, cost.kv_bytes_per_token * copies  # tokens loaded; a token's KV on all the GPUs together
    prefix, seq = np.array([n]), np.array([n + 1])   # one new token: the load is the step
    assert cost.extend_seconds(prefix, seq, loaded_tokens=n) == pytest.approx(kv * n / (tp * 50e9))
    # Read from the storage tier first (a round trip, then the bytes), then over the host links: one store,
    # shared by every GPU.
    assert cost.extend_seconds(prefix, seq, loaded_tokens=n, storage_tokens=n) == \
        pytest.approx(kv * n / (tp * 50e9) + cost.storage_latency_us * 1e-6 + kv * n / 10e9)


def test_a_prefill_that_reads_from_storage_waits_one_round_trip_then_the_bytes_at_its_bandwidth():
    cost = RooflineCost("H100", "llama-3-8b", storage_gbps=10.0, storage_latency_us=250.0)
    compute = cost.extend_seconds(np.array([20000]), np.array([20100]))
    host_only = cost.extend_seconds(np.array([20000]), np.array([20100]), loaded_tokens=20000)
    read = cost.extend_seconds(np.array([20000]), np.array([20100]), loaded_tokens=20000, storage_tokens=20000)
    assert host_only == pytest.approx(max(compute, 20000 * 131072 / 50e9))
    assert read == pytest.approx(20000 * 131072 * (1 / 50e9 + 1 / 10e9) + 250e-6) and read > host_only
    assert RooflineCost("H100", "llama-3-8b").storage_latency_us == 100.0
    for bad in (-1.0, float("inf"), "5"):
        with pytest.raises(ValueError, match="storage_latency_us"):
            RooflineCost("H100", "llama-3-8b", storage_latency_us=bad)
        with pytest.raises(ValueError, match="storage_latency_us"):
            ReplayConfig(capacity_tokens=4096, max_context_len=512, storage_latency_us=bad)
    config = ReplayConfig(capacity_tokens=4096, max_context_len=512, gpu="H100", storage_latency_us=30.0)
    assert cost_model(config).storage_latency_us == 30.0


def test_the_kv_capacity_of_a_gpu_server_is_what_its_memory_leaves_beside_the_weights():
    cost = RooflineCost("H100", "llama-3-70b", tp=8)
    left = 8 * 80e9 * 0.9 - 70.6e9 * 2
    assert cost.kv_capacity_tokens(16) == int(left // (327680 * 16)) * 16
    with pytest.raises(ValueError, match="leave no room for a KV cache"):
        RooflineCost("H100", "deepseek-v3", tp=1).kv_capacity_tokens()


def test_kv_that_tensor_parallelism_cannot_split_is_counted_on_every_gpu_that_keeps_it():
    # MLA's latent is whole on every GPU; 8 KV heads on 16 GPUs are each kept twice (as vLLM and SGLang do).
    mla = RooflineCost("H200", "deepseek-v3", tp=8)
    assert mla.kv_capacity_tokens() == int((8 * 141e9 * 0.9 - 671e9 * 1) // (70272 * 8))
    wide, split = RooflineCost("H100", "llama-3-8b", tp=16), RooflineCost("H100", "llama-3-8b", tp=8)
    assert wide.kv_capacity_tokens() == int((16 * 80e9 * 0.9 - 8.03e9 * 2) // (131072 * 2))
    assert split.kv_capacity_tokens() == int((8 * 80e9 * 0.9 - 8.03e9 * 2) // 131072)
    for cost, copies in ((wide, 2), (split, 1)):
        kv_read = cost.decode_seconds(64, 10**6) - cost.decode_seconds(64, 0)
        assert kv_read == pytest.approx(copies * 131072 * 10**6 / (cost.tp * 3.35e12 * 0.8))


@pytest.mark.parametrize("kwargs, match", [({"gpu": "B200"}, "gpu must be one of"),
                                           ({"model": "gpt-5"}, "model must be one of"),
                                           ({"tp": 0}, "tp"), ({"mfu": 1.5}, "mfu"),
                                           ({"tp": 3}, "tp 3 must divide llama-3-8b's 32 attention heads"),
                                           ({"model": "qwen2.5-7b", "tp": 14},
                                            "tp 14 must divide qwen2.5-7b's 4 KV heads, or be a multiple of them")])
def test_a_bad_roofline_is_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RooflineCost(**{"gpu": "H100", "model": "llama-3-8b", **kwargs})


# ---- at the edges ------------------------------------------------------------------------------------------------
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
                                     "deepseek-v3, gpt-oss-20b, gpt-oss-120b, gemma-3-27b, llama-4-scout, "
                                     "qwen3-next-80b, got 'gpt-5'$"),
    ({"tp": 0}, ValueError, "^tp must be"), ({"tp": 2.0}, TypeError, "^tp must be"),
    ({"mfu": 0.0}, ValueError, "^mfu must be in"), ({"mbu": 0.0}, ValueError, "^mbu must be in"),
    ({"mfu": "0.5"}, ValueError, "^mfu must be a finite number"), ({"mbu": 1.0 + 1e-9}, ValueError, "^mbu must be in")])
def test_a_roofline_names_what_it_refuses_at_the_edges_of_each_range(kwargs, error, match):
    with pytest.raises(error, match=match):
        RooflineCost(**{"gpu": "H100", "model": "llama-3-8b", **kwargs})


def test_the_kv_copies_of_tensor_parallel_gpus_are_a_whole_number():
    assert [kv_copies("llama-3-8b", tp) for tp in (1, 4, 8, 16, 32)] == [1, 1, 1, 2, 4]
    assert all(type(kv_copies("llama-3-8b", tp)) is int for tp in (16, 32))


def test_a_replay_config_naming_a_gpu_prices_with_every_cost_field_it_gives():
    fields = dict(kv_bytes_per_token=1000, h2d_gbps=12.5, storage_gbps=3.0, storage_latency_us=7.0)
    config = ReplayConfig(capacity_tokens=4096, max_context_len=512, gpu="A100", model="qwen2.5-7b", tp=4, **fields)
    assert cost_model(config) == RooflineCost("A100", "qwen2.5-7b", 4, **fields)
    # Without a model, a GPU prices the default model (DEFAULT_KV_BYTES_PER_TOKEN's).
    assert cost_model(ReplayConfig(capacity_tokens=4096, max_context_len=512, gpu="L40S")) == \
        RooflineCost("L40S", "llama-3-8b")


@pytest.mark.parametrize("kwargs, error, match", [
    ({"kv_bytes_per_token": 0}, ValueError, "^kv_bytes_per_token must be a positive int, got 0$"),
    ({"kv_bytes_per_token": 2.0}, TypeError, "^kv_bytes_per_token must be"),
    ({"h2d_gbps": 0}, ValueError, r"^h2d_gbps must be a finite number > 0, got 0$"),
    ({"h2d_gbps": -1.0}, ValueError, "^h2d_gbps must be"), ({"h2d_gbps": "8"}, ValueError, "^h2d_gbps must be"),
    ({"storage_gbps": 0.0}, ValueError, r"^storage_gbps must be a finite number > 0, got 0.0$"),
    ({"storage_gbps": -1.0}, ValueError, "^storage_gbps must be"),
    ({"storage_gbps": None}, ValueError, "^storage_gbps must be"),
    ({"storage_latency_us": -1e-9}, ValueError, r"^storage_latency_us must be a finite number >= 0, got -1e-09$"),
    ({"storage_latency_us": float("inf")}, ValueError, "^storage_latency_us must be")])
def test_a_roofline_names_the_bad_kv_size_link_or_latency_it_refuses(kwargs, error, match):
    with pytest.raises(error, match=match):
        RooflineCost(**{"gpu": "H100", "model": "llama-3-8b", **kwargs})


def test_a_roofline_takes_the_least_kv_size_and_latency_and_the_slowest_links():
    cost = RooflineCost("H100", "llama-3-8b", kv_bytes_per_token=1, h2d_gbps=1e-12, storage_gbps=1e-12,
                        storage_latency_us=0)
    assert cost.kv_bytes_per_token == 1 and cost.storage_latency_us == 0.0
    assert cost.h2d_gbps == 1e-12 and cost.storage_gbps == 1e-12


def test_weights_that_leave_no_room_are_named_in_decimal_gigabytes():
    # llama-3-70b's 141 GB of bf16 weights on one L40S (0.9 x 48 GB).
    with pytest.raises(ValueError, match=r"^llama-3-70b's weights \(141 GB\) leave no room .* \(43 GB\): raise --tp"):
        RooflineCost("L40S", "llama-3-70b").kv_capacity_tokens()


@pytest.mark.parametrize("kwargs, match", [({"decode_step_s": -1e-9}, "decode_step_s"),
                                           ({"prefill_tokens_per_s": 0.0}, "prefill_tokens_per_s"),
                                           ({"prefill_tokens_per_s": float("nan")}, "prefill_tokens_per_s")])
def test_a_fixed_step_cost_refuses_either_bad_field_alone_by_name(kwargs, match):
    with pytest.raises(ValueError, match=f"^need decode_step_s >= 0 and prefill_tokens_per_s > 0, got .*{match}"):
        StepCost(**kwargs)


def test_a_fixed_step_cost_takes_a_free_decode_step_and_under_one_prefill_token_a_second():
    cost = StepCost(decode_step_s=0.0, prefill_tokens_per_s=0.5)
    assert cost.extend_seconds(np.array([0]), np.array([1])) == 2.0 and cost.decode_seconds(1, 1) == 0.0


# ---- hybrid models: each layer priced by its kind ---------------------------------------------------------------
# 8 x H100 at half their peak FLOP/s and 80% of their bandwidth.
FLOPS_PER_S, BYTES_PER_S = 8 * 989.5e12 * 0.5, 8 * 3.35e12 * 0.8


def test_a_sliding_window_layer_prefill_attends_to_at_most_its_window_of_keys():
    cost = RooflineCost("H100", "gpt-oss-120b", tp=8)
    pair = 2 * (64 + 64) * 64  # FLOPs a (query, key) pair costs in one layer: 64 heads of 64
    # A 32,768-token prompt: in the 18 full layers query q reads keys 1..q; in the 18 sliding ones at most the last
    # 128 (8,256 pairs among the first 128 queries, then 128 a query).
    full_pairs, window_pairs = 32768 * 32769 // 2, 128 * 129 // 2 + (32768 - 128) * 128
    hybrid = cost.extend_seconds(np.array([0]), np.array([32768]))
    assert hybrid == pytest.approx((2 * 5.1e9 * 32768 + pair * 18 * (full_pairs + window_pairs)) / FLOPS_PER_S,
                                   rel=EXACT)
    as_full = (2 * 5.1e9 * 32768 + pair * 36 * full_pairs) / FLOPS_PER_S  # every layer priced as full attention
    assert hybrid / as_full == pytest.approx(0.7586, abs=1e-4)
    # 64 requests after a 100-token cached prefix, 512 new tokens each: queries 101..128 read 101..128 keys in a
    # sliding layer, the 484 after them 128 each.
    prefix, seq = np.full(64, 100), np.full(64, 612)
    full_pairs, window_pairs = (612 * 613 - 100 * 101) // 2, (128 * 129 - 100 * 101) // 2 + 484 * 128
    flops = 2 * 5.1e9 * 64 * 512 + pair * 18 * 64 * (full_pairs + window_pairs)
    assert cost.extend_seconds(prefix, seq) == pytest.approx(flops / FLOPS_PER_S, rel=EXACT)
    # A cached prefix saves the pairs among its own tokens, window layers' at most 128 a query.
    saved = 2 * 5.1e9 * 300 + pair * 18 * (300 * 301 // 2 + 128 * 129 // 2 + 172 * 128)
    assert cost.prefill_seconds_saved(300) == pytest.approx(saved / FLOPS_PER_S, rel=EXACT)


def test_a_chunked_layer_prefill_attends_to_the_keys_of_each_querys_chunk():
    cost = RooflineCost("H100", "llama-4-scout", tp=8)
    pair = 2 * (128 + 128) * 40
    # Tokens 10,001..20,000 after a 10,000-token prefix, chunks of 8,192: queries 10,001..16,384 read keys 8,193..q
    # of the second chunk, queries 16,385..20,000 keys 16,385..q of the third.
    chunk_pairs = (8192 * 8193 - 1808 * 1809) // 2 + 3616 * 3617 // 2
    full_pairs = (20000 * 20001 - 10000 * 10001) // 2
    flops = 2 * 17e9 * 10000 + pair * (12 * full_pairs + 36 * chunk_pairs)
    assert cost.extend_seconds(np.array([10000]), np.array([20000])) == pytest.approx(flops / FLOPS_PER_S, rel=EXACT)
    # A decode step's chunked layers read the keys of each request's last chunk, up to its new token.
    assert cost.window_keys(np.array([8192, 8193, 20000])) == 8192 + 1 + 3616


def test_a_linear_attention_layer_costs_a_token_its_state_update_not_a_pair_count():
    cost = RooflineCost("H100", "qwen3-next-80b", tp=8)
    pair = 2 * (256 + 256) * 16
    # Gated DeltaNet, per token and linear layer: 7 x 32 value heads x 128 x 128 on the state, 2 x 8,192 channels x
    # 4 taps of convolution; 36 such layers, and 12 full-attention ones.
    linear = 36 * (7 * 32 * 128 * 128 + 2 * 8192 * 4)
    full_pairs = 32768 * 32769 // 2
    hybrid = cost.extend_seconds(np.array([0]), np.array([32768]))
    assert hybrid == pytest.approx((2 * 3e9 * 32768 + pair * 12 * full_pairs + linear * 32768) / FLOPS_PER_S,
                                   rel=EXACT)
    as_full = (2 * 3e9 * 32768 + pair * 48 * full_pairs) / FLOPS_PER_S
    assert hybrid / as_full == pytest.approx(0.4954, abs=1e-4)


def test_a_hybrid_decode_step_reads_window_layers_kv_for_window_tokens_and_each_requests_state_once_each_way():
    gpt = RooflineCost("H100", "gpt-oss-120b", tp=8)
    # Two requests of 100 and 5,000 tokens: the 18 full layers' KV (36,864 bytes a token) of all 5,100 tokens, the
    # 18 sliding layers' (36,864 bytes a token too) of 100 + 128, and the MXFP4 weights once.
    lens = np.array([100, 5000])
    assert gpt.window_keys(lens) == 228
    moved = 116.8e9 * 4.25 / 8 + 36864 * 5100 + 36864 * 228
    assert gpt.decode_seconds(2, 5100, gpt.window_keys(lens)) == pytest.approx(moved / BYTES_PER_S, rel=EXACT)
    qwen = RooflineCost("H100", "qwen3-next-80b", tp=8)
    # The 12 full layers' KV (24,576 bytes a token, kept 4 times: 2 KV heads on 8 GPUs) and each request's 36 layers
    # of state (8,192 x 4 bf16 conv + 32 x 128 x 128 float32 SSM), read and written back.
    state = 36 * (8192 * 4 * 2 + 32 * 128 * 128 * 4)
    assert state == sizing.state_bytes(sizing.HYBRID_MODEL_CONFIGS["qwen3-next-80b"])
    moved = 80e9 * 2 + 24576 * 4 * 4000 + 2 * 2 * state
    assert qwen.decode_seconds(2, 4000) == pytest.approx(moved / BYTES_PER_S, rel=EXACT)


def test_a_decode_step_of_a_model_with_window_layers_needs_their_keys():
    with pytest.raises(ValueError, match="^window_tokens is needed: gemma-3-27b has window layers"):
        RooflineCost("H100", "gemma-3-27b", tp=8).decode_seconds(2, 5100)
    assert RooflineCost("H100", "llama-3-8b").window is None and StepCost().window is None


@pytest.mark.parametrize("model", sorted(sizing.HYBRID_MODEL_CONFIGS))
def test_a_hybrid_model_is_priced_alike_on_window_aware_and_full_attention_pools(model):
    config = ReplayConfig(capacity_tokens=4096, max_context_len=512, gpu="H100", tp=2, model=model)
    full = dataclasses.replace(config, full_attention_pools=True)
    assert config.hybrid is not None and full.hybrid is None
    assert cost_model(config) == cost_model(full)


@pytest.mark.parametrize("full_attention_pools", [False, True])
def test_a_hybrid_replays_clock_charges_its_decode_steps_window_keys(full_attention_pools):
    config = ReplayConfig(capacity_tokens=4096, max_context_len=512, gpu="H100", tp=8, model="gpt-oss-120b",
                          full_attention_pools=full_attention_pools)
    cost = cost_model(config)
    report = replay([TraceRequest(list(range(300)), output_len=3)], config)
    # The prefill, then two decode steps of 301 and 302 tokens, whose sliding layers read the last 128.
    steps = [cost.extend_seconds(np.array([0]), np.array([300])), cost.decode_seconds(1, 301, 128),
             cost.decode_seconds(1, 302, 128)]
    assert list(report.time_s) == pytest.approx(np.cumsum(steps).tolist(), rel=EXACT)
