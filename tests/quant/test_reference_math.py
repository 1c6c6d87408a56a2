"""The numerical reference: exact dequantization, ModelOpt's quantization recipe, and the experts
computation checked against a deliberately naive per-token loop written only here."""

from __future__ import annotations

import math

import pytest
import torch

from moe_runtime.backend_api import ExpertWeights
from moe_runtime.reference_math import (
    dequantize_expert_weights,
    quantize_expert_weights,
    reference_fused_experts,
    reference_masked_experts,
)

FORMATS = ["bf16", "fp16", "fp8_w8a8", "nvfp4_w4a4", "nvfp4_w4a16"]
TABLE = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
A13_AMAX, A2_AMAX = 3.0, 0.05


def float_weights(e=4, h=48, i=32, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) / math.sqrt(h)
    w2 = torch.randn(e, h, i, generator=g) / math.sqrt(i)
    return w13.to(dtype), w2.to(dtype)


def make_weights(fmt, activation="silu", **shape):
    w13, w2 = float_weights(**shape)
    return quantize_expert_weights(w13, w2, fmt, activation, a13_amax=A13_AMAX, a2_amax=A2_AMAX)


def routing(n, k, e, seed=1, skip=0.2):
    g = torch.Generator().manual_seed(seed)
    ids = (
        torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
        if n
        else torch.zeros(0, k, dtype=torch.long)
    )
    ids[torch.rand(ids.shape, generator=g) < skip] = -1
    weights = torch.rand(n, k, generator=g)
    return ids.to(torch.int32), weights


def hidden_states(n, h, seed=2, dtype=torch.float32):
    return torch.randn(n, h, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---- the naive model, independent of moe_runtime's code ----------------------------------------


def naive_dequant(w: ExpertWeights, which: str) -> torch.Tensor:
    """Element by element from the checkpoint definition, in float64."""
    q = getattr(w, which)
    if w.format in ("bf16", "fp16"):
        return q.double()
    scale = getattr(w, f"{which}_scale").double()
    if w.format == "fp8_w8a8":
        return q.double() * scale[:, :, None]
    lo, hi = (q & 0xF).long(), (q >> 4).long()
    codes = torch.stack([lo, hi], dim=-1).reshape(q.shape[0], q.shape[1], -1)
    values = torch.tensor(TABLE, dtype=torch.float64)[codes]
    return (
        values
        * scale.repeat_interleave(16, -1)
        * getattr(w, f"{which}_scale_2").double()[:, None, None]
    )


def naive_act_quant(v: torch.Tensor, fmt: str, scale) -> torch.Tensor:
    """One row of activations as the GEMM sees it (float64)."""
    if fmt == "fp8_w8a8":
        return (v.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * float(scale)
    if fmt == "nvfp4_w4a4":
        qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
        q, bs, _ = qtensor.NVFP4QTensor.quantize(
            v.float().reshape(1, -1).clone(), 16, None, scale.float()
        )
        return (
            q.dequantize(torch.float64, scale=bs, double_scale=scale.float(), block_sizes={-1: 16})
            .flatten()
            .double()
        )
    return v.double()


def naive_act(v: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return v / (1 + torch.exp(-v))
    return 0.5 * v * (1 + torch.erf(v / math.sqrt(2)))


def naive_expert(x_row, w, e, fmt):
    w13, w2 = naive_dequant(w, "w13")[e], naive_dequant(w, "w2")[e]
    i = w.intermediate_size
    h = w13 @ naive_act_quant(x_row, fmt, w.a13_scale)
    inter = naive_act(h[:i], w.activation) * h[i:]
    return w2 @ naive_act_quant(inter, fmt, w.a2_scale)


def naive_fused(hidden, ids, weights, w, fmt=None):
    fmt = fmt or w.format
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for n in range(hidden.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[n, k])
            if e >= 0:
                out[n] += float(weights[n, k]) * naive_expert(hidden[n], w, e, fmt)
    return out


def assert_close(got, expected, rtol=2e-4):
    scale = expected.abs().max().item() or 1.0
    assert torch.allclose(got.double(), expected, rtol=rtol, atol=rtol * scale), (
        f"max abs diff {(got.double() - expected).abs().max().item():.3g} at scale {scale:.3g}"
    )


# ---- dequantization ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantized_weights_match_the_checkpoint_definition(fmt):
    w = make_weights(fmt)
    w13, w2 = dequantize_expert_weights(w)
    assert w13.shape == (4, 64, 48) and w2.shape == (4, 48, 32) and w13.dtype == torch.float32
    assert torch.equal(w13.double(), naive_dequant(w, "w13").float().double())
    assert torch.equal(w2.double(), naive_dequant(w, "w2").float().double())


def test_dequantize_honours_the_requested_dtype():
    w13, w2 = dequantize_expert_weights(make_weights("nvfp4_w4a16"), torch.bfloat16)
    assert w13.dtype == w2.dtype == torch.bfloat16


def test_dequantize_refuses_missing_scales():
    w = make_weights("nvfp4_w4a4")
    w.w13_scale_2 = None
    with pytest.raises(ValueError, match="w13_scale_2"):
        dequantize_expert_weights(w)


def test_dequantize_refuses_inconsistent_shapes():
    w = make_weights("bf16")
    w.w2 = w.w2[:, :, :16]
    with pytest.raises(ValueError, match="inconsistent shapes"):
        dequantize_expert_weights(w)


def test_unknown_format_is_refused_by_name():
    w = make_weights("bf16")
    w.format = "mxfp8"
    with pytest.raises(ValueError, match="mxfp8"):
        dequantize_expert_weights(w)


# ---- quantization recipe against ModelOpt -------------------------------------------------------


@pytest.mark.parametrize("fmt", ["nvfp4_w4a4", "nvfp4_w4a16"])
def test_nvfp4_weights_match_modelopt_per_projection(fmt):
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
    w13_f, w2_f = float_weights()
    w = quantize_expert_weights(w13_f, w2_f, fmt, "silu", a13_amax=A13_AMAX, a2_amax=A2_AMAX)
    i = w.intermediate_size
    for e in range(w.num_experts):
        gate, up, down = w13_f[e, :i], w13_f[e, i:], w2_f[e]
        # ModelOpt unifies the gate/up weight amax, so both use the larger one's weight_scale_2
        s2_gate_up = torch.maximum(
            *(qtensor.NVFP4QTensor.get_weights_scaling_factor_2(t) for t in (gate, up))
        )
        s2_down = qtensor.NVFP4QTensor.get_weights_scaling_factor_2(down)
        assert torch.equal(w.w13_scale_2[e], s2_gate_up) and torch.equal(w.w2_scale_2[e], s2_down)
        for rows, t, s2, q, bs in (
            (slice(0, i), gate, s2_gate_up, w.w13, w.w13_scale),
            (slice(i, 2 * i), up, s2_gate_up, w.w13, w.w13_scale),
            (slice(None), down, s2_down, w.w2, w.w2_scale),
        ):
            mo_q, mo_bs, _ = qtensor.NVFP4QTensor.quantize(t.clone(), 16, None, s2)
            assert torch.equal(q[e, rows], mo_q._quantized_data)
            assert torch.equal(bs[e, rows].view(torch.uint8), mo_bs.view(torch.uint8))


def test_nvfp4_input_scales_are_amax_over_6_times_448():
    w = make_weights("nvfp4_w4a4")
    assert w.a13_scale.shape == () and w.a13_scale.dtype == torch.float32
    assert w.a13_scale.item() == torch.tensor(A13_AMAX / 2688.0).item()
    assert w.a2_scale.item() == torch.tensor(A2_AMAX / 2688.0).item()


def test_w4a16_layers_carry_no_input_scales():
    w = make_weights("nvfp4_w4a16")
    assert w.a13_scale is None and w.a2_scale is None


@pytest.mark.parametrize("shared", [False, True])
def test_fp8_weights_match_modelopt_per_projection(shared):
    quant_utils = pytest.importorskip("modelopt.torch.export.quant_utils")
    w13_f, w2_f = float_weights()
    w = quantize_expert_weights(
        w13_f,
        w2_f,
        "fp8_w8a8",
        "silu",
        a13_amax=A13_AMAX,
        a2_amax=A2_AMAX,
        shared_gate_up_fp8_scale=shared,
    )
    i = w.intermediate_size
    for e in range(w.num_experts):
        parts = [(slice(0, i), w13_f[e, :i]), (slice(i, 2 * i), w13_f[e, i:])]
        if shared:
            parts = [(slice(None), w13_f[e])]
        for rows, t in parts:
            scale = torch.tensor(t.abs().amax().float().item() / 448.0)  # ModelOpt's export
            assert bool((w.w13_scale[e, rows] == scale).all())
            assert torch.equal(
                w.w13[e, rows].view(torch.uint8),
                quant_utils.to_quantized_weight(t, scale, "fp8").view(torch.uint8),
            )
        scale = torch.tensor(w2_f[e].abs().amax().float().item() / 448.0)
        assert bool((w.w2_scale[e] == scale).all())
        assert torch.equal(
            w.w2[e].view(torch.uint8),
            quant_utils.to_quantized_weight(w2_f[e], scale, "fp8").view(torch.uint8),
        )
    assert w.a13_scale.item() == torch.tensor(A13_AMAX / 448.0).item()


def test_fp8_gate_and_up_scales_differ_unless_shared():
    w13_f, w2_f = float_weights()
    w13_f[:, 32:] *= 4  # up four times larger than gate
    w = quantize_expert_weights(w13_f, w2_f, "fp8_w8a8", "silu", a13_amax=1.0, a2_amax=1.0)
    assert bool((w.w13_scale[:, 32] > 3 * w.w13_scale[:, 0]).all())


@pytest.mark.parametrize("fmt", ["fp8_w8a8", "nvfp4_w4a4"])
def test_activation_quantizing_formats_require_input_amax(fmt):
    w13_f, w2_f = float_weights()
    with pytest.raises(ValueError, match="a13_amax"):
        quantize_expert_weights(w13_f, w2_f, fmt, "silu")


def test_all_zero_expert_has_no_scale_and_is_refused():
    w13_f, w2_f = float_weights()
    w13_f[2] = 0
    with pytest.raises(ValueError, match=r"experts \[2\]"):
        quantize_expert_weights(w13_f, w2_f, "nvfp4_w4a16", "silu")


def test_nvfp4_needs_sizes_that_are_multiples_of_16():
    w13_f, w2_f = float_weights(h=40)
    with pytest.raises(ValueError, match="multiples of 16"):
        quantize_expert_weights(w13_f, w2_f, "nvfp4_w4a16", "silu")


# ---- token-major experts -------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_experts_match_the_per_token_loop(fmt, activation):
    w = make_weights(fmt, activation)
    ids, weights = routing(7, 3, 4)
    x = hidden_states(7, 48)
    assert_close(reference_fused_experts(x, ids, weights, w), naive_fused(x, ids, weights, w))


@pytest.mark.parametrize("fmt", FORMATS)
def test_sizes_that_are_not_powers_of_two(fmt):
    w = make_weights(fmt, e=3, h=80, i=48)
    ids, weights = routing(5, 2, 3)
    x = hidden_states(5, 80)
    assert_close(reference_fused_experts(x, ids, weights, w), naive_fused(x, ids, weights, w))


def test_gelu_is_the_exact_erf_form():
    w = make_weights("bf16", "gelu")
    ids, weights = routing(6, 2, 4, skip=0)
    x = hidden_states(6, 48) * 4
    out = reference_fused_experts(x, ids, weights, w).double()
    assert_close(out, naive_fused(x, ids, weights, w), rtol=1e-5)
    w1, w2 = w.w13.double(), w.w2.double()

    def tanh_gelu_expert(row, e):
        g, u = (w1[e] @ row.double()).split(32)
        act = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
        return w2[e] @ (act * u)

    tanh_out = torch.stack(
        [
            sum(weights[n, k].item() * tanh_gelu_expert(x[n], int(ids[n, k])) for k in range(2))
            for n in range(6)
        ]
    )
    assert not torch.allclose(out, tanh_out, rtol=1e-5, atol=1e-6)


def test_output_has_the_hidden_dtype():
    w = make_weights("bf16")
    ids, weights = routing(4, 2, 4)
    x = hidden_states(4, 48, dtype=torch.bfloat16)
    out = reference_fused_experts(x, ids, weights, w)
    assert out.dtype == torch.bfloat16
    assert_close(out.float(), naive_fused(x, ids, weights, w), rtol=1e-2)


def test_no_tokens_give_an_empty_output():
    w = make_weights("nvfp4_w4a4")
    out = reference_fused_experts(
        torch.zeros(0, 48, dtype=torch.bfloat16),
        torch.zeros(0, 2, dtype=torch.int32),
        torch.zeros(0, 2),
        w,
    )
    assert out.shape == (0, 48) and out.dtype == torch.bfloat16


def test_skipped_slots_contribute_nothing():
    w = make_weights("fp8_w8a8")
    ids, weights = routing(4, 2, 4, skip=0)
    ids[1] = -1
    out = reference_fused_experts(hidden_states(4, 48), ids, weights, w)
    assert torch.equal(out[1], torch.zeros(48))
    assert bool((out[0] != 0).any())


def test_all_tokens_on_one_expert():
    w = make_weights("nvfp4_w4a16")
    ids = torch.full((9, 1), 2, dtype=torch.int32)
    weights = torch.rand(9, 1, generator=torch.Generator().manual_seed(3))
    x = hidden_states(9, 48)
    assert_close(reference_fused_experts(x, ids, weights, w), naive_fused(x, ids, weights, w))


def test_experts_without_tokens_are_never_computed():
    w = make_weights("bf16")
    w.w13[1] = float("nan")  # would poison every output it touched
    ids = torch.tensor([[0, 2], [3, -1], [2, 0]], dtype=torch.int32)
    out = reference_fused_experts(hidden_states(3, 48), ids, torch.ones(3, 2), w)
    assert bool(torch.isfinite(out).all())


def test_an_expert_chosen_twice_by_a_token_counts_twice():
    w = make_weights("bf16")
    x = hidden_states(1, 48)
    once = reference_fused_experts(
        x, torch.tensor([[1, -1]], dtype=torch.int32), torch.tensor([[1.0, 0.0]]), w
    )
    twice = reference_fused_experts(
        x, torch.tensor([[1, 1]], dtype=torch.int32), torch.tensor([[1.0, 1.0]]), w
    )
    assert_close(twice, 2 * once.double(), rtol=1e-6)


def test_w4a4_run_as_w4a16_skips_activation_quantization():
    w = make_weights("nvfp4_w4a4")
    ids, weights = routing(6, 2, 4)
    x = hidden_states(6, 48)
    as_w4a16 = reference_fused_experts(x, ids, weights, w, run_as_format="nvfp4_w4a16")
    assert_close(as_w4a16, naive_fused(x, ids, weights, w, fmt="nvfp4_w4a16"))
    assert not torch.allclose(as_w4a16, reference_fused_experts(x, ids, weights, w), rtol=1e-3)


def test_running_as_an_undeclared_format_is_refused():
    w = make_weights("fp8_w8a8")
    ids, weights = routing(2, 2, 4)
    with pytest.raises(ValueError, match="cannot run as 'bf16'"):
        reference_fused_experts(hidden_states(2, 48), ids, weights, w, run_as_format="bf16")


def test_expert_ids_out_of_range_are_refused():
    w = make_weights("bf16")
    with pytest.raises(ValueError, match=r"\[-1, 4\)"):
        reference_fused_experts(hidden_states(1, 48), torch.tensor([[4]]), torch.ones(1, 1), w)


def test_hidden_size_mismatch_is_refused():
    w = make_weights("bf16")
    with pytest.raises(ValueError, match="hidden must be"):
        reference_fused_experts(
            hidden_states(2, 32), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1), w
        )


# ---- masked layout -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_masked_experts_match_the_per_row_loop(fmt):
    w = make_weights(fmt)
    x = torch.randn(4, 5, 48, generator=torch.Generator().manual_seed(4))
    masked_m = torch.tensor([3, 0, 5, 1], dtype=torch.int32)
    out = reference_masked_experts(x, masked_m, w)
    expected = torch.zeros(4, 5, 48, dtype=torch.float64)
    for e in range(4):
        for r in range(int(masked_m[e])):
            expected[e, r] = naive_expert(x[e, r], w, e, fmt)
    assert_close(out, expected)


def test_masked_rows_past_the_count_are_zero():
    w = make_weights("bf16")
    x = torch.randn(4, 5, 48, generator=torch.Generator().manual_seed(5)).bfloat16()
    out = reference_masked_experts(x, torch.tensor([2, 0, 5, 4]), w)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[0, 2:], torch.zeros(3, 48, dtype=torch.bfloat16))
    assert torch.equal(out[1], torch.zeros(5, 48, dtype=torch.bfloat16))
    assert bool((out[2] != 0).any())


def test_masked_run_as_w4a16_skips_activation_quantization():
    w = make_weights("nvfp4_w4a4")
    x = torch.randn(4, 3, 48, generator=torch.Generator().manual_seed(6))
    masked_m = torch.tensor([3, 1, 0, 2])
    out = reference_masked_experts(x, masked_m, w, run_as_format="nvfp4_w4a16")
    assert_close(out[0, 2], naive_expert(x[0, 2], w, 0, "nvfp4_w4a16"))


def test_masked_counts_beyond_the_rows_are_refused():
    w = make_weights("bf16")
    with pytest.raises(ValueError, match="masked_m"):
        reference_masked_experts(torch.zeros(4, 2, 48), torch.tensor([0, 3, 0, 0]), w)


# ---- CUDA ----------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_scales_are_the_correctly_rounded_quotients():
    from moe_runtime.quant import fp8_scale_from_amax, nvfp4_global_scale

    amax = torch.rand(10000, generator=torch.Generator().manual_seed(8)) * 100
    for to_scale, divisor in ((fp8_scale_from_amax, 448.0), (nvfp4_global_scale, 2688.0)):
        exact = (amax.double() / divisor).float()
        assert torch.equal(to_scale(amax.cuda()).cpu(), exact)
        assert torch.equal(to_scale(amax), exact)


@cuda
def test_cuda_quantization_is_bit_identical_to_cpu():
    w13_f, w2_f = float_weights(e=3, h=64, i=32)
    for fmt in ("fp8_w8a8", "nvfp4_w4a4"):
        on_cpu = quantize_expert_weights(
            w13_f, w2_f, fmt, "silu", a13_amax=A13_AMAX, a2_amax=A2_AMAX
        )
        on_gpu = quantize_expert_weights(
            w13_f.cuda(), w2_f.cuda(), fmt, "silu", a13_amax=A13_AMAX, a2_amax=A2_AMAX
        )
        for name in ("w13", "w2", "w13_scale", "w2_scale"):
            a, b = getattr(on_cpu, name), getattr(on_gpu, name).cpu()
            assert torch.equal(
                a.view(torch.uint8) if a.element_size() == 1 else a,
                b.view(torch.uint8) if b.element_size() == 1 else b,
            ), (fmt, name)


@cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_reference_matches_cpu(fmt):
    w = make_weights(fmt, e=6, h=64, i=48)
    ids, weights = routing(33, 3, 6)
    x = hidden_states(33, 64, dtype=torch.bfloat16)
    on_cpu = reference_fused_experts(x, ids, weights, w)
    on_gpu = reference_fused_experts(x.cuda(), ids.cuda(), weights.cuda(), w.to("cuda"))
    assert on_gpu.device.type == "cuda" and on_gpu.dtype == torch.bfloat16
    assert_close(on_gpu.cpu().float(), on_cpu.double(), rtol=1e-2)
    masked = torch.randn(6, 4, 64, generator=torch.Generator().manual_seed(7)).bfloat16()
    m = torch.tensor([4, 0, 2, 1, 3, 4], dtype=torch.int32)
    assert_close(
        reference_masked_experts(masked.cuda(), m.cuda(), w.to("cuda")).cpu().float(),
        reference_masked_experts(masked, m, w).double(),
        rtol=1e-2,
    )
