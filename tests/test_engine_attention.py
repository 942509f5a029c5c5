"""The engine's FlashInfer glue on the CPU: a stand-in `flashinfer` module that checks the documented call
signatures and computes with the torch reference, so that plan/run arguments (page renumbering for int8/int4,
the MLA wrapper's argument order) are exercised without a GPU. The kernels themselves run in
tests/test_engine_cuda.py on a GPU."""

import sys
import types

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_torch_thread")

from kvmem.attention import reference_paged_attention  # noqa: E402
from kvmem.engine import Engine, build_model  # noqa: E402
from kvmem.engine.attention import FlashInferBackend, TorchAttention  # noqa: E402


class _Paged:
    def __init__(self, workspace, kv_layout="NHD", **kwargs):
        self.layout = kv_layout

    def run(self, q, kv_cache):
        k, v = kv_cache
        assert q.dtype == self.q_dtype
        return reference_paged_attention(q, k, v, *self.md, layout=self.layout, sm_scale=self.sm_scale)


class _Decode(_Paged):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             q_data_type, kv_data_type, sm_scale):
        self.md = (torch.arange(len(indptr), dtype=torch.int32), indptr, indices, last_page_len)
        self.q_dtype, self.sm_scale = q_data_type, sm_scale


class _Prefill(_Paged):
    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             *, causal, sm_scale, q_data_type, kv_data_type):
        assert causal
        self.md = (qo_indptr, kv_indptr, kv_indices, last_page_len)
        self.q_dtype, self.sm_scale = q_data_type, sm_scale


class _MLA:
    def __init__(self, workspace):
        pass

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type):
        assert causal and (head_dim_ckv, head_dim_kpe) == (512, 64)
        last = torch.where(kv_len_arr > 0, (kv_len_arr - 1) % page_size + 1, 0).to(torch.int32)
        self.md, self.sm_scale = (qo_indptr, kv_indptr, kv_indices, last), sm_scale

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache):
        k = torch.cat((ckv_cache, kpe_cache), dim=-1).unsqueeze(2)
        return reference_paged_attention(torch.cat((q_nope, q_pe), -1), k, ckv_cache.unsqueeze(2), *self.md,
                                         sm_scale=self.sm_scale)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_Decode,
                                   BatchPrefillWithPagedKVCacheWrapper=lambda ws, layout, backend: _Prefill(ws, layout),
                                   mla=types.SimpleNamespace(BatchMLAPagedAttentionWrapper=_MLA))
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.parametrize("preset,kv_cache_dtype,overrides", [
    ("llama-tiny", "auto", {}), ("llama-tiny", "int4", {}), ("qwen2-tiny", "fp8_e4m3", {}),
    ("deepseek-v2-tiny", "auto", {"kv_lora_rank": 512, "qk_rope_head_dim": 64})])
def test_flashinfer_backend_plans_what_the_torch_backend_computes(fake_flashinfer, preset, kv_cache_dtype, overrides):
    model = build_model(preset, **overrides)
    prompts = [list(range(1, 40)), list(range(1, 30)) + [200], [7] * 50]
    outputs = {}
    for backend in ("flashinfer", "torch"):
        engine = Engine(model, capacity_tokens=256, page_size=16, kv_cache_dtype=kv_cache_dtype,
                        chunked_prefill_size=32, attention_backend=backend)
        kind = FlashInferBackend if backend == "flashinfer" else TorchAttention
        assert isinstance(engine.runner.attention, kind)
        outputs[backend] = engine.generate(prompts, 6)
    assert outputs["flashinfer"] == outputs["torch"]
