"""Correctness of the TMA / persistent large-batch path (``moe_runtime_triton.tma``, issue 14).

Against the float32 reference (``reference_math``) and against today's sorted path
(``ops.fused_moe_prepared``) on the same prepared weights. On CPU the kernels run in Triton's
interpreter, which runs host-side tensor descriptors too (float16, float32 and fp8; a ``bf16``
layer on CPU holds its values in float32 tensors, see ``test_kernels``); the ``gpu`` tests check
bfloat16 and CUDA-graph capture on a device.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from moe_runtime_triton import ops, tma
from test_kernels import TOL, make_weights, reference, rel_err

from moe_runtime.quant import dequantize_fp8, quantize_fp8_per_tensor

FMTS = ["fp16", "bf16", "fp8_w8a8"]


def _cfg(bm=16, bn1=32, bn2=32, bk=32, group_m=2, fused_gu=True, programs=None,
         a_gather=False):
    cfg = {"BLOCK_M": bm, "fused_gu": fused_gu, "g1": tma._gcfg(bn1, bk, group_m, 4, 2),
           "g2": tma._gcfg(bn2, bk, group_m, 4, 2), "a_gather": a_gather}
    if programs is not None:
        cfg["programs"] = programs
    return cfg


def _act_dtype(fmt, device):
    return torch.bfloat16 if fmt == "bf16" and device == "cuda" else (
        torch.float32 if fmt == "bf16" else torch.float16)


def _check(fmt, E, H, I, ids, device, *, cfg, activation="silu", seed=0):
    torch.manual_seed(seed)
    w = make_weights(fmt, E, H, I, activation, device, seed)
    pw = ops.prepare_weights(w, fmt)
    tw = tma.prepare_tma(pw, fused_gu=cfg["fused_gu"])
    N, K = ids.shape
    x = torch.randn(N, H, device=device).to(_act_dtype(fmt, device))
    wts = torch.rand(N, K, device=device)
    ids = ids.to(device=device, dtype=torch.int32)
    out = tma.fused_moe_tma(x, ids, wts, tw, config=cfg)
    today = ops.fused_moe_prepared(x, ids, wts, pw)
    ref = reference(x, ids, wts, w)
    assert out.shape == (N, H) and out.dtype == today.dtype
    assert rel_err(out, ref) < TOL[fmt]
    # same routing, same quantization points: the two paths agree closer than either to the reference
    assert rel_err(out, today) < TOL[fmt]
    return out, ref


@pytest.mark.parametrize("fused_gu", [True, False])
@pytest.mark.parametrize("fmt", FMTS)
def test_random_routing(fmt, fused_gu, device):
    E, H, I, N, K = 8, 64, 32, 13, 3
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(N)])
    _check(fmt, E, H, I, ids, device, cfg=_cfg(fused_gu=fused_gu, bn1=32 if fused_gu else 16))


@pytest.mark.parametrize("fmt", FMTS)
def test_activation_gathered_in_the_loop(fmt, device):
    """``a_gather``: GEMM 1 reads the tokens' rows of ``x`` itself (fp8: quantized once per
    token first) instead of the gathered copy; same results."""
    E, H, I, N, K = 8, 80, 32, 11, 3  # H = 80: a partial K tile through the pointer loads
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(N)])
    ids[3, 1] = -1
    _check(fmt, E, H, I, ids, device, cfg=_cfg(a_gather=True), seed=7)


@pytest.mark.parametrize("programs,group_m", [(1, 1), (3, 2), (64, 0), (0, 0)])
def test_persistent_programs_cover_every_tile(programs, group_m, device):
    """Fewer programs than tiles (each loops), more programs than tiles (the rest idle), one
    program per tile (``programs`` 0); row groups of 1, 2 and the default (one wave)."""
    E, H, I, N, K = 4, 64, 64, 21, 2
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(N)])
    _check("fp16", E, H, I, ids, device, cfg=_cfg(programs=programs, group_m=group_m), seed=1)


def test_no_valid_pair(device):
    """Every pair on another rank: no used row block, no tile; the output is zero."""
    w = make_weights("fp16", 4, 64, 32, device=device)
    tw = tma.prepare_tma(ops.prepare_weights(w))
    ids = torch.full((5, 2), -1, dtype=torch.int32, device=device)
    out = tma.fused_moe_tma(torch.randn(5, 64, device=device).half(), ids,
                            torch.rand(5, 2, device=device), tw, config=_cfg())
    assert torch.equal(out, torch.zeros_like(out))


def test_one_expert_many_blocks_and_empty_experts(device):
    """40 rows on expert 2 (three 16-row blocks, the last partial), the other experts empty."""
    ids = torch.full((20, 2), 2)
    ids[:, 1] = torch.tensor([2] * 10 + [5] * 10)
    _check("fp8_w8a8", 6, 64, 32, ids, device, cfg=_cfg(), seed=2)


def test_invalid_ids_and_partial_k_and_n_tiles(device):
    """-1 ids (pairs of other ranks) are skipped; H = 80 and I = 48 leave partial K tiles (TMA's
    zero fill) and partial N tiles (masked stores)."""
    ids = torch.tensor([[0, -1], [-1, -1], [3, 1], [-1, 2], [2, 0]])
    _check("fp16", 4, 80, 48, ids, device, cfg=_cfg(bk=32, bn1=64, bn2=32), seed=3)


@pytest.mark.parametrize("fmt", ["fp16", "fp8_w8a8"])
def test_gelu(fmt, device):
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [1, 3]])
    _check(fmt, 4, 64, 32, ids, device, cfg=_cfg(), activation="gelu", seed=4)


def test_fp8_prequantized_input(device):
    torch.manual_seed(5)
    w = make_weights("fp8_w8a8", 4, 64, 32, device=device, seed=5)
    pw = ops.prepare_weights(w)
    tw = tma.prepare_tma(pw)
    x = torch.randn(6, 64, device=device).half()
    xq = quantize_fp8_per_tensor(x.float(), w.a13_scale)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 3], [0, 2], [1, 0]], dtype=torch.int32,
                       device=device)
    wts = torch.rand(6, 2, device=device)
    out = tma.fused_moe_tma(xq, ids, wts, tw, hidden_scale=w.a13_scale, out_dtype=torch.float16,
                            config=_cfg())
    assert out.dtype == torch.float16
    ref = reference(dequantize_fp8(xq, w.a13_scale), ids, wts, w)
    assert rel_err(out, ref) < TOL["fp8_w8a8"]


def test_zero_tokens(device):
    w = make_weights("fp16", 4, 64, 32, device=device)
    tw = tma.prepare_tma(ops.prepare_weights(w))
    out = tma.fused_moe_tma(torch.zeros(0, 64, device=device, dtype=torch.float16),
                            torch.zeros(0, 2, dtype=torch.int32, device=device),
                            torch.zeros(0, 2, device=device), tw, config=_cfg())
    assert out.shape == (0, 64)


def test_default_config_runs(device):
    """The entry's own config (what the benchmark starts its sweep from) on a small layer."""
    E, H, I, N, K = 4, 64, 128, 9, 2
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(N)])
    w = make_weights("fp16", E, H, I, device=device)
    pw = ops.prepare_weights(w)
    cfg = tma.default_config(pw, N, K)
    assert cfg["BLOCK_M"] == 64 and cfg["g1"]["BLOCK_N"] == 256  # few rows per expert
    assert tma.default_config(pw, 4096, K)["BLOCK_M"] == 128
    _check("fp16", E, H, I, ids, device, cfg=cfg, seed=6)


def test_interleave_gate_up():
    E, I, H = 2, 3, 4
    w13 = torch.arange(E * 2 * I * H, dtype=torch.float32).reshape(E, 2 * I, H)
    out = tma.interleave_gate_up(w13, E, I).reshape(E, I, 2, H)
    assert torch.equal(out[:, :, 0], w13[:, :I]) and torch.equal(out[:, :, 1], w13[:, I:])


def test_rejections():
    w = make_weights("nvfp4_w4a16", 4, 64, 32)
    pw = ops.prepare_weights(w)
    assert "decoded in the main loop" in tma.tma_unavailable(pw)
    with pytest.raises(ValueError, match="nvfp4_w4a16"):
        tma.prepare_tma(pw)
    w16 = ops.prepare_weights(make_weights("fp16", 4, 64, 36))  # 72-byte rows of w2
    assert "multiple of 16 bytes" in tma.tma_unavailable(w16)
    tw = tma.prepare_tma(ops.prepare_weights(make_weights("fp16", 4, 64, 32)), fused_gu=False)
    x = torch.randn(2, 64).half()
    with pytest.raises(ValueError, match="fused_gu"):
        tma.fused_moe_tma(x, torch.tensor([[0, 1], [1, 2]], dtype=torch.int32), torch.rand(2, 2),
                          tw, config=_cfg(fused_gu=True))


def _tiles_reference(bexp: list[int]) -> tuple[list[int], list[int]]:
    """A tile at every other half block of each expert's run: full tiles (two half blocks of
    the expert) and half tiles (its last, unpaired one), each list then -1."""
    full, half, j = [], [], 0
    while j < len(bexp) and bexp[j] >= 0:
        run = j
        while run < len(bexp) and bexp[run] == bexp[j]:
            run += 1
        for t in range(j, run, 2):
            (full if t + 1 < run else half).append(t)
        j = run
    return (full + [-1] * (len(bexp) - len(full)), half + [-1] * (len(bexp) - len(half)))


@pytest.mark.parametrize("scan", [4, 16, 1024])
@pytest.mark.parametrize("unused", [6, 0])
def test_tail_tile_list(scan, unused, device):
    """Runs of 1, 2, 3, 4, 5 and 7 half blocks (chunks of ``scan`` cut through them and begin
    at a run's first block), then unused blocks or none: a tile starts at each expert's first,
    third, ... half block, full where the expert has the next one too."""
    runs = [(0, 1), (1, 2), (3, 3), (4, 4), (6, 5), (7, 7)]
    bexp = [e for e, n in runs for _ in range(n)] + [-1] * unused
    b = torch.tensor(bexp, dtype=torch.int32, device=device)
    full, half = torch.full_like(b, 99), torch.full_like(b, 99)
    tma.tail_tiles_kernel[(1,)](b, full, half, b.numel(), SCAN=scan)
    assert (full.tolist(), half.tolist()) == _tiles_reference(bexp)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("a_gather,fused_gu,bm", [(False, True, 32), (True, True, 32),
                                                  (False, False, 32), (False, True, 64)])
def test_half_tail_tiles(fmt, a_gather, fused_gu, bm, device):
    """``tail_half``: experts of 5, 16, 17, 33 and 40 rows with 32-row tiles over 16-row half
    blocks (one half tile; one half tile; one full; full + half; full + full + half), -1 ids
    too; same results as the reference and as 32-row blocks without half tiles (and with
    64-row tiles: half, half, half, full, full + half)."""
    counts = {0: 5, 1: 16, 2: 17, 3: 33, 5: 40}
    pairs = [e for e, n in counts.items() for _ in range(n)] + [-1] * 3
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(1))
    ids = torch.tensor(pairs)[order].reshape(-1, 3)
    cfg = _cfg(bm=bm, fused_gu=fused_gu, bn1=32 if fused_gu else 16, a_gather=a_gather)
    tail, ref = _check(fmt, 6, 64, 32, ids, device, cfg={**cfg, "tail_half": True}, seed=8)
    whole, _ = _check(fmt, 6, 64, 32, ids, device, cfg=cfg, seed=8)
    assert rel_err(tail, whole) < TOL[fmt] / 4


def test_half_tail_tiles_need_a_power_of_two_block_height_of_32_rows_or_more():
    tw = tma.prepare_tma(ops.prepare_weights(make_weights("fp16", 4, 64, 32)))
    for bm in (16, 96):
        with pytest.raises(ValueError, match="tail_half needs BLOCK_M a power of two of at "
                                             f"least 32.*got {bm}"):
            tma.fused_moe_tma(torch.randn(2, 64).half(),
                              torch.tensor([[0, 1], [1, 2]], dtype=torch.int32),
                              torch.rand(2, 2), tw, config={**_cfg(bm=bm), "tail_half": True})


def test_config_candidates_are_valid():
    pw = ops.prepare_weights(make_weights("fp16", 4, 64, 32))
    for n in (16, 4096):
        cands = tma.config_candidates(pw, n, 2)
        assert len({tma.describe(c) for c in cands}) == len(cands)  # no duplicates
        assert cands[0]["fused_gu"] and not all(c["fused_gu"] for c in cands)
        for c in cands:
            assert c["g1"]["BLOCK_N"] % 2 == 0 and c["BLOCK_M"] in (64, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8_w8a8"])
def test_gpu_real_shape_slice(fmt):
    E, H, I, N, K = 16, 2048, 768, 600, 8
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(N)])
    w = make_weights(fmt, E, H, I, device="cuda")
    pw = ops.prepare_weights(w, fmt)
    x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
    wts = torch.rand(N, K, device="cuda")
    ids = ids.to("cuda", torch.int32)
    today = ops.fused_moe_prepared(x, ids, wts, pw)
    ref = reference(x, ids, wts, w)
    tws = {gu: tma.prepare_tma(pw, gu) for gu in (True, False)}
    for cfg in tma.config_candidates(pw, N, K):
        out = tma.fused_moe_tma(x, ids, wts, tws[cfg["fused_gu"]], config=cfg)
        assert rel_err(out, ref) < 2e-2, tma.describe(cfg)
        assert rel_err(out, today) < 2e-2, tma.describe(cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("tail", [False, True])
def test_gpu_cuda_graph_replay(tail):
    """Replays on new routings (the tile list of ``tail_half`` is rebuilt on the device)."""
    E, H, I, K, N = 8, 512, 256, 2, 300
    w = make_weights("bf16", E, H, I, device="cuda")
    pw = ops.prepare_weights(w)
    tw = tma.prepare_tma(pw)
    cfg = {**tma.default_config(pw, N, K), "BLOCK_M": 128, "tail_half": True} if tail else None
    x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, E, (N, K), device="cuda", dtype=torch.int32)
    wts = torch.rand(N, K, device="cuda")
    tma.fused_moe_tma(x, ids, wts, tw, config=cfg)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = tma.fused_moe_tma(x, ids, wts, tw, config=cfg)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        ids.copy_(torch.randint(-1, E, ids.shape, device="cuda"))
        g.replay()
        assert rel_err(out, reference(x, ids, wts, w)) < 2e-2


BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_tma.py"


def test_bench_dry_run_plans_every_row(capsys):
    spec = importlib.util.spec_from_file_location("bench_tma", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("18 rows")
    row = next(ln for ln in lines if ln.startswith("deepseek-v3 N=4096 bf16:"))
    # 128 rows per expert: 64-row blocks first (less padding), 128-row ones second
    assert "today [M128" in row and "tma M64 g1[N256" in row and "; M128 g1[N256" in row
    row = next(ln for ln in lines if ln.startswith("deepseek-v3 N=16384 fp8_w8a8:"))
    assert "tma M128 g1[N256 K128" in row


def test_kernels_compile_for_sm90_with_wgmma_and_tma():
    """Triton compiles for sm_90 without a GPU (its bundled ptxas): both GEMMs of the default
    large-batch config must use wgmma and TMA loads and not spill. Out of process: the tests'
    interpreter mode would replace the kernels by interpreted functions."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, str(BENCH), "--compile-check", "--shapes", "qwen3-30b-a3b",
                        "--tokens", "4096", "--formats", "bf16", "fp8_w8a8", "--max-configs", "1",
                        "--out", ""], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "4 kernels compiled for sm_90, 0 without" in r.stdout


def test_bench_rejects_malformed_rows(capsys):
    spec = importlib.util.spec_from_file_location("bench_tma", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--rows", "deepseek-v3:4096", "--out", ""]) == 2
    assert "SHAPE:TOKENS:FORMAT" in capsys.readouterr().out
