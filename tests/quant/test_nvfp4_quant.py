"""NVFP4 codec: byte-for-byte what ModelOpt 0.47 exports, and the exact dequantization."""

from __future__ import annotations

import pytest
import torch

from moe_runtime.quant import (
    E2M1_VALUES,
    dequantize_nvfp4,
    e2m1_to_float,
    fake_quantize_nvfp4_activation,
    nvfp4_block_scales,
    nvfp4_global_scale,
    pack_e2m1,
    quantize_nvfp4,
    round_to_e2m1,
    unpack_e2m1,
)

DESIGN_TABLE = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


@pytest.fixture(scope="module")
def modelopt_nvfp4():
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
    return qtensor.NVFP4QTensor


def modelopt_quantize(nvfp4_cls, x, global_scale):
    """ModelOpt's export quantization of one weight: (packed, block scales)."""
    qt, block_scale, _ = nvfp4_cls.quantize(x, 16, None, global_scale)
    return qt._quantized_data, block_scale


def assert_same_as_modelopt(nvfp4_cls, x, global_scale):
    packed, block_scale = quantize_nvfp4(x, global_scale)
    mo_packed, mo_scale = modelopt_quantize(nvfp4_cls, x.clone(), global_scale)
    assert block_scale.dtype == torch.float8_e4m3fn and packed.dtype == torch.uint8
    assert torch.equal(block_scale.view(torch.uint8), mo_scale.view(torch.uint8))
    assert torch.equal(packed, mo_packed)


def block_of(values, scale_unit):
    """A [1, 16] row of ``values * scale_unit`` padded with the block's amax, 6 * scale_unit."""
    row = list(values) + [6.0] * (16 - len(values))
    return torch.tensor([row], dtype=torch.float32) * scale_unit


# ---- code table and packing ------------------------------------------------------------------


def test_code_table_is_the_design_table():
    assert list(E2M1_VALUES) == DESIGN_TABLE
    assert [str(v) for v in E2M1_VALUES[8:9]] == ["-0.0"]


def test_code_table_matches_modelopt(modelopt_nvfp4):
    assert (
        e2m1_to_float(torch.arange(16)).tolist() == modelopt_nvfp4.get_e2m1_values("cpu").tolist()
    )


def test_pack_puts_even_column_in_low_nibble():
    assert pack_e2m1(torch.tensor([[0x1, 0xA, 0xF, 0x0]])).tolist() == [[0xA1, 0x0F]]


def test_unpack_inverts_pack():
    codes = torch.randint(
        0, 16, (3, 5, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    assert torch.equal(unpack_e2m1(pack_e2m1(codes)), codes)


def test_pack_refuses_odd_length():
    with pytest.raises(ValueError, match="odd"):
        pack_e2m1(torch.zeros(3, dtype=torch.uint8))


# ---- agreement with ModelOpt -------------------------------------------------------------------


def test_global_scale_matches_modelopt(modelopt_nvfp4):
    g = torch.Generator().manual_seed(2)
    for _ in range(20):
        x = torch.randn(8, 64, generator=g) * torch.rand((), generator=g) * 100
        assert torch.equal(
            nvfp4_global_scale(x.abs().amax()), modelopt_nvfp4.get_weights_scaling_factor_2(x)
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_weights_match_modelopt(modelopt_nvfp4, dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 256, generator=g) * 0.05).to(dtype)
    assert_same_as_modelopt(modelopt_nvfp4, x, nvfp4_global_scale(x.abs().amax()))


def test_block_scales_match_modelopt(modelopt_nvfp4):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(32, 128, generator=g) * torch.logspace(-3, 3, 32).unsqueeze(1)
    gs = nvfp4_global_scale(x.abs().amax())
    mo_scale, _ = modelopt_nvfp4.get_weights_scaling_factor(x, 16, gs)
    assert torch.equal(nvfp4_block_scales(x, gs).view(torch.uint8), mo_scale.view(torch.uint8))


def test_per_expert_global_scales_match_modelopt_stacked_export(modelopt_nvfp4):
    quant_utils = pytest.importorskip("modelopt.torch.export.quant_utils")
    g = torch.Generator().manual_seed(5)
    w = (
        torch.randn(3, 32, 64, generator=g) * torch.tensor([0.01, 1.0, 30.0]).view(3, 1, 1)
    ).bfloat16()
    gs = nvfp4_global_scale(w.abs().amax(dim=(1, 2)))
    block_scale = nvfp4_block_scales(w, gs.view(3, 1, 1))
    mo_packed = quant_utils.to_quantized_weight(w, block_scale, "nvfp4", gs, 16)
    packed, _ = quantize_nvfp4(w, gs.view(3, 1, 1))
    assert torch.equal(packed, mo_packed)


def test_values_at_every_midpoint_match_modelopt(modelopt_nvfp4):
    unit = 2.0**-8  # block scale 1.0 * global scale 2**-8: x / unit is exact
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    x = torch.cat([block_of(mids, unit), block_of([-m for m in mids], unit)], dim=1)
    assert_same_as_modelopt(modelopt_nvfp4, x, torch.tensor(unit))


def test_large_and_small_magnitudes_match_modelopt(modelopt_nvfp4):
    g = torch.Generator().manual_seed(6)
    magnitudes = torch.pow(2.0, torch.randint(-60, 60, (64, 1), generator=g).float())
    x = torch.randn(64, 64, generator=g) * magnitudes
    assert_same_as_modelopt(modelopt_nvfp4, x, nvfp4_global_scale(x.abs().amax()))


def test_zero_blocks_match_modelopt(modelopt_nvfp4):
    x = torch.zeros(2, 48)
    x[1, 16:32] = torch.linspace(-3, 3, 16)
    assert_same_as_modelopt(modelopt_nvfp4, x, nvfp4_global_scale(x.abs().amax()))


def test_saturating_blocks_match_modelopt(modelopt_nvfp4):
    x = torch.linspace(-50, 50, 64).reshape(2, 32)
    assert_same_as_modelopt(modelopt_nvfp4, x, torch.tensor(1e-3))


def _neighbours(t: torch.Tensor, steps: int) -> torch.Tensor:
    """``t`` and its float32 neighbours up to ``steps`` ulps either side, stacked on dim 0."""
    out, up, down = [t], t, t
    for _ in range(steps):
        up, down = (
            torch.nextafter(up, torch.tensor(float("inf"))),
            torch.nextafter(down, torch.tensor(0.0)),
        )
        out += [up, down]
    return torch.stack(out)


def test_block_scale_rounding_follows_modelopt_operation_order(modelopt_nvfp4):
    # block amaxes whose amax / (6 * gs) lands next to an e4m3 rounding midpoint, where
    # amax / 6 / gs (one more rounding) would pick the other e4m3 neighbour
    gs = nvfp4_global_scale(torch.tensor(0.37))
    e4m3 = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    amax = _neighbours((e4m3[:-1] + e4m3[1:]) / 2 * 6 * gs, 5).flatten()
    other_order = (amax / 6.0 / gs).to(torch.float8_e4m3fn).float()
    assert bool(
        (
            nvfp4_block_scales(amax.view(-1, 1).expand(-1, 16), gs).float().flatten() != other_order
        ).any()
    )
    x = torch.zeros(amax.numel(), 16)
    x[:, 0] = amax
    assert_same_as_modelopt(modelopt_nvfp4, x, gs)


def test_quotients_exactly_on_midpoints_match_modelopt(modelopt_nvfp4):
    # non-power-of-two scales: x / (block_scale * gs) is exactly a midpoint, where multiplying by
    # the reciprocal (as some kernels do) lands one ulp off it
    g = torch.Generator().manual_seed(12)
    gs = nvfp4_global_scale(torch.tensor(0.37))
    b = (torch.rand(400, generator=g) * 300 + 0.5).to(torch.float8_e4m3fn).float()
    d = b * gs
    amax = b * 6 * gs
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    cand = _neighbours(mids.view(1, 7) * d.view(-1, 1), 3)  # [steps, rows, 7]
    on_mid = cand / d.view(1, -1, 1) == mids
    rows = on_mid.any(0).all(1) & ((amax / (6.0 * gs)).to(torch.float8_e4m3fn).float() == b)
    x_mid = torch.where(on_mid, cand, torch.inf).amin(0)[rows]
    x = torch.cat([amax[rows].view(-1, 1), x_mid, -x_mid, torch.zeros(len(x_mid), 1)], dim=1)
    assert len(x) > 100
    assert bool((x_mid * (1 / d[rows].view(-1, 1)) != mids).any())
    assert_same_as_modelopt(modelopt_nvfp4, x, gs)
    codes = unpack_e2m1(quantize_nvfp4(x, gs)[0])
    assert bool((codes[:, 1:8] == torch.tensor([0, 2, 2, 4, 4, 6, 6], dtype=torch.uint8)).all())
    assert bool(
        (codes[:, 8:15] == torch.tensor([8, 10, 10, 12, 12, 14, 14], dtype=torch.uint8)).all()
    )


# ---- rounding rules, stated directly ------------------------------------------------------------


def test_midpoints_round_to_the_even_code():
    unit = 2.0**-8
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    packed, block_scale = quantize_nvfp4(block_of(mids, unit), unit)
    assert block_scale.float().tolist() == [[1.0]]
    # 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5->4.0
    assert unpack_e2m1(packed)[0, :7].tolist() == [0, 2, 2, 4, 4, 6, 6]


def test_values_just_past_midpoints_round_away_from_them():
    unit = 2.0**-8
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    above = torch.nextafter(mids, torch.tensor(10.0)).tolist()
    below = torch.nextafter(mids, torch.tensor(0.0)).tolist()
    codes_above = unpack_e2m1(quantize_nvfp4(block_of(above, unit), unit)[0])[0, :7].tolist()
    codes_below = unpack_e2m1(quantize_nvfp4(block_of(below, unit), unit)[0])[0, :7].tolist()
    assert codes_above == [1, 2, 3, 4, 5, 6, 7]
    assert codes_below == [0, 1, 2, 3, 4, 5, 6]


def test_small_negative_values_keep_the_sign_bit():
    packed, _ = quantize_nvfp4(block_of([-0.1, 0.1, -0.0, 0.0], 1.0), 1.0)
    assert unpack_e2m1(packed)[0, :4].tolist() == [8, 0, 0, 0]


def test_nan_and_infinity_round_like_modelopt(modelopt_nvfp4):
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 7.0, -100.0])
    assert round_to_e2m1(x).tolist() == [7, 7, 15, 7, 15]
    assert torch.equal(round_to_e2m1(x), modelopt_nvfp4._cast_fp4(x.clone()))


def test_zero_block_gets_unit_scale_and_zero_codes():
    x = torch.zeros(1, 32)
    x[0, 16:] = 1.0
    packed, block_scale = quantize_nvfp4(x, nvfp4_global_scale(1.0))
    assert block_scale.float()[0, 0].item() == 1.0
    assert unpack_e2m1(packed)[0, :16].tolist() == [0] * 16


def test_tiny_block_scale_clamps_to_smallest_e4m3_subnormal():
    x = torch.full((1, 32), 1e-6)
    x[0, 16:] = 1000.0
    _, block_scale = quantize_nvfp4(x, nvfp4_global_scale(1000.0))
    assert block_scale.float()[0, 0].item() == 2.0**-9


def test_blocks_beyond_the_global_range_saturate():
    x = torch.linspace(-50, 50, 32).reshape(1, 32)
    packed, block_scale = quantize_nvfp4(x, 1e-3)
    assert block_scale.float().tolist() == [[448.0, 448.0]]
    codes = unpack_e2m1(packed)[0]
    assert codes[0].item() == 15 and codes[-1].item() == 7


# ---- dequantization and round trips -------------------------------------------------------------


def test_dequantize_is_the_correctly_rounded_product():
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 16, (4, 64), dtype=torch.uint8, generator=g)
    block_scale = (torch.rand(4, 4, generator=g) * 400 + 0.01).to(torch.float8_e4m3fn)
    gs = torch.tensor(0.0123456789)
    exact = torch.tensor(DESIGN_TABLE, dtype=torch.float64)[codes.long()] * (
        block_scale.double().repeat_interleave(16, -1) * gs.double()
    )
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = dequantize_nvfp4(pack_e2m1(codes), block_scale, gs, dtype)
        assert got.dtype == dtype
        assert torch.equal(got, exact.to(dtype))


def test_dequantize_agrees_with_modelopt_to_one_float32_ulp(modelopt_nvfp4):
    g = torch.Generator().manual_seed(8)
    x = torch.randn(16, 128, generator=g)
    gs = nvfp4_global_scale(x.abs().amax())
    packed, block_scale = quantize_nvfp4(x, gs)
    mo = modelopt_nvfp4(x.shape, torch.float32, packed).dequantize(
        torch.float32,
        scale=block_scale,
        double_scale=gs,
        block_sizes={-1: 16},
    )
    ours = dequantize_nvfp4(packed, block_scale, gs)
    assert torch.allclose(ours, mo, rtol=2.0**-23, atol=0)


def test_representable_values_round_trip_exactly():
    g = torch.Generator().manual_seed(9)
    codes = torch.randint(0, 16, (8, 64), dtype=torch.uint8, generator=g)
    codes[codes == 8] = 0  # -0.0 is stored as +0 (the sign bit is x < 0)
    codes[:, ::16] = 7  # every block reaches 6, so its scale is recovered exactly
    block_scale = (torch.rand(8, 4, generator=g) * 100 + 0.1).to(torch.float8_e4m3fn)
    gs = torch.tensor(0.37)
    x = dequantize_nvfp4(pack_e2m1(codes), block_scale, gs)
    packed, block_scale_again = quantize_nvfp4(x, gs)
    assert torch.equal(block_scale_again.view(torch.uint8), block_scale.view(torch.uint8))
    assert torch.equal(unpack_e2m1(packed), codes)


def test_quantization_error_is_at_most_half_a_step():
    g = torch.Generator().manual_seed(10)
    x = torch.randn(32, 64, generator=g)
    gs = nvfp4_global_scale(x.abs().amax())
    packed, block_scale = quantize_nvfp4(x, gs)
    err = (dequantize_nvfp4(packed, block_scale, gs) - x).abs()
    # the widest gap between E2M1 neighbours is 2 (4 -> 6); scaled by the block's scale
    step = block_scale.float().repeat_interleave(16, -1) * gs
    assert bool((err <= step * 1.0 + 1e-7).all())


# ---- activations and argument checks -----------------------------------------------------------


def test_fake_quantized_activation_is_quantize_then_dequantize():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5, 32, generator=g).bfloat16()
    s = nvfp4_global_scale(4.0)
    packed, block_scale = quantize_nvfp4(x, s)
    expected = dequantize_nvfp4(packed, block_scale, s, torch.float32)
    assert torch.equal(fake_quantize_nvfp4_activation(x, s, torch.float32), expected)
    assert fake_quantize_nvfp4_activation(x, s).dtype == torch.bfloat16


def test_activations_beyond_the_input_scale_saturate():
    s = nvfp4_global_scale(1.0)
    x = torch.full((1, 16), 1000.0)
    assert fake_quantize_nvfp4_activation(x, s).max().item() == pytest.approx(1.0, rel=1e-6)


def test_empty_rows_quantize_to_empty_tensors():
    packed, block_scale = quantize_nvfp4(torch.zeros(0, 32), 1.0)
    assert packed.shape == (0, 16) and block_scale.shape == (0, 2)


def test_last_dim_must_be_a_multiple_of_16():
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(torch.ones(2, 24), 1.0)


def test_zero_global_scale_is_refused():
    with pytest.raises(ValueError, match="positive"):
        quantize_nvfp4(torch.zeros(2, 16), nvfp4_global_scale(0.0))
