"""NVFP4 weights with bfloat16 activations run bfloat16 MMAs (``ops.nvfp4_compute_dtype``).

The float16 MMAs these paths ran before kept the gated intermediate between the GEMMs in float16,
which a bf16 model's activations overflow (the conformance suite's ``large_activations`` case,
about 1e5-1e6 there, failed every NVFP4 combination on the H200). The weights decode exactly into
either dtype (``kernels._scale_codes``). On CPU the interpreter checks the decode's integer half
(its bit patterns) for both dtypes and the dtype choice; the bfloat16 arithmetic (inline
assembly) and the paths end to end are ``gpu`` tests.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from moe_runtime_triton import kernels as K
from moe_runtime_triton import ops
from moe_runtime_triton import w4a16 as W

from moe_runtime.backend_api import ExpertWeights
from moe_runtime.quant import dequantize_nvfp4
from moe_runtime.reference_math import quantize_expert_weights, reference_fused_experts


@triton.jit
def _pairs_bits_kernel(p_ptr, lo_ptr, hi_ptr, R: tl.constexpr, B: tl.constexpr,
                       BF16: tl.constexpr):
    r = tl.arange(0, R)
    b = tl.arange(0, B)
    wb = tl.load(p_ptr + r[:, None] * B + b[None, :])
    if BF16:
        lo, hi = K._e2m1_pairs(wb, R, B, tl.bfloat16)
    else:
        lo, hi = K._e2m1_pairs(wb, R, B, tl.float16)
    tl.store(lo_ptr + r[:, None] * B + b[None, :], lo.to(tl.int16, bitcast=True))
    tl.store(hi_ptr + r[:, None] * B + b[None, :], hi.to(tl.int16, bitcast=True))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_portable_decode_places_sign_and_magnitude_for_each_dtype(dtype, device):
    """Every code's sign lands on bit 15 and its 3 magnitude bits on float16's bits 11..9
    (E2M1 x 2**-14) or bfloat16's 8..6 (E2M1 x 2**-126), in the documented column order, from
    the one packed layout both share (all 256 byte values appear)."""
    R, C = 8, 64
    ck = torch.arange(256, dtype=torch.int32).reshape(8, 32)  # checkpoint bytes, every value
    ck = ck[:, torch.randperm(32, generator=torch.Generator().manual_seed(1))].to(torch.uint8)
    packed = ops.pack_nvfp4_for_kernels(ck).to(device)
    lo = torch.empty((R, C // 2), dtype=torch.int16, device=device)
    hi = torch.empty_like(lo)
    _pairs_bits_kernel[(1,)](packed, lo, hi, R=R, B=C // 2, BF16=dtype == "bfloat16")
    codes = torch.stack([ck & 15, ck >> 4], -1).reshape(R, C).to(torch.int32)
    shift = 6 if dtype == "bfloat16" else 9
    bits = (((codes >> 3) & 1) << 15) | ((codes & 7) << shift)
    group = bits.reshape(R, C // 8, 8)
    want_lo = group[:, :, [0, 1, 4, 5]].reshape(R, -1)
    want_hi = group[:, :, [2, 3, 6, 7]].reshape(R, -1)
    assert torch.equal(lo.cpu().to(torch.int32) & 0xFFFF, want_lo)
    assert torch.equal(hi.cpu().to(torch.int32) & 0xFFFF, want_hi)


def test_compute_dtype_follows_the_activations(monkeypatch):
    monkeypatch.setattr(ops, "INTERPRET", False)
    assert ops.nvfp4_compute_dtype(torch.bfloat16) == torch.bfloat16
    assert ops.nvfp4_compute_dtype(torch.float16) == torch.float16
    assert ops.nvfp4_compute_dtype(torch.float32) == torch.float16
    # the interpreter runs no inline assembly (the bfloat16 decode's scale multiply is one)
    monkeypatch.setattr(ops, "INTERPRET", True)
    assert ops.nvfp4_compute_dtype(torch.bfloat16) == torch.float16


# ----------------------------------------------------------------------------------------------
# GPU only
# ----------------------------------------------------------------------------------------------


def _random_codes(E, H, I, seed, device):
    """Every code and scale byte at random (subnormal and zero block scales included)."""
    g = torch.Generator().manual_seed(seed)

    def codes(r, k):
        return torch.randint(0, 256, (E, r, k // 2), generator=g, dtype=torch.uint8)

    def scales(r, k):
        b = torch.randint(0, 0x7F, (E, r, k // 16), generator=g, dtype=torch.uint8)
        return b.view(torch.float8_e4m3fn)
    w = ExpertWeights("nvfp4_w4a16", "silu", codes(2 * I, H), codes(H, I),
                      w13_scale=scales(2 * I, H), w2_scale=scales(H, I),
                      w13_scale_2=torch.tensor(0.5), w2_scale_2=torch.tensor(0.25))
    return w.to(device)


@pytest.mark.gpu
@pytest.mark.parametrize("asm", [True, False])
@pytest.mark.parametrize("layout", [None, W.W4A16Layout(32, 64, 64, 32),
                                    W.W4A16Layout(64, 64, 64, 32, interleave=True)])
def test_gpu_bf16_decode_bit_identical_to_reference(layout, asm, monkeypatch):
    monkeypatch.setattr(ops, "USE_ASM", asm)
    w = _random_codes(2, 96, 48, seed=3, device="cuda")
    ww = W.prepare_w4a16(w, layout)
    d13, d2 = W.decode_w4a16(ww, torch.bfloat16)
    ref13 = dequantize_nvfp4(w.w13, w.w13_scale, 2.0 ** -7, torch.bfloat16)
    ref2 = dequantize_nvfp4(w.w2, w.w2_scale, 2.0 ** -7, torch.bfloat16)
    assert torch.equal(d13.view(torch.int16), ref13.view(torch.int16))
    assert torch.equal(d2.view(torch.int16), ref2.view(torch.int16))


def _layer(E, H, I, device):
    g = torch.Generator().manual_seed(7)
    w13 = torch.randn(E, 2 * I, H, generator=g) * (1.0 / H ** 0.5)
    w2 = torch.randn(E, H, I, generator=g) * (1.0 / I ** 0.5)
    return quantize_expert_weights(w13, w2, "nvfp4_w4a16", "silu").to(device)


def _largest_intermediate(x, ids, w):
    """``max |act(gate) * up|`` over the routed (token, expert) pairs, float32, dequantized."""
    I = w.intermediate_size
    w13 = dequantize_nvfp4(w.w13, w.w13_scale, w.w13_scale_2.reshape(-1, 1, 1).float())
    gu = torch.einsum("th,tkih->tki", x.float(), w13[ids.long()])
    return (torch.nn.functional.silu(gu[..., :I]) * gu[..., I:]).abs().max().item()


def _rel(a, b):
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm()).item()


W4A16_MODES = {
    "default": {},
    "grouped": {"fused": False},
    "pairs": {"fused": False, "pairs": True},
    "splitk_fold": {"fused": False, "pairs": True, "split_k": 0, "fold": True},
    "x_converted": {"fused": False, "x_f16": True},
}


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 4, 16, 300])
@pytest.mark.parametrize("mode", ["sorted_or_decode", *W4A16_MODES])
def test_gpu_large_bf16_activations_stay_finite_on_every_nvfp4_path(mode, N):
    """Hidden states about N(0, 256^2) (the suite's large_activations scale): the intermediate
    reaches 1e5-1e6, past float16; every NVFP4 path returns the float32 reference's values."""
    E, H, I, topk = 8, 256, 128, 2
    w = _layer(E, H, I, "cuda")
    g = torch.Generator(device="cuda").manual_seed(N)
    x = (torch.randn(N, H, device="cuda", generator=g) * 256.0).bfloat16()
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:topk]
                       for _ in range(N)]).int()
    wts = torch.rand(N, topk, device="cuda", generator=g)
    ref = reference_fused_experts(x.float(), ids, wts, w)
    assert _largest_intermediate(x, ids, w) > 65504  # the case is past float16's range
    if mode == "sorted_or_decode":
        out = ops.fused_moe_prepared(x, ids, wts, ops.prepare_weights(w))
    else:
        over = W4A16_MODES[mode]
        if over.get("pairs") and N * topk > W.FUSED_MAX_PAIRS:
            pytest.skip("the pairs mode takes a few pairs only")
        ww = W.prepare_w4a16(w, W.W4A16Layout(64, 256, 64, 32, True) if over.get("pairs")
                             else None)
        cfg = {**W.default_config(ww, N, topk), **over}
        out = W.fused_moe_w4a16(x, ids, wts, ww, config=cfg)
    assert _rel(out, ref) < 1.5e-2
