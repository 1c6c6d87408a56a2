"""NVFP4 experts at 1-128 tokens: the W4A16 tile-layout path (``moe_runtime_triton.w4a16``) against
today's ``ops.fused_moe_prepared`` on the same weights and inputs (issue 20, step 3).

Both run the whole experts part (routing, both GEMMs, activation, combine) from ``hidden [N, H]``
bf16 and the router's ``topk_ids`` / ``topk_weights`` to ``out [N, H]``, captured in CUDA graphs
(one per input set; inputs rotate over 3 routed batches so that one batch's experts are mostly not
in L2 for the next) and replayed: median of CUDA-event times per replay, median over ``--repeats``
rounds. Before timing, every output is checked against the float32 reference
(``reference_math.reference_fused_experts``: exact dequantization, float32 arithmetic): relative
Frobenius error <= 1.5e-2.

Roofline of a row: bytes of the experts its routing touches (4-bit codes + e4m3 block scales, mean
over the input sets) / 4609 GB/s (the H200 read rate measured in RESULTS.md). "SASS/w": SASS
instructions per thread in the hot loop of each path's first GEMM kernel, times the threads,
per weight of one iteration (``benchmarks/sass_inspect.py``'s count). Each candidate's stages are
also timed alone, and its GEMM kernels described (``sass_inspect.analyse``: MMA kind, shared-
memory round trips, pipeline depth, registers, CTAs per SM, weight bytes in flight).

GPU (H200), about 3 minutes (``--budget`` skips what would run past it)::

    python3 benchmarks/bench_w4a16.py --shapes qwen3-30b-a3b deepseek-v3 --out $OUT/w4a16

Without a GPU, what bounds each variant's kernels and every row's grid against the 132 SMs
(compiled for sm_90 by the installed Triton; the GPU image's is 3.6)::

    python benchmarks/bench_w4a16.py --sass --shapes qwen3-30b-a3b deepseek-v3

CPU dry run (Triton's interpreter, a tiny shape, float16 activations; checks only, the times mean
nothing)::

    python benchmarks/bench_w4a16.py --dry-run --out /tmp/w4a16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

_ROOT = Path(__file__).resolve().parents[1]
for _p in (_ROOT, _ROOT / "plugins" / "triton", _ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import bench_triton_moe  # noqa: E402  (the shapes and the CUDA-graph capture)

READ_GBPS = 4609.0
TOL = 1.5e-2
# the dimensions of bench_triton_moe's shapes (one copy); routing here is uniform random
SHAPES = {name: {k: spec[k] for k in ("H", "I", "E", "K")}
          for name, spec in bench_triton_moe.SHAPES.items() if "local" not in spec}
DRY_SHAPES = {"tiny": dict(H=64, I=32, E=8, K=2)}
LAYOUTS = {  # name -> W4A16Layout(gate_up_rows, gate_up_cols, down_rows, down_cols, interleave)
    "r64k256": (64, 256, 128, 64),
    "r128k128": (128, 128, 128, 128),
    # gate and up rows alternate in one 64-row tile: 32 intermediate columns per program, twice
    # the programs of r64k256 (the one-launch path at 1 token)
    "r64k256i": (64, 256, 128, 32, True),
    # the same with 64-row down tiles: twice the GEMM 2 programs (a few pairs)
    "r64k256i_d64": (64, 256, 64, 32, True),
}
DRY_LAYOUTS = {"r32k64": (32, 64, 64, 32)}
# the W4A16 variants timed per row: (layout, config overrides of W.default_config); "r128k128
# wgmma s4" is the first GPU run's best configuration at 16-128 tokens (RESULTS.md), the control
VARIANTS = {
    # the layout is fixed at load, so the question per layout is how it serves 1-128 tokens.
    # x16 only where it pays: on r64k256i it takes GEMM 1 from 5.1 to 3.5 SASS/w (sm_90, Triton
    # 3.6), on r128k128 ptxas spends what it saves on register moves (3.29 both ways)
    "r128k128 sync s3": ("r128k128", {"mma_sync": True, "num_stages": 3}),
    "r128k128 wgmma s4": ("r128k128", {"mma_sync": False, "num_stages": 4}),
    "r64k256i_d64 sync s3 x16": ("r64k256i_d64", {"mma_sync": True, "num_stages": 3,
                                                 "x_f16": True}),
    # a few pairs: GEMM 1, GEMM 2, finalize with a block per pair and no routing launch
    "r64k256i_d64 sync s3 x16 pairs": ("r64k256i_d64", {"mma_sync": True, "num_stages": 3,
                                                       "x_f16": True, "fused": False,
                                                       "pairs": True}),
    # the same with GEMM 1 split over K (W.split_k: about 6 programs per SM)
    "r64k256i_d64 sync s3 x16 splitk": ("r64k256i_d64", {"mma_sync": True, "num_stages": 3,
                                                        "x_f16": True, "fused": False,
                                                        "pairs": True, "split_k": 0}),
    # and the combine folded into GEMM 2 (no finalize launch)
    "r64k256i_d64 sync s3 x16 splitk fold": ("r64k256i_d64", {
        "mma_sync": True, "num_stages": 3, "x_f16": True, "fused": False, "pairs": True,
        "split_k": 0, "fold": True}),
}
DRY_VARIANTS = {"r32k64 sync": ("r32k64", {"mma_sync": True}),
                "r32k64 wgmma": ("r32k64", {"mma_sync": False}),
                "r32k64 sync fused": ("r32k64", {"mma_sync": True, "fused": True}),
                "r32k64 sync pairs": ("r32k64", {"mma_sync": True, "fused": False,
                                                 "pairs": True}),
                "r32k64 sync splitk": ("r32k64", {"mma_sync": True, "fused": False,
                                                  "pairs": True, "split_k": 2}),
                "r32k64 sync splitk fold": ("r32k64", {"mma_sync": True, "fused": False,
                                                       "pairs": True, "split_k": 2,
                                                       "fold": True})}
STAGE_REPEATS = 10  # launches of one stage per captured graph (per-stage times)


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def random_nvfp4(E, H, I, device, seed):
    """Random NVFP4 experts (every code; block scales 0.5-4, global scales for unit-variance
    rows), made on the device directly (DeepSeek-V3's 256 experts are 5.6 GB of codes)."""
    from moe_runtime.backend_api import ExpertWeights

    g = torch.Generator(device=device).manual_seed(seed)

    def codes(r, k):
        return torch.randint(0, 256, (E, r, k // 2), device=device, generator=g, dtype=torch.uint8)

    def scales(r, k):
        # e4m3 bytes 0x30..0x48: 0.5 .. 4.0
        return torch.randint(0x30, 0x49, (E, r, k // 16), device=device, generator=g,
                             dtype=torch.uint8).view(torch.float8_e4m3fn)
    # mean |e2m1| = 2.06, mean block scale ~1.9: rows of about unit norm after the global scale
    s13 = torch.full((E,), 1.0 / (2.6 * 1.9 * H ** 0.5), device=device)
    s2 = torch.full((E,), 1.0 / (2.6 * 1.9 * I ** 0.5), device=device)
    return ExpertWeights("nvfp4_w4a16", "silu", codes(2 * I, H), codes(H, I),
                         w13_scale=scales(2 * I, H), w2_scale=scales(H, I),
                         w13_scale_2=s13, w2_scale_2=s2)


def input_sets(spec, N, device, dtype, seed, count=3):
    g = torch.Generator(device=device).manual_seed(seed)
    sets = []
    for _ in range(count):
        x = torch.randn(N, spec["H"], device=device, generator=g).to(dtype)
        logits = torch.randn(N, spec["E"], device=device, generator=g)
        top, ids = torch.topk(logits, spec["K"], dim=1)
        sets.append((x, ids.to(torch.int32).contiguous(), torch.softmax(top, dim=1).contiguous()))
    return sets


def expert_bytes(H, I):
    n = 3 * H * I
    return n // 2 + n // 16


def rel_err(a, b):
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


_FACTS: dict = {}


def kernel_facts(compiled, weights_per_iter, warps):
    """``sass_inspect.analyse`` of a launched kernel (MMA kind, shared-memory round trips in the
    loop, pipeline depth, registers, CTAs per SM, SASS per weight); None if unavailable. Once
    per compiled kernel."""
    key = (getattr(compiled, "hash", None) or id(compiled), weights_per_iter, warps)
    if key in _FACTS:
        return _FACTS[key]
    try:
        import sass_inspect

        f = sass_inspect.analyse(compiled, warps, weights_per_iter, weights_per_iter * 0.5625)
        f.pop("loop_ops", None)
        _FACTS[key] = f
        return f
    except Exception as exc:  # the facts are an aid; the bench runs without them
        log(f"  (no kernel facts: {type(exc).__name__}: {exc})")
        return None


def _today_gemms(stages, cfg, topk):
    """``{stage: (compiled, weights per loop iteration, warps)}`` of today's GEMM kernels."""
    out = {}
    for name, _fn, ret in stages:
        if not hasattr(ret, "asm"):
            continue
        if name == "gemm1":
            c = cfg["g1"]
            out[name] = (ret, 2 * c["BLOCK_N"] * c["BLOCK_K"], c["num_warps"])
        elif name == "gemm2":
            c = cfg["g2"]
            out[name] = (ret, c["BLOCK_N"] * c["BLOCK_K"], c["num_warps"])
        elif name == "decode_gemm1":
            c = cfg["d1"]
            out[name] = (ret, 2 * c["BLOCK_N"] * c["BLOCK_K"], c["num_warps"])
        elif name == "decode_gemm2":
            c = cfg["d2"]
            slots = 1 << max(0, (topk - 1).bit_length())
            out[name] = (ret, slots * c["BLOCK_N"] * c["BLOCK_K"], c["num_warps"])
    return out


def _ours_gemms(stages, ww, cfg):
    from moe_runtime_triton import w4a16 as W

    lo = ww.layout
    ni = ww.padded[0] // lo.down_cols
    g1 = (1 if lo.interleave else 2) * lo.gate_up_rows * lo.gate_up_cols
    out = {}
    for name, _fn, ret in stages:
        if not hasattr(ret, "asm"):
            continue
        if name in ("gemm1", "fused"):
            out[name] = (ret, g1, cfg["num_warps"])
        elif name == "gemm2":
            out[name] = (ret, lo.down_rows * lo.down_cols * W.down_unroll(ni, lo.down_cols),
                         cfg["num_warps"])
    return out


def stage_times(timer, stages):
    """Each stage alone (us): a graph of ``STAGE_REPEATS`` launches of it, replayed, divided."""
    if not timer.cuda:
        return {}
    out = {}
    for name, fn, _ in stages:
        try:
            g = torch.cuda.CUDAGraph()
            fn()
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                for _ in range(STAGE_REPEATS):
                    fn()
            g.replay()
            torch.cuda.synchronize()
            ts = []
            for _ in range(15):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b) * 1e3 / STAGE_REPEATS)
            out[name] = round(statistics.median(ts), 1)
            del g
        except Exception as exc:
            out[name] = f"{type(exc).__name__}"
    return out


def compile_counts(spec, variants, layouts=LAYOUTS, arch=90):
    """The W4A16 kernels of each variant compiled for ``sm_<arch>`` without a GPU (Triton
    compiles for any NVIDIA target with its bundled ``ptxas``): ``{variant: {kernel: facts}}``,
    ``sass_inspect.analyse``'s facts (the fused kernel's hot loop is its GEMM 1 loop)."""
    import sass_inspect
    import triton.language as tl
    from moe_runtime_triton import w4a16 as W

    H, I, K = spec["H"], spec["I"], spec["K"]
    out = {}
    for vn, (ln, over) in variants.items():
        lo = W.W4A16Layout(*layouts[ln])
        cfg = {"num_warps": 4, "num_stages": 3, "mma_sync": True, **over}
        warps, stages = cfg["num_warps"], cfg["num_stages"]
        ni = -(-I // lo.inter_cols)
        nk1 = -(-H // lo.gate_up_cols)
        nh = -(-H // lo.down_rows)
        asm1 = W._use_asm(lo.gate_up_rows, lo.gate_up_cols, warps)
        asm2 = W._use_asm(lo.down_rows, lo.down_cols, warps)
        ku = W.down_unroll(ni, lo.down_cols)
        per_step = (1 if lo.interleave else 2) * lo.gate_up_rows * lo.gate_up_cols
        # the activations' dtype is the MMAs' and the intermediate's (ops.nvfp4_compute_dtype):
        # bf16 as a bf16 model runs them, float16 with x_f16 (a float16 model's kernels)
        x = "*fp16" if cfg.get("x_f16") else "*bf16"
        with W._mma(cfg) as sync:
            g1 = sass_inspect.compile_jit(W.w4a16_gemm1_kernel, {
                "x_ptr": x, "w_ptr": "*u8", "s2_ptr": "*fp32", "inter_ptr": x,
                "sorted_ptr": "*i32", "bexp_ptr": "*i32", "P": "i32", "E": "i32", "H": "i32",
                "num_m_blocks": "i32", "topk": "i32", "stride_xm": "i32", "stride_im": "i32"},
                {"NI": ni, "NK": nk1, "ROWS": lo.gate_up_rows, "COLS": lo.gate_up_cols,
                 "BT": 16, "ACT": 0, "EVEN_K": H % lo.gate_up_cols == 0, "USE_ASM": asm1,
                 "IL": lo.interleave, "MMA_SYNC": sync}, warps, stages, arch, ("H",))
            g2 = sass_inspect.compile_jit(W.w4a16_gemm2_kernel, {
                "inter_ptr": x, "w_ptr": "*u8", "s2_ptr": "*fp32", "topk_w_ptr": "*fp32",
                "y_ptr": "*bf16", "sorted_ptr": "*i32", "bexp_ptr": "*i32", "P": "i32",
                "E": "i32", "H": "i32", "num_m_blocks": "i32", "stride_im": "i32", "stride_ym": "i32"},
                {"NH": nh, "NK": ni, "ROWS": lo.down_rows, "COLS": lo.down_cols, "BT": 16,
                 "USE_ASM": asm2, "KU": ku, "MMA_SYNC": sync}, warps, stages, arch, ("H",))
            fu = sass_inspect.compile_jit(W.w4a16_fused_kernel, {
                "x_ptr": x, "ids_ptr": "*i32", "topk_w_ptr": "*fp32", "w13_ptr": "*u8",
                "w2_ptr": "*u8", "s13_ptr": "*fp32", "s2_ptr": "*fp32", "acc_ptr": "*fp32",
                "count_ptr": "*i32", "out_ptr": "*bf16", "E": "i32", "H": "i32",
                "stride_xm": "i32", "stride_om": "i32"},
                {"TOPK": K, "NI": ni, "NK1": nk1, "NH": nh, "HP": nh * lo.down_rows,
                 "ROWS1": lo.gate_up_rows, "COLS1": lo.gate_up_cols, "ROWS2": lo.down_rows,
                 "ACT": 0, "EVEN_K": H % lo.gate_up_cols == 0, "USE_ASM": asm1 and asm2,
                 "IL": lo.interleave, "MMA_SYNC": sync,
                 "DT": tl.float16 if x == "*fp16" else tl.bfloat16}, warps, stages, arch, ("H",))
            if "split_k" in over:
                sk = sass_inspect.compile_jit(W.w4a16_splitk_gemm1_kernel, {
                    "x_ptr": x, "ids_ptr": "*i32", "w_ptr": "*u8", "s2_ptr": "*fp32",
                    "inter_ptr": x, "ws_ptr": "*fp32", "count_ptr": "*i32", "P": "i32",
                    "E": "i32", "H": "i32", "topk": "i32", "stride_xm": "i32",
                    "stride_im": "i32"},
                    {"NI": ni, "NK": nk1, "KS": 2, "SPLIT": -(-nk1 // 2),
                     "ROWS": lo.gate_up_rows, "COLS": lo.gate_up_cols, "IP": ni * lo.inter_cols,
                     "ACT": 0, "EVEN_K": H % lo.gate_up_cols == 0, "USE_ASM": asm1,
                     "IL": lo.interleave, "MMA_SYNC": sync}, warps, stages, arch, ("H",))
            if over.get("fold"):
                fd = sass_inspect.compile_jit(W.w4a16_pairs_down_kernel, {
                    "inter_ptr": x, "ids_ptr": "*i32", "w_ptr": "*u8", "s2_ptr": "*fp32",
                    "topk_w_ptr": "*fp32", "acc_ptr": "*fp32", "count_ptr": "*i32",
                    "out_ptr": "*bf16", "P": "i32", "E": "i32", "H": "i32", "stride_im": "i32",
                    "stride_om": "i32"},
                    {"TOPK": K, "NH": nh, "NK": ni, "ROWS": lo.down_rows, "COLS": lo.down_cols,
                     "HP": nh * lo.down_rows, "USE_ASM": asm2, "KU": ku, "MMA_SYNC": sync},
                    warps, stages, arch, ("H",))
        ent = {}
        if over.get("fold"):
            ent["gemm2 fold"] = sass_inspect.analyse(fd, warps, lo.down_rows * lo.down_cols * ku,
                                                     lo.down_rows * lo.down_cols * ku * 0.5625)
        if "split_k" in over:
            ent["gemm1 split-K"] = sass_inspect.analyse(sk, warps, per_step, per_step * 0.5625)
        for kname, k, wts in (("gemm1", g1, per_step),
                              ("gemm2", g2, lo.down_rows * lo.down_cols * ku),
                              ("fused", fu, per_step)):
            ent[kname] = sass_inspect.analyse(k, warps, wts, wts * 0.5625)
        out[vn] = ent
    return out


def today_facts(spec, n_tokens):
    """Today's kernels for a row (the tuned table's config), compiled for sm_90 without a GPU:
    ``(config, {stage: facts})``."""
    import types

    import sass_inspect
    from moe_runtime_triton import ops

    E, H, I, K = spec["E"], spec["H"], spec["I"], spec["K"]
    cfg = ops.get_config("nvfp4_w4a16", E, H, I, K, n_tokens)
    out = {}
    if cfg.get("w4a16") is not None:  # the W4A16 tile path's kernels: compile_counts has them
        return cfg, out
    if cfg.get("decode"):
        kinds = (("decode_gemm1", "decode1", cfg["d1"], 2), ("decode_gemm2", "decode2", cfg["d2"],
                                                              1 << (K - 1).bit_length()))
    else:
        kinds = (("gemm1", "gemm1", cfg["g1"], 2), ("gemm2", "gemm2", cfg["g2"], 1))
    for stage, kern, c, mats in kinds:
        a = types.SimpleNamespace(kernel=kern, wfmt=2, block_m=cfg.get("BLOCK_M", 16),
                                  block_n=c["BLOCK_N"], block_k=c["BLOCK_K"],
                                  warps=c["num_warps"], stages=c["num_stages"], arch=90,
                                  x_fp16=False, asm=True)
        k = sass_inspect.compile_kernel(a)
        wts = mats * c["BLOCK_N"] * c["BLOCK_K"]
        out[stage] = sass_inspect.analyse(k, c["num_warps"], wts, wts * 0.5625)
    return cfg, out


def grid_report(spec, tokens, variants, layouts=LAYOUTS, sms=132):
    """Programs of every GEMM launch against the SMs' resident CTAs, per row: routing simulated
    as the benchmark draws it (uniform logits, top-k), mean of 3 draws; ``waves`` = programs /
    (SMs x CTAs per SM). Lines of text."""
    from moe_runtime_triton import w4a16 as W

    E, H, I, K = spec["E"], spec["H"], spec["I"], spec["K"]
    var_facts = compile_counts(spec, variants, layouts)
    lines = []
    for N in tokens:
        sets = input_sets(spec, N, "cpu", torch.float32, seed=N)
        counts = [torch.bincount(ids.reshape(-1).long(), minlength=E) for _, ids, _ in sets]

        def blocks(bm):
            return statistics.mean(int(((c + bm - 1) // bm).sum()) for c in counts)
        P = N * K
        cfg, facts = today_facts(spec, N)
        progs = {}
        if cfg.get("w4a16") is not None:  # today is the W4A16 tile path: see the variant lines
            lines.append(f"N={N} today [{describe(cfg)}]: the W4A16 tile path, "
                         f"layout {cfg['w4a16'].get('layout')}")
        elif cfg.get("decode"):
            progs["decode_gemm1"] = P * -(-I // cfg["d1"]["BLOCK_N"])
            progs["decode_gemm2"] = N * -(-H // cfg["d2"]["BLOCK_N"])
        else:
            nb = blocks(cfg["BLOCK_M"])
            progs["gemm1"] = nb * -(-I // cfg["g1"]["BLOCK_N"])
            progs["gemm2"] = nb * -(-H // cfg["g2"]["BLOCK_N"])

        def line(label, progs, facts):
            parts = []
            for st, n in progs.items():
                f = facts.get(st) or {}
                c = f.get("ctas_per_sm") or 1
                parts.append(f"{st} {n:.0f} programs / {sms} x {c} = {n / (sms * c):.2f} waves"
                             f" ({f.get('mma')}, {f.get('warps_per_sm')} warps/SM, "
                             f"{(f.get('weight_bytes_in_flight') or 0) // 1024} KB in flight/SM, "
                             f"{f.get('sass_per_weight')} SASS/w)")
            lines.append(f"N={N} {label}: " + "; ".join(parts))
        if progs:
            line(f"today [{describe(cfg)}]", progs, facts)
        for vn, (ln, over) in variants.items():
            lo = W.W4A16Layout(*layouts[ln])
            ni = -(-I // lo.inter_cols)
            nh = -(-H // lo.down_rows)
            vcfg = {**_cpu_default_config(lo, E, N, K), **over}
            if over.get("pairs") and P > W.FUSED_MAX_PAIRS:
                continue
            if vcfg["fused"]:
                progs = {"fused": P * ni}
            elif vcfg.get("pairs") and "split_k" in over:
                nk1 = -(-H // lo.gate_up_cols)
                want = over["split_k"] or round(6 * sms / max(1, P * ni))
                sk = -(-nk1 // -(-nk1 // max(1, min(nk1, want))))
                progs = {"gemm1 split-K": P * ni * sk,
                         "gemm2 fold" if over.get("fold") else "gemm2": P * nh}
            elif vcfg.get("pairs"):
                progs = {"gemm1": P * ni, "gemm2": P * nh}
            else:
                nb = blocks(vcfg["BLOCK_T"])
                progs = {"gemm1": nb * ni, "gemm2": nb * nh}
            line(vn, progs, var_facts[vn])
    return lines


def describe(cfg):
    from moe_runtime_triton import ops

    return ops.describe_config(cfg)


def _cpu_default_config(lo, E, n_tokens, topk):
    from moe_runtime_triton import w4a16 as W

    pairs = max(1, n_tokens * topk)
    rows = pairs / min(E, pairs)
    return {"fused": pairs <= W.FUSED_MAX_PAIRS and n_tokens <= W.FUSED_MAX_TOKENS,
            "BLOCK_T": 16 if rows <= 16 else 32 if rows <= 48 else 64}


class Timer:
    def __init__(self, cuda, repeats, reps):
        self.cuda, self.repeats, self.reps = cuda, repeats, reps

    def graphed(self, fns):
        """One CUDA graph per callable (after an eager warm-up on a side stream)."""
        if not self.cuda:
            return [(None, f()) for f in fns]
        return bench_triton_moe.Timer("cuda").graphs(fns)

    def time(self, graphs, fns):
        """Median over rounds of the median replay time (us), the graphs rotating."""
        rounds = []
        for _ in range(self.repeats):
            ts = []
            if self.cuda:
                ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(self.reps)]
                for i, (a, b) in enumerate(ev):
                    a.record()
                    graphs[i % len(graphs)][0].replay()
                    b.record()
                torch.cuda.synchronize()
                ts = [a.elapsed_time(b) * 1e3 for a, b in ev]
            else:
                for i in range(self.reps):
                    t0 = time.perf_counter()
                    fns[i % len(fns)]()
                    ts.append((time.perf_counter() - t0) * 1e6)
            rounds.append(statistics.median(ts))
        return statistics.median(rounds)


def run_shape(name, spec, tokens, layouts, variants, args, timer, device, dtype):
    from moe_runtime_triton import ops
    from moe_runtime_triton import w4a16 as W

    from moe_runtime.reference_math import reference_fused_experts

    E, H, I, K = spec["E"], spec["H"], spec["I"], spec["K"]
    log(f"{name}: E={E} H={H} I={I} topk={K}: weights")
    w = random_nvfp4(E, H, I, device, seed=args.seed)
    pw = ops.prepare_weights(w)
    used = sorted({ln for ln, _ in variants.values()})
    wws = {ln: W.prepare_w4a16(w, W.W4A16Layout(*layouts[ln])) for ln in used}
    rows = []
    for N in tokens:
        sets = input_sets(spec, N, device, dtype, seed=args.seed + N)
        refs = [reference_fused_experts(x.float(), ids, wts, w) for x, ids, wts in sets]
        touched = statistics.mean(
            int(torch.unique(ids[ids >= 0]).numel()) for _, ids, _ in sets)
        roof_us = touched * expert_bytes(H, I) / (READ_GBPS * 1e3)
        row = {"shape": name, "tokens": N, "pairs": N * K, "touched_experts": touched,
               "roofline_us": roof_us, "impls": {}}
        cands = {"today": (lambda s, st=None: ops.fused_moe_prepared(*s, pw, _stages=st), None)}
        for vn, (ln, over) in variants.items():
            if over.get("fused") and N > W.FUSED_MAX_TOKENS:
                continue  # the one-launch path's workspace holds FUSED_MAX_TOKENS rows
            if over.get("pairs") and N * K > W.FUSED_MAX_PAIRS:
                continue  # a block per pair: for a few pairs only (and the split-K workspace)
            ww = wws[ln]
            cfg = {**W.default_config(ww, N, K), **over}
            cands[f"w4a16 {vn}"] = (
                lambda s, st=None, ww=ww, cfg=cfg: W.fused_moe_w4a16(*s, ww, config=cfg,
                                                                     _stages=st), (ww, cfg))
        for label, (fn, extra) in cands.items():
            ent = {}
            if time.monotonic() > args.deadline:
                row["impls"][label] = {"error": "skipped: --budget spent", "ok": False}
                continue
            try:
                fns = [lambda s=s, fn=fn: fn(s) for s in sets]
                graphs = timer.graphed(fns)
                if timer.cuda:
                    for g, _ in graphs:
                        g.replay()
                    torch.cuda.synchronize()
                errs = [rel_err(out, ref) for (_, out), ref in zip(graphs, refs)]
                ent["rel_err"] = max(errs)
                ent["ok"] = ent["rel_err"] <= TOL
                ent["us"] = timer.time(graphs, fns)
                ent["pct_roof"] = 100.0 * roof_us / ent["us"]
                del graphs
                stages = []
                fn(sets[0], stages)
                if label == "today":
                    cfg0 = ops.get_config(pw.run_as, E, H, I, K, N)
                    ent["path"] = ops.describe_config(cfg0)
                    w4_cfg = ops.w4a16_config(pw, cfg0, N, K)
                    if w4_cfg is not None:  # today runs the W4A16 tile path: its own kernels
                        ww0 = ops.w4a16_weights(pw, ops.w4a16_layout(pw, w4_cfg))
                        gemms = _ours_gemms(stages, ww0,
                                            ops.w4a16_call_config(ww0, w4_cfg, N, K))
                    else:
                        gemms = _today_gemms(stages, cfg0, K)
                else:
                    ww, cfg = extra
                    ent["path"] = "fused" if cfg.get("fused") else "grouped"
                    gemms = _ours_gemms(stages, ww, cfg)
                ent["launches"] = len(stages)
                ent["stage_us"] = stage_times(timer, stages)
                if timer.cuda:
                    ent["kernels"] = {k: kernel_facts(*v) for k, v in gemms.items()}
                    first = next(iter(ent["kernels"].values()), None)
                    ent["sass_per_weight"] = first.get("sass_per_weight") if first else None
            except Exception as exc:  # one failing candidate must not hide the others
                ent = {"error": f"{type(exc).__name__}: {exc}"[:300], "ok": False}
            row["impls"][label] = ent
            log(f"  N={N} {label}: " + ", ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in ent.items() if k != "kernels"))
            for kn, kf in (ent.get("kernels") or {}).items():
                if kf:
                    log(f"      {kn}: " + ", ".join(f"{k}={v}" for k, v in kf.items()))
        rows.append(row)
    del w, pw, wws
    if timer.cuda:
        torch.cuda.empty_cache()
    return rows


def best_ours(row):
    ours = [(k, v) for k, v in row["impls"].items() if k != "today" and v.get("ok")]
    return min(ours, key=lambda kv: kv[1]["us"]) if ours else (None, None)


def markdown(meta, rows):
    lines = [f"Device: {meta['device']}; torch {meta['torch']}, Triton {meta['triton']}; "
             f"{meta['date']}. Graph-replayed medians (us); roofline = touched expert bytes / "
             f"{READ_GBPS:.0f} GB/s.", "",
             "| shape | tokens | roofline | today | today % roof | W4A16 best | W4A16 % roof | "
             "speedup | best variant (path) | rel err today / ours | SASS/w today / ours | "
             "launches today / ours |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, d=1):
        return "-" if v is None else f"{v:.{d}f}"
    for r in rows:
        t = r["impls"].get("today", {})
        bk, b = best_ours(r)
        if b is None:
            lines.append(f"| {r['shape']} | {r['tokens']} | {f(r['roofline_us'])} | "
                         f"{f(t.get('us'))} | {f(t.get('pct_roof'), 0)} | - | - | - | - | "
                         f"{f(t.get('rel_err'), 4)} / - | - | - |")
            continue
        sp = t["us"] / b["us"] if t.get("us") else None
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {f(r['roofline_us'])} | {f(t.get('us'))} | "
            f"{f(t.get('pct_roof'), 0)} | {f(b['us'])} | {f(b['pct_roof'], 0)} | "
            f"{f(sp, 2)}x | {bk.split(' ', 1)[1]} ({b['path']}) | "
            f"{f(t.get('rel_err'), 4)} / {f(b['rel_err'], 4)} | "
            f"{f(t.get('sass_per_weight'), 2)} / {f(b.get('sass_per_weight'), 2)} | "
            f"{t.get('launches', '-')} / {b.get('launches', '-')} |")
    lines += ["", "Every candidate: stages timed alone (graphs of "
              f"{STAGE_REPEATS} launches); GEMM kernels: MMA, registers, CTAs per SM (limiter), "
              "shared KB, weight KB in flight per SM, shared-memory round trips per K step, "
              "SASS per weight (benchmarks/sass_inspect.py `analyse`).", "",
              "| shape | tokens | candidate | us | % roof | rel err | stages (us) | GEMM kernels |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for k, v in r["impls"].items():
            if "error" in v:
                lines.append(f"| {r['shape']} | {r['tokens']} | {k} | - | - | - | - | "
                             f"{v['error'][:80]} |")
                continue
            st = " ".join(f"{n} {t}" for n, t in (v.get("stage_us") or {}).items())
            ks = []
            for kn, kf in (v.get("kernels") or {}).items():
                if not kf:
                    continue
                ks.append(f"{kn}: {kf.get('mma')} r{kf.get('regs')} "
                          f"{kf.get('ctas_per_sm')}cta({(kf.get('ctas_limited_by') or '?')[:4]}) "
                          f"smem {kf.get('shared', 0) // 1024} fl "
                          f"{(kf.get('weight_bytes_in_flight') or 0) // 1024} "
                          f"rt {kf.get('loop_round_trips')} {kf.get('sass_per_weight')}/w")
            lines.append(f"| {r['shape']} | {r['tokens']} | {k} | {f(v.get('us'))} | "
                         f"{f(v.get('pct_roof'), 0)} | {f(v.get('rel_err'), 4)}"
                         f"{'' if v.get('ok') else ' FAIL'} | {st or '-'} | "
                         f"{'; '.join(ks) or '-'} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: Triton's interpreter, a tiny shape, float16 activations")
    ap.add_argument("--shapes", nargs="+", help=f"default: all of {sorted(SHAPES)}")
    ap.add_argument("--tokens", nargs="+", type=int, help="default: 1 16 128 (dry run: 1 4 16)")
    ap.add_argument("--variants", nargs="+", help=f"W4A16 variants; default: all of {sorted(VARIANTS)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--reps", type=int, default=40, help="replays per round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=float, default=225.0,
                    help="seconds; candidates not started by then are skipped (listed as such)")
    ap.add_argument("--sass", action="store_true",
                    help="no GPU needed: compile the W4A16 variants' kernels and today's for sm_90 "
                         "and print what bounds them (sass_inspect.analyse: MMA, shared-memory "
                         "round trips, pipeline, registers, CTAs per SM, SASS per weight) and "
                         "each row's programs against the SMs (routing simulated)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    args.deadline = time.monotonic() + args.budget
    if args.sass:
        tokens = args.tokens or [1, 16, 128]
        for name in args.shapes or SHAPES:
            if name not in SHAPES:
                ap.error(f"unknown shape {name!r}; accepted: {sorted(SHAPES)}")
            sel = {k: VARIANTS[k] for k in (args.variants or VARIANTS)}
            for vn, ent in compile_counts(SHAPES[name], sel).items():
                for kn, fa in ent.items():
                    ops_ = fa.pop("loop_ops")
                    print(f"{name} {vn} {kn}: " + ", ".join(f"{k}={v}" for k, v in fa.items()))
                    print(f"    loop: {ops_}")
            for ln in grid_report(SHAPES[name], tokens, sel):
                print(f"{name} {ln}")
        return 0
    if args.out is None:
        ap.error("--out is required (results.json and results.md are written there)")
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        ap.error("no CUDA device: run with --dry-run (interpreter, tiny shape)")
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    layouts = DRY_LAYOUTS if args.dry_run else LAYOUTS
    if args.shapes:
        bad = [s for s in args.shapes if s not in shapes]
        if bad:
            ap.error(f"unknown shape(s) {bad}; accepted: {sorted(shapes)}")
        shapes = {s: shapes[s] for s in args.shapes}
    variants = DRY_VARIANTS if args.dry_run else VARIANTS
    if args.variants:
        bad = [s for s in args.variants if s not in variants]
        if bad:
            ap.error(f"unknown variant(s) {bad}; accepted: {sorted(variants)}")
        variants = {s: variants[s] for s in args.variants}
    tokens = args.tokens or ([1, 4, 16] if args.dry_run else [1, 16, 128])
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float16
    timer = Timer(cuda, args.repeats if cuda else 1, args.reps if cuda else 2)
    import triton

    meta = {"device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)",
            "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "read_gbps": READ_GBPS,
            "layouts": layouts, "variants": variants, "tokens": tokens}
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)
    for name, spec in shapes.items():
        rows += run_shape(name, spec, tokens, layouts, variants, args, timer, device, dtype)
        # after every shape: a run cut short by a time limit keeps what it measured
        (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        md = markdown(meta, rows)
        (args.out / "results.md").write_text(md)
    print(md)
    failed = [(r["shape"], r["tokens"], k) for r in rows for k, v in r["impls"].items()
              if not v.get("ok") and not v.get("error", "").startswith("skipped")]
    if failed:
        log(f"failed or over tolerance: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
