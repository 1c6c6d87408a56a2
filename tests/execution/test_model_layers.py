"""Tiny ModelOpt exports load through moe-runtime; every MoE layer's output matches transformers'
own experts forward on ModelOpt-dequantized weights, given the same inputs."""

from __future__ import annotations

import pytest
import torch

from moe_runtime.integration.transformers import load_model

# Per-format tolerance on max |ours - transformers| / max |transformers| for one MoE layer.
# 16-bit and W4A16 formats compute the same products (float32 model): rounding only. W8A8 and
# W4A4 also quantize activations with the calibrated static scales (tokens past the calibrated
# range saturate); transformers does not. Those paths are checked exactly in tests/quant.
TOLERANCE = {"bf16": 1e-5, "w4a16_nvfp4": 1e-5, "fp8": 0.2, "nvfp4": 0.25, "mixed": 0.25}


def _capture_moe_io(model, names):
    """Record (hidden, top_k_index, top_k_weights) -> output of each experts module."""
    seen = {}
    modules = dict(model.named_modules())
    hooks = []
    for name in names:
        mod = modules[name]

        def hook(m, args, out, _name=name):
            seen[_name] = (tuple(a.detach().clone() for a in args), out.detach().clone())

        hooks.append(mod.register_forward_hook(hook))
    return seen, hooks


def _assert_layers_match(ours, seen, names, tolerance, what):
    """Run our experts modules on the captured inputs; compare with transformers' outputs."""
    modules = dict(ours.model.named_modules())
    for name in names:
        args, expected = seen[name]
        with torch.no_grad():
            got = modules[name](*args).float()
        err = ((got - expected.float()).abs().max() / expected.float().abs().max()).item()
        assert err <= tolerance, f"{what} {name}: relative error {err:.3g}"


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3"])
@pytest.mark.parametrize("quant", ["bf16", "fp8", "nvfp4", "w4a16_nvfp4", "mixed"])
def test_moe_layers_match_transformers_on_dequantized_weights(tiny_checkpoint, arch, quant):
    path = tiny_checkpoint(arch, quant)
    ours = load_model(path, dtype="float32")
    ref = load_model(path, dtype="float32", dequantize_experts=True)
    names = [n.replace(".block_sparse_moe.", ".mlp.") for n in
             (layer.name for layer in ours.checkpoint.moe_layers)]
    assert names, "the checkpoint has MoE layers"
    seen, hooks = _capture_moe_io(ref.model, names)
    ids = torch.randint(0, ref.model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref.model(ids)
    for h in hooks:
        h.remove()
    _assert_layers_match(ours, seen, names, TOLERANCE[quant], f"{arch}/{quant}")


def test_plan_reports_format_of_every_layer_of_a_mixed_checkpoint(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe", "mixed", fp8_moe_layers=(1,))
    loaded = load_model(path, dtype="float32")
    formats = [lp.problem.format for lp in loaded.plan.layers]
    assert formats == ["nvfp4_w4a4", "fp8_w8a8"]
    # non-MoE linears: FP8 attention dequantized at load, the excluded o_proj stays 16-bit
    assert loaded.linears["model.layers.1.self_attn.q_proj"] == "fp8 dequantized at load"
    assert "dequantized" not in loaded.linears["model.layers.0.self_attn.o_proj"]


def test_greedy_tokens_match_transformers_for_weight_only_formats(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe", "w4a16_nvfp4")
    ours = load_model(path, dtype="float32")
    ref = load_model(path, dtype="float32", dequantize_experts=True)
    prompt = torch.tensor([[5, 17, 99, 3, 42]])
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        a = ours.model.generate(prompt, **kw)
        b = ref.model.generate(prompt, **kw)
    assert a.tolist() == b.tolist()


# On a GPU the planner picks the fastest declared backend (Triton on Hopper, FlashInfer on 10.x);
# in bf16 the layer is compared with transformers' experts on dequantized weights, also in bf16.
GPU_TOLERANCE = {"bf16": 0.03, "w4a16_nvfp4": 0.03, "fp8": 0.2, "nvfp4": 0.25, "mixed": 0.25}


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("quant", ["bf16", "fp8", "w4a16_nvfp4", "mixed"])
def test_moe_layers_on_gpu_match_transformers(tiny_checkpoint, arch, quant):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path = tiny_checkpoint(arch, quant, hidden_size=128, intermediate_size=64)
    ours = load_model(path, dtype="bfloat16", device="cuda")
    ref = load_model(path, dtype="bfloat16", device="cuda", dequantize_experts=True)
    print({lp.problem.name: (lp.experts, lp.runs_as) for lp in ours.plan.layers})
    names = [layer.name for layer in ours.checkpoint.moe_layers]
    seen, hooks = _capture_moe_io(ref.model, names)
    ids = torch.randint(0, ref.model.config.vocab_size, (4, 33),
                        generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        ref.model(ids)
    for h in hooks:
        h.remove()
    _assert_layers_match(ours, seen, names, GPU_TOLERANCE[quant], f"{arch}/{quant} on GPU")
