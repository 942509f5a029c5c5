"""The engine on a GPU: FlashInfer's attention over kvmem's pools gives the logits of the torch reference path
and of transformers on the same tokens. Skipped without CUDA, flashinfer or transformers."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("transformers")

from kvmem.engine import Engine, build_model  # noqa: E402

# FlashInfer's kernels are built for head dims 64/128/256, so the GPU tiny models use 64.
GPU_TINY = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, initializer_range=0.02)
PROMPTS = [list(range(1, 40)), list(range(1, 30)) + [200, 201], [7] * 70]


def run(engine, prompts, max_new_tokens=8):
    rids = [engine.add_request(p, max_new_tokens, return_logits=True) for p in prompts]
    done = {}
    while not engine.is_idle():
        done.update((o.rid, o) for o in engine.step())
    return [done[r] for r in rids]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "int8"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_engine_matches_transformers_logits_on_its_tokens(page_size, kv_cache_dtype):
    pytest.importorskip("flashinfer")
    model = build_model("llama-tiny", dtype=torch.float16, device="cuda", **GPU_TINY)
    engine = Engine(model, capacity_tokens=512, page_size=page_size, kv_cache_dtype=kv_cache_dtype,
                    chunked_prefill_size=32, attention_backend="flashinfer")
    tolerance = {"auto": 0.02, "fp8_e4m3": 0.1, "int8": 0.05}[kv_cache_dtype]
    for prompt, out in zip(PROMPTS, run(engine, PROMPTS)):
        with torch.no_grad():
            ref = model(torch.tensor([prompt + out.output_ids[:-1]], device="cuda")).logits[0, len(prompt) - 1:]
        err = ((out.logits - ref.float().cpu()).norm(dim=-1) / ref.float().cpu().norm(dim=-1)).max().item()
        assert err <= tolerance, (kv_cache_dtype, err)


def test_flashinfer_and_torch_backends_agree_on_a_gpu():
    pytest.importorskip("flashinfer")
    model = build_model("qwen2-tiny", dtype=torch.bfloat16, device="cuda", **GPU_TINY)
    outs = {}
    for backend in ("flashinfer", "torch"):
        engine = Engine(model, capacity_tokens=256, page_size=16, attention_backend=backend)
        outs[backend] = run(engine, PROMPTS, max_new_tokens=1)
    for a, b in zip(outs["flashinfer"], outs["torch"]):
        torch.testing.assert_close(a.logits, b.logits, atol=0.1, rtol=0.05)


def test_mla_engine_runs_on_a_gpu_through_the_reference_at_tiny_dims():
    model = build_model("deepseek-v2-tiny", dtype=torch.float32, device="cuda")
    engine = Engine(model, capacity_tokens=256, page_size=16)
    prompts = PROMPTS[:2]
    cpu = Engine(build_model("deepseek-v2-tiny"), capacity_tokens=256, page_size=16)
    assert engine.generate(prompts, 6) == cpu.generate(prompts, 6)
