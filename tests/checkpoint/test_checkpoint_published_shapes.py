"""Hand-written config files in the shapes of published ModelOpt checkpoints (``data/``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_runtime import formats
from moe_runtime.checkpoint import (
    CheckpointError,
    ModuleQuant,
    RouterSpec,
    read_checkpoint,
    read_quantization,
    resolve_module,
)

DATA = Path(__file__).parent / "data"
QWEN35 = DATA / "qwen3_5_moe_nvfp4_mixed"
SHAPE1 = DATA / "mixed_shape1_moe_quant_algo"


def edit(folder, name, change):
    path = folder / name
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def qwen35_spec():
    return read_quantization(QWEN35, json.loads((QWEN35 / "config.json").read_text()))


# ------------------------------------------ Qwen3.5-397B-A17B-NVFP4-like: per-expert keys, prefixes


def test_qwen35_moe_layers_sit_under_the_language_model_prefix():
    info = read_checkpoint(QWEN35)
    assert [m.name for m in info.moe_layers] == [
        "model.language_model.layers.0.mlp.experts", "model.language_model.layers.1.mlp.experts"]


def test_qwen35_per_expert_keys_resolve_each_moe_layer_to_nvfp4():
    for layer in read_checkpoint(QWEN35).moe_layers:
        assert layer.quant == ModuleQuant(formats.NVFP4_W4A4, 16, "per-expert keys (12 agree)")


def test_qwen35_structure_comes_from_text_config():
    layer = read_checkpoint(QWEN35).moe_layers[1]
    assert (layer.num_experts, layer.top_k, layer.hidden_size, layer.intermediate_size,
            layer.shared_expert_intermediate_size) == (4, 2, 4096, 1024, 1024)
    assert layer.router == RouterSpec("softmax", renormalize=True)


def test_qwen35_kv_cache_scheme_only_in_config_json_is_read():
    info = read_checkpoint(QWEN35)
    assert (info.method, info.kv_cache_quant_algo) == ("modelopt_mixed", "FP8")


def test_keys_with_a_prefix_resolve_a_name_without_it():
    members = [f"{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")]
    quant = resolve_module(qwen35_spec(), "model.layers.0.mlp.experts", members=members, moe=True)
    assert quant.format == formats.NVFP4_W4A4


def test_keys_without_a_prefix_resolve_a_name_with_it():
    # Shape 1's keys say "layers.3..."; the tensors say "model.layers.3...".
    assert read_checkpoint(SHAPE1).layer(3).quant.source == "per-expert keys (12 agree)"


def test_qwen35_visual_modules_are_excluded_by_glob():
    assert resolve_module(qwen35_spec(), "model.visual.blocks.0.attn.qkv") == ModuleQuant(
        formats.BF16, None, "exclude_modules glob 'model.visual*'")


def test_qwen35_attention_and_shared_expert_resolve_to_fp8_by_exact_key():
    spec = qwen35_spec()
    name = "model.language_model.layers.1.mlp.shared_expert.down_proj"
    assert resolve_module(spec, name) == ModuleQuant(formats.FP8_W8A8, None, f"exact key {name!r}")
    assert resolve_module(spec, "model.language_model.layers.0.linear_attn.out_proj").format == (
        formats.FP8_W8A8)


# ----------------------- MIXED_PRECISION shape 1: moe_quant_algo, awq_block_size, quant_method fp8


def test_shape1_layer_with_awq_block_size_keys_is_nvfp4_group_16():
    assert read_checkpoint(SHAPE1).layer(3).quant == ModuleQuant(
        formats.NVFP4_W4A4, 16, "per-expert keys (12 agree)")


def test_shape1_layer_without_keys_takes_moe_quant_algo():
    assert read_checkpoint(SHAPE1).layer(4).quant == ModuleQuant(
        formats.NVFP4_W4A4, 16, "moe_quant_algo 'NVFP4'")


def test_shape1_config_json_quant_method_fp8_does_not_hide_hf_quant_config():
    info = read_checkpoint(SHAPE1)
    assert (info.method, info.quant_algo, info.kv_cache_quant_algo) == (
        "modelopt_mixed", "MIXED_PRECISION", "FP8")


def test_shape1_without_hf_quant_config_reads_moe_quant_algo_from_config_json(data_copy):
    folder = data_copy("mixed_shape1_moe_quant_algo")
    (folder / "hf_quant_config.json").unlink()
    info = read_checkpoint(folder)
    assert {m.quant for m in info.moe_layers} == {
        ModuleQuant(formats.NVFP4_W4A4, 16, "moe_quant_algo 'NVFP4'")}
    assert info.method == "modelopt_mixed"


def test_shape1_moe_quant_algo_is_not_the_default_of_other_modules():
    spec = read_quantization(SHAPE1, json.loads((SHAPE1 / "config.json").read_text()))
    assert resolve_module(spec, "model.layers.1.mlp.gate_proj").source == "unquantized"


# ---------------------------------------------------------------- the KV cache in only one file


def test_kv_cache_only_in_hf_quant_config_is_read():
    info = read_checkpoint(DATA / "kv_cache_only_in_hf_quant_config")
    assert (info.quant_algo, info.kv_cache_quant_algo) == ("FP8", "FP8")


# ------------------------------------------------------------ which file says what

def test_hf_quant_config_alone_is_read(data_copy):
    folder = data_copy("kv_cache_only_in_hf_quant_config")
    edit(folder, "config.json", lambda d: d.pop("quantization_config"))
    info = read_checkpoint(folder)
    assert (info.method, info.kv_cache_quant_algo) == ("modelopt_fp8", "FP8")


def test_config_json_quantization_config_alone_is_read(data_copy):
    folder = data_copy("kv_cache_only_in_hf_quant_config")
    (folder / "hf_quant_config.json").unlink()
    info = read_checkpoint(folder)
    assert (info.method, info.kv_cache_quant_algo) == ("modelopt_fp8", None)
    assert info.moe_layers[0].quant.format == formats.FP8_W8A8


def test_a_modelopt_block_in_config_json_wins_over_hf_quant_config(data_copy):
    folder = data_copy("kv_cache_only_in_hf_quant_config")
    edit(folder, "hf_quant_config.json",
         lambda d: d["quantization"].update(exclude_modules=["lm_head", "*.experts*"]))
    assert read_checkpoint(folder).moe_layers[0].quant.format == formats.FP8_W8A8


def test_a_foreign_config_json_block_adds_only_moe_and_kv_settings(data_copy):
    folder = data_copy("mixed_shape1_moe_quant_algo")
    edit(folder, "config.json",
         lambda d: d["quantization_config"].update(exclude_modules=["*.experts*"]))
    assert read_checkpoint(folder).layer(4).quant.format == formats.NVFP4_W4A4


# --------------------------------------------------------------------------------------- errors


def test_disagreeing_per_expert_keys_error_names_the_layer_and_the_keys():
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(DATA / "disagreeing_expert_keys")
    message = str(err.value)
    assert "hf_quant_config.json" in message
    assert "'model.layers.1.mlp.experts'" in message
    assert "'model.layers.1.mlp.experts.2.down_proj'" in message and "fp8_w8a8" in message
    assert "nvfp4_w4a4" in message


def test_experts_missing_from_a_per_expert_map_are_an_error(data_copy):
    folder = data_copy("disagreeing_expert_keys")

    def drop(data):
        layers = data["quantization"]["quantized_layers"]
        layers["model.layers.1.mlp.experts.2.down_proj"] = {"quant_algo": "NVFP4", "group_size": 16}
        del layers["model.layers.1.mlp.experts.3.up_proj"]

    edit(folder, "hf_quant_config.json", drop)
    with pytest.raises(CheckpointError, match=r"experts\.3\.up_proj \(not listed"):
        read_checkpoint(folder)


def test_unknown_quant_algo_error_names_the_value_the_file_and_the_accepted_ones():
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(DATA / "unknown_quant_algo")
    message = str(err.value)
    assert "'W4A8_AWQ'" in message
    assert "unknown_quant_algo/hf_quant_config.json" in message
    assert "quantization.quant_algo" in message
    assert "accepted: 'FP8', 'NVFP4', 'W4A16_NVFP4', 'MIXED_PRECISION'" in message


@pytest.mark.parametrize("algo", ["MXFP8", "FP8_PB_WO", "W4A8_NVFP4_FP8"])
def test_other_algorithms_that_are_no_runnable_format_are_errors(data_copy, algo):
    folder = data_copy("unknown_quant_algo")
    edit(folder, "hf_quant_config.json", lambda d: d["quantization"].update(quant_algo=algo))
    with pytest.raises(CheckpointError, match=f"'{algo}'.*accepted"):
        read_checkpoint(folder)


def test_unknown_algorithm_of_a_moe_layer_in_quantized_layers_is_an_error(data_copy):
    folder = data_copy("disagreeing_expert_keys")

    def container(data):
        data["quantization"]["quantized_layers"] = {
            "model.layers.0.mlp.experts": {"quant_algo": "NVFP4", "group_size": 16},
            "model.layers.1.mlp.experts": {"quant_algo": "MXFP8", "group_size": 32},
        }

    edit(folder, "hf_quant_config.json", container)
    key = r"quantized_layers\['model\.layers\.1\.mlp\.experts'\]"
    with pytest.raises(CheckpointError, match=key + r".*'MXFP8'"):
        read_checkpoint(folder)


def test_invalid_json_error_names_the_file():
    with pytest.raises(CheckpointError, match=r"invalid_json/hf_quant_config\.json: invalid JSON"):
        read_checkpoint(DATA / "invalid_json")


def test_missing_config_json_is_an_error(data_copy):
    folder = data_copy("unknown_quant_algo")
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: file not found"):
        read_checkpoint(folder)


def test_missing_folder_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="no such directory"):
        read_checkpoint(tmp_path / "absent")


def test_unsupported_architecture_error_names_it_and_the_supported_ones(data_copy):
    folder = data_copy("kv_cache_only_in_hf_quant_config")
    edit(folder, "config.json", lambda d: d.update(architectures=["LlamaForCausalLM"]))
    with pytest.raises(CheckpointError, match=r"'LlamaForCausalLM' is not supported; supported: "
                                              r"DeepseekV3ForCausalLM, MixtralForCausalLM"):
        read_checkpoint(folder)


def test_files_that_disagree_on_quant_algo_are_an_error(data_copy):
    folder = data_copy("kv_cache_only_in_hf_quant_config")
    edit(folder, "hf_quant_config.json", lambda d: d["quantization"].update(quant_algo="NVFP4"))
    with pytest.raises(CheckpointError, match="disagree on quant_algo: 'FP8' vs 'NVFP4'"):
        read_checkpoint(folder)


def test_foreign_quant_method_without_modelopt_config_is_an_error(data_copy):
    folder = data_copy("kv_cache_only_in_hf_quant_config")
    (folder / "hf_quant_config.json").unlink()
    edit(folder, "config.json",
         lambda d: d.update(quantization_config={"quant_method": "compressed-tensors"}))
    with pytest.raises(CheckpointError, match="'compressed-tensors'.*accepted: ModelOpt"):
        read_checkpoint(folder)


def test_nvfp4_group_size_other_than_16_is_an_error(data_copy):
    folder = data_copy("unknown_quant_algo")
    edit(folder, "hf_quant_config.json",
         lambda d: d["quantization"].update(quant_algo="NVFP4", group_size=32))
    with pytest.raises(CheckpointError, match="group_size 32"):
        read_checkpoint(folder)


def test_missing_structure_field_error_names_the_key(data_copy):
    folder = data_copy("kv_cache_only_in_hf_quant_config")
    edit(folder, "config.json", lambda d: d.pop("moe_intermediate_size"))
    with pytest.raises(CheckpointError, match="config.json: missing 'moe_intermediate_size'"):
        read_checkpoint(folder)
