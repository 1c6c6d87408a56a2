"""Damaged copies of real ModelOpt exports are refused by ``check``, ``plan``, ``load_model`` and
``serve`` with a paragraph naming the problem, and no traceback; undamaged exports still plan.

Every variant starts from a tiny export ModelOpt made on CPU (the session's ``tiny`` fixture),
copied into the test's folder and damaged there. ``DAMAGES`` lists the damage; the fuzz tests at
the end damage at random, since the check validates what a checkpoint must satisfy rather than a
list of known breakages.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_runtime import cli
from moe_runtime.checkpoint.check import CheckpointRefused, check_checkpoint
from moe_runtime.checkpoint.memory import MachineMemory

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
EXPERT = "model.layers.1.mlp.experts.3"  # an expert of the qwen3 exports (8 experts, H 64, I 32)


# ------------------------------------------------------------------------------ the generator


@attrs.frozen
class Damage:
    """One damaged variant: the export it starts from, what is done to it, what must be said.

    :param rule: the check rule that must report it (:data:`moe_runtime.checkpoint.check.RULES`).
    :param needles: texts that one finding's paragraph must all contain.
    """

    id: str
    base: str
    apply: Callable[[Path], None]
    rule: str
    needles: tuple[str, ...] = attrs.field(converter=tuple)


def edit_json(name: str, change: Callable[[dict], None]):
    def apply(folder: Path) -> None:
        path = folder / name
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data, indent=2))
    return apply


def both_quant_configs(change: Callable[[dict], None]):
    """Make the same change to hf_quant_config.json's and config.json's quantization block."""
    def apply(folder: Path) -> None:
        edit_json("hf_quant_config.json", lambda d: change(d["quantization"]))(folder)
        edit_json("config.json", lambda d: change(d["quantization_config"]))(folder)
    return apply


def write_text(name: str, text: str):
    return lambda folder: (folder / name).write_text(text)


def edit_raw(name: str, change: Callable[[bytes], bytes]):
    def apply(folder: Path) -> None:
        before = (folder / name).read_bytes()
        after = change(before)
        assert after != before, f"the damage changed nothing in {name}"
        (folder / name).write_bytes(after)
    return apply


def truncate(name: str, keep: float = 0.5):
    def apply(folder: Path) -> None:
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: int(len(data) * keep)])
    return apply


def edit_tensors(change: Callable[[dict[str, torch.Tensor]], None]):
    def apply(folder: Path) -> None:
        tensors = load_file(folder / WEIGHTS)
        change(tensors)
        save_file(tensors, folder / WEIGHTS, metadata={"format": "pt"})
    return apply


def set_scalar(name: str, value: float):
    return edit_tensors(lambda t: t.__setitem__(name, torch.tensor(value, dtype=torch.float32)))


def set_block_scale_byte(name: str, byte: int):
    def change(t):
        raw = t[name].view(torch.uint8).clone()
        raw[0, 0] = byte
        t[name] = raw.view(torch.float8_e4m3fn)
    return edit_tensors(change)


def delete_tensors(*names: str, prefix: str | None = None):
    def change(t):
        for n in [k for k in t if prefix and k.startswith(prefix)] + list(names):
            del t[n]
    return edit_tensors(change)


def edit_header(change: Callable[[dict], None]):
    """Rewrite the safetensors header of model.safetensors (the data bytes stay as they are)."""
    def apply(folder: Path) -> None:
        raw = (folder / WEIGHTS).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        change(header)
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        (folder / WEIGHTS).write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    return apply


def edit_bytes(change: Callable[[bytearray], bytes | bytearray]):
    def apply(folder: Path) -> None:
        (folder / WEIGHTS).write_bytes(bytes(change(bytearray((folder / WEIGHTS).read_bytes()))))
    return apply


def write_index(extra: dict[str, str] | None = None, moved: str | None = None):
    """A model.safetensors.index.json for the single file, with extra or moved entries."""
    def apply(folder: Path) -> None:
        raw = (folder / WEIGHTS).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        names = [k for k in json.loads(raw[8:8 + n]) if k != "__metadata__"]
        weight_map = {k: WEIGHTS for k in names}
        if moved:
            weight_map[moved] = "model-00002-of-00002.safetensors"
        weight_map.update(extra or {})
        (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return apply


def set_config(**fields):
    return edit_json("config.json", lambda d: d.update(fields))


def delete_config(*keys: str):
    return edit_json("config.json", lambda d: [d.pop(k) for k in keys])


def set_experts(count: int):
    def change(d):
        key = next(k for k in ("num_experts", "num_local_experts") if k in d)
        d[key] = count
    return edit_json("config.json", change)


def empty(folder: Path) -> None:
    for p in folder.iterdir():
        p.unlink()


def dangling_weights(folder: Path) -> None:
    (folder / WEIGHTS).unlink()
    (folder / WEIGHTS).symlink_to(folder / "gone" / WEIGHTS)


def directory_for(name: str):
    def apply(folder: Path) -> None:
        (folder / name).unlink()
        (folder / name).mkdir()
    return apply


def layer_entry(key: str, **entry):
    return both_quant_configs(lambda q: q["quantized_layers"].__setitem__(key, entry))


def drop_layer_entry(key: str):
    return both_quant_configs(lambda q: q["quantized_layers"].pop(key))


DAMAGES = [
    # files and JSON
    Damage("config_truncated", "qwen3_nvfp4", truncate("config.json"), "json",
           ["config.json", "invalid JSON", "truncated"]),
    Damage("config_not_an_object", "qwen3_fp8", write_text("config.json", "[1, 2]"), "json",
           ["config.json", "JSON list, not an object"]),
    Damage("hf_quant_config_truncated", "qwen3_mixed", truncate("hf_quant_config.json", 0.3),
           "json", ["hf_quant_config.json", "invalid JSON"]),
    Damage("hf_quant_config_not_an_object", "qwen3_nvfp4",
           write_text("hf_quant_config.json", '"NVFP4"'), "json",
           ["hf_quant_config.json", "JSON str, not an object"]),
    Damage("empty_folder", "qwen3_nvfp4", empty, "folder", ["the folder is empty"]),
    Damage("no_config_json", "qwen3_fp8", lambda f: (f / "config.json").unlink(), "folder",
           ["has no config.json"]),
    Damage("unreadable_weights", "qwen3_nvfp4", dangling_weights, "folder",
           [WEIGHTS, "cannot be read", "does not exist"]),
    Damage("quant_config_is_a_directory", "qwen3_fp8", directory_for("hf_quant_config.json"),
           "folder", ["hf_quant_config.json", "is a directory"]),
    Damage("index_not_an_object", "qwen3_fp8", write_text(INDEX, "[]"), "json",
           [INDEX, "not an object"]),
    Damage("config_not_utf8", "qwen3_fp8", edit_raw("config.json", lambda b: b.replace(
        b'"qwen3_moe"', b'"qwen3\xff_moe"')), "json",
           ["config.json", "is not UTF-8 text", "byte 0xff", "a JSON object in UTF-8"]),
    Damage("config_nan_literal", "qwen3_nvfp4", edit_raw("config.json", lambda b: b.replace(
        b'"rms_norm_eps": 1e-06', b'"rms_norm_eps": NaN')), "json",
           ["config.json", "rms_norm_eps is NaN", "not JSON", "finite numbers"]),
    Damage("quant_config_infinity_literal", "qwen3_mixed", edit_raw(
        "hf_quant_config.json", lambda b: b.replace(b'"group_size": 16', b'"group_size": Infinity',
                                                    1)), "json",
           ["hf_quant_config.json", "group_size is Infinity", "not JSON"]),
    Damage("config_nested_too_deeply", "qwen3_fp8",
           write_text("config.json", "[" * 100_000 + "]" * 100_000), "json",
           ["config.json", "nested too deeply"]),
    # the quantization config
    Damage("unknown_algorithm", "qwen3_nvfp4",
           both_quant_configs(lambda q: q.update(quant_algo="NVFP5")), "quantization",
           ["'NVFP5'", "accepted", "'NVFP4'"]),
    Damage("unknown_kv_cache_algorithm", "qwen3_mixed",
           both_quant_configs(lambda q: q.update(kv_cache_quant_algo="FP9")), "quantization",
           ["kv_cache_quant_algo is 'FP9'", "no KV-cache quantization", "'FP8'"]),
    Damage("algorithms_disagree", "qwen3_nvfp4",
           edit_json("config.json", lambda d: d["quantization_config"].update(quant_algo="FP8")),
           "agreement", ["config.json", "hf_quant_config.json", "quant_algo", "'FP8'", "'NVFP4'"]),
    Damage("layer_algorithms_disagree", "qwen3_mixed",
           edit_json("hf_quant_config.json", lambda d: d["quantization"]["quantized_layers"][
               "model.layers.1.mlp.experts"].update(quant_algo="NVFP4", group_size=16)),
           "agreement", ["config.json", "hf_quant_config.json",
                         "quantized_layers['model.layers.1.mlp.experts'].quant_algo",
                         "'FP8'", "'NVFP4'"]),
    Damage("group_size_32_only_in_hf_quant_config", "qwen3_nvfp4",
           edit_json("hf_quant_config.json", lambda d: d["quantization"].update(group_size=32)),
           "group_size", ["hf_quant_config.json", "group_size", "32", "exactly 16"]),
    Damage("group_size_32_in_a_layer_entry", "qwen3_mixed",
           layer_entry("model.layers.0.mlp.experts", quant_algo="NVFP4", group_size=32),
           "group_size", ["quantized_layers['model.layers.0.mlp.experts'].group_size", "32"]),
    Damage("quantized_layers_names_an_absent_module", "qwen3_mixed",
           layer_entry("model.layers.0.mlp.shared_expert.gate_proj", quant_algo="FP8"),
           "modules", ["model.layers.0.mlp.shared_expert.gate_proj", "no tensor"]),
    Damage("quantized_layers_leaves_out_a_quantized_module", "qwen3_mixed",
           drop_layer_entry("model.layers.0.self_attn.q_proj"), "tensors",
           ["model.layers.0.self_attn.q_proj.weight", "F8_E4M3", "bf16"]),
    Damage("quantized_layers_in_one_file_only", "qwen3_mixed",
           edit_json("config.json", lambda d: d["quantization_config"]["quantized_layers"].pop(
               "model.layers.2.self_attn.o_proj")),
           "agreement", ["model.layers.2.self_attn.o_proj", "does not list"]),
    Damage("exclude_modules_disagree", "qwen3_fp8",
           edit_json("config.json", lambda d: d["quantization_config"].update(ignore=["lm_head"])),
           "agreement", ["exclude_modules", "model.embed_tokens"]),
    # routing and counts
    Damage("a_billion_layers", "qwen3_fp8", set_config(num_hidden_layers=10 ** 9), "config",
           ["num_hidden_layers is 1000000000", "an integer from 1 to 10000"]),
    Damage("top_k_above_the_experts", "qwen3_nvfp4", set_config(num_experts_per_tok=9),
           "routing", ["num_experts_per_tok is 9", "8"]),
    Damage("n_group_does_not_divide_the_experts", "deepseek_fp8", set_config(n_group=3),
           "routing", ["n_group 3", "8 experts"]),
    Damage("top_k_above_the_kept_groups", "deepseek_fp8", set_config(num_experts_per_tok=6),
           "routing", ["num_experts_per_tok 6", "topk_group"]),
    Damage("config_declares_more_experts_than_stored", "qwen3_nvfp4", set_experts(16),
           "tensors", ["experts.8.", "is missing"]),
    Damage("config_declares_10e30_experts", "qwen3_nvfp4", set_experts(10**30), "tensors",
           [f"declares {10**30} experts", "none past expert 7", "experts.8.gate_proj.weight",
            "matches the tensors (8)"]),
    Damage("config_declares_fewer_experts_than_stored", "qwen3_fp8", set_experts(4),
           "tensors", ["hold expert 7", "declares 4 experts"]),
    Damage("config_declares_fewer_layers_than_stored", "qwen3_nvfp4",
           set_config(num_hidden_layers=1), "tensors",
           ["num_hidden_layers is 1", "decoder layer 1"]),
    Damage("heads_do_not_group", "qwen3_fp8", set_config(num_key_value_heads=3), "config",
           ["num_attention_heads 4", "num_key_value_heads 3"]),
    Damage("size_of_the_wrong_type", "qwen3_mixed", set_config(head_dim="16"), "config",
           ["head_dim is '16'", "a positive integer"]),
    Damage("size_null", "qwen3_mixed", set_config(vocab_size=None), "config",
           ["vocab_size is null", "refuses a null", "a positive integer, or no 'vocab_size' key"]),
    Damage("config_without_model_type", "qwen3_fp8", delete_config("model_type"), "config",
           ["config.json", "has no model_type", "model_type 'qwen3_moe'"]),
    Damage("model_type_of_another_architecture", "mixtral_nvfp4", set_config(model_type="qwen3_moe"),
           "config", ["model_type is 'qwen3_moe'", "MixtralForCausalLM", "model_type 'mixtral'"]),
    Damage("config_without_attention_heads", "qwen3_fp8", delete_config("num_attention_heads"),
           "config", ["config.json", "missing 'num_attention_heads'"]),
    Damage("config_without_vocab_size", "qwen3_nvfp4", delete_config("vocab_size"), "tensors",
           ["config.json", "has no vocab_size", "rows", "accepted: vocab_size "]),
    Damage("router_shape_disagrees", "qwen3_fp8",
           edit_tensors(lambda t: t.__setitem__("model.layers.0.mlp.gate.weight",
                                                t["model.layers.0.mlp.gate.weight"][:6])),
           "tensors", ["model.layers.0.mlp.gate.weight", "[6, 64]", "8 experts"]),
    Damage("correction_bias_missing", "deepseek_fp8",
           delete_tensors("model.layers.1.mlp.gate.e_score_correction_bias"), "tensors",
           ["e_score_correction_bias", "missing"]),
    # tensors
    Damage("final_norm_missing", "qwen3_nvfp4", delete_tensors("model.norm.weight"), "tensors",
           ["'model.norm.weight'", "missing", "cannot be loaded", "the final norm"]),
    Damage("layer_norm_missing", "deepseek_fp8",
           delete_tensors("model.layers.1.post_attention_layernorm.weight"), "tensors",
           ["'model.layers.1.post_attention_layernorm.weight'", "missing", "both norms"]),
    Damage("attention_weight_missing_in_one_layer", "qwen3_mixed",
           delete_tensors("model.layers.2.self_attn.k_proj.weight"), "tensors",
           ["'model.layers.2.self_attn.k_proj.weight'", "the other decoder layers store",
            "cannot be loaded"]),
    # DeepSeek-V3's first layer is its only dense one: nothing of its kind to compare with
    Damage("attention_weight_missing_in_the_only_dense_layer", "deepseek_fp8",
           delete_tensors("model.layers.0.self_attn.o_proj.weight"), "tensors",
           ["'model.layers.0.self_attn.o_proj.weight'", "the other decoder layers store"]),
    Damage("dense_mlp_weight_missing_in_the_only_dense_layer", "deepseek_fp8",
           delete_tensors("model.layers.0.mlp.down_proj.weight"), "tensors",
           ["'model.layers.0.mlp.down_proj.weight'",
            "a dense decoder layer's MLP (mlp.{gate_proj, up_proj, down_proj}.weight)",
            "cannot be loaded"]),
    Damage("moe_router_missing_in_one_layer", "deepseek_mixed",
           delete_tensors("model.layers.2.mlp.gate.weight"), "tensors",
           ["'model.layers.2.mlp.gate.weight'"]),
    Damage("expert_scale_missing", "qwen3_nvfp4", delete_tensors(f"{EXPERT}.down_proj.weight_scale_2"),
           "tensors", [f"{EXPERT}.down_proj.weight_scale_2", "is missing"]),
    Damage("expert_missing", "qwen3_fp8", delete_tensors(prefix="model.layers.0.mlp.experts.5."),
           "tensors", ["model.layers.0.mlp.experts.5.", "is missing", "(and "]),
    Damage("input_scale_missing_for_w4a4", "qwen3_nvfp4",
           delete_tensors(f"{EXPERT}.up_proj.input_scale"), "tensors",
           [f"{EXPERT}.up_proj.input_scale", "is missing"]),
    Damage("input_scale_present_for_w4a16", "mixtral_w4a16", edit_tensors(lambda t: t.__setitem__(
        "model.layers.0.block_sparse_moe.experts.0.w1.input_scale", torch.tensor(0.5))),
           "tensors", ["w1.input_scale", "is present", "quantizes no activations"]),
    Damage("weight_of_the_wrong_dtype", "qwen3_nvfp4", edit_tensors(lambda t: t.__setitem__(
        f"{EXPERT}.gate_proj.weight", t[f"{EXPERT}.gate_proj.weight"].to(torch.bfloat16))),
           "tensors", [f"{EXPERT}.gate_proj.weight", "is BF16", "U8"]),
    Damage("block_scale_of_the_wrong_shape", "qwen3_nvfp4", edit_tensors(lambda t: t.__setitem__(
        f"{EXPERT}.gate_proj.weight_scale", t[f"{EXPERT}.gate_proj.weight_scale"][:, :2].clone())),
           "tensors", [f"{EXPERT}.gate_proj.weight_scale", "[32, 2]", "[32, 4]"]),
    Damage("weight_scale_not_a_scalar", "qwen3_fp8", edit_tensors(lambda t: t.__setitem__(
        f"{EXPERT}.up_proj.weight_scale", torch.ones(2))),
           "tensors", [f"{EXPERT}.up_proj.weight_scale", "not one element"]),
    Damage("intermediate_size_disagrees_with_tensors", "qwen3_nvfp4",
           set_config(moe_intermediate_size=48), "tensors", ["has shape", "[48, 32]"]),
    Damage("vocab_size_disagrees_with_embeddings", "qwen3_fp8", set_config(vocab_size=300),
           "tensors", ["embed_tokens.weight", "vocab_size 300"]),
    # safetensors files and the index
    Damage("corrupt_header_length", "qwen3_nvfp4",
           edit_bytes(lambda b: struct.pack("<Q", 1 << 40) + b[8:]), "safetensors",
           [WEIGHTS, "header is corrupt"]),
    Damage("header_not_json", "qwen3_fp8", edit_bytes(lambda b: b[:8] + b"\xff" * 24 + b[32:]),
           "safetensors", [WEIGHTS, "not valid JSON"]),
    Damage("truncated_weights", "qwen3_nvfp4", edit_bytes(lambda b: b[:-4096]), "safetensors",
           [WEIGHTS, "outside the file", "truncated"]),
    Damage("unknown_dtype_in_header", "qwen3_fp8",
           edit_header(lambda h: h[f"{EXPERT}.gate_proj.weight"].update(dtype="Q4")),
           "safetensors", [f"{EXPERT}.gate_proj.weight", "unknown dtype 'Q4'"]),
    Damage("shape_and_offsets_disagree", "qwen3_fp8",
           edit_header(lambda h: h[f"{EXPERT}.gate_proj.weight"].update(shape=[64, 64])),
           "safetensors", [f"{EXPERT}.gate_proj.weight", "data_offsets span"]),
    Damage("bytes_after_the_last_tensor", "qwen3_fp8", edit_bytes(lambda b: b + b"\0" * 64),
           "safetensors", [WEIGHTS, "64 bytes after the last tensor belong to none"]),
    Damage("overlapping_tensors", "qwen3_fp8", edit_header(lambda h: h[f"{EXPERT}.up_proj.weight"]
                                                           .update(data_offsets=h[
                                                               f"{EXPERT}.gate_proj.weight"][
                                                               "data_offsets"])),
           "safetensors", [WEIGHTS, f"{EXPERT}.", "their bytes overlap"]),
    Damage("offsets_reversed", "qwen3_fp8", edit_header(lambda h: h[f"{EXPERT}.gate_proj.weight"]
                                                        .update(data_offsets=h[
                                                            f"{EXPERT}.gate_proj.weight"][
                                                            "data_offsets"][::-1])),
           "safetensors", [f"{EXPERT}.gate_proj.weight", "start after it ends"]),
    Damage("metadata_not_strings", "qwen3_nvfp4", edit_header(lambda h: h.update(
        __metadata__={"format": 5})), "safetensors",
           [WEIGHTS, "__metadata__ is {'format': 5}", "string -> string"]),
    Damage("index_names_a_missing_shard", "qwen3_nvfp4",
           write_index(moved=f"{EXPERT}.gate_proj.weight"), "index",
           [INDEX, "model-00002-of-00002.safetensors", "missing"]),
    Damage("index_maps_a_tensor_its_shard_lacks", "qwen3_fp8",
           write_index(extra={"model.layers.9.mlp.gate.weight": WEIGHTS}), "index",
           ["model.layers.9.mlp.gate.weight", "does not hold it"]),
    # scales
    *[Damage(f"weight_scale_2_{label}", "qwen3_nvfp4",
             set_scalar(f"{EXPERT}.down_proj.weight_scale_2", value), "scales",
             [f"{EXPERT}.down_proj.weight_scale_2", said])
      for label, value, said in (("nan", math.nan, "NaN"), ("inf", math.inf, "infinite"),
                                 ("zero", 0.0, "zeros"), ("negative", -0.01, "negative"))],
    # a plain weight of a module the model has not: loading would drop it without a word (the
    # check's fast path let every ".weight" under "model." through: audit, 2026-12-07)
    Damage("stray_weight_outside_the_layers", "qwen3_fp8", edit_tensors(
        lambda t: t.__setitem__("model.foo.weight", torch.zeros(4, 4, dtype=torch.bfloat16))),
           "tensors", ["'model.foo.weight' is stored", "no parameter it would be loaded into"]),
    Damage("stray_weight_in_every_moe_block", "qwen3_nvfp4", edit_tensors(
        lambda t: [t.__setitem__(f"model.layers.{i}.mlp.foo.weight",
                                 torch.zeros(4, 4, dtype=torch.bfloat16)) for i in range(3)]),
           "tensors", ["'model.layers.0.mlp.foo.weight' is stored",
                       "no parameter it would be loaded into"]),
    # finite and positive, but what they scale leaves float32 (an audit's 1e38 served NaN)
    Damage("weight_scale_2_overflows", "qwen3_nvfp4",
           set_scalar(f"{EXPERT}.down_proj.weight_scale_2", 1e38), "scales",
           [f"{EXPERT}.down_proj.weight_scale_2", "beyond float32", "at most 1.27e+35"]),
    Damage("fp8_weight_scale_overflows", "qwen3_fp8",
           set_scalar(f"{EXPERT}.gate_proj.weight_scale", 1e36), "scales",
           [f"{EXPERT}.gate_proj.weight_scale", "beyond float32", "at most 7.6e+35"]),
    Damage("input_scale_negative", "qwen3_fp8", set_scalar(f"{EXPERT}.gate_proj.input_scale", -1),
           "scales", [f"{EXPERT}.gate_proj.input_scale", "negative"]),
    Damage("fp8_weight_scale_zero", "qwen3_fp8", set_scalar(f"{EXPERT}.gate_proj.weight_scale", 0),
           "scales", [f"{EXPERT}.gate_proj.weight_scale", "zeros"]),
    Damage("block_scale_nan", "qwen3_nvfp4", set_block_scale_byte(f"{EXPERT}.up_proj.weight_scale",
                                                                  0x7F),
           "scales", [f"{EXPERT}.up_proj.weight_scale", "NaN"]),
    Damage("block_scale_negative", "qwen3_nvfp4",
           set_block_scale_byte(f"{EXPERT}.up_proj.weight_scale", 0xB8),
           "scales", [f"{EXPERT}.up_proj.weight_scale", "negative"]),
    Damage("kv_cache_scale_nan", "qwen3_mixed",
           set_scalar("model.layers.2.self_attn.k_proj.k_scale", math.nan),
           "scales", ["model.layers.2.self_attn.k_proj.k_scale", "NaN"]),
    Damage("attention_input_scale_inf", "qwen3_mixed",
           set_scalar("model.layers.0.self_attn.v_proj.input_scale", math.inf),
           "scales", ["model.layers.0.self_attn.v_proj.input_scale", "infinite"]),
    # impossible sizes
    Damage("huge_expert_intermediate_size", "qwen3_nvfp4",
           set_config(moe_intermediate_size=10**9), "memory",
           ["moe_intermediate_size=1000000000", "serving needs about", "available"]),
    Damage("huge_vocabulary", "qwen3_fp8", set_config(vocab_size=10**10), "memory",
           ["vocab_size=10000000000", "serving needs about", "available"]),
]


@pytest.fixture
def damaged(request, tmp_path):
    """``damaged(damage)`` -> a damaged copy of the damage's base export."""
    def make(damage: Damage) -> Path:
        folder = Path(shutil.copytree(request.getfixturevalue(damage.base), tmp_path / "ckpt"))
        damage.apply(folder)
        return folder
    return make


def finding_with(report, damage: Damage):
    matching = [f for f in report.findings if f.rule == damage.rule
                and all(n in f.paragraph for n in damage.needles)]
    assert matching, (damage.rule, damage.needles, [f.paragraph for f in report.findings])
    return matching[0]


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


# ---------------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda d: d.id)
def test_a_damaged_checkpoint_is_refused_by_check_and_plan_naming_the_problem(
        damage, damaged, capsys):
    folder = damaged(damage)
    started = time.perf_counter()
    report = check_checkpoint(folder)
    assert time.perf_counter() - started < 10
    finding = finding_with(report, damage)
    assert "\n" not in finding.paragraph  # one paragraph

    code, text = run_cli(capsys, "check", str(folder))
    assert code == 2
    assert "Traceback" not in text
    assert all(n in text for n in damage.needles), text

    code, text = run_cli(capsys, "plan", str(folder))
    assert code != 0
    assert "Traceback" not in text
    assert all(n in text for n in damage.needles), text
    assert "communication" not in text  # no plan table for a refused checkpoint


@pytest.mark.parametrize("base", ["qwen3_nvfp4", "qwen3_fp8", "qwen3_mixed", "deepseek_fp8",
                                  "mixtral_w4a16"])
def test_an_undamaged_export_passes_the_check_and_plans(base, request, capsys):
    folder = request.getfixturevalue(base)
    report = check_checkpoint(folder)
    assert report.ok, [f.paragraph for f in report.findings]
    assert report.scale_tensors > 0 and report.memory is not None
    code, text = run_cli(capsys, "plan", str(folder))
    assert code == 0, text
    assert "check: ok" in text and "finite and positive" in text


def test_a_folder_of_config_files_alone_plans_but_is_no_checkpoint_to_serve(capsys):
    folder = Path(__file__).parent / "data" / "qwen3_5_moe_nvfp4_mixed"
    code, text = run_cli(capsys, "plan", str(folder), "--target-device", "sm100")
    assert code == 0, text
    assert "config files only" in text and "serving needs about" in text
    code, text = run_cli(capsys, "check", str(folder))
    assert code == 2 and "holds no *.safetensors weight files" in text


def test_plan_warns_of_memory_but_check_refuses(qwen3_nvfp4, capsys):
    # one sequence of 2**40 tokens: a KV cache no machine has
    code, text = run_cli(capsys, "plan", str(qwen3_nvfp4), "--max-model-len", str(1 << 40))
    assert code == 0, text
    assert "warning: " in text and "KV cache" in text
    code, text = run_cli(capsys, "check", str(qwen3_nvfp4), "--max-model-len", str(1 << 40))
    assert code == 2 and "KV cache" in text and "available" in text


def test_check_prints_every_finding_at_once(qwen3_nvfp4, tmp_path, capsys):
    folder = Path(shutil.copytree(qwen3_nvfp4, tmp_path / "ckpt"))
    for damage in DAMAGES:
        if damage.id in ("algorithms_disagree", "top_k_above_the_experts",
                         "weight_scale_2_nan", "block_scale_of_the_wrong_shape"):
            damage.apply(folder)
    code, text = run_cli(capsys, "check", str(folder), "--json")
    data = json.loads(text)
    assert code == 2 and not data["ok"]
    assert {"agreement", "routing", "scales", "tensors"} <= {f["rule"] for f in data["findings"]}


def test_the_memory_needed_is_compared_with_the_machine(qwen3_nvfp4):
    small = MachineMemory("cpu", 1 << 20, "a test machine has 1.0 MiB available")
    report = check_checkpoint(qwen3_nvfp4, machine=small, batch_size=64)
    (finding,) = report.findings
    assert finding.rule == "memory"
    assert "a test machine has 1.0 MiB available" in finding.paragraph
    assert "at batch 64 x 1024 tokens" in finding.paragraph
    assert "KV cache" in finding.paragraph  # the largest part at this batch, with its fields
    assert check_checkpoint(qwen3_nvfp4, machine=small, batch_size=1,
                            context_tokens=16).memory.total < report.memory.total


def test_expert_parallel_ranks_hold_a_share_of_the_experts(qwen3_nvfp4):
    def experts(report):
        (part,) = [p for p in report.memory.parts if p.name.startswith("expert weights")]
        return part.bytes

    whole = check_checkpoint(qwen3_nvfp4, machine=None)
    quarter = check_checkpoint(qwen3_nvfp4, machine=None, ep_size=4)
    # 2 of the 8 experts per rank: 6 fewer experts x 3 projections x H 64 x I 32 x 0.5625 bytes
    # in each of the 2 layers (routers stay whole)
    assert experts(whole) - experts(quarter) == 2 * 6 * 3 * 64 * 32 * 0.5625


def test_the_scale_scan_is_timed_and_reads_only_scales(qwen3_nvfp4):
    report = check_checkpoint(qwen3_nvfp4)
    tensors = load_file(qwen3_nvfp4 / WEIGHTS)
    scales = [t for n, t in tensors.items() if n.endswith(("_scale", "_scale_2"))]
    assert len(scales) >= 2 * 8 * 3 * 3  # at least the experts' three scales per projection
    assert report.scale_tensors == len(scales)
    assert report.scale_bytes == sum(t.numel() * t.element_size() for t in scales)
    assert report.scale_seconds > 0 and "scanned in" in report.summary


def test_load_model_refuses_a_damaged_checkpoint_before_allocating(damaged):
    from moe_runtime.integration.transformers import load_model

    damage = next(d for d in DAMAGES if d.id == "block_scale_nan")
    with pytest.raises(CheckpointRefused) as info:
        load_model(damaged(damage))
    assert all(n in str(info.value) for n in damage.needles)


def test_debug_shows_the_traceback_of_an_unexpected_error(monkeypatch, capsys, qwen3_fp8):
    def broken(*args, **kwargs):
        raise RuntimeError("something inside broke")

    monkeypatch.setattr(cli, "cmd_check", broken)  # build_parser reads it when it runs
    code, text = run_cli(capsys, "check", str(qwen3_fp8))
    assert code == 1 and "something inside broke" in text and "--debug" in text
    assert "Traceback" not in text
    with pytest.raises(RuntimeError):
        cli.main(["--debug", "check", str(qwen3_fp8)])


# --------------------------------------------------------------- serve refuses at start-up

SERVE_DAMAGES = ["weight_scale_2_nan", "layer_algorithms_disagree", "huge_expert_intermediate_size",
                 "config_nested_too_deeply", "bytes_after_the_last_tensor"]


@pytest.mark.parametrize("damage_id", SERVE_DAMAGES)
def test_serve_refuses_a_damaged_checkpoint_at_start_up(damage_id, damaged):
    damage = next(d for d in DAMAGES if d.id == damage_id)
    _assert_serve_refuses(damaged(damage), damage.needles)


def _assert_serve_refuses(folder, needles):
    """``moe-runtime serve`` on ``folder`` exits non-zero within 120 s, naming ``needles``,
    with no traceback and no half-started server."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "moe_runtime.serve", "--model", str(folder),
                           "--port", "0", "--device", "cpu"],
                          capture_output=True, text=True, timeout=180, env=env)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text
    assert "Traceback" not in text
    assert all(n in text for n in needles), text
    assert "serving '" not in text  # no half-started server
    assert time.monotonic() - started < 120


def test_serve_refuses_a_scale_that_makes_the_first_token_not_finite(tmp_path):
    """A global scale of 1e30 on one expert passes the check (finite, positive, what it scales
    stays finite in float32) but overflows the layer's activations: the start-up token's
    log-probability is NaN, and serve refuses naming the first module whose output is not
    finite, rather than serving empty text (found by an audit, 2026-12-07). The default model:
    an export with a tokenizer, NVFP4 experts."""
    from moe_runtime.serve.default_model import make_default_model

    folder = make_default_model(tmp_path / "m")
    expert = "model.layers.1.mlp.experts.3"
    for proj in ("gate_proj", "up_proj"):  # one fused GEMM: the two share the global scale
        set_scalar(f"{expert}.{proj}.weight_scale_2", 1e30)(folder)
    assert check_checkpoint(folder).ok
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "moe_runtime.serve", "--model", str(folder),
                           "--port", "0", "--device", "cpu"],
                          capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 1, proc.stderr
    [error] = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert "cannot serve" in error and "log-probability of nan" in error
    assert ("the first module whose output holds inf or NaN is model.layers.1.mlp.experts"
            in error)
    assert "Traceback" not in proc.stderr and "ready: " not in proc.stderr


def test_serve_names_config_json_when_transformers_refuses_a_field(qwen3_fp8, tmp_path):
    """A null the check lets by (transformers' config class decides which fields take one) is
    refused naming config.json and the field, not blamed on the tokenizer that read it first."""
    folder = Path(shutil.copytree(qwen3_fp8, tmp_path / "ckpt"))
    set_config(num_experts=None)(folder)
    assert check_checkpoint(folder, machine=None).ok
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "moe_runtime.serve", "--model", str(folder),
                           "--port", "0", "--device", "cpu"],
                          capture_output=True, text=True, timeout=180, env=env)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text
    assert "Traceback" not in text and "serving '" not in text
    assert f"{folder / 'config.json'}: transformers' config class refuses it" in text, text
    assert "num_experts" in text and "tokenizer" not in text.split("error:")[-1]


# ------------------------------------------------------------ damage that no list above names


def _expert_and_scale_tensors(folder: Path) -> tuple[list[str], list[str]]:
    names = list(load_file(folder / WEIGHTS))
    experts = [n for n in names if ".experts." in n]
    # and the weights and biases of the decoder layers' other modules (attention, norms, router)
    experts += [n for n in names if ".layers." in n and ".experts." not in n
                and n.endswith((".weight", ".bias"))]
    scales = [n for n in names if n.rsplit(".", 1)[-1].endswith(("scale", "scale_2"))]
    return experts, scales


@pytest.mark.parametrize("seed", range(4))
def test_random_damage_is_found_and_never_raises(seed, qwen3_mixed, tmp_path):
    rng = random.Random(seed)
    experts, scales = _expert_and_scale_tensors(qwen3_mixed)
    variants = {
        "truncated json": (truncate(rng.choice(["config.json", "hf_quant_config.json"]),
                                    rng.uniform(0.05, 0.95)), "json"),
        "deleted tensor": (delete_tensors(rng.choice(experts)), "tensors"),
        "poisoned scale": (set_scalar(rng.choice([s for s in scales if "weight_scale" not in s
                                                  or s.endswith("_2")]),
                                      rng.choice([math.nan, -math.inf, 0.0, -rng.random()])),
                           "scales"),
        "cut weights": (edit_bytes(lambda b: b[:rng.randrange(9, len(b) - 1)]), "safetensors"),
    }
    for label, (apply, rule) in variants.items():
        folder = Path(shutil.copytree(qwen3_mixed, tmp_path / label.replace(" ", "_")))
        apply(folder)
        report = check_checkpoint(folder)
        assert rule in report.rules() or (rule == "safetensors" and "folder" in report.rules()), (
            label, [f.paragraph for f in report.findings])


@pytest.mark.parametrize("seed", range(3))
def test_random_bytes_in_a_safetensors_header_never_crash_the_check(seed, qwen3_fp8, tmp_path):
    rng = random.Random(seed)
    folder = Path(shutil.copytree(qwen3_fp8, tmp_path / "ckpt"))
    raw = bytearray((folder / WEIGHTS).read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    for _ in range(8):
        raw[rng.randrange(0, 8 + n)] = rng.randrange(256)
    (folder / WEIGHTS).write_bytes(bytes(raw))
    check_checkpoint(folder)  # any finding, or none; never an exception


_ODD_VALUES = (None, -1, 0, 2**40, 1.5, "16", True, [], {}, [1, "x"], {"num_bits": 8})


@pytest.mark.parametrize("seed", range(3))
def test_config_fields_of_any_type_never_crash_the_check(seed, qwen3_mixed, deepseek_fp8, tmp_path):
    """Any field of either config file set to a value of another type: findings, no exception."""
    rng = random.Random(seed)
    for n, base in enumerate((qwen3_mixed, deepseek_fp8) * 6):
        folder = Path(shutil.copytree(base, tmp_path / f"v{n}"))
        file = rng.choice(["config.json", "hf_quant_config.json"])
        data = json.loads((folder / file).read_text())
        block = data.get("quantization_config") or data.get("quantization") or data
        target = rng.choice([data, block])
        key = rng.choice(sorted(target))
        target[key] = rng.choice(_ODD_VALUES)
        (folder / file).write_text(json.dumps(data))
        check_checkpoint(folder, machine=None)


# Found by an outside user: these loaded without a word and served garbage (an integer or boolean
# dense tensor is cast to the model's dtype by transformers; a negative rms_norm_eps or
# rope_theta makes every logit NaN). The check names each.
NUMBER_DAMAGES = [
    Damage("norm_of_an_integer_dtype", "qwen3_nvfp4", edit_tensors(lambda t: t.__setitem__(
        "model.norm.weight", torch.ones(64, dtype=torch.int8))), "tensors",
           ["'model.norm.weight' is I8", "BF16 or F16 or F32"]),
    Damage("layer_norms_of_bool_dtype", "qwen3_fp8", edit_tensors(lambda t: [t.__setitem__(
        f"model.layers.{i}.input_layernorm.weight", torch.ones(64, dtype=torch.bool))
        for i in range(2)]), "tensors", ["input_layernorm.weight' is BOOL", "(and 1 more tensor",
                                         "BF16 or F16 or F32"]),
    Damage("embeddings_of_an_integer_dtype", "qwen3_mixed", edit_tensors(lambda t: t.__setitem__(
        "model.embed_tokens.weight", t["model.embed_tokens.weight"].to(torch.int8))), "tensors",
           ["'model.embed_tokens.weight' is I8", "BF16 or F16 or F32"]),
    Damage("rms_norm_eps_negative", "qwen3_nvfp4", set_config(rms_norm_eps=-1.0), "config",
           ["config.json", "rms_norm_eps is -1.0", "a number of 0 or more"]),
    Damage("rope_theta_negative", "qwen3_fp8",
           set_config(rope_parameters={"rope_type": "default", "rope_theta": -1}), "config",
           ["rope_parameters.rope_theta is -1", "a positive number"]),
    Damage("rope_theta_zero_at_the_top_level", "qwen3_fp8", set_config(rope_theta=0), "config",
           ["rope_theta is 0", "a positive number"]),
    # not numbers: check said ok, and serve stopped on a bare TypeError ("unsupported operand
    # type(s) for ** or pow(): 'str' and 'Tensor'") naming no field
    Damage("rope_theta_a_string", "qwen3_fp8",
           set_config(rope_parameters={"rope_type": "default", "rope_theta": "big"}), "config",
           ["rope_parameters.rope_theta is 'big', a str, not a number", "a positive number"]),
    Damage("rms_norm_eps_a_string", "qwen3_nvfp4", set_config(rms_norm_eps="x"), "config",
           ["rms_norm_eps is 'x', a str, not a number", "a number of 0 or more"]),
]


@pytest.mark.parametrize("damage", NUMBER_DAMAGES, ids=lambda d: d.id)
def test_dense_tensors_and_numeric_constants_out_of_range_are_refused(damage, damaged, capsys):
    test_a_damaged_checkpoint_is_refused_by_check_and_plan_naming_the_problem(
        damage, damaged, capsys)


@pytest.mark.parametrize("which", ["rms_norm_eps_negative", "rope_theta_a_string"])
def test_serve_refuses_a_bad_constant_at_start_up(damaged, which):
    damage = next(d for d in NUMBER_DAMAGES if d.id == which)
    _assert_serve_refuses(damaged(damage), damage.needles)


def copy_of_the_weights(folder: Path) -> None:
    shutil.copy(folder / WEIGHTS, folder / "model-extra.safetensors")


def test_a_tensor_stored_in_two_files_is_refused(damaged, capsys):
    """Found by an outside user: two .safetensors files holding the same tensors, no index, passed
    the check and served (whichever copy the loader read last)."""
    damage = Damage("tensors_in_two_files", "qwen3_nvfp4", copy_of_the_weights, "safetensors",
                    ["is stored in both", WEIGHTS, "model-extra.safetensors", "more tensors",
                     "each tensor in one .safetensors file"])
    test_a_damaged_checkpoint_is_refused_by_check_and_plan_naming_the_problem(
        damage, damaged, capsys)


def test_an_unknown_rope_type_is_refused_naming_the_known_ones(damaged, capsys):
    """Found by an outside user: rope_parameters.rope_type 'bogus' passed check and plan, and serve
    failed at start with a bare "serving failed: KeyError: 'bogus'"."""
    damage = Damage("rope_type_unknown", "qwen3_fp8",
                    set_config(rope_parameters={"rope_type": "bogus", "rope_theta": 1e4}),
                    "config", ["config.json", "rope_parameters.rope_type is 'bogus'",
                               "'default'", "'yarn'"])
    test_a_damaged_checkpoint_is_refused_by_check_and_plan_naming_the_problem(
        damage, damaged, capsys)


# ------------------------------------------- special token ids, head_dim and sliding_window
# Found by testers: each passed check and plan, and serve then refused the checkpoint at load
# (a head_dim its attention tensors do not have), failed at the first request (a sliding window
# of 0 or fewer tokens), or stopped on no token (an eos_token_id outside the vocabulary).


def set_generation_config(**fields):
    return edit_json("generation_config.json", lambda d: d.update(fields))


_EOS_ACCEPTED = ("an integer from 0 to 255", "a non-empty list of such integers, or null")
_WINDOW_ACCEPTED = "a positive integer (the tokens each query attends back over), or null"

CONFIG_VALUE_DAMAGES = [
    *[Damage(f"eos_token_id_{label}", "qwen3_fp8", set_config(eos_token_id=value), "config",
             ["config.json", f"eos_token_id is {said}", problem, *_EOS_ACCEPTED])
      for label, value, said, problem in (
          ("a_string", "x", "'x'", "no token id (str"),
          ("a_float", 1.5, "1.5", "no token id (float"),
          ("a_bool", True, "True", "no token id (bool"),
          ("an_empty_list", [], "[]", "names no token"),
          ("the_vocab_size", 256, "256", "outside the vocabulary of 256 tokens"),
          ("negative", -1, "-1", "outside the vocabulary"),
          ("a_list_with_one_outside", [1, 300], "[1, 300]", "its 300 is outside the vocabulary"),
          ("a_list_with_a_string", [1, "2"], "[1, '2']", "its '2' is no token id"))],
    Damage("generation_config_eos_token_id_a_string", "qwen3_fp8",
           set_generation_config(eos_token_id="x"), "config",
           ["generation_config.json", "eos_token_id is 'x'", "no token id", *_EOS_ACCEPTED]),
    Damage("generation_config_eos_token_id_outside_the_vocabulary", "mixtral_nvfp4",
           set_generation_config(eos_token_id=1000), "config",
           ["generation_config.json", "eos_token_id is 1000", "outside the vocabulary",
            *_EOS_ACCEPTED]),
    Damage("generation_config_pad_token_id_negative", "qwen3_fp8",
           set_generation_config(pad_token_id=-5), "config",
           ["generation_config.json", "pad_token_id is -5", "outside the vocabulary",
            "an integer from 0 to 255 (the vocabulary's 256 tokens), or null"]),
    Damage("bos_token_id_outside_the_vocabulary", "deepseek_fp8", set_config(bos_token_id=999),
           "config", ["config.json", "bos_token_id is 999", "outside the vocabulary",
                      "an integer from 0 to 255"]),
    Damage("pad_token_id_a_list", "qwen3_fp8", set_config(pad_token_id=[0]), "config",
           ["config.json", "pad_token_id is [0]", "no token id (list",
            "an integer from 0 to 255 (the vocabulary's 256 tokens), or null"]),
    # head_dim: transformers builds q/k/v/o_proj (and Qwen3's q_norm/k_norm) from it
    Damage("head_dim_larger_than_the_attention_tensors", "qwen3_fp8", set_config(head_dim=32),
           "tensors", ["config.json", "'model.layers.0.self_attn.q_proj.weight'", "[64, 64]",
                       "[128, 64]", "num_attention_heads 4 x head size 32",
                       "the head size from head_dim 32", "loading would refuse",
                       "accepted: head_dim 16"]),
    Damage("head_dim_smaller_than_packed_attention_tensors", "mixtral_nvfp4",
           set_config(head_dim=8), "tensors",
           ["config.json", "'model.layers.0.self_attn.q_proj.weight'", "U8 packed", "[32, 64]",
            "head_dim 8", "accepted: head_dim 16"]),
    Damage("no_head_dim_and_hidden_over_heads_disagrees", "qwen3_fp8",
           edit_json("config.json", lambda d: d.update(num_attention_heads=2,
                                                       num_key_value_heads=1)
                     or d.pop("head_dim")), "tensors",
           # q/k/v/o_proj's products still agree (2 x 32 = 4 x 16): the per-head norms do not
           ["config.json", "'model.layers.0.self_attn.q_norm.weight'", "holds [16], but",
            "[32] = [head size 32]", "hidden_size 64 / num_attention_heads 2 = 32 (no head_dim)",
            "num_attention_heads, num_key_value_heads, head_dim, hidden_size"]),
    Damage("head_dim_null_where_the_attention_takes_it_as_given", "qwen3_fp8",
           set_config(head_dim=None), "config",
           ["config.json", "head_dim is null", "no 'head_dim' key"]),
    # sliding_window
    Damage("sliding_window_negative", "qwen3_fp8", set_config(sliding_window=-1), "config",
           ["config.json", "sliding_window is -1", "negative", _WINDOW_ACCEPTED]),
    Damage("sliding_window_a_float", "mixtral_nvfp4", set_config(sliding_window=4096.5),
           "config", ["config.json", "sliding_window is 4096.5", "not a number of tokens",
                      _WINDOW_ACCEPTED]),
    Damage("sliding_window_a_string", "qwen3_fp8", set_config(sliding_window="4096"),
           "config", ["config.json", "sliding_window is '4096'", _WINDOW_ACCEPTED]),
    Damage("sliding_window_zero_where_it_applies", "mixtral_nvfp4", set_config(sliding_window=0),
           "config", ["config.json", "sliding_window is 0", "no token to attend to",
                      _WINDOW_ACCEPTED]),
    Damage("layer_types_not_a_list", "qwen3_fp8", set_config(layer_types=-1), "config",
           ["config.json", "layer_types is -1", "expected a list of layer types"]),
    Damage("sliding_window_zero_with_use_sliding_window", "qwen3_fp8",
           set_config(sliding_window=0, use_sliding_window=True), "config",
           ["config.json", "sliding_window is 0", "use_sliding_window false"]),
]


@pytest.mark.parametrize("damage", CONFIG_VALUE_DAMAGES, ids=lambda d: d.id)
def test_special_token_ids_head_dim_and_sliding_window_out_of_range_are_refused(
        damage, damaged, capsys):
    test_a_damaged_checkpoint_is_refused_by_check_and_plan_naming_the_problem(
        damage, damaged, capsys)


@pytest.mark.parametrize("base,file,change", [
    ("qwen3_fp8", "config.json", {"eos_token_id": 0}),
    ("qwen3_fp8", "config.json", {"eos_token_id": 255, "bos_token_id": 0, "pad_token_id": 1}),
    ("qwen3_fp8", "config.json", {"eos_token_id": [1, 2]}),
    ("qwen3_fp8", "config.json", {"eos_token_id": None, "pad_token_id": None}),
    ("qwen3_fp8", "generation_config.json", {"eos_token_id": [0, 1], "pad_token_id": 0}),
    ("qwen3_fp8", "config.json", {"head_dim": 16}),
    ("mixtral_nvfp4", "config.json", {"head_dim": None}),  # Mixtral's attention derives it
    ("deepseek_fp8", "config.json", {"head_dim": 99}),  # MLA: DeepseekV3Config replaces it
    ("qwen3_fp8", "config.json", {"sliding_window": None, "use_sliding_window": True}),
    ("qwen3_fp8", "config.json", {"sliding_window": 4096, "use_sliding_window": True}),
    ("qwen3_fp8", "config.json", {"sliding_window": 0, "use_sliding_window": False}),
    ("mixtral_nvfp4", "config.json", {"sliding_window": 1}),
], ids=lambda v: str(v) if not isinstance(v, dict) else json.dumps(v).replace(" ", ""))
def test_valid_token_ids_head_dims_and_sliding_windows_still_pass(base, file, change, request,
                                                                 tmp_path):
    folder = Path(shutil.copytree(request.getfixturevalue(base), tmp_path / "ckpt"))
    edit_json(file, lambda d: d.update(change))(folder)
    report = check_checkpoint(folder, machine=None)
    assert report.ok, [f.paragraph for f in report.findings]


def test_no_head_dim_passes_where_hidden_size_over_heads_is_the_stored_head_size(qwen3_fp8,
                                                                                 tmp_path):
    folder = Path(shutil.copytree(qwen3_fp8, tmp_path / "ckpt"))
    delete_config("head_dim")(folder)  # 64 / 4 heads = 16, what the tensors hold
    assert check_checkpoint(folder, machine=None).ok


@pytest.mark.parametrize("base,head_dim", [("qwen3_fp8", 8), ("qwen3_fp8", 16),
                                           ("qwen3_fp8", 32), ("qwen3_fp8", None),
                                           ("mixtral_nvfp4", 32), ("mixtral_nvfp4", None),
                                           ("deepseek_fp8", 99)])
def test_check_passes_a_head_dim_exactly_when_the_model_loads(base, head_dim, request,
                                                             tmp_path, monkeypatch):
    """The check derives the head size as transformers' attention of the architecture does: it
    passes the config if and only if ``load_model`` (what serve calls), with the check taken out,
    builds the model and loads the tensors into it."""
    from moe_runtime.checkpoint import check
    from moe_runtime.integration.transformers import load_model

    folder = Path(shutil.copytree(request.getfixturevalue(base), tmp_path / "ckpt"))
    set_config(head_dim=head_dim)(folder)
    passes = check_checkpoint(folder, machine=None).ok
    monkeypatch.setattr(check, "require_sound_checkpoint", lambda path, **_: attrs.evolve(
        check_checkpoint(path, machine=None), findings=()))
    try:
        load_model(folder)
        loads = True
    except Exception:  # noqa: BLE001 - a model that cannot be built or loaded
        loads = False
    assert passes == loads, (passes, loads)


def test_text_config_token_ids_are_checked(data_copy):
    """An architecture whose model fields sit under text_config: its token ids are checked there,
    against its vocab_size."""
    folder = data_copy("qwen3_5_moe_nvfp4_mixed")
    text = json.loads((folder / "config.json").read_text())["text_config"]
    vocab = text["vocab_size"]
    edit_json("config.json", lambda d: d["text_config"].update(eos_token_id=vocab))(folder)
    report = check_checkpoint(folder, machine=None, weights_required=False)
    (finding,) = [f for f in report.findings if "eos_token_id" in f.paragraph]
    assert f"text_config.eos_token_id is {vocab}, outside the vocabulary" in finding.paragraph
    assert f"an integer from 0 to {vocab - 1}" in finding.paragraph


@pytest.mark.parametrize("damage_id", ["head_dim_larger_than_the_attention_tensors",
                                       "generation_config_eos_token_id_a_string"])
def test_serve_refuses_a_wrong_head_dim_or_eos_token_id_at_start_up(damage_id, damaged):
    damage = next(d for d in CONFIG_VALUE_DAMAGES if d.id == damage_id)
    _assert_serve_refuses(damaged(damage), damage.needles)


# ------------------------------------------- found by a user session damaging exports by hand
# Each passed check and plan before its fix: a tensor of an expert that no experts backend reads
# (served without it), a tokenizer with more tokens than the embeddings have rows (serve failed at
# start with "index out of range in self" in embed_tokens), an NVFP4 group_size of 0 (taken as
# 16), and an index whose shard names are paths out of the folder or name the wrong shard.


def add_tensor(name: str, value: torch.Tensor):
    return edit_tensors(lambda t: t.__setitem__(name, value))


def tokenizer_of_512_tokens(folder: Path) -> None:
    from moe_runtime.serve.tiny_tokenizer import save_tokenizer

    save_tokenizer(folder, model_max_length=1024)  # the exports' vocab_size is 256


def index_of_paths(folder: Path) -> None:
    write_index()(folder)
    edit_json(INDEX, lambda d: d["weight_map"].update(
        {k: f"../{folder.name}/{WEIGHTS}" for k in d["weight_map"]}))(folder)


SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def split_in_two_shards(folder: Path) -> dict[str, str]:
    """model.safetensors -> two shards and an index (what ModelOpt writes for a large model)."""
    tensors = load_file(folder / WEIGHTS)
    names = sorted(tensors)
    weight_map = {n: SHARDS[i * 2 // len(names)] for i, n in enumerate(names)}
    for shard in SHARDS:
        save_file({n: tensors[n] for n in names if weight_map[n] == shard}, folder / shard,
                  metadata={"format": "pt"})
    (folder / WEIGHTS).unlink()
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def index_names_the_other_shard(folder: Path) -> None:
    weight_map = split_in_two_shards(folder)
    weight_map["model.norm.weight"] = next(s for s in SHARDS
                                           if s != weight_map["model.norm.weight"])
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def config_link_loop(folder: Path) -> None:
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(folder / "config.json")


_IGNORED = "would be ignored and the layer would compute other numbers than the checkpoint's"

HAND_DAMAGES = [
    Damage("expert_bias_no_backend_reads", "qwen3_fp8",
           add_tensor(f"{EXPERT}.down_proj.bias", torch.zeros(64, dtype=torch.bfloat16)),
           "tensors", [f"'{EXPERT}.down_proj.bias' is stored", "no fp8_w8a8 expert reads it",
                       _IGNORED, "input_scale, weight, weight_scale"]),
    Damage("expert_pre_quant_scale_no_backend_reads", "qwen3_nvfp4",
           edit_tensors(lambda t: [t.__setitem__(f"model.layers.{i}.mlp.experts.{e}.gate_proj"
                                                 ".pre_quant_scale", torch.ones(64))
                                   for i in range(2) for e in range(8)]),
           "tensors", ["'model.layers.0.mlp.experts.0.gate_proj.pre_quant_scale' is stored",
                       "(and 7 more tensors like it)", "no nvfp4_w4a4 expert reads it", _IGNORED,
                       "weight_scale_2"]),
    Damage("tokenizer_larger_than_the_embeddings", "qwen3_fp8", tokenizer_of_512_tokens,
           "config", ["tokenizer.json", "holds token id 511", "config.json's vocab_size is 256",
                      "(and 255 more token ids like it)", "index out of range",
                      "token ids are all below vocab_size 256"]),
    Damage("added_token_outside_the_embeddings", "qwen3_nvfp4",
           write_text("tokenizer_config.json", json.dumps(
               {"added_tokens_decoder": {"7": {"content": "<s>"}, "300": {"content": "<x>"}}})),
           "config", ["tokenizer_config.json", "holds token id 300 ('<x>')", "vocab_size is 256",
                      "below vocab_size 256"]),
    Damage("group_size_0_for_nvfp4", "qwen3_nvfp4",
           both_quant_configs(lambda q: q.update(group_size=0)), "group_size",
           ["hf_quant_config.json", "group_size (with quant_algo 'NVFP4') is 0",
            "exactly 16 elements", "group_size 16"]),
    Damage("group_size_0_in_a_layer_entry", "qwen3_mixed",
           layer_entry("model.layers.0.mlp.experts", quant_algo="NVFP4", group_size=0),
           "group_size", ["quantized_layers['model.layers.0.mlp.experts'].group_size is 0"]),
    Damage("index_shard_names_are_paths", "qwen3_fp8", index_of_paths, "index",
           [INDEX, f"'../ckpt/{WEIGHTS}'", "is a path, not the name of a file in the checkpoint "
            "folder", "shard file names alone"]),
    Damage("index_names_the_other_shard", "qwen3_fp8", index_names_the_other_shard, "index",
           [INDEX, "maps tensor 'model.norm.weight' to", "holds it",
            "each tensor mapped to the shard that stores it"]),
    Damage("config_json_a_link_loop", "qwen3_fp8", config_link_loop, "folder",
           ["config.json", "cannot be read", "symbolic link", "loops"]),
    # served without a word: transformers' Qwen3-MoE attention has no bias (attention_bias
    # false), its router and norms none at all, and a tied model holds one matrix for both ends
    Damage("attention_bias_the_model_has_not", "qwen3_fp8", edit_tensors(lambda t: [
        t.__setitem__(f"model.layers.{i}.self_attn.q_proj.bias",
                      torch.full((64,), 5.0, dtype=torch.bfloat16)) for i in range(2)]),
           "tensors", ["'model.layers.0.self_attn.q_proj.bias' is stored",
                       "Qwen3MoeForCausalLM model that config.json builds has no parameter",
                       "(and 1 more tensor like it)", "would be ignored", "attention_bias true"]),
    Damage("router_bias_the_model_has_not", "qwen3_nvfp4",
           add_tensor("model.layers.1.mlp.gate.bias", torch.ones(8, dtype=torch.bfloat16)),
           "tensors", ["'model.layers.1.mlp.gate.bias' is stored", "would be ignored"]),
    Damage("lm_head_stored_but_tied", "qwen3_fp8", set_config(tie_word_embeddings=True),
           "tensors", ["config.json", "tie_word_embeddings is true",
                       "'lm_head.weight' is stored and is not 'model.embed_tokens.weight'",
                       "other values", "tie_word_embeddings false", "or no lm_head.weight"]),
    Damage("weight_scale_beside_a_bf16_lm_head", "qwen3_nvfp4",
           add_tensor("lm_head.weight_scale", torch.tensor(2.0)), "tensors",
           ["'lm_head.weight_scale' is stored beside the BF16 weight 'lm_head.weight'",
            "not F8_E4M3 or U8", "no weight_scale for an unquantized module"]),
    # scalars loading takes as one: passed the check, and serve's load stopped on them
    Damage("gate_and_up_weight_scale_2_differ", "qwen3_nvfp4",
           set_scalar(f"{EXPERT}.up_proj.weight_scale_2", 0.125), "scales",
           ["MoE layer model.layers.1.mlp.experts (nvfp4_w4a4", f"'{EXPERT}.up_proj."
            f"weight_scale_2' is 0.125 but '{EXPERT}.gate_proj.weight_scale_2' is",
            "one fused GEMM", "loading refuses", "the same weight_scale_2"]),
    Damage("input_scale_differs_between_experts", "qwen3_fp8",
           set_scalar(f"{EXPERT}.gate_proj.input_scale", 0.5), "scales",
           ["the gate_proj/up_proj input_scale differs between experts",
            f"'{EXPERT}.gate_proj.input_scale' is 0.5 but 'model.layers.1.mlp.experts.0.",
            "loading refuses", "one gate_proj/up_proj input_scale shared by every expert"]),
    Damage("down_input_scale_differs_between_nvfp4_experts", "qwen3_nvfp4",
           set_scalar(f"{EXPERT}.down_proj.input_scale", 0.25), "scales",
           ["the down_proj input_scale differs between experts", "is 0.25 but"]),
    # DeepSeek-V3's config: an unknown topk_method routed without the correction bias, and a
    # negative routed_scaling_factor flipped every MoE output, both served without a word; a
    # null q_lora_rank or another n_shared_experts passed the check, and loading refused them
    Damage("topk_method_unknown", "deepseek_fp8", set_config(topk_method="bogus"), "config",
           ["config.json", "topk_method is 'bogus'", "'noaux_tc', 'greedy'",
            "e_score_correction_bias"]),
    *[Damage(f"routed_scaling_factor_{label}", "deepseek_fp8",
             set_config(routed_scaling_factor=value), "config",
             ["config.json", f"routed_scaling_factor is {value!r}", "a positive number"])
      for label, value in (("negative", -2.5), ("zero", 0))],
    Damage("q_lora_rank_null_for_low_rank_tensors", "deepseek_fp8", set_config(q_lora_rank=None),
           "tensors", ["config.json", "needs 'self_attn.q_proj.weight'", "no layer stores it",
                       "'q_a_proj.weight', 'q_b_proj.weight' instead", "q_lora_rank null"]),
    Damage("n_shared_experts_disagrees_with_tensors", "deepseek_fp8",
           set_config(n_shared_experts=2), "tensors",
           ["config.json", "'model.layers.1.mlp.shared_experts.gate_proj.weight' holds [32, 64]",
            "n_shared_experts 2", "gives it [64, 64]", "(and 2 more tensors like it)",
            "intermediate size the tensors hold (32)"]),
    Damage("layer_norms_of_another_width", "qwen3_fp8", edit_tensors(lambda t: [
        t.__setitem__(f"model.layers.{i}.input_layernorm.weight",
                      torch.ones(32, dtype=torch.bfloat16)) for i in range(2)]), "tensors",
           ["'model.layers.0.input_layernorm.weight' has shape [32]",
            "config.json's hidden_size is 64", "(and 1 more tensor like it)",
            "loading would refuse", "accepted: [64]"]),
]


@pytest.mark.parametrize("damage", HAND_DAMAGES, ids=lambda d: d.id)
def test_damage_made_by_hand_is_refused_naming_the_problem(damage, damaged, capsys):
    test_a_damaged_checkpoint_is_refused_by_check_and_plan_naming_the_problem(
        damage, damaged, capsys)


def test_a_link_loop_is_not_also_called_a_missing_config_json(damaged):
    damage = next(d for d in HAND_DAMAGES if d.id == "config_json_a_link_loop")
    report = check_checkpoint(damaged(damage), machine=None)
    assert [f.rule for f in report.findings] == ["folder"], [f.paragraph for f in report.findings]
    assert "does not exist" not in report.findings[0].paragraph


@pytest.mark.parametrize("damage_id", ["attention_bias_the_model_has_not",
                                       "lm_head_stored_but_tied",
                                       "gate_and_up_weight_scale_2_differ",
                                       "topk_method_unknown"])
def test_serve_refuses_weights_it_would_have_ignored(damage_id, damaged):
    damage = next(d for d in HAND_DAMAGES if d.id == damage_id)
    _assert_serve_refuses(damaged(damage), damage.needles)


def test_biases_the_model_has_and_a_tied_lm_head_equal_to_the_embeddings_pass(tiny, qwen3_fp8,
                                                                             tmp_path):
    assert check_checkpoint(tiny(arch="qwen2_moe", quant="fp8"), machine=None).ok  # q/k/v bias
    folder = Path(shutil.copytree(qwen3_fp8, tmp_path / "ckpt"))
    set_config(attention_bias=True)(folder)
    edit_tensors(lambda t: [t.__setitem__(f"model.layers.{i}.self_attn.{p}.bias", torch.zeros(
        t[f"model.layers.{i}.self_attn.{p}.weight"].shape[0], dtype=torch.bfloat16))
        for i in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")])(folder)
    report = check_checkpoint(folder, machine=None)
    assert report.ok, [f.paragraph for f in report.findings]
    set_config(tie_word_embeddings=True)(folder)
    edit_tensors(lambda t: t.__setitem__("lm_head.weight",
                                         t["model.embed_tokens.weight"].clone()))(folder)
    report = check_checkpoint(folder, machine=None)
    assert report.ok, [f.paragraph for f in report.findings]


def test_a_split_export_with_a_true_index_passes(qwen3_fp8, tmp_path):
    folder = Path(shutil.copytree(qwen3_fp8, tmp_path / "ckpt"))
    split_in_two_shards(folder)
    assert check_checkpoint(folder, machine=None).ok


@pytest.mark.parametrize("file,change", [
    ("hf_quant_config.json", {"group_size": 0}),  # a format without blocks: 0 says "none"
    ("config.json", {"vocab_size": 600}),  # embeddings padded past the tokenizer's 512 tokens
])
def test_fp8_group_size_0_and_a_tokenizer_smaller_than_the_vocabulary_pass(file, change,
                                                                          qwen3_fp8, tmp_path):
    folder = Path(shutil.copytree(qwen3_fp8, tmp_path / "ckpt"))
    if file == "config.json":
        tokenizer_of_512_tokens(folder)
        edit_tensors(lambda t: [t.__setitem__(n, torch.zeros(600, 64, dtype=torch.bfloat16))
                                for n in ("model.embed_tokens.weight", "lm_head.weight")])(folder)
        set_config(**change)(folder)
    else:
        edit_json(file, lambda d: d["quantization"].update(change))(folder)
    report = check_checkpoint(folder, machine=None)
    assert report.ok, [f.paragraph for f in report.findings]


@pytest.mark.parametrize("change,said", [
    pytest.param(lambda b: b[:3], "is 3 bytes long, too short to be a safetensors file",
                 id="three_bytes"),
    pytest.param(lambda b: struct.pack("<Q", 1 << 40) + b[8:],
                 "its header length field says 1099511627776 bytes", id="header_length_too_big"),
])
def test_a_safetensors_file_too_short_for_its_header_is_not_called_invalid_json(
        change, said, qwen3_fp8, tmp_path):
    """The header reader's own refusal (a ValueError) was caught again as a JSON error: "the
    header is not valid JSON (<path>: is 3 bytes long ...)", with the JSON header's remedy."""
    folder = Path(shutil.copytree(qwen3_fp8, tmp_path / "ckpt"))
    edit_bytes(change)(folder)
    (finding,) = check_checkpoint(folder, machine=None).findings
    assert finding.paragraph.startswith(f"{folder / WEIGHTS}: {said}"), finding.paragraph
    assert "JSON (" not in finding.paragraph and finding.paragraph.count(WEIGHTS) == 1
    assert "8-byte little-endian header length" in finding.accepted


def test_a_wrong_group_size_is_said_once_and_blames_no_attention_tensor(damaged):
    """A group size that no module resolves with was reported once per module resolved, and the
    attention tensors, whose formats were then unknown, were judged as unpacked."""
    damage = Damage("group_size_negative", "qwen3_nvfp4",
                    both_quant_configs(lambda q: q.update(group_size=-16)), "group_size",
                    ["group_size (with quant_algo 'NVFP4') is -16"])
    report = check_checkpoint(damaged(damage), machine=None)
    finding_with(report, damage)
    paragraphs = [f.paragraph for f in report.findings]
    assert len(paragraphs) == len(set(paragraphs)), paragraphs
    assert not any("transformers builds it" in p for p in paragraphs), paragraphs


def test_serve_refuses_a_tokenizer_larger_than_the_embeddings_at_start_up(damaged):
    damage = next(d for d in HAND_DAMAGES if d.id == "tokenizer_larger_than_the_embeddings")
    _assert_serve_refuses(damaged(damage), damage.needles)


def test_plan_says_a_memory_warning_once(qwen3_nvfp4, capsys):
    """The check's estimate and the planned one were both printed: two warnings, differing only
    in their numbers."""
    code, text = run_cli(capsys, "plan", str(qwen3_nvfp4), "--max-model-len", str(1 << 40))
    assert code == 0, text
    assert text.count("warning: ") == 1, text


@pytest.mark.parametrize("device, needle", [
    ("tpu", "device 'tpu' is not supported; use cpu, cuda or cuda:N"),
    ("cuda:x", "device 'cuda:x' is not supported"),
    ("cpu:0", "device 'cpu:0' is not supported"),
])
def test_check_refuses_a_device_it_cannot_compare_with(qwen3_nvfp4, device, needle):
    # it was accepted: "ok", compared with the host's memory or with none at all
    with pytest.raises(SystemExit) as info:
        cli.main(["check", str(qwen3_nvfp4), "--device", device])
    assert str(info.value.code).startswith(f"error: --device: {needle}")


def test_check_on_cuda_without_cuda_is_refused_not_silently_uncompared(qwen3_nvfp4):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as info:
        cli.main(["check", str(qwen3_nvfp4), "--device", "cuda"])
    assert "CUDA is not available here" in str(info.value.code)


def test_plan_refuses_an_ep_size_of_0_as_an_error(qwen3_nvfp4, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["plan", str(qwen3_nvfp4), "--ep-size", "0"])
    assert str(info.value.code) == "error: --ep-size must be at least 1, got 0"


@pytest.mark.parametrize("field", ["head_dim", "num_key_value_heads"])
def test_a_size_of_the_wrong_type_is_one_finding_not_two(damaged, field):
    # the reader's error and the size rule both said it: "head_dim is '16'" twice
    folder = damaged(Damage(f"{field}_a_string", "qwen3_fp8", set_config(**{field: "16"}),
                            "config", [field]))
    report = check_checkpoint(folder, machine=None)
    said = [f.paragraph for f in report.findings if f"{field} is '16'" in f.paragraph]
    assert len(said) == 1, [f.paragraph for f in report.findings]


@pytest.mark.parametrize("which", ["truncated_weights", "unknown_dtype_in_header"])
def test_a_tensor_with_a_bad_header_entry_is_not_also_reported_missing(damaged, which):
    # serve printed the truncation, then "tensor ... is missing" for the same tensor
    damage = next(d for d in DAMAGES if d.id == which)
    report = check_checkpoint(damaged(damage), machine=None)
    assert [f.rule for f in report.findings] == ["safetensors"], [
        f.paragraph for f in report.findings]
    assert not any("is missing" in f.paragraph for f in report.findings)


@pytest.mark.parametrize("sharded", [False, True], ids=["one_file", "one_of_two_shards"])
def test_an_unreadable_weights_file_is_one_finding_not_every_tensor_missing(
        sharded, qwen3_fp8, tmp_path, monkeypatch):
    """A weights file that cannot be opened (permission denied: the tests run as root, so the
    refusal is made here) was reported, and then every tensor it holds as missing (or, of a
    shard, as mapped by the index to a file "which does not hold it")."""
    folder = Path(shutil.copytree(qwen3_fp8, tmp_path / "ckpt"))
    name = WEIGHTS
    if sharded:
        split_in_two_shards(folder)
        name = SHARDS[1]
    real_open = Path.open

    def denied(self, *args, **kwargs):
        if self == folder / name:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", denied)
    report = check_checkpoint(folder, machine=None)
    assert [f.paragraph for f in report.findings] == [
        f"{folder / name}: cannot be read (Permission denied); accepted: a readable file, or no "
        "file of that name"]
