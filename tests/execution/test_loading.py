"""Weight loading: per-layer stacking, expert-parallel slicing, clear errors, bounded memory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_runtime.checkpoint import read_checkpoint
from moe_runtime.checkpoint.check import CheckpointRefused
from moe_runtime.checkpoint.tensors import CheckpointTensors, WeightError
from moe_runtime.methods import load_expert_weights


def _layer(path, i=0):
    return read_checkpoint(path).moe_layers[i]


def _rewrite(src, dst, edit):
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})
    return dst


def test_nvfp4_layer_is_stacked_with_gate_rows_first(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe", "nvfp4")
    layer = _layer(path)
    w = load_expert_weights(CheckpointTensors(path), layer)
    raw = load_file(str(path / "model.safetensors"))
    e = 5
    g, u, d = (f"{layer.name}.{e}.{p}" for p in layer.expert_names)
    i = layer.intermediate_size
    assert torch.equal(w.w13[e, :i], raw[f"{g}.weight"])
    assert torch.equal(w.w13[e, i:], raw[f"{u}.weight"])
    assert torch.equal(w.w2[e], raw[f"{d}.weight"])
    assert torch.equal(w.w13_scale[e, i:].view(torch.uint8), raw[f"{u}.weight_scale"].view(torch.uint8))
    assert w.w13_scale_2[e] == raw[f"{g}.weight_scale_2"]
    assert w.a13_scale == raw[f"{g}.input_scale"]


def test_mixtral_names_and_expert_parallel_slice(tiny_checkpoint):
    path = tiny_checkpoint("mixtral", "fp8")
    layer = _layer(path, 1)
    assert layer.expert_names == ("w1", "w3", "w2")
    full = load_expert_weights(CheckpointTensors(path), layer)
    part = load_expert_weights(CheckpointTensors(path), layer, experts=[4, 5, 6, 7])
    assert part.num_experts == 4
    assert torch.equal(part.w13.view(torch.uint8), full.w13[4:].view(torch.uint8))
    assert torch.equal(part.w2_scale, full.w2_scale[4:])


def test_missing_tensor_names_tensor_and_layer(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("qwen3_moe", "nvfp4")
    layer = _layer(path)
    name = f"{layer.name}.3.{layer.expert_names[2]}.weight_scale"
    bad = _rewrite(path, tmp_path / "bad", lambda t: t.pop(name))
    with pytest.raises(WeightError, match=rf"'{name}'.*layer {layer.name}.*missing.*e4m3 block scale"):
        load_expert_weights(CheckpointTensors(bad), layer)


def test_wrong_shape_is_refused_with_expected_shape(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("qwen3_moe", "fp8")
    layer = _layer(path)
    name = f"{layer.name}.0.{layer.expert_names[0]}.weight"
    bad = _rewrite(path, tmp_path / "bad", lambda t: t.update({name: t[name][:-1]}))
    with pytest.raises(WeightError, match=rf"'{name}'.*shape \[31, 64\]; expected \[32, 64\]"):
        load_expert_weights(CheckpointTensors(bad), layer)


def test_wrong_dtype_is_refused(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("qwen3_moe", "nvfp4")
    layer = _layer(path)
    name = f"{layer.name}.1.{layer.expert_names[1]}.weight_scale"
    bad = _rewrite(path, tmp_path / "bad", lambda t: t.update({name: t[name].float()}))
    with pytest.raises(WeightError, match=rf"'{name}'.*dtype torch.float32; expected torch.float8_e4m3fn"):
        load_expert_weights(CheckpointTensors(bad), layer)


def test_unshared_input_scale_is_refused(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("qwen3_moe", "nvfp4")
    layer = _layer(path)
    name = f"{layer.name}.6.{layer.expert_names[2]}.input_scale"
    bad = _rewrite(path, tmp_path / "bad", lambda t: t.update({name: t[name] * 2}))
    with pytest.raises(WeightError, match=rf"down input_scale must be shared.*'{name}'"):
        load_expert_weights(CheckpointTensors(bad), layer)


def test_gate_and_up_must_share_weight_scale_2(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("mixtral", "nvfp4")
    layer = _layer(path)
    name = f"{layer.name}.2.w3.weight_scale_2"
    bad = _rewrite(path, tmp_path / "bad", lambda t: t.update({name: t[name] * 2}))
    with pytest.raises(WeightError, match=r"weight_scale_2 of expert 2's gate and up"):
        load_expert_weights(CheckpointTensors(bad), layer)


def test_sharded_checkpoint_reads_through_the_index(tiny_checkpoint):
    path = tiny_checkpoint("deepseek_v3", "nvfp4", max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    layer = _layer(path)
    w = load_expert_weights(CheckpointTensors(path), layer)
    assert w.num_experts == layer.num_experts


PEAK_SCRIPT = textwrap.dedent("""
    import gc, json, resource, sys
    import torch
    from moe_runtime.checkpoint import read_checkpoint
    from moe_runtime.methods import load_expert_weights
    from moe_runtime.checkpoint.tensors import CheckpointTensors
    path = sys.argv[1]
    ckpt = read_checkpoint(path)
    tensors = CheckpointTensors(path)
    gc.collect()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    largest = 0
    for layer in ckpt.moe_layers:
        w = load_expert_weights(tensors, layer)
        size = sum(t.numel() * t.element_size() for t in (w.w13, w.w2))
        largest = max(largest, size)
        del w
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"growth_kb": peak - base, "largest_layer_kb": largest // 1024}))
""")


def test_peak_memory_stays_near_one_layer(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("qwen3_moe", "bf16", num_layers=8, hidden_size=256,
                           intermediate_size=256, num_experts=16)
    total_kb = sum(f.stat().st_size for f in path.glob("*.safetensors")) // 1024
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path)], capture_output=True,
                         text=True, check=True)
    r = json.loads(out.stdout)
    assert total_kb > 6 * r["largest_layer_kb"]  # the checkpoint is several layers large
    # peak growth is bounded by a couple of layers, not by the checkpoint
    assert r["growth_kb"] < 3 * r["largest_layer_kb"], (r, total_kb)


@pytest.mark.parametrize("fmt, pick, value, needle", [
    # a dense weight: the tensor named
    ("bf16", lambda names, layer: "model.layers.0.self_attn.q_proj.weight", float("nan"),
     r"tensor 'model.layers.0.self_attn.q_proj.weight' of .* holds 1 NaN or infinite value\(s\)"),
    ("bf16", lambda names, layer: "model.norm.weight", float("inf"),
     r"tensor 'model.norm.weight' of .* holds 1 NaN or infinite"),
    # an expert's weight: the checkpoint tensor named (not the loader's field, "w2")
    ("bf16", lambda names, layer: f"{layer.name}.5.{layer.expert_names[2]}.weight",
     float("-inf"), r"tensor 'model\.layers\.\d+\.mlp\.experts\.5\.down_proj\.weight' holds "
                    r"NaN or infinite values \(1 of .* w2 values; the first in expert 5\)"),
    # fp8: e4m3fn's NaN code, which no float comparison on the bytes would see as a value; of
    # the fused gate/up rows, the gate's
    ("fp8", lambda names, layer: f"{layer.name}.3.{layer.expert_names[0]}.weight", float("nan"),
     r"tensor 'model\.layers\.\d+\.mlp\.experts\.3\.gate_proj\.weight' holds NaN"),
    ("bf16", lambda names, layer: f"{layer.name}.2.{layer.expert_names[1]}.weight", float("nan"),
     r"tensor 'model\.layers\.\d+\.mlp\.experts\.2\.up_proj\.weight' holds NaN"),
])
def test_a_weight_that_is_not_finite_stops_loading_and_is_named(tiny_checkpoint, tmp_path, fmt,
                                                                 pick, value, needle):
    from moe_runtime.integration.transformers import load_model

    path = tiny_checkpoint("qwen3_moe", fmt)
    layer = _layer(path)
    raw = load_file(str(path / "model.safetensors"))
    name = pick(raw, layer)
    assert name in raw, sorted(raw)[:20]

    def poison(t):
        w = t[name].clone()
        w.view(-1)[7] = value  # float8 stores NaN as its own code
        t[name] = w

    bad = _rewrite(path, tmp_path / "bad", poison)
    with pytest.raises(WeightError, match=needle):
        load_model(bad, dtype="float32")
    load_model(path, dtype="float32")  # the untouched export loads


def test_a_weight_beyond_the_load_dtypes_range_is_named_as_such(tiny_checkpoint, tmp_path):
    """A finite bf16 weight of 1e5 overflows float16: the message says so and names the dtypes
    that hold it, rather than calling the checkpoint broken."""
    from moe_runtime.integration.transformers import load_model

    path = tiny_checkpoint("qwen3_moe", "bf16")
    name = "model.layers.0.self_attn.q_proj.weight"

    def enlarge(t):
        w = t[name].clone()
        w.view(-1)[3] = 1e5
        t[name] = w

    bad = _rewrite(path, tmp_path / "big", enlarge)
    with pytest.raises(WeightError, match=rf"'{name}' .* beyond float16's range .* bfloat16 or "
                                          r"float32"):
        load_model(bad, dtype="float16")
    load_model(bad, dtype="float32")  # it is finite: a wider dtype loads it


def test_nonfinite_counts_each_format_and_finds_the_first(tmp_path):
    from moe_runtime.checkpoint.tensors import nonfinite

    x = torch.randn(1000)
    assert nonfinite(x) == (0, -1)
    x[[17, 400]] = torch.tensor([float("nan"), float("inf")])
    assert nonfinite(x) == (2, 17)
    assert nonfinite(x.to(torch.bfloat16)) == (2, 17)
    f8 = torch.randn(64).to(torch.float8_e4m3fn)
    assert nonfinite(f8) == (0, -1)
    f8[9] = float("nan")
    assert nonfinite(f8) == (1, 9)
    e5 = torch.randn(64).to(torch.float8_e5m2)
    e5[3] = float("inf")
    assert nonfinite(e5) == (1, 3)
    assert nonfinite(torch.full((8,), 255, dtype=torch.uint8)) == (0, -1)  # packed NVFP4
    if hasattr(torch, "float8_e8m0fnu"):  # MX block scales: 0xFF is its NaN
        e8 = torch.full((16,), 127, dtype=torch.uint8)
        e8[5] = 255
        assert nonfinite(e8.view(torch.float8_e8m0fnu)) == (1, 5)
    # a finite tensor whose float32 sum overflows is finite, not refused
    assert nonfinite(torch.full((4,), 3e38)) == (0, -1)


def test_every_missing_dense_tensor_is_listed_before_anything_is_read(tiny_checkpoint, tmp_path,
                                                                      monkeypatch):
    """A tensor gone from every layer (which no layer-to-layer comparison sees) stops loading at
    once, with the count and the names, not at the first one after reading the others."""
    from moe_runtime.integration.transformers import load_model

    path = tiny_checkpoint("qwen3_moe", "bf16")
    gone = [k for k in load_file(str(path / "model.safetensors")) if k.endswith("k_proj.weight")]
    assert len(gone) >= 2
    bad = _rewrite(path, tmp_path / "no_k", lambda t: [t.pop(k) for k in gone])
    reads = []
    real_get = CheckpointTensors.get

    def counting_get(self, name, **kw):
        reads.append(name)
        return real_get(self, name, **kw)

    monkeypatch.setattr(CheckpointTensors, "get", counting_get)
    # the check that opens load_model says it first (since 3ff9d46), naming the projection
    with pytest.raises(CheckpointRefused, match=r"needs 'self_attn\.k_proj\.weight'.*in every "
                                                r"decoder layer, but no layer stores it"):
        load_model(bad, dtype="float32")
    assert not reads, reads[:5]
    # and the loader's own listing, for what a check does not cover: with the check's report
    # taken as sound, loading still stops before reading any dense tensor
    from moe_runtime.checkpoint import check

    real_check = check.require_sound_checkpoint

    def report_only(*args, **kwargs):
        try:
            return real_check(*args, **kwargs)
        except CheckpointRefused as refused:
            return refused.report

    monkeypatch.setattr(check, "require_sound_checkpoint", report_only)
    monkeypatch.setattr(check, "require_memory_for_plan", lambda report, plan: report)
    with pytest.raises(WeightError, match=rf"{len(gone)} tensor\(s\) of the model are missing "
                                          rf".*'{gone[0]}' \(looked for"):
        load_model(bad, dtype="float32")
    assert not [n for n in reads if "self_attn" in n or "norm" in n], reads[:5]
