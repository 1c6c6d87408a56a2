"""FP8 per-tensor codec: byte-for-byte what ModelOpt 0.47 exports."""

from __future__ import annotations

import pytest
import torch

from moe_runtime.quant import (
    dequantize_fp8,
    fake_quantize_fp8,
    fp8_scale_from_amax,
    quantize_fp8_per_tensor,
)


@pytest.fixture(scope="module")
def to_quantized_weight():
    return pytest.importorskip("modelopt.torch.export.quant_utils").to_quantized_weight


def modelopt_weight_scale(w: torch.Tensor) -> torch.Tensor:
    """What ModelOpt's HF export registers as a per-tensor FP8 weight_scale (unified_export_hf)."""
    return torch.tensor(w.abs().amax().float().item() / 448.0)


def test_scale_is_amax_over_448_as_modelopt_exports_it():
    g = torch.Generator().manual_seed(20)
    for _ in range(50):
        w = torch.randn(16, 16, generator=g) * torch.rand((), generator=g) * 10
        assert torch.equal(fp8_scale_from_amax(w.abs().amax()), modelopt_weight_scale(w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_weights_match_modelopt_export(to_quantized_weight, dtype):
    g = torch.Generator().manual_seed(21)
    w = (torch.randn(128, 256, generator=g) * 0.02).to(dtype)
    scale = modelopt_weight_scale(w)
    expected = to_quantized_weight(w, scale, "fp8")
    assert torch.equal(
        quantize_fp8_per_tensor(w, fp8_scale_from_amax(w.abs().amax())).view(torch.uint8),
        expected.view(torch.uint8),
    )


def test_bf16_quotient_is_rounded_to_bf16_first(to_quantized_weight):
    # ModelOpt divides the bf16 weight by a 0-dim float32 scale, so the quotient is bf16; a direct
    # float32 -> e4m3 cast differs on a few percent of elements, which this must reproduce
    g = torch.Generator().manual_seed(22)
    w = torch.randn(256, 256, generator=g).bfloat16()
    scale = fp8_scale_from_amax(w.abs().amax())
    ours = quantize_fp8_per_tensor(w, scale).view(torch.uint8)
    direct = (w.float() / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    assert bool((ours != direct).any())
    assert torch.equal(ours, to_quantized_weight(w, scale, "fp8").view(torch.uint8))


def test_out_of_range_values_saturate():
    q = quantize_fp8_per_tensor(torch.tensor([1e6, -1e6, 500.0, 449.0]), 1.0)
    assert q.float().tolist() == [448.0, -448.0, 448.0, 448.0]


def test_per_expert_scales_broadcast_like_separate_tensors():
    g = torch.Generator().manual_seed(23)
    w = (
        torch.randn(3, 8, 32, generator=g).bfloat16()
        * torch.tensor([0.01, 1.0, 50.0]).view(3, 1, 1).bfloat16()
    )
    scales = fp8_scale_from_amax(w.abs().amax(dim=(1, 2)))
    stacked = quantize_fp8_per_tensor(w, scales.view(3, 1, 1))
    for e in range(3):
        assert torch.equal(
            stacked[e].view(torch.uint8), quantize_fp8_per_tensor(w[e], scales[e]).view(torch.uint8)
        )


def test_dequantize_is_code_times_scale():
    codes = torch.arange(0, 256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn)  # drop the two NaNs
    s = torch.tensor(0.0123)
    assert torch.equal(dequantize_fp8(codes, s), codes.float() * s)
    assert torch.equal(
        dequantize_fp8(codes, s, torch.bfloat16), (codes.double() * s.double()).bfloat16()
    )


def test_every_e4m3_value_round_trips():
    codes = torch.arange(0, 256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    s = torch.tensor(0.37)
    x = dequantize_fp8(codes.view(torch.float8_e4m3fn), s)
    back = quantize_fp8_per_tensor(x, s).view(torch.uint8)
    zero = codes == 0x80  # -0.0 comes back as +0.0 or -0.0 alike; compare values there
    assert (
        torch.equal(back[~zero], codes[~zero])
        and back[zero].view(torch.float8_e4m3fn).float().item() == 0
    )


def test_fake_quantize_divides_in_float32():
    g = torch.Generator().manual_seed(24)
    x = torch.randn(64, 64, generator=g).bfloat16()
    s = fp8_scale_from_amax(x.abs().amax().float())
    expected = (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    assert torch.equal(fake_quantize_fp8(x, s, torch.float32), expected)
    assert fake_quantize_fp8(x, s).dtype == torch.bfloat16


def test_integer_input_is_refused():
    with pytest.raises(TypeError, match="float"):
        quantize_fp8_per_tensor(torch.ones(4, dtype=torch.int32), 1.0)
