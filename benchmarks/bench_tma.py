#!/usr/bin/env python3
"""The TMA / persistent large-batch path (``moe_runtime_triton.tma``, issue 14) against today's
Triton path, one command on the H200.

For each shape x token count (1024, 4096, 16384) x format (bf16, fp8_w8a8): the new path's output
is checked against today's path (``ops.fused_moe_prepared``, tuned config from ``configs.json``)
with ``bench_triton_moe.TOL``, then today's path and the new path over a small config sweep
(``tma.config_candidates``) are timed (medians of CUDA events, inputs rotating among
``bench_triton_moe.ROTATE`` routed batches: ``bench_triton_moe.Timer``). The best new config's
stages (gather, GEMM 1, GEMM 2, finalize) are then timed apart, with each GEMM's TFLOP/s (useful
rows only) against the measured matmul rate. Rows are skipped once ``--time-budget`` is spent.

Writes ``OUT/bench_tma.json`` and ``OUT/bench_tma.md``.

    python benchmarks/bench_tma.py --time-budget 300 --out $OUT        # H200, <= 6 minutes
    python benchmarks/bench_tma.py --dry-run                            # the plan, no device work
    TRITON_INTERPRET=1 python benchmarks/bench_tma.py --smoke --out /tmp/tma   # CPU, interpreter
    python benchmarks/bench_tma.py --compile-check                      # sm_90 compile, no GPU

``--compile-check`` compiles every kernel of every candidate config for sm_90 with the ptxas
Triton bundles (no GPU needed) and reports registers, spills, shared memory, and whether the
TTGIR holds wgmma (``warp_group_dot``) and TMA loads (``async_tma_copy``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import bench_triton_moe as B  # noqa: E402  (puts the plugin and the repository on sys.path)
import torch  # noqa: E402

SHAPES = ("deepseek-v3", "qwen3.5-397b-a17b", "qwen3-30b-a3b")
TOKENS = (1024, 4096, 16384)
FORMATS = ("bf16", "fp8_w8a8")
SMOKE_TOKENS = (24,)


def _modules():
    from moe_runtime_triton import kernels as K
    from moe_runtime_triton import ops, tma
    return K, ops, tma


# --------------------------------------------------------------------------------------------
# Compile check (no GPU)
# --------------------------------------------------------------------------------------------


def _ptxas_info(ptx: str) -> tuple[int | None, int | None]:
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as fh:
        fh.write(ptx)
    try:
        r = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", fh.name, "-o", os.devnull],
                           capture_output=True, text=True, check=False)
    finally:
        os.unlink(fh.name)
    txt = r.stdout + r.stderr
    regs = re.findall(r"Used (\d+) registers", txt)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", txt)
    return (int(regs[0]) if regs else None,
            sum(int(a) + int(b) for a, b in spills) if spills else None)


def compile_one(kernel: str, fmt: str, cfg: dict, arch: int = 90) -> dict:
    """Compile one of the path's GEMM kernels for ``sm_{arch}`` without a device."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    K, ops, tma = _modules()
    dt = "fp8e4nv" if fmt == "fp8_w8a8" else "bf16"
    wfmt = K.WFMT_FP8 if fmt == "fp8_w8a8" else K.WFMT_16BIT
    bm = cfg["BLOCK_M"]
    g = cfg["g1"] if kernel == "gemm1" else cfg["g2"]
    bn, bk = g["BLOCK_N"], g["BLOCK_K"]
    descs = {"a_desc": f"tensordesc<{dt}[{bm}, {bk}]>", "b_desc": f"tensordesc<{dt}[{bn}, {bk}]>",
             "a_half_desc": f"tensordesc<{dt}[{max(16, bm // 2)}, {bk}]>", "tiles_ptr": "*i32",
             "halves_ptr": "*i32"}
    tail = bool(cfg.get("tail_half", False))
    if kernel == "gemm1":
        fn = tma.tma_gemm1_kernel
        sig = {**descs, "inter_ptr": "*" + dt, "ws_ptr": "*fp32", "a_scale_ptr": "*fp32",
               "a2_scale_ptr": "*fp32", "bexp_ptr": "*i32", "x_ptr": "*" + dt,
               "sorted_ptr": "*i32"}
        sig.update({n: "i32" for n in ("num_m_blocks", "num_progs", "group_m", "P", "topk", "H",
                                       "I", "stride_im", "stride_xm")})
        consts = {"WFMT": wfmt, "ACT": 0, "OUT_FP8": wfmt == K.WFMT_FP8, "EXACT": False,
                  "FUSED_GU": bool(cfg.get("fused_gu", True)),
                  "A_GATHER": bool(cfg.get("a_gather", False)), "TAIL": tail}
    else:
        fn = tma.tma_gemm2_kernel
        sig = {**descs, "ws_ptr": "*fp32", "a2_scale_ptr": "*fp32", "topk_w_ptr": "*fp32",
               "y_ptr": "*bf16", "sorted_ptr": "*i32", "bexp_ptr": "*i32"}
        sig.update({n: "i32" for n in ("P", "num_m_blocks", "num_progs", "group_m", "H", "I",
                                       "stride_ym")})
        consts = {"WFMT": wfmt, "TAIL": tail}
    consts.update({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                   "FLATTEN": bool(cfg.get("flatten", True))})
    for name in fn.arg_names:
        sig.setdefault(name, "constexpr")
    div16 = {"H", "I", "stride_im", "stride_ym", "stride_xm"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or n in div16}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": g["num_warps"], "num_stages": g["num_stages"]})
    ttgir = k.asm["ttgir"]
    regs, spills = _ptxas_info(k.asm["ptx"])
    return {"kernel": kernel, "format": fmt, "config": tma.describe(cfg), "regs": regs,
            "spill_bytes": spills, "shared": k.metadata.shared,
            # every dot on wgmma (a dot left as tt.dot runs on mma.sync)
            "wgmma": "warp_group_dot" in ttgir and " tt.dot " not in ttgir,
            "tma_loads": ttgir.count("async_tma_copy_global"),
            "convert_layout": ttgir.count("ttg.convert_layout"),
            "warp_specialized": "ttg.warp_specialize" in ttgir}


def compile_check(args) -> int:
    import triton

    K, ops, tma = _modules()
    seen, results, bad = set(), [], 0
    for sname in args.shapes:
        spec = B.SHAPES[sname]
        for fmt in args.formats:
            for N in args.tokens:
                pw = _fake_prepared(ops, fmt, spec)
                for cfg in tma.config_candidates(pw, N, spec["K"])[:args.max_configs or None]:
                    for kernel in ("gemm1", "gemm2"):
                        key = (kernel, fmt, tma.describe(cfg))
                        if key in seen:
                            continue
                        seen.add(key)
                        try:
                            r = compile_one(kernel, fmt, cfg)
                        except Exception as exc:
                            r = {"kernel": kernel, "format": fmt, "config": tma.describe(cfg),
                                 "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
                        ok = ("error" not in r and r["wgmma"] and r["tma_loads"] > 0
                              and not r["spill_bytes"])
                        bad += not ok
                        results.append(r)
                        B.log(("ok  " if ok else "BAD ") + json.dumps(r))
    B.log(f"triton {triton.__version__}: {len(results)} kernels compiled for sm_90, "
          f"{bad} without wgmma/TMA, spilling or failing")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_tma_compile.json").write_text(json.dumps(results, indent=1))
    return 1 if bad else 0


def _fake_prepared(ops, fmt, spec):
    """A ``PreparedWeights`` carrying only what the configs read (no tensors of the real size)."""
    K, _, _ = _modules()
    t = torch.empty(1, dtype=torch.float8_e4m3fn if fmt == "fp8_w8a8" else torch.bfloat16)
    return ops.PreparedWeights(
        run_as=fmt, wfmt=K.WFMT_FP8 if fmt == "fp8_w8a8" else K.WFMT_16BIT, activation="silu",
        w13=t, w2=t, w13_scale=None, w2_scale=None, w13_scale_2=None, w2_scale_2=None,
        a13_scale=None, a2_scale=None, num_experts=spec["E"], hidden_size=spec["H"],
        intermediate_size=spec["I"])


# --------------------------------------------------------------------------------------------
# Timing run
# --------------------------------------------------------------------------------------------


_WARM = {}
_POISONED = []  # a worker's CUDA context broken by an earlier task: later ones prove nothing


def _compile_key(fmt, path, cfg):
    """What decides a config's compiled kernels (the program count does not)."""
    return (fmt, path, json.dumps({k: v for k, v in cfg.items()
                                   if k not in ("programs", "programs_per_sm")}, sort_keys=True))


def _warm_one(task):
    """Run one (format, path, config) on a small stand-in layer of the same divisibility class
    (a worker process: the compiled kernels land in Triton's on-disk cache). Returns
    ``(key, None)``, ``(key, "failed: ...")``, or ``(key, "untested: ...")`` where an earlier
    failure broke this worker's CUDA context."""
    fmt, path, cfg, topk = task
    key = _compile_key(fmt, path, cfg)
    if _POISONED:
        return key, f"untested: {_POISONED[0]}"
    try:
        K, ops, tma = _modules()
        if fmt not in _WARM:
            _WARM.clear()
            lw = B.LayerWeights(16, 2048, 768, "cuda", torch.bfloat16)
            w = lw.bf16 if fmt == "bf16" else lw.fp8(5.0 / 448, 1.0 / 448)
            pw = ops.prepare_weights(w)
            _WARM[fmt] = (pw, {True: tma.prepare_tma(pw), False: tma.prepare_tma(pw, False)})
        pw, tws = _WARM[fmt]
        tw = tws[bool(cfg.get("fused_gu", True))]
        N = 512
        x = torch.randn(N, 2048, device="cuda", dtype=torch.bfloat16)
        ids = torch.randint(0, 16, (N, topk), device="cuda", dtype=torch.int32)
        wts = torch.rand(N, topk, device="cuda")
        if path == "today":
            ops.fused_moe_prepared(x, ids, wts, pw, config=cfg)
        else:
            tma.fused_moe_tma(x, ids, wts, tw, config=cfg)
        torch.cuda.synchronize()
        return key, None
    except Exception as exc:
        msg = f"{type(exc).__name__}: {str(exc)[:300]}"
        try:
            torch.cuda.synchronize()
            torch.zeros(1, device="cuda").sum().item()
        except Exception:
            _POISONED.append(msg)
        return key, f"failed: {msg}"


def warm_compile(shapes, tokens, formats, max_configs, workers, rows=None):
    """Compile every kernel variant the run uses once, in parallel processes (Triton caches them
    on disk; the timing process then loads them)."""
    import multiprocessing as mp

    K, ops, tma = _modules()
    seen, tasks = set(), []
    for sname, spec in shapes.items():
        for fmt in formats:
            pw = _fake_prepared(ops, fmt, spec)
            for N in tokens:
                if rows and f"{sname}:{N}:{fmt}" not in rows:
                    continue
                cfgs = [("today", ops.get_config(fmt, spec["E"], spec["H"], spec["I"], spec["K"],
                                                 N))]
                cfgs += [("tma", c) for c in
                         tma.config_candidates(pw, N, spec["K"])[:max_configs or None]]
                for path, c in cfgs:
                    key = _compile_key(fmt, path, c)
                    if key not in seen:
                        seen.add(key)
                        tasks.append((fmt, path, c, spec["K"]))
    tasks.sort(key=lambda t: t[0])
    t0 = time.time()
    failed = {}
    with mp.get_context("spawn").Pool(workers) as pool:
        for key, status in pool.imap_unordered(_warm_one, tasks):
            if status:
                B.log(f"   warm-up {key[0]} {key[1]} {key[2]}: {status}")
                if status.startswith("failed"):
                    failed[key] = status
    B.log(f"warm-up: {len(tasks)} compiles in {time.time() - t0:.0f}s with {workers} workers, "
          f"{len(failed)} failed (not run in this process: a CUDA fault here would end the run)")
    return failed


def _gemm_tflops(spec, valid_pairs, gemm, seconds):
    H, I = spec["H"], spec["I"]
    flops = valid_pairs * 2 * H * I * (2 if gemm == "gemm1" else 1)
    return flops / seconds / 1e12


def run_rows(args) -> int:
    K, ops, tma = _modules()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not ops.INTERPRET:
        B.log("no CUDA device: run with TRITON_INTERPRET=1 and --smoke (or --dry-run)")
        return 2
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    timer = B.Timer(device)
    t_start = time.time()
    shapes = {k: B.SMOKE_SHAPES[k] for k in ("tiny",)} if args.smoke else \
        {k: B.SHAPES[k] for k in args.shapes}
    tokens = args.tokens
    if args.rows:
        bad = [r for r in args.rows if r.count(":") != 2 or r.split(":")[0] not in shapes]
        if bad:
            B.log(f"--rows {bad}: expected SHAPE:TOKENS:FORMAT with SHAPE one of {sorted(shapes)}")
            return 2
        shapes = {k: v for k, v in shapes.items() if any(r.startswith(k + ":") for r in args.rows)}
        tokens = sorted({int(r.split(":")[1]) for r in args.rows})
    args.warm_failed = {}
    if device == "cuda" and args.warm_workers > 0:
        args.warm_failed = warm_compile(shapes, tokens, args.formats, args.max_configs,
                                        args.warm_workers, args.rows)
    ceil = B.measure_ceilings(timer, device) if device == "cuda" and not args.no_ceilings else {}
    B.log(f"ceilings: {json.dumps({k: v for k, v in ceil.items() if k != 'read_detail'})}")
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
            "torch": torch.__version__, "triton": __import__("triton").__version__,
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "ceilings": ceil,
            "args": {k: v for k, v in vars(args).items() if k != "warm_failed"},
            "warm_failed": {" ".join(k): v for k, v in args.warm_failed.items()}}
    rows = []
    gen = torch.Generator(device=device).manual_seed(1234)
    for sname, spec in shapes.items():
        E, H, I, topk = spec["E"], spec["H"], spec["I"], spec["K"]
        if time.time() - t_start > args.time_budget:
            B.log(f"time budget spent: skipping {sname}")
            rows += [{"shape": sname, "tokens": n, "format": f, "skipped": "time budget"}
                     for n in tokens for f in args.formats]
            continue
        t0 = time.time()
        lw = B.LayerWeights(E, H, I, device, dtype)
        xs0 = torch.randn(256, H, device=device, generator=gen).to(dtype)
        gu = xs0.float() @ lw.w13[0].float().t()
        a2_amax = (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]).abs().amax().item() * 1.5
        a13, a2 = 5.0 / 448, a2_amax / 448
        B.log(f"== {sname}: E={E} H={H} I={I} topk={topk}; weights in {time.time() - t0:.1f}s")
        for fmt in args.formats:
            if args.rows and not any(r.startswith(f"{sname}:") and r.endswith(f":{fmt}")
                                     for r in args.rows):
                continue
            w = lw.bf16 if fmt == "bf16" else lw.fp8(a13, a2)
            pw = ops.prepare_weights(w)
            # the views are the ones today's path builds and keeps with pw (ops.tma_weights), made
            # when a candidate first asks: two private copies besides those held 12+ GiB more on
            # the largest shape and ran an 80 GB card out of memory (H100, 2026-12-06)
            tw = _LazyViews(ops, pw)
            for N in tokens:
                if args.rows and f"{sname}:{N}:{fmt}" not in args.rows:
                    continue
                if time.time() - t_start > args.time_budget:
                    B.log(f"   time budget spent: skipping {sname} N={N} {fmt}")
                    rows.append({"shape": sname, "tokens": N, "format": fmt,
                                 "skipped": "time budget"})
                    continue
                try:
                    rows.append(_one_row(args, B, ops, tma, timer, gen, spec, sname, fmt, w, pw,
                                         tw, N, device, dtype, ceil))
                except torch.OutOfMemoryError as exc:
                    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
                    rows.append({"shape": sname, "tokens": N, "format": fmt,
                                 "error": f"out of memory on this {gib:.0f} GiB card (weights "
                                          f"and views of {sname} {fmt} held): "
                                          f"{str(exc).split('.')[0]}"})
                    tw.pop(False, None)  # keep the layout today's path uses; retry room
                    torch.cuda.empty_cache()
                except Exception as exc:
                    traceback.print_exc()
                    rows.append({"shape": sname, "tokens": N, "format": fmt,
                                 "error": f"{type(exc).__name__}: {str(exc)[:500]}"})
                B.log("   " + _row_line(rows[-1]))
                _write(args, meta, rows)
            del tw, pw, w
            gc.collect()  # what only the cyclic collector frees goes now, not at its next run
            if device == "cuda":
                torch.cuda.empty_cache()
        del lw
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    meta["wall_s"] = round(time.time() - t_start, 1)
    _write(args, meta, rows)
    B.log(markdown(meta, rows))
    return 0


class _LazyViews(dict):
    """``{fused_gu: TmaWeights}`` of ``pw``, each built (through ``ops.tma_weights``, so shared
    with today's path) on first lookup; ``pop`` drops one from ``pw`` too."""

    def __init__(self, ops, pw):
        super().__init__()
        self._ops, self._pw = ops, pw

    def __missing__(self, fused_gu):
        made = self[fused_gu] = self._ops.tma_weights(self._pw, fused_gu)
        return made

    def pop(self, key, *default):
        self._pw.tma_views.pop(key, None)
        return super().pop(key, *default)


def _one_row(args, B, ops, tma, timer, gen, spec, sname, fmt, w, pw, tw, N, device, dtype, ceil):
    E, H, I, topk = spec["E"], spec["H"], spec["I"], spec["K"]
    sets = []
    for _ in range(B.ROTATE):
        x = torch.randn(N, H, device=device, generator=gen).to(dtype)
        ids, wts, _ = B.route_batch(spec, N, device, gen)
        sets.append((x, ids.to(torch.int32).contiguous(), wts.contiguous()))
    valid_pairs = int((sets[0][1] >= 0).sum())
    flops = valid_pairs * 6 * H * I
    ids_flat = sets[0][1].reshape(-1)
    counts = torch.bincount(ids_flat[ids_flat >= 0].long(), minlength=E)
    rate = ceil.get("fp8_TFLOPs" if fmt == "fp8_w8a8" else "bf16_TFLOPs")
    row = {"shape": sname, "tokens": N, "format": fmt, "valid_pairs": valid_pairs,
           "experts_touched": int((counts > 0).sum()),
           "roofline_flops_us": round(flops / (rate * 1e12) * 1e6, 1) if rate else None}
    # rows computed per block height: each expert's last block is padded (computed all the same)
    row["padded_rows"] = {bm: int(((counts + bm - 1) // bm).sum()) * bm for bm in (64, 128)}
    cfg_today = ops.get_config(fmt, E, H, I, topk, N)
    row["today_config"] = ops.describe_config(cfg_today)
    x0, ids0, wts0 = sets[0]
    ref = ops.fused_moe_prepared(x0, ids0, wts0, pw)
    row["today_us"] = round(timer.run(
        [lambda s=s: ops.fused_moe_prepared(s[0], s[1], s[2], pw) for s in sets]) * 1e6, 1)
    cands = tma.config_candidates(pw, N, topk)
    if args.max_configs:
        cands = cands[:args.max_configs]
    row["tma"] = []
    for cfg in cands:
        ent = {"config": tma.describe(cfg)}
        why = args.warm_failed.get(_compile_key(fmt, "tma", cfg))
        if why:
            ent["error"] = f"in the warm-up process: {why}"
            row["tma"].append(ent)
            continue
        try:
            twc = tw[bool(cfg.get("fused_gu", True))]
            out = tma.fused_moe_tma(x0, ids0, wts0, twc, config=cfg)
            err = B.rel_err(out, ref)
            ent["rel_err_vs_today"] = round(err, 5)
            if not err <= B.TOL[fmt]:
                ent["error"] = f"rel err {err:.3g} vs today's path > {B.TOL[fmt]}"
            else:
                ent["us"] = round(timer.run(
                    [lambda s=s: tma.fused_moe_tma(s[0], s[1], s[2], twc, config=cfg)
                     for s in sets]) * 1e6, 1)
        except Exception as exc:
            ent["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        row["tma"].append(ent)
    timed = [(e["us"], i) for i, e in enumerate(row["tma"]) if "us" in e]
    if timed:
        best_us, bi = min(timed)
        row["tma_best_us"], row["tma_best_config"] = best_us, row["tma"][bi]["config"]
        row["tma_best"] = cands[bi]  # the config itself, as a tuned-table entry would hold it
        row["speedup_vs_today"] = round(row["today_us"] / best_us, 3)
        if row["roofline_flops_us"]:
            row["tma_pct_flops_roof"] = round(100 * row["roofline_flops_us"] / best_us, 1)
            row["today_pct_flops_roof"] = round(100 * row["roofline_flops_us"] / row["today_us"], 1)
        if device == "cuda" and N <= args.graph_max_tokens:
            # launch-bound sizes: both paths also timed as CUDA-graph replays (as
            # bench_triton_moe does up to its GRAPH_MAX_TOKENS), the better one counts
            twb = tw[bool(cands[bi].get("fused_gu", True))]
            try:
                row["today_graph_us"] = _graph_us(timer, [
                    lambda s=s: ops.fused_moe_prepared(s[0], s[1], s[2], pw) for s in sets])
                row["tma_graph_us"] = _graph_us(timer, [
                    lambda s=s: tma.fused_moe_tma(s[0], s[1], s[2], twb, config=cands[bi])
                    for s in sets])
                today = min(row["today_us"], row["today_graph_us"])
                row["speedup_vs_today"] = round(today / min(best_us, row["tma_graph_us"]), 3)
            except Exception as exc:
                row["graph_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        if not args.no_stages:
            row["stages_us"] = _stage_times(timer, tma, x0, ids0, wts0,
                                            tw[bool(cands[bi].get("fused_gu", True))], cands[bi],
                                            spec, valid_pairs, rate, row,
                                            row["padded_rows"][cands[bi]["BLOCK_M"]])
    return row


def _graph_us(timer, fns):
    graphs = timer.graphs(fns)
    return round(timer.run([g.replay for g, _ in graphs]) * 1e6, 1)


def _stage_times(timer, tma, x, ids, wts, tw, cfg, spec, valid_pairs, rate, row, padded_rows):
    """Each stage of the best config timed alone; the GEMMs' TFLOP/s on the valid rows and, as a
    share of the matmul rate, on the rows they compute (padding included: the main loop's rate)."""
    stages = []
    tma.fused_moe_tma(x, ids, wts, tw, config=cfg, _stages=stages)
    out = {}
    for name, fn, _ in stages:
        t, _graphed = B.stage_seconds(timer, fn, use_graph=False)  # host-bound ones from a graph
        out[name] = round(t * 1e6, 1)
        if name in ("gemm1", "gemm2"):
            tf = _gemm_tflops(spec, valid_pairs, name, t)
            row[f"{name}_TFLOPs"] = round(tf, 1)
            if rate:
                row[f"{name}_pct_mm_rate"] = round(100 * tf / rate, 1)
                row[f"{name}_loop_pct_mm_rate"] = round(100 * tf * padded_rows / valid_pairs
                                                        / rate, 1)
    return out


def _row_line(r):
    head = f"{r['shape']} N={r['tokens']} {r['format']}"
    if "skipped" in r or "error" in r:
        return f"{head}: {r.get('skipped') or r.get('error')}"
    s = f"{head}: today {r['today_us']} us"
    if "tma_best_us" in r:
        s += f", tma {r['tma_best_us']} us ({r['tma_best_config']})"
        if "tma_graph_us" in r:
            s += f"; graphs: today {r['today_graph_us']}, tma {r['tma_graph_us']}"
        s += f" = {r['speedup_vs_today']}x"
        if "stages_us" in r:
            s += " stages " + " ".join(f"{k}={v}" for k, v in r["stages_us"].items())
    bad = [e for e in r.get("tma", []) if "error" in e]
    if bad:
        s += f"; {len(bad)} config(s) failed: {bad[0]['config']}: {bad[0]['error'][:160]}"
    return s


# peer times of the 2026-12-04 01:25 UTC H200 run (RESULTS.md, "Large batches"): best peer per
# row, for the ratio column only (this script does not run the peers)
PEER_US_20261204 = {
    ("deepseek-v3", 1024, "bf16"): 5268.2, ("deepseek-v3", 4096, "bf16"): 8141.6,
    ("deepseek-v3", 16384, "bf16"): 24247.8, ("deepseek-v3", 1024, "fp8_w8a8"): 3931.1,
    ("deepseek-v3", 4096, "fp8_w8a8"): 6371.5, ("deepseek-v3", 16384, "fp8_w8a8"): 17773.8,
    ("qwen3-30b-a3b", 1024, "bf16"): 564.5, ("qwen3-30b-a3b", 4096, "bf16"): 1047.7,
    ("qwen3-30b-a3b", 16384, "bf16"): 3197.0, ("qwen3-30b-a3b", 1024, "fp8_w8a8"): 547.6,
    ("qwen3-30b-a3b", 4096, "fp8_w8a8"): 1260.1, ("qwen3-30b-a3b", 16384, "fp8_w8a8"): 3505.2,
    ("qwen3.5-397b-a17b", 1024, "bf16"): 3265.3, ("qwen3.5-397b-a17b", 4096, "bf16"): 4145.9,
    ("qwen3.5-397b-a17b", 16384, "bf16"): 11950.8, ("qwen3.5-397b-a17b", 1024, "fp8_w8a8"): 2029.3,
    ("qwen3.5-397b-a17b", 4096, "fp8_w8a8"): 3017.5,
    ("qwen3.5-397b-a17b", 16384, "fp8_w8a8"): 8586.6,
}


def markdown(meta, rows) -> str:
    lines = [f"TMA path vs today's Triton path: {meta['device']}, torch {meta['torch']}, Triton "
             f"{meta['triton']}, {meta['started']}; us, medians of CUDA events. Peer: the best peer "
             "of the 2026-12-04 01:25 run (not re-measured here).", "",
             "GEMMn % mm: the GEMM's valid-row TFLOP/s as a share of the measured matmul rate; "
             "loop: the same on every row it computes (each expert's last block padded to "
             "BLOCK_M), the main loop's rate. Rows up to --graph-max-tokens: the better of eager "
             "and CUDA-graph replay on each side. Stages: each alone; one under "
             f"{B.STAGE_GRAPH_BELOW_S * 1e6:.0f} us eagerly (host-bound: launches) is timed from a "
             "graph of its launches. The peer ratio holds only where this run's device is the "
             "old run's (an H200).", "",
             "| shape | tokens | format | today (us) | TMA best (us) | TMA / today | vs peer "
             "(old run) | TMA % flops roof | GEMM1 % mm (loop) | GEMM2 % mm (loop) | padding "
             "M64 / M128 | best config | stages (us) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r or "error" in r:
            lines.append(f"| {r['shape']} | {r['tokens']} | {r['format']} | "
                         f"{r.get('skipped') or r.get('error')} | | | | | | | | | |")
            continue
        peer = PEER_US_20261204.get((r["shape"], r["tokens"], r["format"]))
        best = r.get("tma_best_us")
        if best and r.get("tma_graph_us"):
            best = min(best, r["tma_graph_us"])
        today = min(r["today_us"], r.get("today_graph_us") or r["today_us"])
        vs_peer = f"{peer / best:.2f}x" if peer and best else "-"
        st = " ".join(f"{k} {v}" for k, v in r.get("stages_us", {}).items())
        pr = r.get("padded_rows", {})
        pad = " / ".join(f"{100 * (1 - r['valid_pairs'] / pr[bm]):.0f}%" if pr.get(bm) else "-"
                         for bm in (64, 128))

        def pct(g):
            return f"{r.get(g + '_pct_mm_rate', '-')} ({r.get(g + '_loop_pct_mm_rate', '-')})"
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['format']} | {today} | {best or '-'} | "
            f"{r.get('speedup_vs_today', '-')} | {vs_peer} | {r.get('tma_pct_flops_roof', '-')} | "
            f"{pct('gemm1')} | {pct('gemm2')} | {pad} | "
            f"{r.get('tma_best_config', '-')} | {st} |")
    return "\n".join(lines)


def _write(args, meta, rows):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_tma.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "bench_tma.md").write_text(markdown(meta, rows) + "\n")


def dry_run(args) -> int:
    K, ops, tma = _modules()
    shapes = {"tiny": B.SMOKE_SHAPES["tiny"]} if args.smoke else {k: B.SHAPES[k] for k in args.shapes}
    n = 0
    for sname, spec in shapes.items():
        for fmt in args.formats:
            pw = _fake_prepared(ops, fmt, spec)
            for N in args.tokens:
                cands = tma.config_candidates(pw, N, spec["K"])[:args.max_configs or None]
                today = ops.describe_config(ops.get_config(fmt, spec["E"], spec["H"], spec["I"],
                                                           spec["K"], N))
                B.log(f"{sname} N={N} {fmt}: today [{today}]; tma " +
                      "; ".join(tma.describe(c) for c in cands))
                n += 1
    B.log(f"{n} rows; time budget {args.time_budget:.0f}s; out {args.out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=sorted(B.SHAPES))
    ap.add_argument("--tokens", nargs="*", type=int)
    ap.add_argument("--formats", nargs="*", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--time-budget", type=float, default=300.0,
                    help="seconds; rows past it are skipped (weights and compiles included)")
    ap.add_argument("--rows", nargs="*",
                    help="only these SHAPE:TOKENS:FORMAT rows (e.g. deepseek-v3:4096:bf16)")
    ap.add_argument("--max-configs", type=int, default=0, help="at most this many TMA configs a row")
    ap.add_argument("--warm-workers", type=int, default=8,
                    help="processes compiling the kernels first (0: compile as they run)")
    ap.add_argument("--graph-max-tokens", type=int, default=B.GRAPH_MAX_TOKENS,
                    help="rows up to this many tokens are also timed as CUDA-graph replays")
    ap.add_argument("--no-stages", action="store_true", help="skip the per-stage timing")
    ap.add_argument("--no-ceilings", action="store_true", help="skip the matmul-rate measurement")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny shape in fp16/fp8 (CPU: TRITON_INTERPRET=1)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, no device work")
    ap.add_argument("--compile-check", action="store_true",
                    help="compile every candidate's kernels for sm_90 (no GPU) and report")
    args = ap.parse_args(argv)
    if args.tokens is None:
        args.tokens = list(SMOKE_TOKENS if args.smoke else TOKENS)
    if args.smoke and not args.max_configs:
        args.max_configs = 2  # the interpreter takes seconds a call
    if any(n <= 0 for n in args.tokens):
        ap.error(f"--tokens must be positive, got {args.tokens}")
    if args.compile_check:
        return compile_check(args)
    if args.dry_run:
        return dry_run(args)
    return run_rows(args)


if __name__ == "__main__":
    raise SystemExit(main())
