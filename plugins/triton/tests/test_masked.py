"""The masked layout (``hidden [E, M, H]`` + per-expert counts) against
``moe_runtime.reference_math.reference_masked_experts``; interpreter on CPU, kernels on a GPU."""

from __future__ import annotations

import pytest
import torch
from moe_runtime_triton import ops

from moe_runtime import reference_math as R

TOL = {"fp16": 5e-3, "bf16": 1e-2, "fp8_w8a8": 2e-2, "nvfp4_w4a16": 5e-3}


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _weights(fmt, E, H, I, seed, device):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.05
    w2 = torch.randn(E, H, I, generator=g) * 0.05
    kw = {"a13_amax": torch.tensor(4.0), "a2_amax": torch.tensor(0.05)} if fmt == "fp8_w8a8" else {}
    return R.quantize_expert_weights(w13, w2, fmt, "silu", **kw).to(device)


def _valid_rows_err(out, ref, counts):
    num = den = 0.0
    for e, c in enumerate(counts):
        num += (out[e, :c].float() - ref[e, :c].float()).norm().item() ** 2
        den += ref[e, :c].float().norm().item() ** 2
    return (num / max(den, 1e-24)) ** 0.5


@pytest.mark.parametrize("fmt", ["fp16", "fp8_w8a8", "nvfp4_w4a16"]
                         + (["bf16"] if torch.cuda.is_available() else []))
def test_masked_matches_reference(fmt):
    dev = _device()
    E, M, H, I = 4, 21, 64, 32  # M not a multiple of any row block
    w = _weights(fmt, E, H, I, seed=1, device=dev)
    dt = torch.bfloat16 if fmt == "bf16" else torch.float16
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(E, M, H, generator=g).to(dt).to(dev)
    counts = [5, 0, 21, 17]  # an empty expert and a full one
    masked_m = torch.tensor(counts, dtype=torch.int32, device=dev)
    pw = ops.prepare_weights(w)
    out = ops.fused_moe_masked(hidden, masked_m, pw)
    ref = R.reference_masked_experts(hidden, masked_m, w)
    assert out.shape == (E, M, H) and out.dtype == hidden.dtype
    err = _valid_rows_err(out, ref, counts)
    assert err < TOL[fmt], err


def test_masked_small_row_blocks_and_prequantized_fp8():
    """16-row blocks over M = 40 (blocks past a count are skipped) and an fp8 payload."""
    dev = _device()
    E, M, H, I = 3, 40, 64, 32
    w = _weights("fp8_w8a8", E, H, I, seed=3, device=dev)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(E, M, H, generator=g).to(dev)
    scale = w.a13_scale.reshape(1).float().to(dev)
    codes = (hidden / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    counts = [40, 16, 3]
    masked_m = torch.tensor(counts, dtype=torch.int32, device=dev)
    pw = ops.prepare_weights(w)
    cfg = ops.heuristic_config(pw.wfmt, E, H, I, 1, E * M, allow_decode=False)
    cfg["BLOCK_M"] = 16
    out = ops.fused_moe_masked(codes, masked_m, pw, hidden_scale=scale, config=cfg)
    ref = R.reference_masked_experts(codes.float() * scale, masked_m, w)
    assert out.dtype == torch.bfloat16
    err = _valid_rows_err(out, ref, counts)
    assert err < TOL["fp8_w8a8"], err


def test_masked_rejects_mismatched_inputs():
    w = _weights("fp16", 4, 64, 32, seed=5, device="cpu")
    pw = ops.prepare_weights(w)
    with pytest.raises(ValueError, match="does not match"):
        ops.fused_moe_masked(torch.zeros(3, 8, 64, dtype=torch.float16), torch.zeros(3), pw)
    with pytest.raises(ValueError, match="one count per expert"):
        ops.fused_moe_masked(torch.zeros(4, 8, 64, dtype=torch.float16), torch.zeros(3), pw)
    with pytest.raises(ValueError, match=r"\[experts, max_tokens, hidden\]"):
        ops.fused_moe_masked(torch.zeros(32, 64, dtype=torch.float16), torch.zeros(4), pw)
