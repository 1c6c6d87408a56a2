"""Correctness of the Triton fused-MoE path against a plain-torch reference.

On CPU these run through Triton's interpreter (float16/float32/fp8 paths; bfloat16 is checked by the
``gpu`` tests, the interpreter cannot compute it).
"""

from __future__ import annotations

import pytest
import torch
from _reference import make_weights, reference, rel_err
from moe_runtime_triton import ops

TOL = {"fp16": 5e-3, "bf16": 1e-3, "fp8_w8a8": 5e-3, "nvfp4_w4a16": 5e-3, "nvfp4_w4a4": 5e-3}


def _act_dtype(fmt, device):
    if fmt == "bf16":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return torch.float16


def _run(fmt, E, H, I, ids, *, device, activation="silu", seed=0, run_as=None, config=None,
         weights=None):
    torch.manual_seed(seed)
    dt = _act_dtype(fmt, device)
    w, deq = make_weights(fmt, E, H, I, activation=activation, device=device, seed=seed,
                          dtype=dt if fmt == "bf16" else torch.bfloat16)
    if weights is not None:
        weights[:] = [w, deq]
    N, K = ids.shape
    x = torch.randn(N, H, device=device).to(dt)
    ids = ids.to(device=device, dtype=torch.int32)
    wts = torch.rand(N, K, device=device)
    out = ops.fused_moe(x, ids, wts, w, run_as=run_as or fmt, config=config)
    sc = (w.a13_scale, w.a2_scale) if (run_as or fmt) == "fp8_w8a8" else None
    ref = reference(x, ids, wts, deq, activation=activation, fp8_scales=sc)
    return out, ref


ALL = ["fp16", "bf16", "fp8_w8a8", "nvfp4_w4a16"]


@pytest.mark.parametrize("fmt", ALL)
def test_random_routing(fmt, device):
    E, H, I, N, K = 8, 64, 32, 7, 3
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(N)])
    out, ref = _run(fmt, E, H, I, ids, device=device)
    assert out.shape == (N, H)
    assert rel_err(out, ref) < TOL[fmt]


@pytest.mark.parametrize("fmt", ALL)
def test_one_token(fmt, device):
    ids = torch.tensor([[3, 0]])
    out, ref = _run(fmt, 4, 64, 32, ids, device=device, seed=1)
    assert rel_err(out, ref) < TOL[fmt]


@pytest.mark.parametrize("fmt", ALL)
def test_zero_tokens(fmt, device):
    ids = torch.zeros((0, 2), dtype=torch.int32)
    out, _ = _run(fmt, 4, 64, 32, ids, device=device)
    assert out.shape == (0, 64)


@pytest.mark.parametrize("fmt", ["fp16", "fp8_w8a8", "nvfp4_w4a16"])
def test_all_tokens_one_expert_and_empty_experts(fmt, device):
    # 20 pairs on expert 2 (more than one BLOCK_M=16 block), experts 0, 1, 3..5 empty
    ids = torch.tensor([[2]] * 20)
    out, ref = _run(fmt, 6, 64, 32, ids, device=device, seed=2)
    assert rel_err(out, ref) < TOL[fmt]


@pytest.mark.parametrize("fmt", ["fp16", "fp8_w8a8", "nvfp4_w4a16"])
def test_minus_one_ids(fmt, device):
    ids = torch.tensor([[0, -1], [-1, -1], [3, 1], [-1, 2]])
    out, ref = _run(fmt, 4, 64, 32, ids, device=device, seed=3)
    assert rel_err(out, ref) < TOL[fmt]
    assert torch.all(out[1] == 0)


@pytest.mark.parametrize("fmt,H,I", [("fp16", 40, 24), ("bf16", 72, 40), ("fp8_w8a8", 48, 20),
                                     ("nvfp4_w4a16", 96, 32), ("nvfp4_w4a16", 80, 48)])
def test_non_power_of_two_sizes(fmt, H, I, device):
    ids = torch.tensor([[0, 1], [1, 2], [2, 0]])
    out, ref = _run(fmt, 3, H, I, ids, device=device, seed=4)
    assert rel_err(out, ref) < TOL[fmt]


@pytest.mark.parametrize("fmt", ["fp16", "nvfp4_w4a16"])
def test_gelu(fmt, device):
    ids = torch.tensor([[0, 1], [1, 2]])
    out, ref = _run(fmt, 3, 64, 32, ids, device=device, activation="gelu", seed=5)
    assert rel_err(out, ref) < TOL[fmt]


def test_nvfp4_w4a4_runs_as_w4a16(device):
    ids = torch.tensor([[0, 1], [1, 2], [2, 3]])
    out, ref = _run("nvfp4_w4a4", 4, 64, 32, ids, device=device, run_as="nvfp4_w4a16", seed=6)
    assert rel_err(out, ref) < TOL["nvfp4_w4a4"]


@pytest.mark.parametrize("prequant", [False, True])
def test_fp8_activation_quant_paths(prequant, device):
    """Activation quantization inside GEMM 1 and in a separate kernel give the same result."""
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]])
    cfg = ops.heuristic_config(1, 4, 64, 32, 2, 4)
    cfg["a_prequant"] = prequant
    out, ref = _run("fp8_w8a8", 4, 64, 32, ids, device=device, config=cfg, seed=7)
    assert rel_err(out, ref) < TOL["fp8_w8a8"]


def test_fp8_prequantized_input(device):
    torch.manual_seed(8)
    w, deq = make_weights("fp8_w8a8", 4, 64, 32, device=device, seed=8)
    x = torch.randn(3, 64, device=device).half()
    xq = (x.float() / w.a13_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32, device=device)
    wts = torch.rand(3, 2, device=device)
    pw = ops.prepare_weights(w)
    out = ops.fused_moe_prepared(xq, ids, wts, pw, hidden_scale=w.a13_scale, out_dtype=torch.float16)
    ref = reference(xq.float() * w.a13_scale, ids, wts, deq, fp8_scales=(w.a13_scale, w.a2_scale))
    assert rel_err(out, ref) < TOL["fp8_w8a8"]


@pytest.mark.parametrize("block_m", [16, 64])
def test_configs_with_larger_blocks(block_m, device):
    ids = torch.stack([torch.randperm(5)[:2] for _ in range(40)])
    cfg = ops.heuristic_config(0, 5, 64, 32, 2, 40)
    cfg["BLOCK_M"] = block_m
    cfg["g1"].update(BLOCK_N=16, BLOCK_K=32, GROUP_M=2)
    cfg["g2"].update(BLOCK_N=32, BLOCK_K=16, GROUP_M=3)
    out, ref = _run("fp16", 5, 64, 32, ids, device=device, config=cfg, seed=9)
    assert rel_err(out, ref) < TOL["fp16"]


def _check_routing(ids: torch.Tensor, E: int, bm: int):
    sorted_ids, bexp, R = ops.route(ids, E, bm)
    flat = ids.reshape(-1).cpu()
    P = flat.numel()
    sorted_ids, bexp = sorted_ids.cpu(), bexp.cpu()
    counts = torch.bincount(flat[(flat >= 0) & (flat < E)].long(), minlength=E)
    padded = (counts + bm - 1) // bm * bm
    ends = torch.cumsum(padded, 0)
    assert R >= int(ends[-1]) and R % bm == 0 and bexp.numel() == R // bm
    want = torch.full((R // bm,), -1, dtype=torch.int32)
    for e in range(E):
        want[int(ends[e] - padded[e]) // bm: int(ends[e]) // bm] = e
    assert torch.equal(bexp, want)
    starts = ends - padded
    seen = torch.zeros(P, dtype=torch.bool)
    for e in range(E):
        rows = sorted_ids[int(starts[e]): int(ends[e])]
        real = rows[rows < P]
        assert real.numel() == counts[e]
        assert torch.all(flat[real.long()] == e)
        assert torch.all(rows[real.numel():] == P)  # padding after the real rows
        seen[real.long()] = True
    assert torch.equal(seen, (flat >= 0) & (flat < E))


def test_routing_tiny_path(device):
    ids = torch.tensor([[3, -1, 3], [0, 3, 5], [5, 5, -1]], device=device, dtype=torch.int32)
    _check_routing(ids, 6, 16)


def test_routing_small_path(device):
    ids = torch.randint(-1, 6, (37, 3), device=device, dtype=torch.int32)
    _check_routing(ids, 6, 16)


def test_routing_large_path(device):
    # more pairs than the one-program path takes: the count/offsets/scatter kernels
    ids = torch.randint(-1, 33, (ops.SMALL_ROUTE_MAX_PAIRS // 2 + 7, 2), device=device)
    _check_routing(ids, 33, 64)


def test_large_routing_end_to_end(device):
    N, K, E = ops.SMALL_ROUTE_MAX_PAIRS // 4 + 3, 4, 4
    ids = torch.randint(-1, E, (N, K))
    cfg = ops.heuristic_config(0, E, 32, 16, K, N)
    cfg["BLOCK_M"] = 128
    out, ref = _run("fp16", E, 32, 16, ids, device=device, config=cfg, seed=10)
    assert rel_err(out, ref) < TOL["fp16"]


def test_rejects_unsupported_run_as():
    w, _ = make_weights("fp8_w8a8", 2, 32, 32)
    with pytest.raises(ValueError, match="does not run"):
        ops.prepare_weights(w, "nvfp4_w4a16")


def test_tuned_table_and_heuristic():
    cfg = ops.get_config("bf16", 3, 40, 24, 2, 5)  # no table entry: heuristic
    assert cfg["BLOCK_M"] in (16, 32, 64, 128)
    for n in (1, 16, 128, 1024, 4096, 16384):
        cfg = ops.get_config("bf16", 128, 2048, 768, 8, n)
        assert {"BLOCK_M", "g1", "g2"} <= set(cfg)


# ----------------------------------------------------------------------------------------------
# GPU only
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8_w8a8", "nvfp4_w4a16"])
def test_gpu_real_shape_slice(fmt):
    E, H, I, N, K = 16, 2048, 768, 33, 8
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(N)])
    out, ref = _run(fmt, E, H, I, ids, device="cuda")
    assert rel_err(out, ref) < 2e-2


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    E, H, I, K = 8, 512, 256, 2
    w, deq = make_weights("bf16", E, H, I, device="cuda", dtype=torch.bfloat16)
    pw = ops.prepare_weights(w)
    x = torch.randn(4, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, E, (4, K), device="cuda", dtype=torch.int32)
    wts = torch.rand(4, K, device="cuda")
    ops.fused_moe_prepared(x, ids, wts, pw)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.fused_moe_prepared(x, ids, wts, pw)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        ids.copy_(torch.randint(-1, E, ids.shape, device="cuda"))
        g.replay()
        ref = reference(x, ids, wts, deq)
        assert rel_err(out, ref) < 2e-2
