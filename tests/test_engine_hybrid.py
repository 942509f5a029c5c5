"""kvmem.engine on hybrid models against transformers: Gemma 3 (local and global layers), gpt-oss (sliding window
with sinks, MoE) and Qwen3-Next (gated DeltaNet and full attention, MoE). Greedy tokens equal `model.generate`
run one prompt at a time, with prompts several windows long, shared prefixes, chunked prefill, page sizes 1 and 4,
and capacities small enough to evict.

The tiny presets have 8-token windows; Qwen3-Next's states are checkpointed on the 64-token grid, so its prompts
are a few grid steps long.
"""

import random

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_torch_thread")

from kvmem.engine import Engine, build_model  # noqa: E402
from kvmem.engine.gated_delta import gated_delta_net  # noqa: E402
from kvmem.engine.window_attention import window_attention  # noqa: E402

WINDOWED = ["gemma3-tiny", "gpt-oss-tiny"]
HYBRID = WINDOWED + ["qwen3-next-tiny"]
MAX_NEW = 8
GRID = 64  # Qwen3-Next's states are kept at multiples of lcm(64, page_size): 64 at page sizes 1 and 4
# Windowed models: 8 prompts of 9..89 tokens sharing heads of up to 40 (1 to 11 windows of 8). 112 full slots, 40
# window slots, chunks of 32 and 6 running requests evict full KV and window KV at page sizes 1 and 4.
WINDOW_WORKLOAD = dict(groups=1, shared=40, head=(8, 40), tail=(1, 50), n=8,
                       engine=dict(capacity_tokens=112, window_tokens=40, chunked_prefill_size=32,
                                   max_running_requests=6))
# Qwen3-Next: 9 prompts of 65..189 tokens in 3 groups sharing heads of 64..159 (one to two grid steps), chunks of 64.
# 256 full slots and 3 states evict full KV and states.
LINEAR_WORKLOAD = dict(groups=3, shared=160, head=(64, 160), tail=(1, 30), n=9,
                       engine=dict(capacity_tokens=256, state_slots=3, chunked_prefill_size=GRID,
                                   max_running_requests=4))


def linear(preset):
    return preset.startswith("qwen3-next")


def workload_of(preset):
    return LINEAR_WORKLOAD if linear(preset) else WINDOW_WORKLOAD


def workload(preset, seed=0, vocab=256):
    w, rng = workload_of(preset), random.Random(seed)
    heads = [[rng.randrange(vocab) for _ in range(w["shared"])] for _ in range(w["groups"])]
    return [heads[i % w["groups"]][:rng.randrange(*w["head"])] +
            [rng.randrange(vocab) for _ in range(rng.randrange(*w["tail"]))] for i in range(w["n"])]


_MODELS, _REFERENCE = {}, {}


def model_of(preset):
    if preset not in _MODELS:
        _MODELS[preset] = build_model(preset)
    return _MODELS[preset]


def hf_generate(model, prompts, max_new_tokens=MAX_NEW):
    return [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new_tokens)[0, len(p):].tolist()
            for p in prompts]


def reference(preset):
    if preset not in _REFERENCE:
        _REFERENCE[preset] = hf_generate(model_of(preset), workload(preset))
    return _REFERENCE[preset]


def run_all(engine, prompts, max_new_tokens=MAX_NEW):
    """Drives add_request/step, checking the scheduler's memory invariants (each component's) after every step."""
    rids = [engine.add_request(p, max_new_tokens) for p in prompts]
    done = {}
    while not engine.is_idle():
        for out in engine.step():
            done[out.rid] = out
        engine.scheduler.check_invariants()
    return [done[r] for r in rids]


def common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def resumable(preset, prompt, served, page_size):
    """Where the cache can resume `prompt` after the requests `served` ((prompt, outputs), one at a time, nothing
    evicted): a windowed model from the longest cached prefix of all but its last token, in whole pages; Qwen3-Next
    only from a position where a request left a state: its prefill chunk ends on the grid, and its own end when on
    the grid."""
    key, best = prompt[:-1], 0
    for q, out in served:
        kv_len = len(q) + len(out) - 1  # the last output's KV is never computed
        common = common_prefix(key, (q + out)[:kv_len])
        if linear(preset):
            ends = set(range(GRID, len(q), GRID)) | {n for n in (len(q), kv_len) if n % GRID == 0}
            best = max([best] + [g for g in ends if g <= common])
        else:
            best = max(best, min(common, kv_len) // page_size * page_size)
    return best


# ---- the three families against transformers ----------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("preset", HYBRID)
def test_greedy_tokens_equal_transformers_generate_under_eviction(preset, page_size):
    w = workload_of(preset)
    engine = Engine(model_of(preset), page_size=page_size, **w["engine"])
    outputs = run_all(engine, workload(preset))
    assert [o.output_ids for o in outputs] == reference(preset)
    tree, stats = engine.tree_cache, engine.stats
    assert stats.evicted_tokens > 0 and stats.cached_tokens > 0, stats
    if linear(preset):
        assert tree.state_evicted > 0 and tree.state_copies > 0
    else:
        assert tree.window_evicted_tokens > 0
    assert max(map(len, workload(preset))) > w["engine"]["chunked_prefill_size"]  # some prefilled in chunks


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("preset", HYBRID)
def test_each_prompt_resumes_from_the_longest_prefix_the_cache_can_continue(preset, page_size):
    engine = Engine(model_of(preset), capacity_tokens=1024, page_size=page_size,
                    chunked_prefill_size=workload_of(preset)["engine"]["chunked_prefill_size"])
    served = []
    for prompt, want in zip(workload(preset), reference(preset)):
        expected = resumable(preset, prompt, served, page_size)
        (out,) = run_all(engine, [prompt])
        assert (out.output_ids, out.cached_tokens) == (want, expected)
        served.append((prompt, out.output_ids))
    assert engine.stats.cached_tokens > 0 and engine.stats.evicted_tokens == 0


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("preset", HYBRID)
def test_an_exact_repeat_and_a_prefix_of_a_cached_prompt_are_served_from_cache(preset, page_size):
    model = model_of(preset)
    prompt = max(workload(preset), key=len)  # 89 tokens (windowed), 189 (Qwen3-Next)
    short = prompt[:len(prompt) // 2 + 9]
    engine = Engine(model, capacity_tokens=512, page_size=page_size, chunked_prefill_size=GRID)
    (cold,) = run_all(engine, [prompt])
    (warm,) = run_all(engine, [prompt])
    (head,) = run_all(engine, [short])
    # All but the last prompt token (the prefill must produce logits): whole pages, or for Qwen3-Next down to the
    # last state on the grid (its chunk ends).
    unit = GRID if linear(preset) else page_size
    assert (cold.cached_tokens, warm.cached_tokens, head.cached_tokens) == \
        (0, (len(prompt) - 1) // unit * unit, (len(short) - 1) // unit * unit)
    assert warm.output_ids == cold.output_ids == hf_generate(model, [prompt])[0]
    assert head.output_ids == hf_generate(model, [short])[0]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("preset", WINDOWED)
def test_a_long_decode_frees_the_window_it_left_and_its_next_turn_still_resumes(preset, page_size):
    model = model_of(preset)
    prompt = workload(preset)[0]
    engine = Engine(model, capacity_tokens=256, window_tokens=64, page_size=page_size)
    (first,) = run_all(engine, [prompt], max_new_tokens=40)
    assert first.output_ids == hf_generate(model, [prompt], 40)[0]
    assert engine.tree_cache.window_slots_freed > 0  # decode gave back the window slots its window had left
    turn = prompt + first.output_ids + [3, 4]
    (second,) = run_all(engine, [turn])
    # The outputs whose window KV went are a tombstone, but the window before the new tokens is there.
    kv_len = len(prompt) + 40 - 1
    assert second.cached_tokens == kv_len // page_size * page_size
    assert second.output_ids == hf_generate(model, [turn])[0]


# ---- the pieces --------------------------------------------------------------------------------------
def test_window_attention_with_sinks_equals_transformers_gpt_oss_eager_attention():
    from transformers.masking_utils import sliding_window_causal_mask_function
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    torch.manual_seed(0)
    n, heads, kv_heads, d, window = 20, 4, 2, 16, 5
    q, k, v = torch.randn(n, heads, d), torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
    sinks = torch.randn(heads)
    i, j = torch.arange(n)[:, None], torch.arange(n)
    visible = sliding_window_causal_mask_function(window)(0, 0, i, j)  # transformers' own mask: j in (i - 5, i]
    mask = torch.zeros(n, n).masked_fill(~visible, float("-inf"))
    module = torch.nn.Module()
    module.num_key_value_groups, module.sinks, module.training = heads // kv_heads, sinks, False
    want, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      v.transpose(0, 1)[None], mask[None, None], scaling=d ** -0.5)
    # The last 7 queries over the keys they can see (window - 1 before the first of them).
    got = window_attention(q[13:], k[9:], v[9:], q_start=13, kv_start=9, scale=d ** -0.5, window=window,
                           sinks=sinks)
    torch.testing.assert_close(got, want[0, 13:].reshape(7, heads, d), atol=1e-6, rtol=0)


def test_gated_delta_net_over_a_state_slot_computes_what_transformers_cached_path_computes():
    from transformers import DynamicCache

    model = model_of("qwen3-next-tiny")
    gdn = model.model.layers[0].linear_attn
    torch.manual_seed(0)
    x = torch.randn(150, gdn.hidden_size)
    conv = torch.zeros(gdn.conv_dim, gdn.conv_kernel_size)
    ssm = torch.zeros(gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        whole = gdn(x[None])[0]
        # A first call, a call from the state on the 64 grid, one past it, then one token (the recurrent rule).
        for a, b in ((0, 64), (64, 128), (128, 149), (149, 150)):
            mine = gated_delta_net(gdn, x[a:b], conv, ssm, fresh=a == 0)
            assert torch.equal(mine, gdn(x[None, a:b], cache=cache)[0])
            torch.testing.assert_close(mine, whole[a:b], atol=1e-5, rtol=0)  # float rounding of the hand-over
    layer = cache.layers[0]
    assert torch.equal(conv, layer.conv_states[0][0]) and torch.equal(ssm, layer.recurrent_states[0][0])


# ---- bad input -----------------------------------------------------------------------------------------
def test_a_layer_kind_list_that_does_not_match_the_model_is_refused():
    model = build_model("gemma3-tiny")
    model.config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match="config.layer_types lists 2 kinds for 3 layers"):
        Engine(model, capacity_tokens=64)
    model.config.layer_types = ["sliding_attention", "chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match="config.layer_types holds 'chunked_attention'"):
        Engine(model, capacity_tokens=64)


@pytest.mark.parametrize("window, match", [
    (0, "config.sliding_window must be a positive int for sliding layers, got 0"),
    (None, "config.sliding_window must be a positive int for sliding layers, got None"),
    (513, "config.sliding_window 513 exceeds the model's context of 512 tokens")])
def test_a_sliding_window_of_no_tokens_or_beyond_the_context_is_refused(window, match):
    model = build_model("gpt-oss-tiny")
    model.config.sliding_window = window
    with pytest.raises(ValueError, match=match):
        Engine(model, capacity_tokens=64)


def test_hybrid_models_refuse_the_flashinfer_backend_by_name():
    with pytest.raises(ValueError, match="hybrid models .* run the torch attention"):
        Engine(model_of("gpt-oss-tiny"), capacity_tokens=64, attention_backend="flashinfer")


@pytest.mark.parametrize("preset, kwargs, match", [
    ("qwen3-next-tiny", dict(state_slots=1), "state_slots must be an int >= 2"),
    ("gpt-oss-tiny", dict(window_tokens=4), "token_allocator.window_size 4 is too small for window 8"),
    ("gpt-oss-tiny", dict(state_slots=4), "state_slots is for a model with linear-attention layers"),
    ("qwen3-next-tiny", dict(window_tokens=64), "window_tokens is for a model with sliding-window layers")])
def test_a_state_pool_or_window_pool_too_small_for_one_request_is_refused_by_name(preset, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Engine(model_of(preset), capacity_tokens=64, **kwargs)
