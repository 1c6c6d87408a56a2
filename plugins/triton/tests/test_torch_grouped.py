"""The torch grouped GEMM path (``plugin.TORCH_GROUPED_GEMMS``): routing, offsets, gather,
activation and combine around ``torch._grouped_mm`` / ``torch._scaled_grouped_mm``, against
``reference_math``.

On CPU torch's own grouped GEMM runs (float32 for a ``bf16`` layer, see ``test_kernels``; fp8 through
the portable form of the scaled product) and the kernels around it run in Triton's interpreter; the
operands' layouts are checked against torch's own argument checks on the meta device. The ``gpu``
tests run the CUTLASS kernels.
"""

from __future__ import annotations

import os

import pytest
import torch
from moe_runtime_triton import ops
from moe_runtime_triton.plugin import TORCH_GROUPED_GEMMS
from test_kernels import TOL, _act_dtype, _inputs, make_weights, reference, rel_err

from moe_runtime import formats as F
from moe_runtime.quant import dequantize_fp8, quantize_fp8_per_tensor

FORMATS = ["bf16", "fp8_w8a8"]


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setattr(ops, "GROUPED_MM_MODE", ops.grouped_mm_mode("1"))


def _run(fmt, E, H, I, ids, device, *, activation="silu", seed=0, config=None):
    torch.manual_seed(seed)
    w = make_weights(fmt, E, H, I, activation, device, seed)
    N, K = ids.shape
    x, wts = _inputs(N, K, H, _act_dtype(fmt, device), device)
    ids = ids.to(device=device, dtype=torch.int32)
    stages = []
    pw = ops.prepare_weights(w)
    out = ops.fused_moe_prepared(x, ids, wts, pw, config=config, _stages=stages)
    return out, reference(x, ids, wts, w), [s[0] for s in stages]


GROUPED_STAGES = ["route", "gather", "gemm1", "act", "gemm2", "combine"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_forced_random_routing(fmt, device, forced):
    E, H, I, N, K = 8, 64, 32, 9, 3
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(N)])
    out, ref, stages = _run(fmt, E, H, I, ids, device)
    assert stages == GROUPED_STAGES
    assert rel_err(out, ref) < TOL[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
def test_forced_empty_experts_and_other_ranks(fmt, device, forced):
    # experts 0, 4, 5 empty; -1 (another rank) in the middle of tokens and a token with none local
    ids = torch.tensor([[2, -1], [-1, -1], [3, 1], [-1, 2], [2, 2], [1, 3], [6, -1]])
    out, ref, stages = _run(fmt, 7, 64, 32, ids, device, seed=3)
    assert stages == GROUPED_STAGES
    assert rel_err(out, ref) < TOL[fmt]
    assert torch.all(out[1] == 0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_forced_no_local_pair(fmt, device, forced):
    ids = torch.full((3, 2), -1)
    out, _, stages = _run(fmt, 4, 64, 32, ids, device)
    assert stages == GROUPED_STAGES and torch.all(out == 0)


def test_forced_gelu_and_uneven_sizes(device, forced):
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [1, 1]])
    out, ref, stages = _run("bf16", 3, 72, 40, ids, device, activation="gelu", seed=4)
    assert stages == GROUPED_STAGES
    assert rel_err(out, ref) < TOL["bf16"]


def test_forced_fp8_pairs_equal_to_experts(device, forced):
    # P == E: the activations get one spare row (never written or read) so that no torch version
    # can read their per-row scale vector as one scale per group; the result is unchanged
    ids = torch.tensor([[0, 1], [2, 3]])
    out, ref, stages = _run("fp8_w8a8", 4, 64, 32, ids, device, seed=5)
    assert stages == GROUPED_STAGES
    assert rel_err(out, ref) < TOL["fp8_w8a8"]


def test_forced_fp8_prequantized_input(device, forced):
    torch.manual_seed(8)
    w = make_weights("fp8_w8a8", 4, 64, 32, device=device, seed=8)
    x = torch.randn(5, 64, device=device).half()
    xq = quantize_fp8_per_tensor(x.float(), w.a13_scale)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 3], [0, 2]], dtype=torch.int32, device=device)
    wts = torch.rand(5, 2, device=device)
    stages = []
    out = ops.fused_moe_prepared(xq, ids, wts, ops.prepare_weights(w), hidden_scale=w.a13_scale,
                                 out_dtype=torch.float16, _stages=stages)
    assert [s[0] for s in stages] == GROUPED_STAGES
    assert rel_err(out, reference(dequantize_fp8(xq, w.a13_scale), ids, wts, w)) < TOL["fp8_w8a8"]


def test_table_flag_chooses_the_path_and_env_overrides(device, monkeypatch):
    monkeypatch.setattr(ops, "GROUPED_MM_MODE", "")
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [1, 3]])
    cfg = ops.heuristic_config(0, 4, 64, 32, 2, 5, allow_decode=False)
    _, _, plain = _run("bf16", 4, 64, 32, ids, device, config=cfg)
    assert "finalize" in plain and "combine" not in plain
    flagged = dict(cfg, grouped_mm=True)
    out, ref, stages = _run("bf16", 4, 64, 32, ids, device, config=flagged)
    assert stages == GROUPED_STAGES and rel_err(out, ref) < TOL["bf16"]
    monkeypatch.setattr(ops, "GROUPED_MM_MODE", ops.grouped_mm_mode("0"))
    _, _, off = _run("bf16", 4, 64, 32, ids, device, config=flagged)
    assert "finalize" in off and "combine" not in off
    assert "grouped_mm" in ops.describe_config(flagged)


def test_fp16_and_nvfp4_stay_on_triton_when_forced(device, forced):
    ids = torch.tensor([[0, 1], [1, 2], [2, 3]])
    for fmt in ("fp16", "nvfp4_w4a16"):
        out, ref, stages = _run(fmt, 4, 64, 32, ids, device)
        assert "combine" not in stages, fmt
        assert rel_err(out, ref) < TOL[fmt]


def test_the_mode_is_read_from_the_environment_once_and_a_bad_one_is_named():
    import subprocess
    import sys

    code = ("import os, moe_runtime_triton.ops as o; print(o.GROUPED_MM_MODE); "
            "os.environ[o.GROUPED_MM_ENV] = '0'; print(o.wants_torch_grouped({}))")
    env = {**os.environ, ops.GROUPED_MM_ENV: "1"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert res.stdout.split() == ["1", "True"]
    with pytest.raises(ValueError, match="MOE_TRITON_GROUPED_MM='yes'.*accepted"):
        ops.grouped_mm_mode("yes")


def test_availability_is_probed_once_at_prepare(device):
    w = make_weights("fp8_w8a8", 4, 64, 32, device=device)
    assert ops.prepare_weights(w).grouped_mm_unavailable is None
    w16 = make_weights("fp16", 4, 64, 32, device=device)
    assert "no torch grouped GEMM path" in ops.prepare_weights(w16).grouped_mm_unavailable


def test_unavailable_reasons():
    u = ops._grouped_unavailable
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    assert u(F.BF16, 7168, 2048, bf16, "cuda", (9, 0)) is None
    assert u(F.FP8_W8A8, 7168, 2048, fp8, "cuda", (10, 0)) is None
    assert "no torch grouped GEMM path" in u(F.FP16, 64, 32, torch.float16, "cuda", (9, 0))
    assert "no torch grouped GEMM path" in u(F.NVFP4_W4A16, 64, 32, torch.uint8, "cuda", (9, 0))
    assert "9.0, 10.0; this GPU has 8.0" in u(F.BF16, 64, 32, bf16, "cuda", (8, 0))
    assert "9.0, 10.0; this GPU has 12.0" in u(F.FP8_W8A8, 64, 32, fp8, "cuda", (12, 0))
    assert "runs bfloat16 operands" in u(F.BF16, 64, 32, torch.float32, "cuda", (9, 0))
    assert "divisible by 16, got 64 and 24" in u(F.FP8_W8A8, 64, 24, fp8, "cuda", (9, 0))
    assert "divisible by 8, got 60 and 32" in u(F.BF16, 60, 32, bf16, "cuda", (9, 0))


def _meta(t):
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")


@pytest.mark.parametrize("fmt", FORMATS)
def test_operands_pass_torchs_own_checks(fmt):
    """The prepared weights' transposed views, the row-major activations, the int32 offsets and the
    scale shapes are what torch's grouped GEMMs accept (their meta functions hold the CUDA
    kernels' checks)."""
    E, H, I, M = 4, 64, 32, 24
    w = make_weights(fmt, E, H, I, device="cpu")
    pw = ops.prepare_weights(w)
    spec = TORCH_GROUPED_GEMMS[fmt]
    dt = torch.float8_e4m3fn if fmt == "fp8_w8a8" else torch.bfloat16
    w13 = _meta(pw.w13.to(dt) if fmt == "bf16" else pw.w13)
    w2 = _meta(pw.w2.to(dt) if fmt == "bf16" else pw.w2)
    offs = torch.empty(E, dtype=torch.int32, device="meta")
    sa = torch.empty(M, device="meta") if fmt == "fp8_w8a8" else None
    a = torch.empty(M, H, dtype=dt, device="meta")
    gu = ops._grouped_gemm(spec.op, a, w13.transpose(1, 2), offs, sa,
                           _meta(pw.w13_scale) if sa is not None else None)
    assert gu.shape == (M, 2 * I) and gu.dtype == torch.bfloat16
    h = torch.empty(M, I, dtype=dt, device="meta")
    y = ops._grouped_gemm(spec.op, h, w2.transpose(1, 2), offs, sa,
                          _meta(pw.w2_scale) if sa is not None else None)
    assert y.shape == (M, H) and y.dtype == torch.bfloat16
    with pytest.raises(RuntimeError):  # the checks are live: int64 offsets are refused
        ops._grouped_gemm(spec.op, a, w13.transpose(1, 2), offs.long(), sa,
                          _meta(pw.w13_scale) if sa is not None else None)


# ----------------------------------------------------------------------------------------------
# GPU only
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_grouped_real_shape_slice(fmt, forced):
    E, H, I, N, K = 16, 2048, 768, 300, 8
    pool = torch.tensor([e for e in range(E) if e not in (5, 6)])
    ids = torch.stack([pool[torch.randperm(len(pool))[:K]] for _ in range(N)])
    ids[0, 0] = 6  # one row for expert 6, none for expert 5
    ids[::7, 1] = -1  # pairs of other ranks
    out, ref, stages = _run(fmt, E, H, I, ids, "cuda")
    assert stages == GROUPED_STAGES
    assert rel_err(out, ref) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_grouped_cuda_graph_replay(fmt, forced):
    E, H, I, N, K = 8, 512, 256, 64, 2
    w = make_weights(fmt, E, H, I, device="cuda")
    pw = ops.prepare_weights(w)
    x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, E, (N, K), device="cuda", dtype=torch.int32)
    wts = torch.rand(N, K, device="cuda")
    ops.fused_moe_prepared(x, ids, wts, pw)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.fused_moe_prepared(x, ids, wts, pw)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        ids.copy_(torch.randint(-1, E, ids.shape, device="cuda"))
        g.replay()
        assert rel_err(out, reference(x, ids, wts, w)) < 2e-2
