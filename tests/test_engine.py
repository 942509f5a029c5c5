"""kvmem.engine against transformers: greedy tokens equal `model.generate` run one prompt at a time with its
default cache, while kvmem batches, chunks, reuses prefixes, evicts and retracts underneath.

The tiny models draw weights with initializer_range 0.2 (see kvmem.engine.presets), so every greedy choice has
a margin far above fp32 rounding; the quantized-KV tests use 0.02, the scale of real checkpoints.
"""

import random

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_torch_thread")

from kvmem.engine import Engine, build_model  # noqa: E402

# Relative L2 error of each sampled step's logits against the fp32 model on the same tokens, by KV storage
# (measured 0.003, 0.017, 0.037, 0.061 at worst on the tiny models; docs/engine.md documents these bounds).
KV_LOGIT_TOLERANCE = {"int8": 0.01, "fp8_e4m3": 0.04, "fp8_e5m2": 0.08, "int4": 0.12}
MAX_NEW = 8
# With this workload (8 prompts of 14..65 tokens sharing up to 40), capacity 112, chunks of 32 and 6 running
# requests make the scheduler evict and retract at page sizes 1 and 16.
CAPACITY, CHUNK, RUNNING = 112, 32, 6


def workload(seed: int = 0, n: int = 8, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(40)]
    return [shared[:rng.randrange(8, 40)] + [rng.randrange(vocab) for _ in range(rng.randrange(1, 50))]
            for _ in range(n)]


def hf_generate(model, prompts, max_new_tokens=MAX_NEW):
    outs = []
    for p in prompts:
        seq = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new_tokens)
        outs.append(seq[0, len(p):].tolist())
    return outs


_MODELS, _REFERENCE = {}, {}


def model_of(preset, **overrides):
    key = (preset, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        _MODELS[key] = build_model(preset, **overrides)
    return _MODELS[key]


def reference(preset):
    if preset not in _REFERENCE:
        _REFERENCE[preset] = hf_generate(model_of(preset), workload())
    return _REFERENCE[preset]


def run_all(engine, prompts, max_new_tokens=MAX_NEW, **kwargs):
    """Drives add_request/step, checking the scheduler's memory invariants after every step."""
    rids = [engine.add_request(p, max_new_tokens, **kwargs) for p in prompts]
    done = {}
    while not engine.is_idle():
        for out in engine.step():
            done[out.rid] = out
        engine.scheduler.check_invariants()
    return [done[r] for r in rids]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("preset", ["llama-tiny", "qwen2-tiny", "deepseek-v2-tiny"])
def test_greedy_tokens_equal_transformers_generate_under_eviction_and_retraction(preset, page_size):
    engine = Engine(model_of(preset), capacity_tokens=CAPACITY, page_size=page_size, chunked_prefill_size=CHUNK,
                    max_running_requests=RUNNING)
    outputs = run_all(engine, workload())
    assert [o.output_ids for o in outputs] == reference(preset)
    stats = engine.stats
    assert stats.retractions > 0 and stats.evicted_tokens > 0 and stats.cached_tokens > 0, stats
    assert max(map(len, workload())) > CHUNK  # some prompts were prefilled in chunks


@pytest.mark.parametrize("preset", ["mistral-tiny", "deepseek-v3-tiny"])
def test_mistral_and_deepseek_v3_tokens_equal_transformers_generate(preset):
    prompts = workload(seed=1, n=4)
    engine = Engine(model_of(preset), capacity_tokens=256, chunked_prefill_size=CHUNK)
    assert engine.generate(prompts, MAX_NEW) == hf_generate(model_of(preset), prompts)


def teacher_forced_logits(model, prompt, output_ids):
    """The fp32 model's next-token logits at every step the engine sampled, on the engine's own tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output_ids[:-1]])).logits[0, len(prompt) - 1:]
    return logits.float()


def test_fp32_logits_match_transformers_to_rounding():
    model = model_of("llama-tiny")
    engine = Engine(model, capacity_tokens=CAPACITY, page_size=16, chunked_prefill_size=CHUNK)
    prompts = workload()[:4]
    for prompt, out in zip(prompts, run_all(engine, prompts, return_logits=True)):
        assert out.logits.shape == (MAX_NEW, 256)
        torch.testing.assert_close(out.logits, teacher_forced_logits(model, prompt, out.output_ids),
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("preset,kv_cache_dtype", [
    ("llama-tiny", "int8"), ("llama-tiny", "int4"), ("llama-tiny", "fp8_e4m3"), ("qwen2-tiny", "fp8_e5m2"),
    ("deepseek-v2-tiny", "fp8_e4m3"), ("deepseek-v2-tiny", "fp8_e5m2")])
def test_quantized_kv_logits_stay_within_documented_tolerance(preset, kv_cache_dtype):
    model = model_of(preset, initializer_range=0.02)
    engine = Engine(model, capacity_tokens=CAPACITY, page_size=16, kv_cache_dtype=kv_cache_dtype,
                    chunked_prefill_size=CHUNK, max_running_requests=RUNNING)
    prompts = workload()
    worst = 0.0
    for prompt, out in zip(prompts, run_all(engine, prompts, return_logits=True)):
        ref = teacher_forced_logits(model, prompt, out.output_ids)
        worst = max(worst, ((out.logits - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item())
    assert 0 < worst <= KV_LOGIT_TOLERANCE[kv_cache_dtype]


@pytest.mark.parametrize("page_size", [1, 16])
def test_prompt_served_from_prefix_cache_gives_the_same_tokens(page_size):
    model = model_of("qwen2-tiny")
    prompt = workload()[1]  # 65 tokens
    engine = Engine(model, capacity_tokens=256, page_size=page_size, chunked_prefill_size=CHUNK)
    (cold,) = run_all(engine, [prompt])
    (warm,) = run_all(engine, [prompt])
    assert cold.cached_tokens == 0
    # Everything but the last prompt token (the prefill must produce logits), whole pages only.
    assert warm.cached_tokens == (len(prompt) - 1) // page_size * page_size
    assert warm.output_ids == cold.output_ids == hf_generate(model, [prompt])[0]


def test_stop_token_ends_a_request_as_generate_does_with_eos():
    plain = reference("llama-tiny")
    eos = plain[2][3]  # a token that request 2 samples at step 4
    model = model_of("llama-tiny", eos_token_id=eos)
    expected = hf_generate(model, workload())
    assert expected[2] == plain[2][:4]
    engine = Engine(model, capacity_tokens=CAPACITY, chunked_prefill_size=CHUNK, max_running_requests=RUNNING)
    assert engine.generate(workload(), MAX_NEW) == expected


def test_stop_tokens_release_what_their_requests_no_longer_generate():
    # A stop token used to leave the request's unused output reserved: admission then starved, and the engine
    # stopped with "no batch while requests are pending" within a few requests.
    model = model_of("llama-tiny")
    engine = Engine(model, capacity_tokens=128)
    prompt = [5, 6, 7, 8]
    stop = engine.generate([prompt], 4)[0][1]
    for _ in range(3):
        assert engine.generate([prompt], 100, stop_token_ids=[stop]) == [hf_generate(model, [prompt], 2)[0]]
        engine.scheduler.check_invariants()
    engine.add_request(prompt, 100, stop_token_ids=[stop])
    engine.add_request([9, 10, 11], 3)
    while not engine.is_idle():
        engine.step()
        engine.scheduler.check_invariants()  # the owed-token count too, after every step


@pytest.mark.parametrize("stop_token_ids, error, match", [
    (7, TypeError, "stop_token_ids must be a sequence of token ids, got int"),
    ("ab", TypeError, "stop_token_ids must be a sequence of token ids, got str"),
    (["x"], ValueError, "stop_token_ids: a token id must be a non-negative int"),
    ([None], ValueError, "stop_token_ids: a token id must be a non-negative int"),
    ([256], ValueError, r"stop_token_ids: a token id must be .*at most 255"),
    ([-1], ValueError, "stop_token_ids: a token id must be"),
])
def test_bad_stop_token_ids_are_refused_before_anything_is_queued(stop_token_ids, error, match):
    engine = Engine(model_of("llama-tiny"), capacity_tokens=128)
    with pytest.raises(error, match=match):
        engine.add_request([1, 2, 3], 4, stop_token_ids=stop_token_ids)
    with pytest.raises(error, match=match):
        engine.generate([[1, 2, 3]], 4, stop_token_ids=stop_token_ids)
    assert engine.is_idle() and engine.generate([[1, 2, 3]], 2) == [hf_generate(engine.model, [[1, 2, 3]], 2)[0]]


def test_engine_arguments_of_the_wrong_kind_are_named():
    model = model_of("llama-tiny")
    with pytest.raises(ValueError, match="device 'nowhere' is not a device torch knows"):
        Engine(model, capacity_tokens=64, device="nowhere")
    engine = Engine(model, capacity_tokens=64)
    with pytest.raises(TypeError, match="max_new_tokens must be an int or one per prompt, got float"):
        engine.generate([[1, 2]], 2.0)
    assert engine.is_idle()


@pytest.mark.parametrize("prompts, max_new_tokens, error, match", [
    (None, 2, TypeError, "prompts must be a sequence of prompts .*got NoneType"),
    (5, 2, TypeError, "prompts must be .*got int"),
    ("ab", 2, TypeError, "prompts must be .*got str"),
    ({0: [1, 2]}, 2, TypeError, "prompts must be .*got dict"),
    ([{1, 2}], 2, TypeError, r"request 'prompts\[0\]': input_ids must be a sequence of token ids, got set"),
    ([{1: 2}], 2, TypeError, r"request 'prompts\[0\]': input_ids must be a sequence .*got dict"),
    ([[1, 2]], None, TypeError, "max_new_tokens must be an int or one per prompt, got NoneType"),
    ([[1, 2]], "3", TypeError, "max_new_tokens must be an int or one per prompt, got str"),
    ([[1, 2], [3]], {2, 4}, TypeError, "max_new_tokens .* got set"),
    ([[1, 2]], {0: 3}, TypeError, "max_new_tokens .* got dict"),
    ([[1, 2]], True, TypeError, "max_new_tokens must be a positive int, got True"),
    ([[1, 2]], 0, ValueError, "max_new_tokens must be a positive int, got 0"),
])
def test_generate_refuses_arguments_of_the_wrong_kind_by_name_and_stays_idle(prompts, max_new_tokens, error, match):
    engine = Engine(model_of("llama-tiny"), capacity_tokens=64)
    with pytest.raises(error, match=match):
        engine.generate(prompts, max_new_tokens)
    assert engine.is_idle() and engine.stats.requests == 0 and engine.token_allocator.available_size() == 64


def test_add_request_refuses_a_prompt_in_no_order_by_name():
    engine = Engine(model_of("llama-tiny"), capacity_tokens=64)
    with pytest.raises(TypeError, match="request 0: input_ids must be a sequence of token ids, got set"):
        engine.add_request({1, 2}, 2)
    assert engine.is_idle()


def test_generate_takes_any_iterable_of_prompts():
    engine = Engine(model_of("llama-tiny"), capacity_tokens=64)
    want = engine.generate([[1, 2], [3, 4]], 2)
    assert engine.generate(([1, 2], [3, 4]), 2) == engine.generate(iter([[1, 2], [3, 4]]), iter([2, 2])) == want


def test_bad_requests_are_rejected_by_name_while_the_others_keep_running():
    model = model_of("llama-tiny")
    prompts = workload()[:4]
    engine = Engine(model, capacity_tokens=CAPACITY, chunked_prefill_size=CHUNK)
    rids = [engine.add_request(p, MAX_NEW) for p in prompts]
    done = {o.rid: o.output_ids for o in engine.step()}
    with pytest.raises(ValueError, match=r"token id 256 at position 1 is outside the vocabulary \[0, 256\)"):
        engine.add_request([3, 256, 4], MAX_NEW)
    with pytest.raises(ValueError, match=r"token id -1 at position 0"):
        engine.add_request([-1], MAX_NEW)
    with pytest.raises(ValueError, match=r"100 prompt \+ 20 new tokens exceed the KV pool's capacity of 112"):
        engine.add_request([1] * 100, 20)
    with pytest.raises(TypeError, match="input_ids must hold ints"):
        engine.add_request([1.5], MAX_NEW)
    while not engine.is_idle():
        done.update((o.rid, o.output_ids) for o in engine.step())
    assert [done[r] for r in rids] == reference("llama-tiny")[:4]


def test_prompt_beyond_the_model_context_is_refused():
    model = model_of("llama-tiny", max_position_embeddings=64)
    engine = Engine(model, capacity_tokens=256)
    with pytest.raises(ValueError, match=r"request 0: 60 prompt \+ 8 new tokens exceed the model's context of 64"):
        engine.add_request([1] * 60, 8)
    assert engine.generate([[1] * 56], 8)[0]  # 64 tokens fit


def test_generate_checks_every_prompt_before_running_any():
    engine = Engine(model_of("llama-tiny"), capacity_tokens=CAPACITY)
    with pytest.raises(ValueError, match=r"request 'prompts\[1\]': token id 999"):
        engine.generate([[1, 2], [999], [3]], 4)
    assert engine.is_idle() and engine.stats.requests == 0
    assert engine.token_allocator.available_size() == CAPACITY
    with pytest.raises(ValueError, match="max_new_tokens has 1 counts for 2 prompts"):
        engine.generate([[1], [2]], [4])
    assert [len(o) for o in engine.generate([[1, 2], [3]], [2, 5])] == [2, 5]


def test_unsupported_architecture_is_named():
    from transformers import AutoModelForCausalLM, GPT2Config

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match=r"unsupported architecture 'gpt2' \(GPT2LMHeadModel\)"):
        Engine(gpt2, capacity_tokens=64)


def test_engine_arguments_are_checked():
    model = model_of("llama-tiny")
    with pytest.raises(ValueError, match="capacity_tokens 100 must be a multiple of page_size 16"):
        Engine(model, capacity_tokens=100, page_size=16)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Engine(model, capacity_tokens=64, kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="kv_cache_dtype"):  # MLA latents take no per-group scales
        Engine(model_of("deepseek-v2-tiny"), capacity_tokens=64, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="attention_backend"):
        Engine(model, capacity_tokens=64, attention_backend="sdpa")
    with pytest.raises(ValueError, match="device 'meta' holds no memory"):
        Engine(model, capacity_tokens=64, device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            Engine(model, capacity_tokens=64, attention_backend="flashinfer")


def test_build_model_is_deterministic_per_seed():
    a, b, c = build_model("llama-tiny", seed=3), build_model("llama-tiny", seed=3), build_model("llama-tiny", seed=4)
    wa, wb, wc = (m.model.layers[0].self_attn.q_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    with pytest.raises(ValueError, match="preset must be one of"):
        build_model("gpt-5")
