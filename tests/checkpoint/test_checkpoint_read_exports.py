"""read_checkpoint on folders ModelOpt exported: every MoE layer resolved to its format."""

from __future__ import annotations

import json
import shutil

import pytest

from moe_runtime import formats
from moe_runtime.checkpoint import CheckpointError, ModuleQuant, RouterSpec, read_checkpoint


def layer_formats(info):
    return {layer.index: (layer.quant.format, layer.quant.group_size) for layer in info.moe_layers}


def test_qwen3_fp8_layers_resolve_to_fp8_by_the_checkpoint_default(qwen3_fp8):
    info = read_checkpoint(qwen3_fp8)
    assert info.moe_layers[0].quant == ModuleQuant(formats.FP8_W8A8, None, "checkpoint default")
    assert layer_formats(info) == {0: (formats.FP8_W8A8, None), 1: (formats.FP8_W8A8, None)}


def test_qwen3_nvfp4_layers_resolve_to_nvfp4_w4a4_with_group_16(qwen3_nvfp4):
    assert layer_formats(read_checkpoint(qwen3_nvfp4)) == {
        0: (formats.NVFP4_W4A4, 16), 1: (formats.NVFP4_W4A4, 16)}


def test_qwen3_w4a16_layers_resolve_to_nvfp4_w4a16(qwen3_w4a16):
    assert layer_formats(read_checkpoint(qwen3_w4a16)) == {
        0: (formats.NVFP4_W4A16, 16), 1: (formats.NVFP4_W4A16, 16)}


def test_mixed_export_resolves_each_moe_layer_by_its_container_key(qwen3_mixed):
    info = read_checkpoint(qwen3_mixed)
    assert layer_formats(info) == {
        0: (formats.NVFP4_W4A4, 16), 1: (formats.FP8_W8A8, None), 2: (formats.NVFP4_W4A4, 16)}
    assert info.layer(1).quant.source == "exact key 'model.layers.1.mlp.experts'"


def test_mixed_export_reports_fp8_attention_and_unlisted_modules_as_bf16(qwen3_mixed):
    info = read_checkpoint(qwen3_mixed)
    assert info.linear("model.layers.0.self_attn.q_proj").format == formats.FP8_W8A8
    assert info.linear("model.layers.0.self_attn.o_proj") == ModuleQuant(
        formats.BF16, None, "unquantized")
    assert info.linear("lm_head").format == formats.BF16
    assert info.linear("model.layers.2.mlp.gate").format == formats.BF16


def test_linears_leave_out_experts_and_embeddings(qwen3_mixed):
    names = [name for name, _ in read_checkpoint(qwen3_mixed).linears]
    assert not [n for n in names if ".experts." in n or "embed" in n]
    assert names.index("model.layers.2.self_attn.q_proj") > names.index(
        "model.layers.0.self_attn.v_proj")


def test_kv_cache_algorithm_of_an_export_is_read(qwen3_mixed, qwen3_nvfp4):
    assert read_checkpoint(qwen3_mixed).kv_cache_quant_algo == "FP8"
    assert read_checkpoint(qwen3_nvfp4).kv_cache_quant_algo is None


@pytest.mark.parametrize(
    "fixture, method, algo",
    [
        ("qwen3_bf16", "unquantized", None),
        ("qwen3_fp8", "modelopt_fp8", "FP8"),
        ("qwen3_nvfp4", "modelopt_fp4", "NVFP4"),
        ("qwen3_w4a16", "modelopt_w4a16_nvfp4", "W4A16_NVFP4"),
        ("qwen3_mixed", "modelopt_mixed", "MIXED_PRECISION"),
    ],
)
def test_method_name_is_reported_from_the_top_level_algorithm(request, fixture, method, algo):
    info = read_checkpoint(request.getfixturevalue(fixture))
    assert (info.method, info.quant_algo) == (method, algo)


def test_bf16_export_resolves_to_unquantized_bf16(qwen3_bf16):
    info = read_checkpoint(qwen3_bf16)
    assert info.moe_layers[0].quant == ModuleQuant(formats.BF16, None, "unquantized")
    assert (info.producer, info.dtype) == (None, "bfloat16")


def test_producer_and_dtype_are_read(qwen3_nvfp4):
    info = read_checkpoint(qwen3_nvfp4)
    assert info.producer.startswith("modelopt 0.47")
    assert info.dtype == "bfloat16"


def test_qwen3_structure_matches_the_config_it_was_made_from(qwen3_nvfp4):
    layer = read_checkpoint(qwen3_nvfp4).moe_layers[1]
    assert (layer.name, layer.num_experts, layer.top_k, layer.hidden_size,
            layer.intermediate_size, layer.activation, layer.shared_expert_intermediate_size) == (
        "model.layers.1.mlp.experts", 8, 2, 64, 32, "silu", 0)
    assert layer.expert_names == ("gate_proj", "up_proj", "down_proj")
    assert layer.router == RouterSpec("softmax", renormalize=True)


def test_mixtral_layers_are_block_sparse_moe_with_w1_w3_w2(mixtral_nvfp4):
    layer = read_checkpoint(mixtral_nvfp4).moe_layers[0]
    assert layer.name == "model.layers.0.block_sparse_moe.experts"
    assert layer.expert_names == ("w1", "w3", "w2")
    assert layer.quant.format == formats.NVFP4_W4A4


def test_mixtral_mixed_export_has_its_fp8_moe_layer(mixtral_mixed):
    assert layer_formats(read_checkpoint(mixtral_mixed)) == {
        0: (formats.FP8_W8A8, None), 1: (formats.NVFP4_W4A4, 16)}


def test_mixtral_w4a16_export_resolves_to_nvfp4_w4a16(mixtral_w4a16):
    assert {q.format for q in (m.quant for m in read_checkpoint(mixtral_w4a16).moe_layers)} == {
        formats.NVFP4_W4A16}


def test_deepseek_first_dense_layer_is_not_a_moe_layer(deepseek_fp8):
    info = read_checkpoint(deepseek_fp8)
    assert [m.index for m in info.moe_layers] == [1]
    assert info.linear("model.layers.0.mlp.gate_proj").format == formats.FP8_W8A8


def test_deepseek_router_and_shared_expert_follow_its_config(deepseek_fp8):
    layer = read_checkpoint(deepseek_fp8).moe_layers[0]
    assert layer.router == RouterSpec("sigmoid", renormalize=True, n_group=2, topk_group=1,
                                      routed_scaling_factor=2.5, has_correction_bias=True)
    assert layer.shared_expert_intermediate_size == 32


def test_deepseek_fp8_export_resolves_to_fp8(deepseek_fp8):
    assert read_checkpoint(deepseek_fp8).moe_layers[0].quant.format == formats.FP8_W8A8


def test_deepseek_mixed_export_has_an_fp8_and_an_nvfp4_moe_layer(deepseek_mixed):
    info = read_checkpoint(deepseek_mixed)
    assert layer_formats(info) == {1: (formats.FP8_W8A8, None), 2: (formats.NVFP4_W4A4, 16)}
    assert info.linear("model.layers.1.mlp.shared_experts.up_proj").format == formats.FP8_W8A8


def test_two_reads_of_a_folder_are_equal(deepseek_mixed):
    assert read_checkpoint(deepseek_mixed) == read_checkpoint(deepseek_mixed)


def test_tensors_contradicting_the_config_are_an_error(qwen3_nvfp4, tmp_path):
    folder = shutil.copytree(qwen3_nvfp4, tmp_path / "ckpt")
    for name, path in (("hf_quant_config.json", ["quantization"]),
                       ("config.json", ["quantization_config"])):
        data = json.loads((folder / name).read_text())
        block = data
        for key in path:
            block = block[key]
        block["quant_algo"] = "FP8"
        (folder / name).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"experts\.0\.gate_proj\.weight' is U8.*fp8_w8a8"):
        read_checkpoint(folder)
