"""The W4A16 NVFP4 path (``moe_runtime_triton.w4a16``): exact decode of the load-time tile layout,
both forward paths (one launch for a few pairs, swap-AB grouped GEMMs) against
``reference_math.reference_fused_experts`` in float32, and its errors.

On CPU these run through Triton's interpreter with float16 activations (it cannot compute
bfloat16); the ``gpu`` tests cover bfloat16 and CUDA-graph replay.
"""

from __future__ import annotations

import pytest
import torch
from moe_runtime_triton import ops
from moe_runtime_triton import w4a16 as W

from moe_runtime.backend_api import ExpertWeights
from moe_runtime.quant import dequantize_nvfp4
from moe_runtime.reference_math import quantize_expert_weights, reference_fused_experts

TOL = 5e-3


def _float_weights(E, H, I, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5,
            torch.randn(E, H, I, generator=g) / I ** 0.5)


def make_weights(E, H, I, *, activation="silu", seed=0, device="cpu") -> ExpertWeights:
    """Random experts quantized to NVFP4 by the repository's ModelOpt recipe."""
    return quantize_expert_weights(*_float_weights(E, H, I, seed), "nvfp4_w4a16",
                                   activation).to(device)


def random_code_weights(E, H, I, seed, device="cpu") -> ExpertWeights:
    """Every code and every finite positive e4m3 scale byte (0x00..0x7E), uniformly at random:
    the decode's whole input space."""
    g = torch.Generator().manual_seed(seed)

    def codes(r, k):
        return torch.randint(0, 256, (E, r, k // 2), generator=g, dtype=torch.uint8)

    def scales(r, k):
        return torch.randint(0, 0x7F, (E, r, k // 16), generator=g,
                             dtype=torch.uint8).view(torch.float8_e4m3fn)
    s2 = torch.rand(E, generator=g) + 0.5
    return ExpertWeights("nvfp4_w4a16", "silu", codes(2 * I, H), codes(H, I),
                         w13_scale=scales(2 * I, H), w2_scale=scales(H, I),
                         w13_scale_2=s2, w2_scale_2=s2 * 0.5).to(device)


def reference(x, ids, wts, w):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return reference_fused_experts(x.float(), ids, wts, w)
    finally:
        torch.set_num_threads(threads)


def rel_err(a, b):
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _bits(t):
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("H,I,layout", [
    (64, 32, None),  # default layout for the shape
    (96, 48, W.W4A16Layout(32, 64, 64, 32)),  # padded: H to 128 (both GEMMs), I to 64
    (64, 64, W.W4A16Layout(32, 32, 32, 32)),
    (96, 48, W.W4A16Layout(64, 64, 64, 32, interleave=True)),  # gate/up rows alternate
])
def test_decode_bit_identical_to_reference_dequantization(H, I, layout, device):
    w = random_code_weights(2, H, I, seed=H + I, device=device)
    ww = W.prepare_w4a16(w, layout)
    d13, d2 = W.decode_w4a16(ww)
    ref13 = dequantize_nvfp4(w.w13, w.w13_scale, 2.0 ** -7, torch.float16)
    ref2 = dequantize_nvfp4(w.w2, w.w2_scale, 2.0 ** -7, torch.float16)
    assert d13.shape == ref13.shape and d2.shape == ref2.shape
    # bit for bit, signed zeros included
    assert torch.equal(_bits(d13), _bits(ref13))
    assert torch.equal(_bits(d2), _bits(ref2))


def test_tile_layout_places_scales_after_codes(device):
    """A tile is its codes then its block scales: moving one scale byte changes exactly the 16
    decoded values of its block."""
    w = random_code_weights(1, 64, 32, seed=5, device=device)
    ww = W.prepare_w4a16(w, W.W4A16Layout(32, 64, 32, 32))
    before, _ = W.decode_w4a16(ww)
    # tile (gate rows 0..31, cols 0..63): codes 32 * 32 bytes, then 32 rows x 4 scale bytes
    ww.w13[0, 0, 0, 32 * 32 + 4 * 5 + 2] = 0x38  # row 5, block 2 -> scale 1.0
    after, _ = W.decode_w4a16(ww)
    diff = (_bits(before) != _bits(after)).nonzero().tolist()
    assert diff and all(e == 0 and r == 5 and 32 <= c < 48 for e, r, c in diff)


def _run(w, ids, *, fused, seed=0, device="cpu", layout=None, dtype=torch.float16):
    torch.manual_seed(seed)
    N = ids.shape[0]
    x = torch.randn(N, w.hidden_size).to(dtype).to(device)
    wts = torch.rand(ids.shape).to(device)
    ids = ids.to(device=device, dtype=torch.int32)
    ww = W.prepare_w4a16(w, layout)
    cfg = W.default_config(ww, N, ids.shape[1])
    # fused: True (one launch), False (grouped), "pairs" (grouped, a block per pair),
    # "splitk" (pairs, GEMM 1 split over two K ranges where it has two K tiles) or "splitk_fold"
    # (that, and the combine folded into GEMM 2)
    cfg["fused"] = fused is True
    cfg["pairs"] = fused in ("pairs", "splitk", "splitk_fold")
    if fused in ("splitk", "splitk_fold"):
        cfg["split_k"] = 2
    cfg["fold"] = fused == "splitk_fold"
    out = W.fused_moe_w4a16(x, ids, wts, ww, config=cfg)
    return out, reference(x, ids, wts, w), (x, ids, wts, ww, cfg)


@pytest.mark.parametrize("fused", [True, False, "pairs", "splitk", "splitk_fold"])
def test_one_token(fused, device):
    w = make_weights(4, 64, 32, seed=1, device=device)
    out, ref, _ = _run(w, torch.tensor([[3, 0]]), fused=fused, device=device)
    assert out.dtype == torch.float16 and out.shape == (1, 64)
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("fused", [True, False, "pairs", "splitk", "splitk_fold"])
def test_minus_one_ids_and_repeated_calls(fused, device):
    """Skipped slots contribute nothing (a token without experts gets zeros), and a second call
    with other inputs is not disturbed by the first (the fused path's workspace clears itself)."""
    w = make_weights(4, 64, 32, seed=3, device=device)
    ids = torch.tensor([[0, -1], [-1, -1], [3, 1], [-1, 2]])
    out, ref, (x, ids_d, wts, ww, cfg) = _run(w, ids, fused=fused, seed=3, device=device)
    assert rel_err(out, ref) < TOL
    assert torch.all(out[1] == 0)
    x2 = torch.randn_like(x)
    out2 = W.fused_moe_w4a16(x2, ids_d, wts, ww, config=cfg)
    assert rel_err(out2, reference(x2, ids_d, wts, w)) < TOL
    if fused is True:
        assert torch.all(ww.acc == 0) and torch.all(ww.count == 0)
    if fused in ("splitk", "splitk_fold"):
        assert torch.all(ww.ws == 0) and torch.all(ww.ws_count == 0)
    if fused == "splitk_fold":
        assert torch.all(ww.acc == 0) and torch.all(ww.out_count == 0)


@pytest.mark.parametrize("bt", [32, 64])
def test_grouped_wider_token_blocks(bt, device):
    """BLOCK_T above 16 (the larger batches' blocks): 40 pairs on one expert, 3 on another."""
    w = make_weights(4, 64, 32, seed=12, device=device)
    ids = torch.tensor([[1, 3]] * 3 + [[1, 0]] * 37)
    torch.manual_seed(12)
    x = torch.randn(ids.shape[0], 64).half().to(device)
    wts = torch.rand(ids.shape).to(device)
    ids = ids.to(device=device, dtype=torch.int32)
    ww = W.prepare_w4a16(w)
    cfg = {"fused": False, "BLOCK_T": bt, "num_warps": 4, "num_stages": 1}
    out = W.fused_moe_w4a16(x, ids, wts, ww, config=cfg)
    assert rel_err(out, reference(x, ids, wts, w)) < TOL
    with pytest.raises(ValueError, match="BLOCK_T must be a power of two"):
        W.fused_moe_w4a16(x, ids, wts, ww, config={**cfg, "BLOCK_T": 24})


def test_grouped_random_routing_and_a_crowded_expert(device):
    # 7 tokens x 3 experts of 8; then 20 pairs on expert 2 (two 16-row blocks), others empty
    w = make_weights(8, 64, 32, seed=4, device=device)
    ids = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(i))[:3]
                       for i in range(7)])
    out, ref, _ = _run(w, ids, fused=False, seed=4, device=device)
    assert rel_err(out, ref) < TOL
    w6 = make_weights(6, 64, 32, seed=5, device=device)
    out, ref, _ = _run(w6, torch.tensor([[2]] * 20), fused=False, seed=5, device=device)
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("fused", [True, False, "pairs", "splitk", "splitk_fold"])
@pytest.mark.parametrize("interleave", [False, True])
def test_padded_sizes_and_gelu(fused, interleave, device):
    """H = 80 and I = 48 are not multiples of the tiles (padding with zero codes and scales);
    with gate and up rows interleaved in 64-row tiles too."""
    w = make_weights(3, 80, 48, activation="gelu", seed=6, device=device)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0]])
    layout = W.W4A16Layout(64 if interleave else 32, 64, 64, 32, interleave=interleave)
    out, ref, _ = _run(w, ids, fused=fused, seed=6, device=device, layout=layout)
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("fused", [True, False, "pairs", "splitk", "splitk_fold"])
def test_several_intermediate_tiles(fused, device):
    """I = 64 in 32-column tiles: fused, two programs per pair add into one token row; grouped,
    GEMM 2 runs both K tiles in one unrolled iteration."""
    w = make_weights(4, 64, 64, seed=7, device=device)
    lo = W.W4A16Layout(32, 32, 32, 32)
    assert W.down_unroll(2, lo.down_cols) == 2
    out, ref, _ = _run(w, torch.tensor([[1, 3, 0], [2, 0, 1]]), fused=fused, seed=7,
                       device=device, layout=lo)
    assert rel_err(out, ref) < TOL


def test_float32_input_and_empty_batch(device):
    w = make_weights(4, 64, 32, seed=8, device=device)
    out, ref, (x, ids, wts, ww, cfg) = _run(w, torch.tensor([[2, 1]]), fused=True, seed=8,
                                            device=device, dtype=torch.float32)
    assert out.dtype == torch.float32 and rel_err(out, ref) < TOL
    empty = W.fused_moe_w4a16(x[:0], ids[:0], wts[:0], ww)
    assert empty.shape == (0, 64)


def test_default_config_picks_fused_for_few_pairs():
    w = make_weights(4, 64, 32, seed=9)
    ww = W.prepare_w4a16(w)
    assert W.default_config(ww, 2, 8)["fused"]
    assert not W.default_config(ww, 3, 8)["fused"]  # 24 pairs
    assert W.default_config(ww, 128, 8)["BLOCK_T"] == 64  # 256 rows per expert of 4


def test_errors_name_the_problem():
    w = make_weights(4, 64, 32, seed=10)
    bf16 = quantize_expert_weights(*_float_weights(4, 64, 32, 10), "bf16", "silu")
    with pytest.raises(ValueError, match="NVFP4 weights"):
        W.prepare_w4a16(bf16)
    with pytest.raises(ValueError, match="down_cols"):
        W.prepare_w4a16(w, W.W4A16Layout(64, 64, 64, 32))
    with pytest.raises(ValueError, match="intermediate columns of a GEMM 1 tile \\(32\\)"):
        W.prepare_w4a16(w, W.W4A16Layout(64, 64, 64, 64, interleave=True))
    with pytest.raises(ValueError, match="power of two"):
        W.prepare_w4a16(w, W.W4A16Layout(48, 64, 64, 48))
    ww = W.prepare_w4a16(w)
    x = torch.randn(2, 48, dtype=torch.float16)
    ids = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="hidden size 48"):
        W.fused_moe_w4a16(x, ids, torch.ones(2, 1), ww)
    x = torch.randn(W.FUSED_MAX_TOKENS + 1, 64, dtype=torch.float16)
    ids = torch.zeros(x.shape[0], 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="at most 16 tokens"):
        W.fused_moe_w4a16(x, ids, torch.ones(x.shape[0], 1), ww, config={"fused": True,
                                                                          "num_warps": 4,
                                                                          "num_stages": 1})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU interpreter's")
def test_benchmark_dry_run(tmp_path):
    """benchmarks/bench_w4a16.py --dry-run: both paths checked against the reference, the table
    written, the one-launch path taken for the few-pair row and the grouped one above."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_w4a16.py"
    spec = importlib.util.spec_from_file_location("bench_w4a16", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--dry-run", "--tokens", "1", "16", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 16]
    names = {"today", "w4a16 r32k64 sync", "w4a16 r32k64 wgmma", "w4a16 r32k64 sync fused"}
    # a block per pair only for a few pairs (2 here; 32 at 16 tokens)
    few = {"w4a16 r32k64 sync pairs", "w4a16 r32k64 sync splitk", "w4a16 r32k64 sync splitk fold"}
    assert set(rows[0]["impls"]) == names | few
    assert set(rows[1]["impls"]) == names
    assert [rows[0]["impls"][k]["launches"] for k in sorted(few)] == [3, 3, 2]
    for r in rows:
        assert all(v["ok"] and v["rel_err"] < bench.TOL for v in r["impls"].values())
    # 16 tokens x 2 = 32 pairs: the grouped path by default, the one-launch path where asked
    assert [r["impls"]["w4a16 r32k64 sync"]["path"] for r in rows] == ["fused", "grouped"]
    assert [r["impls"]["w4a16 r32k64 sync"]["launches"] for r in rows] == [1, 4]
    assert rows[1]["impls"]["w4a16 r32k64 sync fused"]["path"] == "fused"
    md = (tmp_path / "results.md").read_text()
    assert "| tiny | 1 |" in md and "| tiny | 16 |" in md


GPU_MODES = {  # config overrides of the GPU check: the default, the wgmma control, pairs + x_f16
    "default": {}, "wgmma": {"mma_sync": False},
    "pairs_x16": {"fused": False, "pairs": True, "x_f16": True},
    "splitk_x16": {"fused": False, "pairs": True, "split_k": 0, "x_f16": True},
    "splitk_fold_x16": {"fused": False, "pairs": True, "split_k": 0, "x_f16": True, "fold": True},
}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", sorted(GPU_MODES))
@pytest.mark.parametrize("N", [1, 2, 16, 128])
def test_gpu_bf16_graph_replay_matches_reference_and_today(N, mode):
    """bfloat16 activations on a mid-size layer, eager and CUDA-graph replayed, against the float32
    reference and today's ``ops.fused_moe_prepared``; the interleaved layout (the pairs mode's)
    with ``pairs_x16``."""
    dev = "cuda"
    E, H, I, topk = 16, 512, 256, 4
    few = mode in ("pairs_x16", "splitk_x16", "splitk_fold_x16")
    if few and N * topk > W.FUSED_MAX_PAIRS:
        pytest.skip("a block per pair: a few pairs only")
    w = make_weights(E, H, I, seed=11, device=dev)
    ww = W.prepare_w4a16(w, W.W4A16Layout(64, 256, 64, 32, True) if few else None)
    g = torch.Generator(device=dev).manual_seed(N)
    x = torch.randn(N, H, device=dev, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:topk] for _ in range(N)]).int()
    wts = torch.rand(N, topk, device=dev, generator=g)
    ref = reference(x, ids, wts, w)
    cfg = {**W.default_config(ww, N, topk), **GPU_MODES[mode]}
    out = W.fused_moe_w4a16(x, ids, wts, ww, config=cfg)
    assert rel_err(out, ref) < 1.5e-2
    today = ops.fused_moe_prepared(x, ids, wts, ops.prepare_weights(w))
    assert rel_err(out, today) < 1.5e-2
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        W.fused_moe_w4a16(x, ids, wts, ww, config=cfg)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gout = W.fused_moe_w4a16(x, ids, wts, ww, config=cfg)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert rel_err(gout, ref) < 1.5e-2


@pytest.mark.parametrize("fused", [True, False])
def test_activations_converted_once_give_the_same_output(fused, device):
    """``x_f16``: float32 activations rounded to float16 by one launch before the GEMMs give the
    output of the kernels' own rounding (bit for bit where the sums run in a fixed order: the
    fused path adds its partial sums with atomics on GPUs)."""
    w = make_weights(4, 64, 32, seed=3, device=device)
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 64, generator=g) * 3).to(device)
    ids = torch.randint(0, 4, (3, 2), generator=g, dtype=torch.int32).to(device)
    wts = torch.rand(3, 2, generator=g).to(device)
    ww = W.prepare_w4a16(w, W.W4A16Layout(32, 64, 64, 32))
    cfg = {**W.default_config(ww, 3, 2), "fused": fused}
    st = []
    once = W.fused_moe_w4a16(x, ids, wts, ww, config={**cfg, "x_f16": True}, _stages=st)
    assert st[0][0] == "x_f16"
    in_loop = W.fused_moe_w4a16(x, ids, wts, ww, config=cfg)
    assert once.dtype == torch.float32
    if fused and device != "cpu":
        torch.testing.assert_close(once, in_loop, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(once, in_loop)
    assert rel_err(once, reference(x.to(torch.float16), ids, wts, w)) < TOL


@pytest.mark.parametrize("before", [None, "0"])
def test_mma_sync_sets_triton_switch_only_around_launches(monkeypatch, before):
    import os

    if before is None:
        monkeypatch.delenv("DISABLE_MMA_V3", raising=False)
    else:
        monkeypatch.setenv("DISABLE_MMA_V3", before)
    with W._mma({"mma_sync": True}) as sync:
        assert sync is True and os.environ["DISABLE_MMA_V3"] == "1"
    assert os.environ.get("DISABLE_MMA_V3") == before
    with W._mma({"mma_sync": False}) as sync:
        assert sync is False and os.environ.get("DISABLE_MMA_V3") == before
    with pytest.raises(RuntimeError):
        with W._mma({"mma_sync": True}):
            raise RuntimeError("launch failed")
    assert os.environ.get("DISABLE_MMA_V3") == before


@pytest.mark.skipif(ops.INTERPRET, reason="the interpreter's kernels do not compile; compiled "
                    "for sm_90 where Triton runs compiled (GPU runs, or TRITON_INTERPRET=0)")
def test_sm90_compile_keeps_decoded_tile_in_registers_with_mma_sync():
    """Compiled for sm_90 on this machine (Triton's bundled ptxas): with ``mma_sync`` GEMM 1's
    dot is mma.sync with no shared-memory round trip of the decoded tile in its loop and no
    spills; as wgmma (the first GPU run's configuration) fewer CTAs fit an SM. Why depends on the
    compiler: Triton 3.6 (the GPU's) stages the decoded tile through shared memory every K step
    (the profile in benchmarks/RESULTS.md); Triton 3.9 keeps it in registers as wgmma's A operand
    but at 255 registers a thread. Either way the tile costs the wgmma kernel occupancy."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_w4a16.py"
    spec = importlib.util.spec_from_file_location("bench_w4a16", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shape = {"H": 512, "I": 256, "E": 4, "K": 2}
    facts = bench.compile_counts(shape, {
        "sync": ("r", {"mma_sync": True, "num_stages": 3}),
        "wgmma": ("r", {"mma_sync": False, "num_stages": 3})},
        layouts={"r": (128, 128, 128, 128)})
    sync, wg = facts["sync"]["gemm1"], facts["wgmma"]["gemm1"]
    assert sync["mma"] == "mma.sync" and sync["loop_round_trips"] == 0
    assert wg["mma"] == "wgmma"
    assert (wg["loop_round_trip_bytes"] >= 2 * 128 * 128 * 2
            or wg["ctas_limited_by"] == "registers"), wg
    assert sync["ctas_per_sm"] > wg["ctas_per_sm"]
    assert sync["local"] == 0  # no register spills
