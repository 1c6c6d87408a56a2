"""What ModelOpt 0.47 writes for the tiny checkpoints, checked against DESIGN.md's facts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from moe_runtime.checkpoint import read_checkpoint

E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6])
H, INTER, E = 64, 32, 8  # the tiny defaults: hidden, expert intermediate, experts


def tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def hf_quant(folder) -> dict:
    return json.loads((folder / "hf_quant_config.json").read_text())


def config_json(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def dequant_nvfp4(w, scale, scale_2):
    """DESIGN.md: W = e2m1(weight) * weight_scale.repeat_interleave(16, -1) * weight_scale_2,
    low nibble = even column."""
    codes = torch.stack([w & 0xF, w >> 4], dim=-1).reshape(w.shape[0], -1).long()
    return E2M1[codes] * scale.float().repeat_interleave(16, -1) * scale_2.float()


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ----------------------------------------------------------------------- tensor names and dtypes


def test_nvfp4_expert_tensors_have_design_names_dtypes_and_shapes(qwen3_nvfp4):
    t = tensors(qwen3_nvfp4)
    shapes = {"gate_proj": (INTER, H), "up_proj": (INTER, H), "down_proj": (H, INTER)}
    for proj, (out, inp) in shapes.items():
        m = f"model.layers.1.mlp.experts.7.{proj}"
        assert (t[f"{m}.weight"].dtype, t[f"{m}.weight"].shape) == (torch.uint8, (out, inp // 2))
        assert t[f"{m}.weight_scale"].dtype == torch.float8_e4m3fn
        assert t[f"{m}.weight_scale"].shape == (out, inp // 16)
        assert (t[f"{m}.weight_scale_2"].dtype, t[f"{m}.weight_scale_2"].shape) == (
            torch.float32, ())
        assert (t[f"{m}.input_scale"].dtype, t[f"{m}.input_scale"].shape) == (torch.float32, ())


def test_w4a16_nvfp4_export_has_no_input_scale(qwen3_w4a16):
    t = tensors(qwen3_w4a16)
    assert t["model.layers.0.mlp.experts.0.gate_proj.weight"].dtype == torch.uint8
    assert "model.layers.0.mlp.experts.0.gate_proj.weight_scale_2" in t
    assert not [k for k in t if k.endswith(".input_scale")]


def test_fp8_expert_tensors_are_e4m3_with_scalar_scales(qwen3_fp8):
    t = tensors(qwen3_fp8)
    m = "model.layers.0.mlp.experts.3.down_proj"
    assert (t[f"{m}.weight"].dtype, t[f"{m}.weight"].shape) == (torch.float8_e4m3fn, (H, INTER))
    assert (t[f"{m}.weight_scale"].dtype, t[f"{m}.weight_scale"].shape) == (torch.float32, ())
    assert (t[f"{m}.input_scale"].dtype, t[f"{m}.input_scale"].shape) == (torch.float32, ())


def test_mixtral_experts_are_stored_as_block_sparse_moe_w1_w3_w2(mixtral_nvfp4):
    t = tensors(mixtral_nvfp4)
    base = "model.layers.0.block_sparse_moe.experts.5"
    assert t[f"{base}.w1.weight"].shape == (INTER, H // 2)  # gate
    assert t[f"{base}.w3.weight"].shape == (INTER, H // 2)  # up
    assert t[f"{base}.w2.weight"].shape == (H, INTER // 2)  # down
    assert not [k for k in t if ".mlp.experts." in k or "gate_up_proj" in k]


def test_routers_correction_bias_and_lm_head_stay_bf16(deepseek_nvfp4):
    t = tensors(deepseek_nvfp4)
    assert t["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.bfloat16
    assert t["lm_head.weight"].dtype == torch.bfloat16


# ------------------------------------------------------------------------------- the scales


def test_nvfp4_weights_dequantize_to_the_bf16_weights_of_the_same_seed(qwen3_nvfp4, qwen3_bf16):
    q, ref = tensors(qwen3_nvfp4), tensors(qwen3_bf16)
    for e in range(E):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            m = f"model.layers.0.mlp.experts.{e}.{proj}"
            w = dequant_nvfp4(q[f"{m}.weight"], q[f"{m}.weight_scale"], q[f"{m}.weight_scale_2"])
            assert rel_err(w, ref[f"{m}.weight"]) < 0.15, m


def test_nvfp4_weight_scale_2_is_amax_over_6_times_448(qwen3_nvfp4, qwen3_bf16):
    q, ref = tensors(qwen3_nvfp4), tensors(qwen3_bf16)
    m = "model.layers.1.mlp.experts.2.down_proj"
    amax = ref[f"{m}.weight"].float().abs().max()
    assert q[f"{m}.weight_scale_2"].item() == pytest.approx((amax / (6 * 448)).item(), rel=1e-2)


def test_fp8_weights_dequantize_with_weight_scale_amax_over_448(qwen3_fp8, qwen3_bf16):
    q, ref = tensors(qwen3_fp8), tensors(qwen3_bf16)
    m = "model.layers.1.mlp.experts.4.down_proj"
    w = ref[f"{m}.weight"].float()
    assert q[f"{m}.weight_scale"].item() == pytest.approx(w.abs().max().item() / 448, rel=1e-2)
    assert rel_err(q[f"{m}.weight"].float() * q[f"{m}.weight_scale"], w) < 0.05


def test_gate_and_up_of_an_expert_share_weight_scale_2(qwen3_nvfp4):
    t = tensors(qwen3_nvfp4)
    for e in range(E):
        base = f"model.layers.0.mlp.experts.{e}"
        gate, up = t[f"{base}.gate_proj.weight_scale_2"], t[f"{base}.up_proj.weight_scale_2"]
        assert torch.equal(gate, up)


def test_fp8_gate_and_up_of_an_expert_share_weight_scale(qwen3_fp8):
    t = tensors(qwen3_fp8)
    for e in range(E):
        base = f"model.layers.1.mlp.experts.{e}"
        gate, up = t[f"{base}.gate_proj.weight_scale"], t[f"{base}.up_proj.weight_scale"]
        assert torch.equal(gate, up)


def test_input_scale_is_shared_per_projection_by_the_experts_of_a_layer(qwen3_nvfp4):
    t = tensors(qwen3_nvfp4)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        scales = {t[f"model.layers.1.mlp.experts.{e}.{proj}.input_scale"].item() for e in range(E)}
        assert len(scales) == 1, proj
    gate = t["model.layers.1.mlp.experts.0.gate_proj.input_scale"]
    assert torch.equal(gate, t["model.layers.1.mlp.experts.0.up_proj.input_scale"])


# ----------------------------------------------------------------------- the config files


def test_single_format_hf_quant_config_lists_group_size_and_excluded_routers(qwen3_nvfp4):
    q = hf_quant(qwen3_nvfp4)
    assert q["producer"]["name"] == "modelopt"
    assert {k: q["quantization"][k] for k in ("quant_algo", "group_size", "kv_cache_quant_algo")} \
        == {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None}
    assert {"lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"} <= set(
        q["quantization"]["exclude_modules"])
    assert "quantized_layers" not in q["quantization"]


def test_config_json_carries_the_same_settings_as_quantization_config(qwen3_nvfp4):
    qc = config_json(qwen3_nvfp4)["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"]) == ("modelopt", "NVFP4")
    assert qc["ignore"] == hf_quant(qwen3_nvfp4)["quantization"]["exclude_modules"]


def test_mixed_hf_quant_config_keys_experts_by_container_and_has_no_exclude_list(qwen3_mixed):
    q = hf_quant(qwen3_mixed)["quantization"]
    assert q["quant_algo"] == "MIXED_PRECISION"
    layers = q["quantized_layers"]
    assert layers["model.layers.0.mlp.experts"] == {"quant_algo": "NVFP4", "group_size": 16}
    assert layers["model.layers.1.mlp.experts"] == {"quant_algo": "FP8"}
    assert layers["model.layers.0.self_attn.q_proj"] == {"quant_algo": "FP8"}
    assert "model.layers.0.self_attn.o_proj" not in layers and "lm_head" not in layers
    assert "exclude_modules" not in q


def test_mixed_config_json_copies_quantized_layers_with_an_empty_ignore_list(qwen3_mixed):
    qc = config_json(qwen3_mixed)["quantization_config"]
    assert qc["quantized_layers"] == hf_quant(qwen3_mixed)["quantization"]["quantized_layers"]
    assert qc["ignore"] == []
    assert qc["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"}


def test_fp8_kv_cache_writes_k_and_v_scales(qwen3_mixed):
    t = tensors(qwen3_mixed)
    assert t["model.layers.2.self_attn.k_proj.k_scale"].dtype == torch.float32
    assert t["model.layers.2.self_attn.v_proj.v_scale"].dtype == torch.float32


def test_exported_config_reloads_in_transformers(qwen3_mixed):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(qwen3_mixed)
    assert config.architectures == ["Qwen3MoeForCausalLM"]
    sizes = (config.num_experts, config.moe_intermediate_size, config.num_hidden_layers)
    assert sizes == (E, INTER, 3)
    model = AutoModelForCausalLM.from_config(config)
    assert model.model.layers[2].mlp.experts.gate_up_proj.shape == (E, 2 * INTER, H)


def test_bf16_export_reloads_in_transformers_with_the_same_weights(qwen3_bf16):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen3_bf16, dtype=torch.bfloat16)
    t = tensors(qwen3_bf16)
    gate_up = model.model.layers[1].mlp.experts.gate_up_proj[3]
    assert torch.equal(gate_up[:INTER], t["model.layers.1.mlp.experts.3.gate_proj.weight"])
    assert torch.equal(gate_up[INTER:], t["model.layers.1.mlp.experts.3.up_proj.weight"])


# ---------------------------------------------------------------------------- the maker itself


def test_same_arguments_give_byte_identical_tensors(tmp_path, qwen3_nvfp4):
    from moe_runtime.checkpoint.tiny import make_tiny_checkpoint

    again = make_tiny_checkpoint(tmp_path, arch="qwen3_moe", quant="nvfp4")
    assert (again / "model.safetensors").read_bytes() == (
        qwen3_nvfp4 / "model.safetensors").read_bytes()


def test_another_seed_gives_other_weights(tmp_path, qwen3_bf16):
    from moe_runtime.checkpoint.tiny import make_tiny_checkpoint

    other = make_tiny_checkpoint(tmp_path, arch="qwen3_moe", quant="bf16", seed=1)
    name = "model.layers.0.mlp.experts.0.gate_proj.weight"
    assert not torch.equal(tensors(other)[name], tensors(qwen3_bf16)[name])


def test_making_a_checkpoint_leaves_the_global_rng_alone(tmp_path):
    from moe_runtime.checkpoint.tiny import make_tiny_checkpoint

    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    make_tiny_checkpoint(tmp_path, arch="mixtral", quant="bf16", num_layers=1)
    assert torch.equal(torch.rand(3), expected)


def test_max_shard_size_writes_shards_and_an_index(tiny, qwen3_nvfp4):
    sharded = tiny(arch="qwen3_moe", quant="nvfp4", max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (sharded / "model.safetensors").exists()
    assert read_checkpoint(sharded).moe_layers == read_checkpoint(qwen3_nvfp4).moe_layers


def test_fp8_moe_layers_must_name_moe_layers(tmp_path):
    from moe_runtime.checkpoint.tiny import make_tiny_checkpoint

    with pytest.raises(ValueError, match=r"\[0\] are not MoE layers"):
        make_tiny_checkpoint(tmp_path, arch="deepseek_v3", quant="mixed", fp8_moe_layers=(0,))
