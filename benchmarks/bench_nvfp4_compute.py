"""NVFP4 experts with bfloat16 against float16 MMAs: what keeping a bf16 model's range costs.

NVFP4 weights run as W4A16 on the 16-bit tensor cores. With bfloat16 activations the kernels now
decode into bfloat16 and keep the intermediate in bfloat16 (``ops.nvfp4_compute_dtype``); before,
they rounded activations and intermediate to float16, which overflows to inf where a bf16 model's
gated intermediate passes 65504 (the conformance suite's ``large_activations`` case). This times
the same layer, the same routing and the same values both ways, CUDA-graph replayed:

- ``bf16``: bfloat16 activations (what a bf16 model sends now);
- ``fp16``: the same activations as float16, which runs the float16 kernels (the MMAs of before;
  they then read float16 activations directly, so this is if anything faster than the old path,
  which converted bfloat16 activations in the loop).

Per row it checks the bfloat16 output against a float32 reference, and at ``--large`` (hidden
states times 256) whether each side stays finite. Paths: the default dispatch
(``ops.fused_moe_prepared``, the tuned table's configs) and, up to 128 tokens, the opt-in W4A16
tile path (``w4a16.fused_moe_w4a16``, its default config).

Usage (GPU; CPU runs only ``--smoke`` under ``TRITON_INTERPRET=1``)::

    python benchmarks/bench_nvfp4_compute.py --shapes qwen3-30b-a3b deepseek-v3 \
        --tokens 1 16 128 1024 4096 --repeats 3 --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "plugins" / "triton"))

import bench_triton_moe as B  # noqa: E402


def _rel(a, b):
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _time(timer, fn, cuda, repeats):
    """Median over ``repeats`` of the timer's median per call (graph replay on CUDA)."""
    if cuda:
        (g, _), = timer.graphs([fn])
        call = g.replay
    else:
        call = fn
    return statistics.median(timer.run([call]) for _ in range(repeats))


def run(args) -> list[dict]:
    from moe_runtime_triton import ops
    from moe_runtime_triton import w4a16 as W

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    timer = B.Timer(dev)
    rows = []
    for name in args.shapes:
        spec = {**B.SHAPES, **B.SMOKE_SHAPES}[name]
        E = spec.get("local", spec["E"])
        t0 = time.perf_counter()
        lw = B.LayerWeights(E, spec["H"], spec["I"], dev,
                            torch.bfloat16 if cuda else torch.float32)
        w = lw.nvfp4()
        pw = ops.prepare_weights(w)
        B.log(f"{name}: weights in {time.perf_counter() - t0:.1f} s")
        for N in args.tokens:
            gen = torch.Generator(device=dev).manual_seed(N)
            ids, wts, _ = B.route_batch(spec, N, dev, gen)
            ids = ids.to(torch.int32)
            if E != spec["E"]:
                ids = torch.where(ids < E, ids, -1)
            base = torch.randn(N, spec["H"], device=dev, generator=gen)
            paths = {"default": lambda x: ops.fused_moe_prepared(x, ids, wts, pw,
                                                                  out_dtype=torch.bfloat16
                                                                  if cuda else torch.float32)}
            if N <= 128:
                ww = W.prepare_w4a16(w)
                paths["w4a16"] = lambda x, ww=ww: W.fused_moe_w4a16(
                    x, ids, wts, ww, out_dtype=torch.bfloat16 if cuda else torch.float32)
            ref = B.reference_fp32(lw, "nvfp4_w4a16", base.bfloat16().float(), ids, wts)
            big = base * 256.0
            big_ref = B.reference_fp32(lw, "nvfp4_w4a16", big.bfloat16().float(), ids, wts)
            for pname, fn in paths.items():
                row = {"shape": name, "tokens": N, "path": pname}
                for dname, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
                    if not cuda and dt == torch.bfloat16:
                        continue  # the interpreter computes no bfloat16
                    x = base.bfloat16().to(dt)
                    xb = big.bfloat16().to(dt)
                    row[f"{dname}_err"] = _rel(fn(x), ref)
                    row[f"{dname}_large_err"] = _rel(fn(xb), big_ref)
                    row[f"{dname}_us"] = _time(timer, lambda x=x: fn(x), cuda, args.repeats) * 1e6
                if "bf16_us" in row and "fp16_us" in row:
                    row["bf16_over_fp16"] = row["bf16_us"] / row["fp16_us"]
                B.log(json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                                  for k, v in row.items()}))
                rows.append(row)
        del lw, w, pw
        if cuda:
            torch.cuda.empty_cache()
    return rows


def table(rows) -> str:
    def f(v, spec):
        return "-" if v is None else (("inf" if v == float("inf") else format(v, spec)))
    out = ["| shape | tokens | path | bf16 µs | fp16 µs | bf16 / fp16 | bf16 err | "
           "large: bf16 err | large: fp16 err |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['shape']} | {r['tokens']} | {r['path']} | {f(r.get('bf16_us'), '.1f')} | "
                   f"{f(r.get('fp16_us'), '.1f')} | {f(r.get('bf16_over_fp16'), '.3f')} | "
                   f"{f(r.get('bf16_err'), '.2e')} | {f(r.get('bf16_large_err'), '.2e')} | "
                   f"{f(r.get('fp16_large_err'), '.2e')} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--shapes", nargs="*", default=["qwen3-30b-a3b", "deepseek-v3"],
                    help=f"benchmark shapes ({', '.join(B.SHAPES)})")
    ap.add_argument("--tokens", nargs="*", type=int, default=[1, 16, 128, 1024, 4096])
    ap.add_argument("--repeats", type=int, default=3, help="timings per row (median of medians)")
    ap.add_argument("--smoke", action="store_true", help="the tiny shape at 1 and 4 tokens (CPU)")
    ap.add_argument("--out", type=Path, default=Path("bench_out/nvfp4_compute"))
    args = ap.parse_args(argv)
    unknown = [s for s in args.shapes if s not in B.SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}; known: {', '.join(B.SHAPES)}")
    if args.smoke:
        args.shapes, args.tokens, args.repeats = ["tiny"], [1, 4], 1
    rows = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    (args.out / "nvfp4_compute.json").write_text(json.dumps({"device": dev, "rows": rows},
                                                            indent=1))
    md = f"device: {dev}\n\n{table(rows)}\n"
    (args.out / "nvfp4_compute.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
