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
per weight of one iteration (``benchmarks/sass_inspect.py``'s count).

GPU (H200)::

    python3 benchmarks/bench_w4a16.py --out $OUT/w4a16

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
}
DRY_LAYOUTS = {"r32k64": (32, 64, 64, 32)}


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


def sass_per_weight(compiled, weights_per_iter, warps):
    """Hot-loop SASS instructions per weight of a compiled Triton kernel (None if unavailable)."""
    try:
        import sass_inspect

        sass = compiled.asm.get("sass") or ""
        if not sass:
            from triton.tools.disasm import get_sass
            sass = get_sass(compiled.asm["cubin"])
        loop = sass_inspect.innermost_loop(sass)
        return round(len(loop) * 32 * warps / weights_per_iter, 2)
    except Exception as exc:  # the count is an aid; the bench runs without it
        log(f"  (no SASS count: {type(exc).__name__}: {exc})")
        return None


def _today_first_gemm(stages, cfg, topk):
    for name, _fn, ret in stages:
        if name in ("gemm1", "decode_gemm1") and hasattr(ret, "asm"):
            if name == "gemm1":
                c = cfg["g1"]
            else:
                c = cfg["d1"]
            return ret, 2 * c["BLOCK_N"] * c["BLOCK_K"], c["num_warps"]
    return None


def _ours_first_gemm(stages, ww, cfg):
    lo = ww.layout
    for name, _fn, ret in stages:
        if name in ("gemm1", "fused") and hasattr(ret, "asm"):
            return (ret, (1 if lo.interleave else 2) * lo.gate_up_rows * lo.gate_up_cols,
                    cfg["num_warps"])
    return None


def compile_counts(spec, layouts, arch=90):
    """SASS/w of the W4A16 kernels compiled for ``sm_<arch>`` without a GPU (Triton compiles for
    any NVIDIA target with its bundled ``ptxas``): ``{layout: {kernel: (SASS/w, shared bytes,
    wgmma)}}``. The hot loop of the fused kernel is its GEMM 1 loop."""
    import sass_inspect
    import triton
    from moe_runtime_triton import w4a16 as W
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    H, I, K = spec["H"], spec["I"], spec["K"]

    def comp(fn, sig, consts, warps=4, stages=4):
        sig = dict(sig)
        for n in fn.arg_names:
            sig.setdefault(n, "constexpr")
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if sig[n].startswith("*") or n.startswith("stride") or n == "H"}
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", arch, 32),
                           options={"num_warps": warps, "num_stages": stages})
        return k
    out = {}
    for ln, lf in layouts.items():
        lo = W.W4A16Layout(*lf)
        ni = -(-I // lo.inter_cols)
        nk1 = -(-H // lo.gate_up_cols)
        nh = -(-H // lo.down_rows)
        asm1 = W._use_asm(lo.gate_up_rows, lo.gate_up_cols, 4)
        asm2 = W._use_asm(lo.down_rows, lo.down_cols, 4)
        g1 = comp(W.w4a16_gemm1_kernel, {
            "x_ptr": "*bf16", "w_ptr": "*u8", "s2_ptr": "*fp32", "inter_ptr": "*fp16",
            "sorted_ptr": "*i32", "bexp_ptr": "*i32", "P": "i32", "H": "i32",
            "num_m_blocks": "i32", "topk": "i32", "stride_xm": "i32", "stride_im": "i32"},
            {"NI": ni, "NK": nk1, "ROWS": lo.gate_up_rows, "COLS": lo.gate_up_cols, "BT": 16,
             "ACT": 0, "EVEN_K": H % lo.gate_up_cols == 0, "USE_ASM": asm1,
             "IL": lo.interleave})
        g2 = comp(W.w4a16_gemm2_kernel, {
            "inter_ptr": "*fp16", "w_ptr": "*u8", "s2_ptr": "*fp32", "topk_w_ptr": "*fp32",
            "y_ptr": "*bf16", "sorted_ptr": "*i32", "bexp_ptr": "*i32", "P": "i32", "H": "i32",
            "num_m_blocks": "i32", "stride_im": "i32", "stride_ym": "i32"},
            {"NH": nh, "NK": ni, "ROWS": lo.down_rows, "COLS": lo.down_cols, "BT": 16,
             "USE_ASM": asm2, "KU": W.down_unroll(ni, lo.down_cols)})
        fu = comp(W.w4a16_fused_kernel, {
            "x_ptr": "*bf16", "ids_ptr": "*i32", "topk_w_ptr": "*fp32", "w13_ptr": "*u8",
            "w2_ptr": "*u8", "s13_ptr": "*fp32", "s2_ptr": "*fp32", "acc_ptr": "*fp32",
            "count_ptr": "*i32", "out_ptr": "*bf16", "E": "i32", "H": "i32", "stride_xm": "i32",
            "stride_om": "i32"},
            {"TOPK": K, "NI": ni, "NK1": nk1, "NH": nh, "HP": nh * lo.down_rows,
             "ROWS1": lo.gate_up_rows, "COLS1": lo.gate_up_cols, "ROWS2": lo.down_rows,
             "ACT": 0, "EVEN_K": H % lo.gate_up_cols == 0, "USE_ASM": asm1 and asm2,
             "IL": lo.interleave})
        ent = {}
        per_step = (1 if lo.interleave else 2) * lo.gate_up_rows * lo.gate_up_cols
        for kname, k, wts in (("gemm1", g1, per_step),
                              ("gemm2", g2, lo.down_rows * lo.down_cols
                               * W.down_unroll(ni, lo.down_cols)),
                              ("fused", fu, per_step)):
            from triton.tools.disasm import get_sass
            loop = sass_inspect.innermost_loop(k.asm.get("sass") or get_sass(k.asm["cubin"]))
            ent[kname] = (round(len(loop) * 128 / wts, 2), k.metadata.shared,
                          "warp_group_dot" in k.asm["ttgir"])
        out[ln] = ent
    return out


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


def run_shape(name, spec, tokens, layouts, args, timer, device, dtype):
    from moe_runtime_triton import ops
    from moe_runtime_triton import w4a16 as W

    from moe_runtime.reference_math import reference_fused_experts

    E, H, I, K = spec["E"], spec["H"], spec["I"], spec["K"]
    log(f"{name}: E={E} H={H} I={I} topk={K}: weights")
    w = random_nvfp4(E, H, I, device, seed=args.seed)
    pw = ops.prepare_weights(w)
    wws = {ln: W.prepare_w4a16(w, W.W4A16Layout(*lf)) for ln, lf in layouts.items()}
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
        for ln, ww in wws.items():
            cfgs = {ln: W.default_config(ww, N, K)}
            if not cfgs[ln]["fused"] and N <= W.FUSED_MAX_TOKENS:
                # where the one-launch path stops paying: it also runs above FUSED_MAX_PAIRS
                cfgs[f"{ln}+fused"] = {**cfgs[ln], "fused": True}
            for cn, cfg in cfgs.items():
                cands[f"w4a16 {cn}"] = (
                    lambda s, st=None, ww=ww, cfg=cfg: W.fused_moe_w4a16(*s, ww, config=cfg,
                                                                         _stages=st), (ww, cfg))
        for label, (fn, extra) in cands.items():
            ent = {}
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
                stages = []
                fn(sets[0], stages)
                if label == "today":
                    cfg0 = ops.get_config(pw.run_as, E, H, I, K, N)
                    ent["path"] = ops.describe_config(cfg0)
                    first = _today_first_gemm(stages, cfg0, K)
                else:
                    ww, cfg = extra
                    ent["path"] = "fused" if cfg.get("fused") else "grouped"
                    first = _ours_first_gemm(stages, ww, cfg)
                ent["launches"] = len(stages)
                ent["sass_per_weight"] = (sass_per_weight(*first) if first and timer.cuda
                                          else None)
                del graphs
            except Exception as exc:  # one failing candidate must not hide the others
                ent = {"error": f"{type(exc).__name__}: {exc}"[:300], "ok": False}
            row["impls"][label] = ent
            log(f"  N={N} {label}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else
                                                f"{k}={v}" for k, v in ent.items()))
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
             "speedup | best layout (path) | other layouts | rel err today / ours | "
             "SASS/w today / ours | launches today / ours |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, d=1):
        return "-" if v is None else f"{v:.{d}f}"
    for r in rows:
        t = r["impls"].get("today", {})
        bk, b = best_ours(r)
        others = "; ".join(f"{k.split(' ', 1)[1]} {f(v.get('us'))}" if v.get("ok") else
                           f"{k.split(' ', 1)[1]} {v.get('error', 'failed check')[:40]}"
                           for k, v in r["impls"].items() if k not in ("today", bk))
        if b is None:
            lines.append(f"| {r['shape']} | {r['tokens']} | {f(r['roofline_us'])} | "
                         f"{f(t.get('us'))} | {f(t.get('pct_roof'), 0)} | - | - | - | - | "
                         f"{others} | {f(t.get('rel_err'), 4)} / - | - | - |")
            continue
        sp = t["us"] / b["us"] if t.get("us") else None
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {f(r['roofline_us'])} | {f(t.get('us'))} | "
            f"{f(t.get('pct_roof'), 0)} | {f(b['us'])} | {f(b['pct_roof'], 0)} | "
            f"{f(sp, 2)}x | {bk.split(' ', 1)[1]} ({b['path']}) | {others or '-'} | "
            f"{f(t.get('rel_err'), 4)} / {f(b['rel_err'], 4)} | "
            f"{f(t.get('sass_per_weight'), 2)} / {f(b.get('sass_per_weight'), 2)} | "
            f"{t.get('launches', '-')} / {b.get('launches', '-')} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: Triton's interpreter, a tiny shape, float16 activations")
    ap.add_argument("--shapes", nargs="+", help=f"default: all of {sorted(SHAPES)}")
    ap.add_argument("--tokens", nargs="+", type=int, help="default: 1 16 128 (dry run: 1 4 16)")
    ap.add_argument("--layouts", nargs="+", help=f"default: all of {sorted(LAYOUTS)}")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--reps", type=int, default=60, help="replays per round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sass", action="store_true",
                    help="only compile the W4A16 kernels for sm_90 (no GPU needed) and print "
                         "their SASS instructions per weight for the selected shapes and layouts")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.sass:
        for name in args.shapes or SHAPES:
            if name not in SHAPES:
                ap.error(f"unknown shape {name!r}; accepted: {sorted(SHAPES)}")
            sel = {k: LAYOUTS[k] for k in (args.layouts or LAYOUTS)}
            for ln, ent in compile_counts(SHAPES[name], sel).items():
                print(f"{name} {ln}: " + "; ".join(
                    f"{k} {v[0]} SASS/w, shared {v[1]} B{', wgmma' if v[2] else ''}"
                    for k, v in ent.items()))
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
    if args.layouts:
        bad = [s for s in args.layouts if s not in layouts]
        if bad:
            ap.error(f"unknown layout(s) {bad}; accepted: {sorted(layouts)}")
        layouts = {s: layouts[s] for s in args.layouts}
    tokens = args.tokens or ([1, 4, 16] if args.dry_run else [1, 16, 128])
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float16
    timer = Timer(cuda, args.repeats if cuda else 1, args.reps if cuda else 2)
    import triton

    meta = {"device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)",
            "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "read_gbps": READ_GBPS,
            "layouts": layouts, "tokens": tokens}
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)
    for name, spec in shapes.items():
        rows += run_shape(name, spec, tokens, layouts, args, timer, device, dtype)
        # after every shape: a run cut short by a time limit keeps what it measured
        (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        md = markdown(meta, rows)
        (args.out / "results.md").write_text(md)
    print(md)
    failed = [(r["shape"], r["tokens"], k) for r in rows for k, v in r["impls"].items()
              if not v.get("ok")]
    if failed:
        log(f"failed or over tolerance: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
