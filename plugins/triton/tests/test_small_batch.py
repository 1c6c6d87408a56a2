"""The two-kernel decode path and the NVFP4 operand order, against ``moe_runtime.reference_math``.

On CPU these run in Triton's interpreter (fp16 / fp8 / nvfp4; bf16 inputs are not trustworthy
there); on a GPU the same tests run the compiled kernels, with the inline-PTX NVFP4 decode.
"""

from __future__ import annotations

import pytest
import torch
from moe_runtime_triton import ops

from moe_runtime import reference_math as R

FORMATS = ["fp16", "fp8_w8a8", "nvfp4_w4a16"]
TOL = {"fp16": 5e-3, "bf16": 1e-2, "fp8_w8a8": 2e-2, "nvfp4_w4a16": 5e-3}


def _weights(fmt, E, H, I, seed, device):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.05
    w2 = torch.randn(E, H, I, generator=g) * 0.05
    if fmt in ("fp16", "bf16"):
        dt = torch.float16 if fmt == "fp16" else torch.bfloat16
        return R.quantize_expert_weights(w13, w2, fmt, "silu").to(device), dt
    kw = {"a13_amax": torch.tensor(4.0), "a2_amax": torch.tensor(0.05)} if fmt == "fp8_w8a8" else {}
    return R.quantize_expert_weights(w13, w2, fmt, "silu", **kw).to(device), torch.float16


def _inputs(N, H, E, topk, seed, device, dtype, invalid=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(N)]).to(torch.int32)
    if invalid:
        ids[0, 0] = -1  # an expert on another rank
        if N > 1:
            ids[-1, -1] = -1
    wts = torch.rand(N, topk, generator=g).softmax(-1)
    return x.to(device), ids.to(device), wts.to(device)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("fmt", FORMATS + (["bf16"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("N,invalid", [(1, False), (2, True), (3, False)])
def test_decode_path_matches_reference(fmt, N, invalid):
    dev = _device()
    E, H, I, topk = 8, 64, 48, 3
    w, dt = _weights(fmt, E, H, I, seed=N, device=dev)
    x, ids, wts = _inputs(N, H, E, topk, seed=10 + N, device=dev, dtype=dt, invalid=invalid)
    pw = ops.prepare_weights(w)
    cfg = ops.decode_config(pw.wfmt, H, I, stages=4 if dev == "cuda" else 1)
    cfg["d1"].update(BLOCK_N=16, BLOCK_K=32)  # several K blocks and a ragged N (I = 48)
    cfg["d2"].update(BLOCK_N=16, BLOCK_K=32)  # I = 48: a partial K block
    out = ops.fused_moe_prepared(x, ids, wts, pw, config=cfg)
    ref = R.reference_fused_experts(x, ids, wts, w)
    assert out.shape == (N, H) and out.dtype == x.dtype
    assert _rel(out, ref) < TOL[fmt], _rel(out, ref)


def test_decode_path_skips_other_ranks_experts_entirely():
    """A token whose experts all live elsewhere gets exactly zero."""
    dev = _device()
    E, H, I, topk = 4, 32, 32, 2
    w, dt = _weights("fp16", E, H, I, seed=3, device=dev)
    x, ids, wts = _inputs(2, H, E, topk, seed=4, device=dev, dtype=dt)
    ids[1] = -1
    pw = ops.prepare_weights(w)
    cfg = ops.decode_config(pw.wfmt, H, I, stages=1)
    cfg["d1"]["BLOCK_K"] = cfg["d2"]["BLOCK_K"] = 32
    out = ops.fused_moe_prepared(x, ids, wts, pw, config=cfg)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref = R.reference_fused_experts(x, ids, wts, w)
    assert _rel(out[0], ref[0]) < TOL["fp16"]


def test_heuristic_uses_decode_path_for_few_pairs_only():
    small = ops.heuristic_config(0, 128, 2048, 768, 8, 1)
    large = ops.heuristic_config(0, 128, 2048, 768, 8, 64)
    assert small.get("decode") and "d1" in small
    assert not large.get("decode") and "BLOCK_M" in large


def test_kernel_layout_of_nvfp4_codes_decodes_by_the_kernels_bit_operations():
    """Every code in every column of a group, packed by ``pack_nvfp4_for_kernels`` and decoded by
    the kernels' integer operations (written out here in torch), gives the E2M1 value times
    2**-14 as a float16, lo = columns (0, 1, 4, 5) and hi = (2, 3, 6, 7) of each group."""
    e2m1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
    codes = torch.stack([torch.roll(torch.arange(16), s) for s in range(8)], dim=1)  # [16, 8]
    codes = codes.repeat(1, 2).to(torch.uint8)  # two groups per row
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # checkpoint order
    kb = ops.pack_nvfp4_for_kernels(packed).to(torch.int64)
    w = (kb.reshape(16, 2, 4) << torch.tensor([0, 8, 16, 24])).sum(-1)  # [16 rows, 2 groups]
    m32 = 0xFFFFFFFF
    regs = [w & 0x8E008E00, (w << 3) & 0x8E008E00,
            ((w << 9) & 0x0E000E00) | ((w << 2) & 0x80008000),
            ((w << 6) & 0x0E000E00) | ((w << 1) & 0x80008000)]
    halves = [torch.stack([(r & m32) & 0xFFFF, ((r & m32) >> 16) & 0xFFFF], -1) for r in regs]
    cols = {(0, 0): 0, (0, 1): 1, (1, 0): 4, (1, 1): 5, (2, 0): 2, (2, 1): 3, (3, 0): 6, (3, 1): 7}
    for (reg, half), col in cols.items():
        bits = halves[reg][..., half].to(torch.int16)
        got = bits.view(torch.float16).float() * 2.0 ** 14
        want = e2m1[codes.long().reshape(16, 2, 8)[..., col]]
        assert torch.equal(got, want), (reg, half, col)
    with pytest.raises(ValueError, match="multiple of 8"):
        ops.pack_nvfp4_for_kernels(torch.zeros(2, 6, dtype=torch.uint8))


def test_decode_path_takes_prequantized_fp8_activations():
    """A dispatch that already quantized the tokens (W8A8, per-tensor scale) hands fp8 codes and
    their scale; the decode path must not quantize them again."""
    dev = _device()
    E, H, I, topk = 6, 64, 32, 2
    w, _ = _weights("fp8_w8a8", E, H, I, seed=8, device=dev)
    x, ids, wts = _inputs(3, H, E, topk, seed=9, device=dev, dtype=torch.float16)
    scale = w.a13_scale.reshape(1).float().to(dev)
    codes = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    pw = ops.prepare_weights(w)
    cfg = ops.decode_config(pw.wfmt, H, I, stages=4 if dev == "cuda" else 1)
    cfg["d1"]["BLOCK_K"] = cfg["d2"]["BLOCK_K"] = 32
    out = ops.fused_moe_prepared(codes, ids, wts, pw, hidden_scale=scale, config=cfg)
    assert out.dtype == torch.bfloat16
    ref = R.reference_fused_experts(codes.float() * scale, ids, wts, w)
    assert _rel(out, ref) < TOL["fp8_w8a8"], _rel(out, ref)


def test_nvfp4_rewrite_in_slices_equals_one_piece(monkeypatch):
    """Large layers are rewritten in row slices (bounded temporaries); the result is the same."""
    x = torch.randint(0, 256, (3, 10, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    whole = ops.pack_nvfp4_for_kernels(x)
    monkeypatch.setattr(ops, "PACK_SLICE_BYTES", 7 * 32)  # 7 rows per slice: 30 rows, ragged end
    assert torch.equal(ops.pack_nvfp4_for_kernels(x), whole)
    assert not torch.equal(whole, x)  # it is a rewrite, not a copy
