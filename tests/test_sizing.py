import dataclasses
import json

import pytest

from kvmem import sizing
from kvmem.sizing import (
    GIB,
    MODEL_CONFIGS,
    MHAConfig,
    MLAConfig,
    bytes_per_token,
    get_model_config,
    main,
    tokens_for_budget,
)

LLAMA_3_70B = MHAConfig(num_layers=80, num_kv_heads=8, head_dim=128)


def test_llama_3_70b_int8_costs_160_kib_per_token_without_scales():
    # 2 (K and V) x 8 kv heads x 128 dims x 80 layers x 1 byte
    assert bytes_per_token(LLAMA_3_70B, "int8", include_scales=False) == 2 * 8 * 128 * 80 == 163840 == 160 * 1024


def test_llama_3_70b_int8_with_one_float32_scale_per_head_adds_5120_bytes():
    # one 4-byte scale per (K or V, kv head, layer) on top of the 160 KiB
    assert bytes_per_token(LLAMA_3_70B, "int8") == 163840 + 2 * 8 * 80 * 4 == 168960


def test_smaller_quant_groups_add_one_scale_per_group():
    # head_dim 128 / quant_group 32 = 4 scales per head
    assert bytes_per_token(LLAMA_3_70B, "int8", quant_group=32) == 163840 + 2 * 8 * 80 * 4 * 4


def test_int4_costs_half_a_byte_per_element_plus_scales():
    assert bytes_per_token(LLAMA_3_70B, "int4", include_scales=False) == 163840 // 2
    assert bytes_per_token(LLAMA_3_70B, "int4") == 163840 // 2 + 5120


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_costs_one_byte_per_element_and_has_no_scales(kv_cache_dtype):
    assert bytes_per_token(LLAMA_3_70B, kv_cache_dtype) == 163840
    assert bytes_per_token(LLAMA_3_70B, kv_cache_dtype, include_scales=False) == 163840


def test_auto_stores_the_model_dtype():
    assert bytes_per_token(get_model_config("llama-3-8b")) == 2 * 8 * 128 * 32 * 2 == 128 * 1024
    assert bytes_per_token(MHAConfig(32, 8, 128, dtype="float32")) == 2 * 8 * 128 * 32 * 4


def test_v_head_dim_counts_separately_from_head_dim():
    assert bytes_per_token(MHAConfig(2, 4, 192, v_head_dim=128)) == 2 * 4 * (192 + 128) * 2


def test_deepseek_v3_mla_stores_one_576_wide_latent_per_layer():
    config = get_model_config("deepseek-v3")
    assert bytes_per_token(config) == 61 * (512 + 64) * 2 == 70272
    assert bytes_per_token(config, "fp8_e4m3") == 61 * 576


def test_presets_hold_the_public_model_shapes():
    assert MODEL_CONFIGS["llama-3-8b"] == MHAConfig(32, 8, 128)
    assert MODEL_CONFIGS["llama-3-70b"] == LLAMA_3_70B
    assert MODEL_CONFIGS["qwen2.5-7b"] == MHAConfig(28, 4, 128)
    assert MODEL_CONFIGS["mistral-7b"] == MHAConfig(32, 8, 128)
    assert MODEL_CONFIGS["deepseek-v3"] == MLAConfig(61, 512, 64)


def test_unknown_model_name_raises_listing_the_known_ones():
    with pytest.raises(ValueError, match="'llama-4'.*llama-3-8b.*deepseek-v3"):
        get_model_config("llama-4")


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        LLAMA_3_70B.num_layers = 1


@pytest.mark.parametrize("kwargs, match", [
    ({"num_layers": 0, "num_kv_heads": 8, "head_dim": 128}, "num_layers"),
    ({"num_layers": 2, "num_kv_heads": -1, "head_dim": 128}, "num_kv_heads"),
    ({"num_layers": 2, "num_kv_heads": 8, "head_dim": 1.5}, "head_dim"),
    ({"num_layers": 2, "num_kv_heads": 8, "head_dim": 128, "v_head_dim": 0}, "v_head_dim"),
    ({"num_layers": 2, "num_kv_heads": 8, "head_dim": 128, "dtype": "fp8"}, "dtype"),
    ({"num_layers": 2, "num_kv_heads": 8, "head_dim": 128, "dtype": ["bfloat16"]}, r"dtype must be one of .*\['bf"),
])
def test_bad_mha_config_fields_raise_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MHAConfig(**kwargs)


def test_bad_mla_config_fields_raise_naming_the_field():
    with pytest.raises(ValueError, match="kv_lora_rank"):
        MLAConfig(61, 0, 64)
    with pytest.raises(ValueError, match="dtype must be one of"):
        MLAConfig(61, 512, 64, dtype={"bfloat16"})


@pytest.mark.parametrize("config, kwargs, match", [
    (LLAMA_3_70B, {"kv_cache_dtype": "fp16"}, "kv_cache_dtype"),
    (LLAMA_3_70B, {"kv_cache_dtype": "int8", "quant_group": 48}, "quant_group 48 must divide head_dim"),
    (MHAConfig(2, 2, 128, v_head_dim=96), {"kv_cache_dtype": "int8", "quant_group": 64}, "v_head_dim"),
    (LLAMA_3_70B, {"kv_cache_dtype": "auto", "quant_group": 32}, "quant_group applies to int8/int4 only"),
    (MHAConfig(2, 2, 7), {"kv_cache_dtype": "int4"}, "int4 needs even head dims"),
    (MLAConfig(61, 512, 64), {"kv_cache_dtype": "int8"}, "not supported for MLA"),
])
def test_bad_bytes_per_token_arguments_raise(config, kwargs, match):
    with pytest.raises(ValueError, match=match):
        bytes_per_token(config, **kwargs)


def test_bytes_per_token_refuses_what_is_not_a_bool_as_include_scales():
    with pytest.raises(TypeError, match="include_scales must be a bool, got str"):
        bytes_per_token(LLAMA_3_70B, "int8", include_scales="no")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        bytes_per_token(LLAMA_3_70B, ["int8"])


def test_bytes_per_token_rejects_a_non_config():
    with pytest.raises(TypeError, match="config"):
        bytes_per_token((80, 8, 128))


def test_tokens_for_budget_pays_for_the_padding_page_and_rounds_down_to_pages():
    per_token = bytes_per_token(LLAMA_3_70B)
    # exactly (size + page_size) tokens of memory -> size
    assert tokens_for_budget(LLAMA_3_70B, (4096 + 16) * per_token, page_size=16) == 4096
    # one byte short loses a whole page
    assert tokens_for_budget(LLAMA_3_70B, (4096 + 16) * per_token - 1, page_size=16) == 4096 - 16
    assert tokens_for_budget(LLAMA_3_70B, (4096 + 1) * per_token) == 4096


def test_tokens_for_budget_is_zero_when_not_even_the_padding_page_fits():
    assert tokens_for_budget(LLAMA_3_70B, 0) == 0
    assert tokens_for_budget(LLAMA_3_70B, bytes_per_token(LLAMA_3_70B) * 31, page_size=16) == 0


def test_gpu_mem_gb_counts_gibibytes():
    config = get_model_config("llama-3-8b")
    assert tokens_for_budget(config, gpu_mem_gb=1) == tokens_for_budget(config, GIB) == GIB // (128 * 1024) - 1
    assert tokens_for_budget(config, gpu_mem_gb=1, kv_cache_dtype="fp8_e4m3") == GIB // (64 * 1024) - 1


@pytest.mark.parametrize("args, kwargs, match", [
    ((), {}, "exactly one of mem_bytes"),
    ((1 << 20,), {"gpu_mem_gb": 1}, "exactly one of mem_bytes"),
    ((-1,), {}, "mem_bytes"),
    ((), {"gpu_mem_gb": float("nan")}, "gpu_mem_gb"),
    ((1 << 20,), {"page_size": 0}, "page_size"),
    ((1 << 20,), {"kv_cache_dtype": "int3"}, "kv_cache_dtype"),
])
def test_bad_tokens_for_budget_arguments_raise(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tokens_for_budget(LLAMA_3_70B, *args, **kwargs)


def test_command_line_prints_a_json_report(capsys):
    main(["llama-3-70b", "--kv-cache-dtype", "int8", "--gpu-mem-gb", "40", "--page-size", "16"])
    report = json.loads(capsys.readouterr().out)
    assert report["bytes_per_token"] == 168960
    assert report["bytes_per_token_without_scales"] == 163840
    assert report["tokens"] == tokens_for_budget(LLAMA_3_70B, gpu_mem_gb=40, kv_cache_dtype="int8", page_size=16)
    assert report["tokens"] % 16 == 0


def test_command_line_sizes_a_hybrid_model_both_ways(capsys):
    main(["gpt-oss-120b", "--gpu-mem-gb", "40", "--page-size", "16", "--max-running", "64"])
    report = json.loads(capsys.readouterr().out)
    gpt = sizing.HYBRID_MODEL_CONFIGS["gpt-oss-120b"]
    assert report["bytes_per_token"] == 73728 and report["tokens"] == 582512  # every layer as full attention
    cap = sizing.hybrid_capacity(gpt, gpu_mem_gb=40, page_size=16, max_running_requests=64)
    assert report["window_aware"] == {"full_bytes_per_token": 36864, "window_bytes_per_token": 36864,
                                      "state_bytes": 0, **cap._asdict()}
    assert report["window_aware"]["full_tokens"] >= 1.8 * report["tokens"]


@pytest.mark.parametrize("argv, message", [
    (["--gpu-mem-gb", "-1"], "argument --gpu-mem-gb: expected a positive number, got '-1'"),
    (["--gpu-mem-gb", "nan"], "argument --gpu-mem-gb: expected a positive number, got 'nan'"),
    (["--gpu-mem-gb", "0"], "argument --gpu-mem-gb: expected a positive number, got '0'"),
    (["--gpu-mem-gb", "1e30"], "gpu_mem_gb 1e+30 is beyond any memory"),
    (["--quant-group", "0"], "argument --quant-group: expected a positive int, got '0'"),
    (["--kv-cache-dtype", "int4", "--quant-group", "3"], "quant_group 3 must divide head_dim 128"),
    (["--quant-group", "32"], "quant_group applies to int8/int4 only"),
    (["--page-size", "-3"], "argument --page-size: expected a positive int, got '-3'"),
    (["--page-size", "x"], "argument --page-size: expected a positive int, got 'x'"),
    (["--page-size", "16"], "argument --page-size: it rounds --gpu-mem-gb's tokens to whole pages; give --gpu-mem-gb"),
])
def test_command_line_refuses_bad_numbers_in_one_line_with_status_2(capsys, argv, message):
    with pytest.raises(SystemExit) as raised:
        main(["llama-3-8b", *argv])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
