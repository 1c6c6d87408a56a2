"""resolve_module's order: exact key, per-expert keys, container key, exclude glob, default."""

from __future__ import annotations

import pytest

from moe_runtime import formats
from moe_runtime.checkpoint import CheckpointError, ModuleQuant, QuantizationSpec, resolve_module
from moe_runtime.checkpoint.quant_config import LayerEntry

NVFP4 = ("NVFP4", 16)
FP8 = ("FP8", None)


def spec(layers=None, *, quant_algo="MIXED_PRECISION", exclude=(), moe_quant_algo=None,
         dtype="bfloat16"):
    return QuantizationSpec(
        quant_algo=quant_algo,
        moe_quant_algo=moe_quant_algo,
        exclude_modules=tuple(exclude),
        quantized_layers=tuple(LayerEntry(k, *v) for k, v in (layers or {}).items()),
        dtype=dtype,
    )


def test_exact_key_wins_over_a_container_key():
    s = spec({"model.layers.0.mlp": FP8, "model.layers.0.mlp.experts": NVFP4})
    assert resolve_module(s, "model.layers.0.mlp.experts") == ModuleQuant(
        formats.NVFP4_W4A4, 16, "exact key 'model.layers.0.mlp.experts'")


def test_the_longest_container_key_wins():
    s = spec({"model.layers.0": FP8, "model.layers.0.mlp.experts": NVFP4})
    assert resolve_module(s, "model.layers.0.mlp.experts.3.up_proj") == ModuleQuant(
        formats.NVFP4_W4A4, 16, "container key 'model.layers.0.mlp.experts'")


def test_per_expert_keys_that_agree_resolve_their_container():
    s = spec({f"model.layers.0.mlp.experts.{e}.{p}": NVFP4 for e in range(2) for p in "abc"})
    assert resolve_module(s, "model.layers.0.mlp.experts") == ModuleQuant(
        formats.NVFP4_W4A4, 16, "per-expert keys (6 agree)")


def test_per_expert_keys_that_disagree_are_an_error_even_without_members():
    s = spec({"model.layers.0.mlp.experts.0.w1": NVFP4, "model.layers.0.mlp.experts.1.w1": FP8})
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.experts' disagree"):
        resolve_module(s, "model.layers.0.mlp.experts")


def test_an_exclude_glob_applies_only_after_the_keys():
    s = spec({"model.layers.0.self_attn.q_proj": FP8}, exclude=["*self_attn*"])
    assert resolve_module(s, "model.layers.0.self_attn.q_proj").format == formats.FP8_W8A8
    assert resolve_module(s, "model.layers.0.self_attn.k_proj") == ModuleQuant(
        formats.BF16, None, "exclude_modules glob '*self_attn*'")


def test_an_excluded_container_excludes_the_modules_inside_it():
    s = spec(quant_algo="NVFP4", exclude=["model.layers.1.self_attn"])
    assert resolve_module(s, "model.layers.1.self_attn.o_proj").source == (
        "exclude_modules glob 'model.layers.1.self_attn'")
    assert resolve_module(s, "model.layers.11.self_attn.o_proj").source == "checkpoint default"


def test_a_single_format_checkpoint_resolves_unlisted_modules_to_its_format():
    assert resolve_module(spec(quant_algo="W4A16_NVFP4"), "model.layers.0.mlp.experts") == (
        ModuleQuant(formats.NVFP4_W4A16, 16, "checkpoint default"))


def test_a_mixed_checkpoint_leaves_unlisted_modules_unquantized():
    assert resolve_module(spec({"lm_head": FP8}), "model.layers.0.mlp.experts") == ModuleQuant(
        formats.BF16, None, "unquantized")


def test_moe_quant_algo_is_the_default_of_moe_layers_only():
    s = spec(moe_quant_algo="NVFP4")
    assert resolve_module(s, "model.layers.0.mlp.experts", moe=True).format == (
        formats.NVFP4_W4A4)
    assert resolve_module(s, "model.layers.0.self_attn.q_proj").format == formats.BF16


@pytest.mark.parametrize("key, name", [
    ("model.language_model.layers.0.mlp.experts", "model.layers.0.mlp.experts"),
    ("layers.0.mlp.experts", "model.language_model.layers.0.mlp.experts"),
    ("backbone.layers.0.mlp.experts", "layers.0.mlp.experts"),
    ("language_model.model.layers.0.mlp.experts", "model.layers.0.mlp.experts"),
])
def test_model_prefixes_are_ignored_on_either_side(key, name):
    assert resolve_module(spec({key: NVFP4}), name).format == formats.NVFP4_W4A4


def test_exclude_globs_ignore_model_prefixes():
    s = spec(quant_algo="FP8", exclude=["model.language_model.layers.*.mlp.gate"])
    assert resolve_module(s, "model.layers.7.mlp.gate").format == formats.BF16


def test_members_not_listed_make_the_layer_disagree():
    s = spec({"model.layers.0.mlp.experts.0.w1": NVFP4})
    with pytest.raises(CheckpointError, match=r"experts\.1\.w1 \(not listed: unquantized\)"):
        resolve_module(s, "model.layers.0.mlp.experts", members=["0.w1", "1.w1"], moe=True)


def test_members_not_listed_take_moe_quant_algo_when_the_checkpoint_has_one():
    s = spec({"model.layers.0.mlp.experts.0.w1": NVFP4}, moe_quant_algo="NVFP4")
    quant = resolve_module(s, "model.layers.0.mlp.experts", members=["0.w1", "1.w1"], moe=True)
    assert quant == ModuleQuant(formats.NVFP4_W4A4, 16, "per-expert keys (1 agree)")


def test_unquantized_modules_of_an_fp16_checkpoint_are_fp16():
    assert resolve_module(spec(dtype="float16"), "lm_head").format == formats.FP16


def test_an_unquantized_module_of_a_float32_checkpoint_is_an_error():
    with pytest.raises(CheckpointError, match="'dtype' is 'float32'"):
        resolve_module(spec(dtype="float32"), "lm_head")
