"""Compile the Triton plugin's GEMM kernels for a GPU target without a GPU and count instructions.

Profiling aid for issue 8 ("where a target is missed, say what bounds it"): Triton compiles for
any NVIDIA target with the ``ptxas`` it bundles, so the instruction mix of a kernel's main loop can
be read on a CPU-only machine. The report lists, per kernel and config, the SASS instructions of
the innermost loop by opcode, the instructions per weight element of that loop, and whether the
TTGIR moves data through shared memory for layout conversions (``convert_layout`` /
``local_alloc`` of computed values).

:func:`analyse` adds what bounds a weight-streaming GEMM: the MMA kind (wgmma or mma.sync), values
written to shared memory and read back inside the loop, the software pipeline's depth, registers
and spills, CTAs per SM and weight bytes in flight per SM (``bench_w4a16.py --sass`` runs it over
every variant and row). The GPU image's Triton (3.6) can be used here without installing it over
the local one: ``pip install --no-deps --target DIR triton==3.6.0`` and ``PYTHONPATH=DIR``; its
counts matched the H200 run's (4.12 / 3.39 / 5.66 SASS per weight, 55 / 154 registers).

Usage (any machine; the Triton version decides the code, so use the GPU image's Triton to match)::

    python benchmarks/sass_inspect.py --kernel gemm2 --wfmt 2 --block-m 16 --block-n 128 \
        --block-k 128 --warps 4 --stages 3 [--arch 90] [--dump DIR]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "triton"))
from moe_runtime_triton import kernels as K  # noqa: E402

_COMMON_PTRS = {"sorted_ptr": "*i32", "bexp_ptr": "*i32"}


def _signature(kernel: str, wfmt: int, args_x_fp16: bool = False,
               nvfp4_compute: str = "bfloat16") -> tuple[object, dict, dict]:
    w = "*u8" if wfmt == K.WFMT_NVFP4 else ("*fp8e4nv" if wfmt == K.WFMT_FP8 else "*bf16")
    ws = "*u8" if wfmt == K.WFMT_NVFP4 else "*fp32"
    act = ("*fp16" if args_x_fp16 and wfmt == K.WFMT_NVFP4 else "*bf16") if wfmt != K.WFMT_FP8 else "*fp8e4nv"
    nv = "*fp16" if nvfp4_compute == "float16" else "*bf16"
    inter = nv if wfmt == K.WFMT_NVFP4 else ("*fp8e4nv" if wfmt == K.WFMT_FP8 else "*bf16")
    if kernel == "gemm1":
        fn = K.moe_gemm1_kernel
        sig = {"x_ptr": act, "w_ptr": w, "ws_ptr": ws, "ws2_ptr": "*fp32", "a_scale_ptr": "*fp32",
               "a2_scale_ptr": "*fp32", "inter_ptr": inter, **_COMMON_PTRS}
        ints = ["P", "E", "H", "I", "num_m_blocks", "topk", "stride_xm", "stride_we", "stride_wn",
                "stride_wse", "stride_wsn", "stride_im"]
    elif kernel == "decode1":
        fn = K.moe_decode_gemm1_kernel
        sig = {"x_ptr": act, "ids_ptr": "*i32", "w_ptr": w, "ws_ptr": ws, "ws2_ptr": "*fp32",
               "a_scale_ptr": "*fp32", "a2_scale_ptr": "*fp32", "inter_ptr": "*fp32"}
        ints = ["P", "E", "H", "I", "topk", "stride_xm", "stride_we", "stride_wn", "stride_wse",
                "stride_wsn", "stride_im"]
    elif kernel == "decode2":
        fn = K.moe_decode_gemm2_kernel
        sig = {"inter_ptr": "*fp32", "ids_ptr": "*i32", "topk_w_ptr": "*fp32", "w_ptr": w,
               "ws_ptr": ws, "ws2_ptr": "*fp32", "a2_scale_ptr": "*fp32", "out_ptr": "*bf16"}
        ints = ["E", "H", "I", "stride_im", "stride_we", "stride_wn", "stride_wse", "stride_wsn",
                "stride_om"]
    else:
        fn = K.moe_gemm2_kernel
        sig = {"inter_ptr": inter, "w_ptr": w, "ws_ptr": ws, "ws2_ptr": "*fp32", "a2_scale_ptr": "*fp32",
               "topk_w_ptr": "*fp32", "y_ptr": "*bf16", **_COMMON_PTRS}
        ints = ["P", "E", "H", "I", "num_m_blocks", "stride_im", "stride_we", "stride_wn",
                "stride_wse", "stride_wsn", "stride_ym"]
    for name in ints:
        sig[name] = "i32"
    return fn, sig, {}


def compile_kernel(args) -> object:
    fn, sig, _ = _signature(args.kernel, args.wfmt, args.x_fp16, args.nvfp4_compute)
    ctype = {K.WFMT_NVFP4: getattr(triton.language, args.nvfp4_compute),
             K.WFMT_FP8: triton.language.float8e4nv}.get(args.wfmt, triton.language.bfloat16)
    if args.kernel.startswith("decode"):
        consts = {"WFMT": args.wfmt, "EVEN_K": True, "BLOCK_N": args.block_n, "BLOCK_K": args.block_k,
                  "USE_ASM": args.asm}
        consts.update({"A_QUANT": 2 if args.wfmt == K.WFMT_FP8 else 0, "ACT": 0, "EXACT": False}
                      if args.kernel == "decode1" else {"TOPK": 8})
    else:
        consts = {"WFMT": args.wfmt, "EVEN_K": True, "BLOCK_M": args.block_m, "BLOCK_N": args.block_n,
                  "BLOCK_K": args.block_k, "GROUP_M": 1, "compute_dtype": ctype}
    if args.kernel == "gemm1":
        consts.update({"A_QUANT": 2 if args.wfmt == K.WFMT_FP8 else 0,
                       "OUT_FP8": args.wfmt == K.WFMT_FP8, "ACT": 0, "EXACT": False})
    if not args.kernel.startswith("decode"):
        consts["USE_ASM"] = args.asm
    for name in fn.arg_names:
        if name not in sig:
            sig[name] = "constexpr"
    # what the JIT would specialize at a launch: pointers and strides divisible by 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if sig[name].startswith("*") or name.startswith("stride") or name in ("H", "I")}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    target = GPUTarget("cuda", args.arch, 32)
    return triton.compile(src, target=target,
                          options={"num_warps": args.warps, "num_stages": args.stages})


# Triton's disassembly: "LBB2:" labels, "ctrl\t[@P0 ]OPCODE ...;" instructions (nvdisasm's
# ".L_x_2:" / "/*0040*/ OPCODE" form is accepted too)
_LABEL = re.compile(r"^\s*\.?(L\w+):\s*$")
_BRA = re.compile(r"BRA\s+(?:`\()?\.?(L\w+)")
_INSTR = re.compile(r"^(?:[-\w:]+\t|\s*/\*[0-9a-f]{4,}\*/\s+)(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def innermost_loop(sass: str) -> list[str]:
    """Opcodes of the backward branch's body with the smallest span (the hot loop)."""
    lines = sass.splitlines()
    labels, instrs = {}, []
    for line in lines:
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = _INSTR.search(line)
        if m:
            instrs.append((m.group(1), line))
    best = None
    for idx, (op, line) in enumerate(instrs):
        if op.startswith("BRA"):
            b = _BRA.search(line)
            if b and b.group(1) in labels and labels[b.group(1)] <= idx:
                span = (labels[b.group(1)], idx + 1)
                # the main loop: the largest backward loop (inner tiny loops are fills)
                if best is None or span[1] - span[0] > best[1] - best[0]:
                    best = span
    if best is None:
        return [op for op, _ in instrs]
    return [op for op, _ in instrs[best[0]:best[1]]]



# ----------------------------------------------------------------------------------------------
# What bounds a compiled kernel: MMA kind, shared-memory round trips, pipelining, occupancy
# ----------------------------------------------------------------------------------------------

# sm_90 (H100 / H200) per-SM limits
SM90 = {"regs": 65536, "smem": 233472, "smem_per_block_reserved": 1024, "warps": 64, "blocks": 32,
        "reg_granularity_per_warp": 256, "sms": 132}

_MEMDESC = re.compile(r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<([0-9x]+)x(\w+),")
_TYPE_BYTES = {"i8": 1, "f8E4M3FN": 1, "f8E5M2": 1, "bf16": 2, "f16": 2, "i16": 2, "f32": 4,
               "i32": 4, "i64": 8}


def _resources(cubin: bytes) -> dict:
    """``{"regs", "local"}`` of the kernel from ``cuobjdump -res-usage`` (Triton's bundled one);
    LOCAL > 0 means register spills."""
    import os
    import subprocess
    import tempfile

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
        fh.write(cubin)
    try:
        out = subprocess.run([str(tool), "-res-usage", fh.name], capture_output=True, text=True,
                             check=False).stdout
    finally:
        os.unlink(fh.name)
    m = re.search(r"REG:(\d+).*?LOCAL:(\d+)", out)
    return {"regs": int(m.group(1)), "local": int(m.group(2))} if m else {}


def occupancy(regs: int, shared: int, warps: int, lim: dict = SM90) -> tuple[int, str]:
    """Resident CTAs per SM and what limits them (registers, shared memory or warps)."""
    per_warp = -(-regs * 32 // lim["reg_granularity_per_warp"]) * lim["reg_granularity_per_warp"]
    by = {"registers": lim["regs"] // max(1, per_warp * warps),
          "shared memory": lim["smem"] // max(1, shared + lim["smem_per_block_reserved"]),
          "warps": lim["warps"] // warps, "blocks": lim["blocks"]}
    n = min(by.values())
    return n, min(by, key=by.get)


def analyse(k, warps: int, weights_per_iter: int, weight_bytes_per_iter: float) -> dict:
    """Facts about a compiled kernel that bound a weight-streaming GEMM (sm_90):

    - ``mma``: ``wgmma`` (``warp_group_dot``, Hopper's MMA) or ``mma.sync`` (``tt.dot`` with an
      ``nvidia_mma`` version-2 layout);
    - ``loop_round_trips``: ``local_alloc`` of computed tensors inside the main loop (a value
      written to shared memory and read back: a layout conversion or a wgmma operand), with the
      bytes per iteration they move;
    - ``buffers`` / ``async_wait``: the software pipeliner's ring depth (leading dimension of
      the multi-buffered allocations) and how many copy groups it leaves in flight when it waits;
      ``stage_bytes``: bytes one stage copies (``cp.async`` / TMA); ``weight_bytes_in_flight``:
      weight bytes in flight per SM while computing = (buffers - 1) x weight bytes of a stage x
      CTAs per SM;
    - ``regs``, ``spill_bytes`` (ptxas' local memory), ``shared``, ``ctas_per_sm`` and its
      limiter, ``warps_per_sm``;
    - ``sass_per_weight``: hot-loop SASS thread-instructions per weight; ``loop_ops``: its
      opcode histogram."""
    ttgir = k.asm["ttgir"]
    sass = k.asm.get("sass") or ""
    if not sass:
        from triton.tools.disasm import get_sass
        sass = get_sass(k.asm["cubin"])
    loop = innermost_loop(sass)
    res = _resources(k.asm["cubin"])
    shared = k.metadata.shared
    out = {"mma": "wgmma" if "ttng.warp_group_dot " in ttgir or "warp_group_dot %" in ttgir
           else ("mma.sync" if re.search(r"versionMajor = 2", ttgir) else "none"),
           "shared": shared, **res}
    # the main loop's body in the TTGIR: the outermost scf.for that holds a dot
    body = ""
    for m in re.finditer(r"scf\.for ", ttgir):
        start = m.start()
        depth, i = 0, ttgir.index("{", start)
        j = i
        while j < len(ttgir):
            if ttgir[j] == "{":
                depth += 1
            elif ttgir[j] == "}":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        seg = ttgir[start:j]
        if ("tt.dot " in seg or "warp_group_dot" in seg) and len(seg) > len(body):
            body = seg
    trips = re.findall(r"ttg\.local_alloc %\S+ : \(tensor<([0-9x]+)x(\w+),", body)
    out["loop_round_trips"] = len(trips)
    out["loop_round_trip_bytes"] = sum(
        _prod(s) * _TYPE_BYTES.get(t, 2) for s, t in trips)
    bufs = [(_prod(s.split("x")[1:]) * _TYPE_BYTES.get(t, 1), int(s.split("x")[0]))
            for s, t in _MEMDESC.findall(ttgir) if s.count("x") >= 2]
    out["buffers"] = max((n for _, n in bufs), default=0)
    out["stage_bytes"] = sum(b for b, _ in bufs)
    waits = [int(n) for n in re.findall(r"ttg\.async_wait .*?\{num = (\d+)", body)]
    out["async_wait"] = waits
    out["tma"] = "async_tma_copy" in ttgir or "tma_load" in ttgir
    ctas, lim = occupancy(res.get("regs", 0), shared, warps) if res else (None, None)
    out["ctas_per_sm"], out["ctas_limited_by"] = ctas, lim
    out["warps_per_sm"] = ctas * warps if ctas else None
    out["weight_bytes_in_flight"] = (int(max(0, out["buffers"] - 1) * weight_bytes_per_iter * ctas)
                                     if ctas else None)
    out["sass_per_weight"] = round(len(loop) * 32 * warps / weights_per_iter, 2)
    out["loop_ops"] = dict(collections.Counter(op.split(".")[0] for op in loop).most_common(12))
    return out


def _prod(dims) -> int:
    n = 1
    for d in (dims.split("x") if isinstance(dims, str) else dims):
        n *= int(d)
    return n


def compile_jit(fn, sig: dict, consts: dict, warps: int = 4, stages: int = 3, arch: int = 90,
                divisible: tuple = ("H", "I")):
    """Compile a ``@triton.jit`` function for ``sm_<arch>`` without a GPU: ``sig`` gives the
    runtime arguments' types, the others are ``consts``; pointers, ``stride*`` and the names in
    ``divisible`` are specialised as multiples of 16 (as the JIT does at a launch)."""
    sig = dict(sig)
    for name in fn.arg_names:
        sig.setdefault(name, "constexpr")
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if sig[name].startswith("*") or name.startswith("stride") or name in divisible}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": warps, "num_stages": stages})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", choices=["gemm1", "gemm2", "decode1", "decode2"], default="gemm2")
    ap.add_argument("--wfmt", type=int, default=K.WFMT_NVFP4, help="0 = 16-bit, 1 = fp8, 2 = nvfp4")
    ap.add_argument("--block-m", type=int, default=16)
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--block-k", type=int, default=128)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--x-fp16", action="store_true", help="GEMM 1 activations in float16")
    ap.add_argument("--nvfp4-compute", choices=["bfloat16", "float16"], default="bfloat16",
                    help="the MMA dtype of NVFP4 weights: bfloat16 (what bf16 activations run, "
                         "ops.nvfp4_compute_dtype) or float16 (float16 / float32 activations)")
    ap.add_argument("--asm", action="store_true", help="NVFP4 decode by inline PTX (as on GPUs)")
    ap.add_argument("--dump", type=Path, help="write ttgir/ptx/sass here")
    args = ap.parse_args(argv)
    k = compile_kernel(args)
    sass = k.asm.get("sass") or ""
    if not sass:
        from triton.tools.disasm import get_sass
        sass = get_sass(k.asm["cubin"])
    ttgir = k.asm["ttgir"]
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            (args.dump / f"{args.kernel}.{ext}").write_text(k.asm[ext])
        (args.dump / f"{args.kernel}.sass").write_text(sass)
    loop = innermost_loop(sass)
    hist = collections.Counter(op.split(".")[0] for op in loop)
    # GEMM 1 reads gate and up rows; the decode GEMM 2 reads the rows of all 8 experts at once
    per_iter_weights = args.block_n * args.block_k * {"gemm1": 2, "decode1": 2, "decode2": 8}.get(
        args.kernel, 1)
    print(f"{args.kernel} wfmt={args.wfmt} M{args.block_m} N{args.block_n} K{args.block_k} "
          f"w{args.warps} s{args.stages} sm_{args.arch}: shared {k.metadata.shared} B")
    threads = 32 * args.warps
    print(f"  main loop: {len(loop)} SASS instructions per thread per iteration, "
          f"{len(loop) * threads / per_iter_weights:.2f} thread-instructions per weight")
    print("  " + ", ".join(f"{op} {n}" for op, n in hist.most_common()))
    conv = len(re.findall(r"ttg\.convert_layout", ttgir))
    allocs = len(re.findall(r"ttg\.local_alloc", ttgir))
    print(f"  ttgir: {conv} convert_layout, {allocs} local_alloc, "
          f"wgmma {'yes' if 'warp_group_dot' in ttgir else 'no'}")
    facts = analyse(k, args.warps, per_iter_weights, per_iter_weights * 0.5625)
    facts.pop("loop_ops")
    print("  " + ", ".join(f"{n}={v}" for n, v in facts.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
