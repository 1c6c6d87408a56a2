#!/usr/bin/env python3
"""Benchmark of moe-runtime's Triton experts backend (issue 8): one script, one device run.

What is timed: the experts part of an MoE layer for a local (EP = 1, or one EP shard) layer, from
``hidden [N, H]`` and the router's ``topk_ids``/``topk_weights`` to the combined ``out [N, H]``:
dispatch routing (counts, sorted order), both grouped GEMMs, activation, weighting and the combine.
The router (softmax top-k, or DeepSeek-V3's sigmoid grouped top-k with bias) is the same torch code
for every implementation; it runs once per input outside the timed region and its own time is
reported in a separate column.

Implementations, all on the same weights and inputs:
  triton      this repository's plugin (moe_runtime_triton), configs from its tuned table, or tuned
              here (--tune) and written to $OUT/configs.json
  tf_grouped  transformers' experts implementation "grouped_mm" (bf16 weights)
  tf_batched  transformers' "batched_mm" (bf16; skipped where it would materialise > 24 GB)
  mk_triton   PyPI moe-kernels' Triton fused_moe (vLLM lineage), best of a grid of tile configs;
              its compiled helper ops (moe_align_block_size, silu_and_mul, moe_sum, static fp8
              quant) are replaced by torch equivalents, timed apart (column mk_helpers)
  reference   plain torch: per-expert loop over the experts the batch touches (bf16 matmuls)
  humming     PyPI humming-kernels (NVFP4 W4A16, JIT): benchmarks/humming_peer.py, our routing,
              its indexed grouped GEMMs and activation, a bmm combine (optional: skipped with
              the reason where it does not import)

Every row's output is checked against a float32 reference (weights dequantized exactly, W8A8
activation quantization emulated) before it is timed. Medians of CUDA-event times; inputs rotate
among several routed batches so repeated runs do not measure L2; small token counts are also timed
as CUDA-graph replays. Rooflines: bytes of the experts the routing touched / measured HBM read
bandwidth (a large read-only reduction), and FLOPs / measured matmul rate (bf16, fp8).

Usage: python benchmarks/bench_triton_moe.py [--quick] [--tune] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT / "plugins" / "triton", ROOT):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402
import torch.nn.functional as TF  # noqa: E402

# --------------------------------------------------------------------------------------------
# Problem definitions
# --------------------------------------------------------------------------------------------

SHAPES = {
    "qwen3-30b-a3b": dict(H=2048, I=768, E=128, K=8, scoring="softmax"),
    "qwen3.5-397b-a17b": dict(H=4096, I=1024, E=512, K=10, scoring="softmax"),
    "deepseek-v3": dict(H=7168, I=2048, E=256, K=8, scoring="sigmoid", n_group=8, topk_group=4),
    "deepseek-v3-ep32": dict(H=7168, I=2048, E=256, K=8, scoring="sigmoid", n_group=8,
                             topk_group=4, local=32),
}
TOKENS = [1, 16, 128, 1024, 4096, 16384]
FORMATS = ["bf16", "fp8_w8a8", "nvfp4_w4a16"]
GRAPH_MAX_TOKENS = 1024
PROFILE_ROWS = {("qwen3-30b-a3b", 1), ("qwen3.5-397b-a17b", 16), ("qwen3.5-397b-a17b", 128),
                ("qwen3-30b-a3b", 4096),
                ("deepseek-v3", 4096), ("tiny", 1)}
ROTATE = 3  # input sets per row
STAGE_REPEAT = 20  # launches of one stage per graph in the stage profile
# a stage that takes less than this eagerly is timed again from a graph even in a large batch:
# its eager time is mostly the host's launching (the routing's 75-134 us at 4096 tokens were
# 13-17 us of kernels, RESULTS "Routing at 32K pairs")
STAGE_GRAPH_BELOW_S = 400e-6
TOL = {"bf16": 1.5e-2, "fp8_w8a8": 4e-2, "nvfp4_w4a16": 1.5e-2}

SMOKE_SHAPES = {
    "tiny": dict(H=64, I=32, E=8, K=2, scoring="softmax"),
    "tiny-ep": dict(H=64, I=32, E=16, K=4, scoring="sigmoid", n_group=4, topk_group=2, local=8),
}


def log(*a):
    print(*a, flush=True)


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


class Timer:
    def __init__(self, device):
        self.cuda = device == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def run(self, fns, target_s=0.15, min_reps=5, max_reps=200):
        """Median seconds of ``fns[i % len]()`` calls (each timed alone, inputs rotating)."""
        for f in fns:
            f()
        self.sync()
        t0 = time.perf_counter()
        for f in fns:
            f()
        self.sync()
        est = max((time.perf_counter() - t0) / len(fns), 1e-6)
        reps = int(min(max_reps, max(min_reps, target_s / est)))
        times = []
        if self.cuda:
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
            for i in range(reps):
                starts[i].record()
                fns[i % len(fns)]()
                ends[i].record()
            torch.cuda.synchronize()
            times = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]
        else:
            for i in range(reps):
                t = time.perf_counter()
                fns[i % len(fns)]()
                times.append(time.perf_counter() - t)
        return statistics.median(times)

    def graphs(self, fns):
        """Capture one CUDA graph per callable; returns replay callables and the outputs."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for f in fns:
                f()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        out = []
        for f in fns:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                res = f()
            out.append((g, res))
        torch.cuda.synchronize()
        return out


# --------------------------------------------------------------------------------------------
# Ceilings
# --------------------------------------------------------------------------------------------


def measure_ceilings(timer, device):
    import triton
    import triton.language as tl

    @triton.jit
    def read_sum_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        base = pid * BLOCK * ITERS
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in tl.static_range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0,
                           eviction_policy="evict_first").to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))

    res = {}
    if device != "cuda":
        return {"read_GBps": 1.0, "copy_GBps": 1.0, "bf16_TFLOPs": 1.0, "fp8_TFLOPs": 2.0,
                "read_detail": {}}
    n = (4 << 30) // 2  # 4 GiB of bf16
    x = torch.randn(n // 1024, 1024, device=device, dtype=torch.bfloat16).reshape(-1)
    best, detail = 0.0, {}
    for block, iters, warps in [(4096, 4, 8), (8192, 4, 8), (2048, 8, 4), (4096, 8, 8),
                                (16384, 2, 16), (1024, 16, 4)]:
        grid = triton.cdiv(n, block * iters)
        out = torch.empty(grid, device=device, dtype=torch.float32)
        fn = lambda: read_sum_kernel[(grid,)](x, out, n, BLOCK=block, ITERS=iters,
                                              num_warps=warps)
        t = timer.run([fn], target_s=0.3)
        ref = x.float().sum().item() if block == 4096 and iters == 4 else None
        if ref is not None:
            assert abs(out.sum().item() - ref) <= 1e-3 * abs(ref) + 1e3, "read kernel sum is wrong"
        gbps = n * 2 / t / 1e9
        detail[f"triton_sum_B{block}_I{iters}_w{warps}"] = round(gbps, 1)
        best = max(best, gbps)
    t = timer.run([lambda: x.sum(dtype=torch.float32)], target_s=0.3)
    detail["torch_sum"] = round(n * 2 / t / 1e9, 1)
    best = max(best, n * 2 / t / 1e9)
    y = torch.empty_like(x)
    t = timer.run([lambda: y.copy_(x)], target_s=0.3)
    res["copy_GBps"] = round(2 * n * 2 / t / 1e9, 1)
    del x, y
    res["read_GBps"] = round(best, 1)
    res["read_detail"] = detail
    m = 8192
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    t = timer.run([lambda: torch.mm(a, b)], target_s=0.3)
    res["bf16_TFLOPs"] = round(2 * m ** 3 / t / 1e12, 1)
    try:
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()
        one = torch.tensor(1.0, device=device)
        t = timer.run([lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)],
                      target_s=0.3)
        res["fp8_TFLOPs"] = round(2 * m ** 3 / t / 1e12, 1)
    except Exception as exc:  # pragma: no cover - depends on the torch build
        res["fp8_TFLOPs"] = 2 * res["bf16_TFLOPs"]
        res["fp8_note"] = f"torch._scaled_mm failed ({exc}); fp8 rate taken as 2x bf16"
    return res


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------

E2M1_BOUNDS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
E2M1 = [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]


def nvfp4_quantize(w, scale_2):
    """``w [R, K]`` float32 -> packed uint8 [R, K/2], e4m3 [R, K/16]."""
    r, k = w.shape
    blocks = w.reshape(r, k // 16, 16)
    bs = (blocks.abs().amax(-1) / 6.0 / scale_2).clamp(2 ** -9, 448).to(torch.float8_e4m3fn)
    vals = blocks / (bs.float() * scale_2)[..., None]
    bounds = torch.tensor(E2M1_BOUNDS, device=w.device)
    idx = torch.bucketize(vals.abs(), bounds)
    codes = (idx + 8 * (vals < 0).long()).to(torch.uint8).reshape(r, k)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous(), bs


def nvfp4_dequant(packed, bs, scale_2):
    r, kh = packed.shape
    table = torch.tensor(E2M1, device=packed.device)
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(r, kh * 2).long()
    return table[codes] * bs.float().repeat_interleave(16, -1) * scale_2


class LayerWeights:
    """bf16 master weights of the local experts and their fp8 / nvfp4 versions."""

    def __init__(self, E, H, I, device, dtype, seed=0):
        from moe_runtime.backend_api import ExpertWeights

        g = torch.Generator(device=device).manual_seed(seed)
        self.E, self.H, self.I = E, H, I
        self.w13 = torch.empty(E, 2 * I, H, device=device, dtype=dtype)
        self.w2 = torch.empty(E, H, I, device=device, dtype=dtype)
        for e in range(E):
            self.w13[e] = (torch.randn(2 * I, H, device=device, generator=g) / H ** 0.5).to(dtype)
            self.w2[e] = (torch.randn(H, I, device=device, generator=g) / I ** 0.5).to(dtype)
        self.bf16 = ExpertWeights("bf16" if dtype == torch.bfloat16 else "fp16", "silu",
                                  self.w13, self.w2)
        self._fp8 = self._nv = None
        self.device = device

    def fp8(self, a13, a2):
        from moe_runtime.backend_api import ExpertWeights

        if self._fp8 is None:
            E, H, I = self.E, self.H, self.I
            q13 = torch.empty(E, 2 * I, H, device=self.device, dtype=torch.float8_e4m3fn)
            q2 = torch.empty(E, H, I, device=self.device, dtype=torch.float8_e4m3fn)
            s13 = torch.empty(E, device=self.device)
            s2 = torch.empty(E, device=self.device)
            for e in range(E):
                s13[e] = self.w13[e].abs().amax().float() / 448
                s2[e] = self.w2[e].abs().amax().float() / 448
                q13[e] = (self.w13[e].float() / s13[e]).to(torch.float8_e4m3fn)
                q2[e] = (self.w2[e].float() / s2[e]).to(torch.float8_e4m3fn)
            # one scale per expert and matrix (gate and up share it) so that the peer, which takes
            # per-expert scales, runs exactly the same weights
            self._fp8 = ExpertWeights("fp8_w8a8", "silu", q13, q2,
                                      w13_scale=s13[:, None].expand(E, 2 * I).contiguous(),
                                      w2_scale=s2[:, None].expand(E, H).contiguous(),
                                      a13_scale=torch.tensor(a13, device=self.device),
                                      a2_scale=torch.tensor(a2, device=self.device))
            self.fp8_expert_scales = (s13, s2)
        return self._fp8

    def nvfp4(self):
        from moe_runtime.backend_api import ExpertWeights

        if self._nv is None:
            E, H, I = self.E, self.H, self.I
            p13 = torch.empty(E, 2 * I, H // 2, device=self.device, dtype=torch.uint8)
            p2 = torch.empty(E, H, I // 2, device=self.device, dtype=torch.uint8)
            b13 = torch.empty(E, 2 * I, H // 16, device=self.device, dtype=torch.float8_e4m3fn)
            b2 = torch.empty(E, H, I // 16, device=self.device, dtype=torch.float8_e4m3fn)
            t13 = torch.empty(E, device=self.device)
            t2 = torch.empty(E, device=self.device)
            for e in range(E):
                w = self.w13[e].float()
                t13[e] = w.abs().amax() / (448 * 6)
                p13[e], b13[e] = nvfp4_quantize(w, t13[e])
                w = self.w2[e].float()
                t2[e] = w.abs().amax() / (448 * 6)
                p2[e], b2[e] = nvfp4_quantize(w, t2[e])
            self._nv = ExpertWeights("nvfp4_w4a16", "silu", p13, p2, w13_scale=b13, w2_scale=b2,
                                     w13_scale_2=t13, w2_scale_2=t2)
        return self._nv

    def expert_fp32(self, fmt, e):
        if fmt in ("bf16", "fp16"):
            return self.w13[e].float(), self.w2[e].float()
        if fmt == "fp8_w8a8":
            w = self._fp8
            return (w.w13[e].float() * w.w13_scale[e][:, None], w.w2[e].float() * w.w2_scale[e][:, None])
        w = self._nv
        return (nvfp4_dequant(w.w13[e], w.w13_scale[e], w.w13_scale_2[e]),
                nvfp4_dequant(w.w2[e], w.w2_scale[e], w.w2_scale_2[e]))

    def bytes_per_expert(self, fmt):
        n = 3 * self.H * self.I
        return {"bf16": 2 * n, "fp8_w8a8": n + 4 * (3 * self.I + self.H),
                "nvfp4_w4a16": n // 2 + n // 16 + 8}[fmt]


def fake_fp8(x, s):
    return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s


def reference_fp32(lw, fmt, x, ids, wts, scales=None):
    """float32 reference: per touched expert, dequantized weights, W8A8 emulated."""
    N, H = x.shape
    I = lw.I
    out = torch.zeros(N, H, device=x.device, dtype=torch.float32)
    xf = x.float()
    if scales is not None:
        xf = fake_fp8(xf, scales[0])
    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < lw.E)
    for e in torch.unique(flat[valid]).tolist():
        sel = (flat == e).nonzero().squeeze(1)
        tok = sel // ids.shape[1]
        w13, w2 = lw.expert_fp32(fmt, e)
        gu = xf[tok] @ w13.t()
        h = TF.silu(gu[:, :I]) * gu[:, I:]
        if scales is not None:
            h = fake_fp8(h, scales[1])
        y = (h @ w2.t()) * wts.reshape(-1)[sel].float()[:, None]
        out.index_add_(0, tok, y)
    return out


def rel_err(a, b):
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


# --------------------------------------------------------------------------------------------
# Peers
# --------------------------------------------------------------------------------------------


def make_tf_experts(lw, impl):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=lw.H, moe_intermediate_size=lw.I, num_experts=lw.E,
                         hidden_act="silu", num_experts_per_tok=2)
    cfg._experts_implementation = impl
    with torch.device("meta"):
        m = Qwen3MoeExperts(cfg)
    m.gate_up_proj = torch.nn.Parameter(lw.w13, requires_grad=False)
    m.down_proj = torch.nn.Parameter(lw.w2, requires_grad=False)
    m.config = cfg
    m.eval()
    E = lw.E

    def run(x, ids, wts):
        # transformers marks experts of other ranks with ids >= num_experts and weight 0
        ids_tf = torch.where(ids < 0, torch.full_like(ids, E), ids).long()
        w_tf = torch.where(ids < 0, torch.zeros_like(wts), wts).to(x.dtype)
        return m(x, ids_tf, w_tf)

    return run


class MoEKernelsPeer:
    """PyPI moe-kernels' Triton fused_moe, compiled helper ops replaced by torch equivalents."""

    def __init__(self, path):
        sys.path.insert(0, str(path))
        stub = types.ModuleType("moe_kernels._moe_kernels")
        sys.modules["moe_kernels._moe_kernels"] = stub
        try:
            import pynvml  # noqa: F401  (nvidia-ml-py; only used for config file names)
        except ImportError:
            sys.modules["pynvml"] = types.ModuleType("pynvml")
        import importlib

        importlib.import_module("moe_kernels")
        mkf = sys.modules["moe_kernels.fused_moe"]  # the package re-exports a function of that name

        self.mkf = mkf
        self.valid = None  # set per call when topk_ids may hold -1
        peer = self

        def align(topk_ids, num_experts, block_size, sorted_ids, expert_ids, num_post):
            flat = topk_ids.reshape(-1)
            P = flat.numel()
            ok = (flat >= 0) & (flat < num_experts)
            key = torch.where(ok, flat, num_experts).long()
            counts = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
            counts.scatter_add_(0, key, torch.ones_like(key))
            c = counts[:num_experts]
            padded = (c + block_size - 1) // block_size * block_size
            ends = torch.cumsum(padded, 0)
            starts = torch.cat([ends.new_zeros(1), ends[:-1]])
            ustarts = torch.cumsum(counts, 0) - counts
            order = torch.sort(key, stable=True).indices
            skey = key[order]
            rank = torch.arange(P, device=flat.device) - ustarts[skey]
            starts_x = torch.cat([starts, starts.new_full((1,), sorted_ids.numel() - 1)])
            dest = torch.where(skey < num_experts, starts_x[skey] + rank,
                               torch.full_like(rank, sorted_ids.numel() - 1))
            sorted_ids.fill_(P)
            sorted_ids.scatter_(0, dest, torch.where(skey < num_experts, order,
                                                     torch.full_like(order, P)).to(torch.int32))
            blocks = torch.arange(expert_ids.numel(), device=flat.device) * block_size
            expert_ids.copy_(torch.searchsorted(ends, blocks, right=True)
                             .clamp_(max=num_experts - 1).to(torch.int32))
            num_post.copy_(ends[-1:].to(torch.int32))

        def silu_and_mul(out, x):
            d = x.shape[-1] // 2
            torch.mul(TF.silu(x[..., :d]), x[..., d:], out=out)

        def moe_sum(inp, out):
            if peer.valid is not None:
                inp = torch.where(peer.valid[..., None], inp, torch.zeros((), dtype=inp.dtype,
                                                                          device=inp.device))
            torch.sum(inp, dim=1, out=out)

        def static_fp8(inp, scale=None, *a, **k):
            q = (inp.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            return q, scale

        mkf.ops.moe_align_block_size = align
        mkf.ops.silu_and_mul = silu_and_mul
        mkf.ops.moe_sum = moe_sum
        mkf.scaled_fp8_quant = static_fp8
        self.helpers = dict(align=align, silu_and_mul=silu_and_mul, moe_sum=moe_sum,
                            fp8=static_fp8)

    def graphable(self, lw, fmt, cfg, fp8_args, has_invalid):
        def run(x, ids, wts):
            self.valid = (ids >= 0) if has_invalid else None
            return self._call(x, ids, wts, lw, fmt, cfg, fp8_args)

        return run

    def _call(self, x, ids, wts, lw, fmt, cfg, fp8_args):
        mkf = self.mkf
        if fmt == "fp8_w8a8":
            w, (s13, s2) = fp8_args
            return mkf.fused_experts(x, w.w13, w.w2, wts, ids, override_config=dict(cfg),
                                     use_fp8_w8a8=True, w1_scale=s13, w2_scale=s2,
                                     a1_scale=w.a13_scale.reshape(1),
                                     a2_scale=w.a2_scale.reshape(1))
        return mkf.fused_experts(x, lw.w13, lw.w2, wts, ids, override_config=dict(cfg))


def mk_grid(rows_per_expert):
    def c(m, n, k, g, w, s):
        return {"BLOCK_SIZE_M": m, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": k, "GROUP_SIZE_M": g,
                "num_warps": w, "num_stages": s}
    if rows_per_expert <= 4:
        return [c(16, 32, 64, 1, 4, 4), c(16, 64, 128, 1, 4, 4), c(16, 128, 128, 1, 4, 3),
                c(16, 64, 256, 1, 4, 3), c(16, 32, 128, 1, 4, 5), c(16, 128, 64, 1, 4, 4)]
    if rows_per_expert <= 48:
        return [c(16, 64, 128, 1, 4, 4), c(16, 128, 128, 1, 4, 3), c(32, 64, 128, 1, 4, 4),
                c(32, 128, 64, 16, 4, 4), c(64, 64, 64, 1, 4, 4), c(16, 64, 256, 1, 4, 3)]
    return [c(64, 128, 64, 8, 4, 4), c(64, 128, 128, 16, 8, 3), c(128, 128, 64, 16, 8, 3),
            c(64, 256, 64, 16, 8, 3), c(128, 256, 64, 32, 8, 4), c(128, 128, 128, 32, 8, 3)]


def torch_reference_impl(lw):
    """Plain torch (what a naive implementation does): loop over the touched experts."""
    def run(x, ids, wts):
        out = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
        flat = ids.reshape(-1).long()
        valid = (flat >= 0) & (flat < lw.E)
        for e in torch.unique(flat[valid]).tolist():
            sel = (flat == e).nonzero().squeeze(1)
            tok = sel // ids.shape[1]
            gu = x[tok] @ lw.w13[e].t()
            h = TF.silu(gu[:, :lw.I]) * gu[:, lw.I:]
            y = (h @ lw.w2[e].t()).float() * wts.reshape(-1)[sel][:, None]
            out.index_add_(0, tok, y)
        return out.to(x.dtype)
    return run


# --------------------------------------------------------------------------------------------
# Our configs
# --------------------------------------------------------------------------------------------


def our_candidates(fmt_code, rows_per_expert, on_gpu):
    def g(bn, bk, gm, w, s):
        if fmt_code == 1:  # fp8: K twice as deep for the same bytes, bounded by shared memory
            bk = min(2 * bk, 256 if rows_per_expert <= 24 else 128)
        return {"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm, "num_warps": w,
                "num_stages": s if on_gpu else 1}
    if rows_per_expert <= 4:
        bms = [16]
        g1s = [g(32, 128, 1, 4, 4), g(64, 128, 1, 4, 4), g(16, 256, 1, 4, 4), g(32, 256, 1, 4, 3),
               g(32, 64, 1, 4, 6), g(64, 64, 1, 4, 5), g(16, 128, 1, 4, 5)]
        g2s = [g(64, 128, 1, 4, 4), g(32, 128, 1, 4, 4), g(128, 128, 1, 4, 3), g(64, 256, 1, 4, 3),
               g(32, 256, 1, 4, 4), g(64, 64, 1, 4, 6), g(16, 256, 1, 4, 4)]
    elif rows_per_expert <= 24:
        bms = [16, 32]
        g1s = [g(32, 128, 1, 4, 4), g(64, 128, 1, 4, 4), g(64, 64, 4, 4, 4), g(32, 256, 1, 4, 3)]
        g2s = [g(64, 128, 1, 4, 4), g(128, 64, 4, 4, 4), g(128, 128, 1, 4, 3), g(64, 64, 4, 4, 4)]
        if fmt_code == 2:
            # NVFP4 is bound by the decode's instructions: wide tiles share more of the per-tile
            # work (benchmarks/sass_inspect.py: 4.3 against 5.0 instructions per weight)
            g1s += [g(128, 128, 1, 4, 3), g(256, 128, 1, 8, 3)]
            g2s += [g(256, 128, 1, 4, 3), g(256, 128, 1, 8, 3)]
    elif rows_per_expert <= 160:
        bms = [64, 128]
        g1s = [g(64, 64, 8, 4, 4), g(64, 128, 8, 4, 3), g(128, 64, 8, 8, 3), g(64, 64, 8, 8, 4)]
        g2s = [g(128, 64, 8, 4, 4), g(64, 128, 8, 4, 4), g(128, 128, 8, 8, 3), g(256, 64, 8, 8, 3)]
    else:
        bms = [64, 128]
        g1s = [g(64, 64, 8, 8, 3), g(128, 64, 8, 8, 3), g(64, 64, 8, 4, 4), g(64, 128, 8, 8, 3),
               g(128, 64, 32, 8, 4), g(64, 64, 32, 8, 4)]
        g2s = [g(128, 64, 8, 8, 3), g(256, 64, 8, 8, 3), g(128, 128, 8, 8, 3), g(128, 64, 8, 4, 4),
               g(256, 64, 32, 8, 4), g(128, 64, 32, 8, 4)]
    return bms, g1s, g2s


# --------------------------------------------------------------------------------------------
# Parallel warm-up of Triton's compile cache
# --------------------------------------------------------------------------------------------
#
# Each tile config is a separate Triton compilation (about a second or two each, hundreds in a tuned
# run). Worker processes run every (shape, format, tokens, config) once on stand-in weights that
# give the kernels the same specialisation (same hidden/intermediate sizes and strides' divisibility;
# our kernels take the expert count unspecialised, so expert weights are a stride-0 expand; the peer
# gets 16 real experts), which fills the on-disk cache; the measuring process then loads binaries.


def _est_rows_per_expert(spec, N):
    E_loc = spec.get("local", spec["E"])
    pairs = N * spec["K"] * E_loc / spec["E"]
    return max(1.0, pairs / max(1, min(E_loc, pairs)))


DECODE_TUNE_MAX_PAIRS = 32  # rows with at most this many pairs also try the two-kernel decode path


def decode_candidates(on_gpu):
    """(d1s, d2s): tiles of the decode path's two kernels (rows per program, K depth, warps,
    stages), tuned one kernel at a time."""
    def d(bn, bk, w, s):
        return {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": s if on_gpu else 1}
    d1s = [d(16, 256, 4, 4), d(8, 256, 4, 4), d(32, 128, 4, 4), d(16, 512, 4, 3), d(8, 512, 4, 3),
           d(32, 256, 8, 3), d(4, 512, 4, 4)]
    # GEMM 2 tiles hold the rows of all top-k experts: fewer rows per expert
    d2s = [d(4, 256, 4, 4), d(8, 128, 4, 4), d(4, 512, 8, 3), d(8, 256, 8, 3), d(2, 512, 4, 4),
           d(16, 64, 4, 4), d(2, 256, 4, 4)]
    return d1s, d2s


def decode_task_configs(on_gpu):
    d1s, d2s = decode_candidates(on_gpu)
    return ([{"decode": True, "d1": d1, "d2": d2s[0]} for d1 in d1s]
            + [{"decode": True, "d1": d1s[0], "d2": d2} for d2 in d2s[1:]])


def our_task_configs(fmt, rows_per_expert, on_gpu, pairs):

    code = {"bf16": 0, "fp8_w8a8": 1, "nvfp4_w4a16": 2}[fmt]
    bms, g1s, g2s = our_candidates(code, rows_per_expert, on_gpu)
    cfgs = decode_task_configs(on_gpu) if pairs <= DECODE_TUNE_MAX_PAIRS else []
    for bm in bms:
        for g1, g2 in zip(g1s, g2s):
            for pre in ((False, True) if code == 1 else (False,)):
                cfgs.append({"BLOCK_M": bm, "g1": g1, "g2": g2, "a_prequant": pre})
    return cfgs


_W = {}


def _worker_weights(key, spec, fmt, device, dtype):
    from moe_runtime_triton import ops

    if key in _W:
        return _W[key]
    _W.clear()
    torch.cuda.empty_cache()
    E_loc = spec.get("local", spec["E"])
    H, I = spec["H"], spec["I"]
    lw = LayerWeights(16, H, I, device, dtype)
    out = {"lw": lw}
    if fmt == "bf16":
        w = lw.bf16
    elif fmt == "fp8_w8a8":
        w = lw.fp8(5.0 / 448, 1.0 / 448)
    else:
        w = lw.nvfp4()
    pw = ops.prepare_weights(w)

    def big(t):
        return None if t is None else t[:1].expand(E_loc, *t.shape[1:])
    import attrs
    out["pw"] = attrs.evolve(pw, w13=big(pw.w13), w2=big(pw.w2), w13_scale=big(pw.w13_scale),
                             w2_scale=big(pw.w2_scale), w13_scale_2=big(pw.w13_scale_2),
                             w2_scale_2=big(pw.w2_scale_2), num_experts=E_loc)
    out["w"] = w
    _W[key] = out
    return out


def _warm_one(task):
    sname, spec, fmt, N, impl, cfg, mk_path = task
    device, dtype = "cuda", torch.bfloat16
    try:
        from moe_runtime_triton import ops

        ww = _worker_weights((sname, fmt), spec, fmt, device, dtype)
        E_loc = spec.get("local", spec["E"])
        K = spec["K"]
        x = torch.randn(N, spec["H"], device=device, dtype=dtype)
        if impl == "triton":
            ids = torch.randint(-1 if "local" in spec else 0, E_loc, (N, K), device=device,
                                dtype=torch.int32)
            wts = torch.rand(N, K, device=device)
            ops.fused_moe_prepared(x, ids, wts, ww["pw"], config=cfg)
        else:
            global _MK
            if _MK is None:
                _MK = MoEKernelsPeer(mk_path)
            lw = ww["lw"]
            ids = torch.randint(-1 if "local" in spec else 0, 16, (N, K), device=device,
                                dtype=torch.int32)
            wts = torch.rand(N, K, device=device)
            fp8_args = (ww["w"], lw.fp8_expert_scales) if fmt == "fp8_w8a8" else None
            _MK.graphable(lw, fmt, cfg, fp8_args, "local" in spec)(x, ids, wts)
        torch.cuda.synchronize()
        return None
    except Exception as exc:
        return f"{sname} {fmt} N={N} {impl}: {type(exc).__name__}: {str(exc)[:200]}"


_MK = None


def warm_compile(shapes, tokens, formats, with_mk, mk_path, tune, workers):
    """Compile every kernel variant the run will use, once each, in parallel processes.

    Our GEMMs are specialised only by format and tile config (expert count, pair count and top-k
    are not specialised; hidden/intermediate sizes and strides share their divisibility class), so
    each (format, config) is compiled once on the smallest shape. The peer is specialised by top-k
    and by whether the pair count is a multiple of 16 too."""
    from moe_runtime_triton import ops

    small = {}
    for sname, spec in shapes.items():
        small.setdefault(spec["K"], (sname, spec))
    first = next(iter(shapes.items()))
    seen, tasks = set(), []
    for sname, spec in shapes.items():
        E_loc = spec.get("local", spec["E"])
        for fmt in formats:
            for N in tokens:
                rpe = _est_rows_per_expert(spec, N)
                pairs = N * spec["K"]
                cfgs = our_task_configs(fmt, rpe, True, pairs) if tune else []
                cfgs.append(ops.get_config(fmt, E_loc, spec["H"], spec["I"], spec["K"], N))
                for c in cfgs:
                    # the decode path is specialised by top-k as well
                    key = ("triton", fmt, json.dumps(c, sort_keys=True),
                           spec["K"] if c.get("decode") else None)
                    if key not in seen:
                        seen.add(key)
                        sn, sp = small[spec["K"]] if c.get("decode") else first
                        tasks.append((sn, sp, fmt, min(N, 1024), "triton", c, mk_path))
                if with_mk and fmt in ("bf16", "fp8_w8a8"):
                    for c in mk_grid(rpe):
                        key = ("mk", fmt, json.dumps(c, sort_keys=True), spec["K"], pairs % 16 == 0)
                        if key not in seen:
                            seen.add(key)
                            sn, sp = small[spec["K"]]
                            tasks.append((sn, sp, fmt, N, "mk", c, mk_path))
    # group by (shape, format) so that workers reuse their stand-in weights
    tasks.sort(key=lambda t: (t[0], t[2], t[3]))
    import multiprocessing as mp

    t0 = time.time()
    ctx = mp.get_context("spawn")
    errors = []
    with ctx.Pool(workers) as pool:
        for err in pool.imap_unordered(_warm_one, tasks, chunksize=4):
            if err:
                errors.append(err)
    log(f"warm-up: {len(tasks)} runs in {time.time() - t0:.0f}s with {workers} workers, "
        f"{len(errors)} errors")
    for e in errors[:10]:
        log("   warm error:", e)
    return len(tasks), errors


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def route_batch(spec, N, device, gen):
    from moe_runtime.router import RouterConfig, route

    E = spec["E"]
    sigmoid = spec["scoring"] == "sigmoid"
    cfg = RouterConfig(scoring=spec["scoring"], top_k=spec["K"], renormalize=True,
                       n_group=spec.get("n_group", 1), topk_group=spec.get("topk_group", 1),
                       routed_scaling_factor=2.5 if sigmoid else 1.0,
                       has_correction_bias=sigmoid)
    logits = torch.randn(N, E, device=device, generator=gen)
    bias = (torch.randn(E, device=device, generator=gen) * 0.1) if sigmoid else None
    ids, wts = route(logits, cfg, bias)
    return ids, wts, (lambda: route(logits, cfg, bias))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short subset (2 shapes, 3 token counts)")
    ap.add_argument("--tune", action="store_true", help="tune our tile configs per row")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU with TRITON_INTERPRET=1)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--shapes", nargs="*")
    ap.add_argument("--tokens", nargs="*", type=int)
    ap.add_argument("--formats", nargs="*")
    ap.add_argument("--rows", nargs="*", help="only these SHAPE:TOKENS rows (e.g. the profiled ones)")
    ap.add_argument("--peers", nargs="*", default=["tf_grouped", "tf_batched", "mk_triton",
                                                   "humming", "reference"])
    ap.add_argument("--mk-path", default=str(ROOT / ".peers" / "moe-kernels-0.8.2"))
    ap.add_argument("--warm-workers", type=int, default=12,
                    help="processes that fill Triton's compile cache first (0: none)")
    ap.add_argument("--time-budget", type=float, default=480.0,
                    help="seconds; rows past it are skipped (reported)")
    ap.add_argument("--grouped-min-tokens", type=int, default=1024,
                    help="rows with at least this many tokens also time our torch grouped GEMM "
                         "path (triton_grouped)")
    ap.add_argument("--w4a16-max-tokens", type=int, default=128,
                    help="--tune: NVFP4 rows of at most this many tokens also try the W4A16 tile "
                         "path (moe_runtime_triton.w4a16: W4A16_TUNE_VARIANTS); a variant that "
                         "wins is written to configs.json as the entry's \"w4a16\"")
    ap.add_argument("--tma-min-tokens", type=int, default=1024,
                    help="with --tune, rows with at least this many tokens also sweep the TMA / "
                         "persistent path (moe_runtime_triton.tma); a config that wins is written "
                         "to configs.json as the entry's \"tma\"")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the rows and implementations this command would time, then exit")
    args = ap.parse_args(argv)
    t_start = time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    timer = Timer(device)
    torch.backends.cuda.matmul.allow_tf32 = False

    from moe_runtime_triton import ops

    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.rows:
        keep = {r.split(":")[0] for r in args.rows}
        shapes = {k: v for k, v in shapes.items() if k in keep}
    if args.shapes:  # in the order given (rows past the time budget are skipped: first first)
        shapes = {k: shapes[k] for k in dict.fromkeys(args.shapes) if k in shapes}
    elif args.quick and not args.smoke:
        shapes = {k: SHAPES[k] for k in ("qwen3-30b-a3b", "qwen3.5-397b-a17b")}
    tokens = args.tokens or ([1, 16, 128] if args.smoke else
                             [1, 128, 4096] if args.quick else TOKENS)
    formats = args.formats or FORMATS
    if args.rows:
        tokens = sorted({int(r.split(":")[1]) for r in args.rows})
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        ap.error(f"unknown format(s) {unknown}; accepted: {FORMATS}")
    if not shapes:
        ap.error(f"no shape selected; accepted: {sorted(SMOKE_SHAPES if args.smoke else SHAPES)}")
    if args.dry_run:
        for line in run_plan(shapes, tokens, formats, args):
            log(line)
        return
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    if os.environ.pop(ops.GROUPED_MM_ENV, None) is not None:  # for the warm-up workers too
        log(f"{ops.GROUPED_MM_ENV} unset for this run: each row names its path itself")
    ops.GROUPED_MM_MODE = ""

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "capability": list(torch.cuda.get_device_capability()) if device == "cuda" else None,
        "torch": torch.__version__,
    }
    try:
        import triton
        meta["triton"] = triton.__version__
    except Exception:
        pass
    try:
        import transformers
        meta["transformers"] = transformers.__version__
    except Exception:
        pass
    log("meta", json.dumps(meta))

    if device == "cuda" and args.warm_workers > 0:
        try:
            n, errs = warm_compile(shapes, tokens, formats, "mk_triton" in args.peers,
                                   args.mk_path, args.tune, args.warm_workers)
            meta["warm"] = {"runs": n, "errors": errs[:20], "s": round(time.time() - t_start)}
        except Exception as exc:
            meta["warm"] = {"error": f"{type(exc).__name__}: {exc}"}
            log("warm-up failed:", meta["warm"]["error"])

    ceil = measure_ceilings(timer, device)
    meta["ceilings"] = ceil
    log("ceilings", json.dumps(ceil))

    mk = None
    mk_error = None
    if "mk_triton" in args.peers:
        try:
            mk = MoEKernelsPeer(args.mk_path)
        except Exception as exc:
            mk_error = f"{type(exc).__name__}: {exc}"
            log("moe-kernels unavailable:", mk_error)
    meta["mk_error"] = mk_error
    humming_error = None
    if "humming" in args.peers:
        import humming_peer

        humming_error = humming_peer.available()
        if humming_error:
            log("humming unavailable:", humming_error)
    meta["humming_error"] = humming_error

    rows = []
    tuned = {}
    gen = torch.Generator(device=device).manual_seed(1234)
    for sname, spec in shapes.items():
        E_loc = spec.get("local", spec["E"])
        H, I, K = spec["H"], spec["I"], spec["K"]
        log(f"== {sname}: E={spec['E']} local={E_loc} H={H} I={I} K={K}")
        t0 = time.time()
        lw = LayerWeights(E_loc, H, I, device, dtype)
        # activation scales: inputs are unit normal (amax ~5); intermediate amax from a sample
        xs = torch.randn(256, H, device=device, generator=gen).to(dtype)
        gu = xs.float() @ lw.w13[0].float().t()
        a2_amax = (TF.silu(gu[:, :I]) * gu[:, I:]).abs().amax().item() * 1.5
        a13, a2 = 5.0 / 448, a2_amax / 448
        prepared = {}
        for fmt in formats:
            if fmt == "bf16":
                w = lw.bf16
            elif fmt == "fp8_w8a8":
                w = lw.fp8(a13, a2)
            else:
                w = lw.nvfp4()
            prepared[fmt] = (w, ops.prepare_weights(w))
        log(f"   weights ready in {time.time() - t0:.1f}s")
        hm = None
        if "humming" in args.peers and humming_error is None and "nvfp4_w4a16" in prepared:
            try:
                t1 = time.time()
                hm = humming_peer.HummingNvfp4Experts(prepared["nvfp4_w4a16"][0], dtype,
                                                      skips="local" in spec)
                hm.plan([n * K for n in tokens])
                humming_peer.compile_all([hm])
                log(f"   humming compiled in {time.time() - t1:.1f}s")
            except Exception as exc:
                hm = exc
                log(f"   humming failed to load: {type(exc).__name__}: {str(exc)[:300]}")
        tf_impls = {}
        for impl in ("tf_grouped", "tf_batched"):
            if impl in args.peers:
                try:
                    tf_impls[impl] = make_tf_experts(
                        lw, "grouped_mm" if impl == "tf_grouped" else "batched_mm")
                except Exception as exc:
                    tf_impls[impl] = exc
        for N in tokens:
            if args.rows and f"{sname}:{N}" not in args.rows:
                continue
            if time.time() - t_start > args.time_budget:
                log(f"   time budget spent: skipping {sname} N={N}")
                rows.append({"shape": sname, "tokens": N, "skipped": "time budget"})
                continue
            sets = []
            router_t = None
            for r in range(ROTATE):
                x = torch.randn(N, H, device=device, generator=gen).to(dtype)
                ids, wts, router_fn = route_batch(spec, N, device, gen)
                if "local" in spec:
                    ids = torch.where(ids < E_loc, ids, torch.full_like(ids, -1)).to(torch.int32)
                sets.append((x, ids.contiguous(), wts.contiguous()))
                if r == 0:
                    router_t = timer.run([router_fn], target_s=0.05)
            flat = sets[0][1].reshape(-1)
            valid_pairs = int((flat >= 0).sum())
            touched = sum(int(torch.unique(s[1][s[1] >= 0]).numel()) for s in sets) / ROTATE
            has_invalid = bool(any((s[1] < 0).any().item() for s in sets))
            rows_per_expert = max(1.0, valid_pairs / max(1, min(E_loc, valid_pairs)))
            flops = valid_pairs * 2 * 3 * H * I
            for fmt in formats:
                w, pw = prepared[fmt]
                row = {"shape": sname, "tokens": N, "format": fmt, "E_local": E_loc,
                       "table_key": ops.table_key(fmt, E_loc, H, I, K),
                       "experts_touched": round(touched, 1), "valid_pairs": valid_pairs,
                       "router_us": round(router_t * 1e6, 1), "impl": {}}
                rate = ceil["fp8_TFLOPs"] if fmt == "fp8_w8a8" else ceil["bf16_TFLOPs"]
                nbytes = touched * lw.bytes_per_expert(fmt) + N * H * 4
                row["roofline_bytes_us"] = round(nbytes / (ceil["read_GBps"] * 1e9) * 1e6, 2)
                row["roofline_flops_us"] = round(flops / (rate * 1e12) * 1e6, 2)
                row["roofline_us"] = max(row["roofline_bytes_us"], row["roofline_flops_us"])
                scales = (w.a13_scale.float(), w.a2_scale.float()) if fmt == "fp8_w8a8" else None
                x0, ids0, wts0 = sets[0]
                ref = reference_fp32(lw, fmt, x0, ids0, wts0, scales)

                def record(name, fn_factory, graph_ok=True, check_fn=None):
                    ent = {}
                    try:
                        fns = [(lambda s=s: fn_factory()(*s)) for s in sets]
                        f0 = fn_factory()
                        out = f0(*sets[0])
                        err = rel_err(out, ref)
                        ent["rel_err"] = round(err, 5)
                        if not err <= TOL[fmt]:
                            ent["error"] = f"wrong result: rel err {err:.3g} > {TOL[fmt]}"
                            row["impl"][name] = ent
                            log(f"   {sname} N={N} {fmt} {name}: WRONG {err:.3g}")
                            return ent
                        calls = [(lambda s=s, f=f0: f(*s)) for s in sets]
                        ent["eager_us"] = round(timer.run(calls) * 1e6, 2)
                        if graph_ok and device == "cuda" and N <= GRAPH_MAX_TOKENS:
                            gs = timer.graphs(calls)
                            g_out = gs[0][1]
                            gs[0][0].replay()
                            torch.cuda.synchronize()
                            gerr = rel_err(g_out, ref)
                            if not gerr <= TOL[fmt]:
                                ent["graph_error"] = f"graph replay wrong: {gerr:.3g}"
                            else:
                                ent["graph_us"] = round(
                                    timer.run([g.replay for g, _ in gs]) * 1e6, 2)
                            del gs
                    except Exception as exc:
                        ent["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                        log(f"   {sname} N={N} {fmt} {name}: FAILED {ent['error']}")
                        if os.environ.get("BENCH_TRACEBACK"):
                            traceback.print_exc()
                    row["impl"][name] = ent
                    if device == "cuda":
                        import gc

                        gc.collect()
                        torch.cuda.empty_cache()
                    return ent

                # ---- ours (tuned here or from the table)
                cfg = ops.get_config(fmt, E_loc, H, I, K, N)
                if args.tune:
                    fmt_code = {"bf16": 0, "fp8_w8a8": 1, "nvfp4_w4a16": 2}[fmt]
                    bms, g1s, g2s = our_candidates(fmt_code, rows_per_expert, device == "cuda")
                    best = None
                    use_graph = device == "cuda" and N <= GRAPH_MAX_TOKENS

                    def time_cfg_(c):
                        c = dict(c, grouped_mm=bool(c.get("grouped_mm")))
                        calls = [(lambda s=s, c=c: ops.fused_moe_prepared(*s, pw, config=c))
                                 for s in sets]
                        if use_graph:  # decode runs from CUDA graphs: tune what is replayed
                            gs = timer.graphs(calls)
                            t = timer.run([g.replay for g, _ in gs], target_s=0.03, min_reps=5)
                            del gs
                            return t
                        return timer.run(calls, target_s=0.04, min_reps=3)

                    def time_cfg(c):
                        try:
                            return time_cfg_(c)
                        except Exception as exc:  # e.g. a tile that needs too much shared memory
                            row.setdefault("tune_skipped", []).append(str(exc)[:120])
                            return float("inf")
                    trials = []
                    try:
                        for bm in bms:
                            c = {"BLOCK_M": bm, "g1": g1s[0], "g2": g2s[0],
                                 "a_prequant": fmt == "fp8_w8a8" and valid_pairs > 1024}
                            t_g1 = []
                            for g1 in g1s:
                                c1 = dict(c, g1=g1)
                                t_g1.append((time_cfg(c1), g1))
                            g1b = min(t_g1, key=lambda z: z[0])[1]
                            for g2 in g2s:
                                c2 = dict(c, g1=g1b, g2=g2)
                                trials.append((time_cfg(c2), c2))
                        if fmt == "fp8_w8a8":
                            tb, cb = min(trials, key=lambda z: z[0])
                            c3 = dict(cb, a_prequant=not cb["a_prequant"])
                            trials.append((time_cfg(c3), c3))
                        if N * K <= DECODE_TUNE_MAX_PAIRS:
                            d1s, d2s = decode_candidates(device == "cuda")
                            t_d1 = [(time_cfg({"decode": True, "d1": d1, "d2": d2s[0]}), d1)
                                    for d1 in d1s]
                            d1b = min(t_d1, key=lambda z: z[0])[1]
                            for d2 in d2s:
                                cd = {"decode": True, "d1": d1b, "d2": d2}
                                trials.append((time_cfg(cd), cd))
                        trials.append((time_cfg(cfg), cfg))
                        best = min(trials, key=lambda z: z[0])[1]
                        # the TMA path's sweep (1024+ tokens) and the W4A16 tile path's (NVFP4,
                        # up to 128 tokens): each config checked against the reference before it
                        # is timed; an entry keeps its sorted (or decode) config as the fallback
                        from moe_runtime_triton import tma as T

                        sweeps = (
                            ("tma", "tune_tma", tma_skip_reason(ops, pw, N, args.tma_min_tokens),
                             lambda: [(T.describe(c), c) for c in T.config_candidates(pw, N, K)]),
                            ("w4a16", "tune_w4a16",
                             w4a16_skip_reason(ops, pw, N, args.w4a16_max_tokens),
                             w4a16_candidates),
                        )
                        for key, field, why_not, candidates in sweeps:
                            if why_not:
                                row[field] = {"skipped": why_not}
                                continue
                            fallback = {k: v for k, v in best.items() if k != key}
                            timed = []
                            for name, c in candidates():
                                ct = dict(fallback, **{key: c})
                                why = tma_check(ops, pw, ct, x0, ids0, wts0, ref, TOL[fmt])
                                t = float("inf") if why else time_cfg(ct)
                                if why:
                                    row.setdefault("tune_skipped", []).append(
                                        f"{key} {name}: {why}"[:160])
                                timed.append((t, ct, name))
                            trials.extend((t, c) for t, c, _ in timed)
                            tb, _, nb = min(timed, key=lambda z: z[0])
                            row[field] = ({"best_us": round(tb * 1e6, 2), "config": nb,
                                           "configs_timed": len(timed)}
                                          if tb < float("inf") else
                                          {"error": f"every {key} config failed or was wrong"})
                            best = min(trials, key=lambda z: z[0])[1]
                        if not grouped_skip_reason(ops, pw, device, N, args.grouped_min_tokens):
                            cg = dict(best, grouped_mm=True)
                            trials.append((time_cfg(cg), cg))
                            best = min(trials, key=lambda z: z[0])[1]
                        cfg = best
                        row["tune_trials"] = len(trials)
                    except Exception as exc:
                        row["tune_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                        log(f"   tune failed {sname} N={N} {fmt}: {row['tune_error']}")
                    tuned.setdefault(ops.table_key(fmt, E_loc, H, I, K), {})[str(N)] = cfg
                row["triton_config"] = ops.describe_config(cfg)
                # "triton": the Triton GEMMs; "triton_grouped": the same backend's torch grouped
                # GEMM path (plugin.TORCH_GROUPED_GEMMS), which the tuned table may pick per row
                cfg_t, cfg_g = dict(cfg, grouped_mm=False), dict(cfg, grouped_mm=True)
                record("triton", lambda: (lambda x, i, t: ops.fused_moe_prepared(
                    x, i, t, pw, config=cfg_t)))
                grouped_why = grouped_skip_reason(ops, pw, device, N, args.grouped_min_tokens)
                if grouped_why:
                    row["impl"]["triton_grouped"] = {"skipped": grouped_why}
                else:
                    record("triton_grouped", lambda: (lambda x, i, t: ops.fused_moe_prepared(
                        x, i, t, pw, config=cfg_g)))
                row["table_config"] = cfg
                if (sname, N) in PROFILE_ROWS and device == "cuda":
                    try:
                        row["profile"] = profile_stages(ops, pw, sets, cfg_t, timer,
                                                        N <= GRAPH_MAX_TOKENS)
                        if not grouped_why:
                            row["profile_grouped"] = profile_stages(ops, pw, sets, cfg_g, timer,
                                                                    N <= GRAPH_MAX_TOKENS)
                    except Exception as exc:
                        row["profile"] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}

                # ---- peers
                if fmt == "bf16":
                    for impl, f in tf_impls.items():
                        if isinstance(f, Exception):
                            row["impl"][impl] = {"error": f"{type(f).__name__}: {f}"}
                            continue
                        if impl == "tf_batched":
                            need = N * K * (3 * H * I) * 2 + N * K * H * 8
                            if need > 24e9:
                                row["impl"][impl] = {"skipped": f"would materialise "
                                                     f"{need / 1e9:.0f} GB of gathered weights"}
                                continue
                        record(impl, lambda f=f: f)
                    if "reference" in args.peers:
                        record("reference", lambda: torch_reference_impl(lw), graph_ok=False)
                if fmt == "nvfp4_w4a16" and hm is not None:
                    if isinstance(hm, Exception):
                        row["impl"]["humming"] = {"error": f"{type(hm).__name__}: {str(hm)[:300]}"}
                    else:
                        record("humming", lambda: hm)
                if mk is not None and fmt in ("bf16", "fp8_w8a8"):
                    name = "mk_triton" if fmt == "bf16" else "mk_triton_fp8"
                    fp8_args = (w, lw.fp8_expert_scales) if fmt == "fp8_w8a8" else None
                    best = None
                    trials = []
                    for c in mk_grid(rows_per_expert):
                        try:
                            fn = mk.graphable(lw, fmt, c, fp8_args, has_invalid)
                            out = fn(*sets[0])
                            err = rel_err(out, ref)
                            if not err <= TOL[fmt]:
                                trials.append((float("inf"), c, f"rel err {err:.3g}"))
                                continue
                            t = timer.run([(lambda s=s, fn=fn: fn(*s)) for s in sets],
                                          target_s=0.04, min_reps=3)
                            trials.append((t, c, None))
                        except Exception as exc:
                            trials.append((float("inf"), c, f"{type(exc).__name__}: {exc}"[:200]))
                    ok = [z for z in trials if math.isfinite(z[0])]
                    if ok:
                        tb, cb, _ = min(ok, key=lambda z: z[0])
                        ent = record(name, lambda cb=cb: mk.graphable(lw, fmt, cb, fp8_args,
                                                                       has_invalid))
                        ent["config"] = cb
                        # helper ops (torch replacements) timed apart on the same inputs
                        try:
                            he, hg = mk_helper_time(
                                mk, timer, sets, E_loc, I, cb["BLOCK_SIZE_M"], fmt, w,
                                has_invalid, graph_too=device == "cuda" and N <= GRAPH_MAX_TOKENS)
                            ent["helpers_us"] = round(he * 1e6, 2)
                            if hg is not None:
                                ent["helpers_graph_us"] = round(hg * 1e6, 2)
                        except Exception as exc:
                            ent["helpers_error"] = str(exc)[:200]
                    else:
                        row["impl"][name] = {"error": "every config failed: " + "; ".join(
                            str(z[2]) for z in trials[:3])}
                summarize_row(row)
                rows.append(row)
                log(row_line(row))
            torch.cuda.empty_cache() if device == "cuda" else None
        del lw, prepared, tf_impls, hm
        if device == "cuda":
            torch.cuda.empty_cache()

    meta["elapsed_s"] = round(time.time() - t_start, 1)
    targets_report(rows)  # adds the nvfp4 comparison fields to the rows
    with open(outdir / "results.json", "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    if tuned:
        # the plugin applies a table only on the compute capability it was tuned on (ops._meta)
        tuned["_meta"] = {"capability": meta["capability"], "device": meta["device"],
                          "source": f"{meta['command']} ({meta['date']})"}
        with open(outdir / "configs.json", "w") as fh:
            json.dump(tuned, fh, indent=1, sort_keys=True)
    table, changes = grouped_table(ops, rows)
    if changes:
        with open(outdir / "configs_grouped_mm.json", "w") as fh:
            json.dump(table, fh, indent=1, sort_keys=True)
        log("grouped_mm flags measured in this run (configs_grouped_mm.json = the plugin's table "
            "with them):")
        for line in changes:
            log("   " + line)
    md = markdown_table(meta, rows) + "\n" + "\n".join(targets_report(rows)) + "\n"
    md += "\n" + compact_table(rows)
    (outdir / "profile.md").write_text(profile_md(rows))
    (outdir / "results.md").write_text(md)
    try:
        plot(rows, meta, outdir / "bench_triton_moe.png")
    except Exception as exc:
        log("plot failed:", exc)
    log(md)
    log(f"done in {time.time() - t_start:.0f}s")


def stage_seconds(timer, fn, use_graph: bool) -> tuple[float, bool]:
    """``(seconds per launch of the stage fn, whether from a graph)``: a graph of STAGE_REPEAT
    launches of it, replayed (its time per launch is the kernels' own, with the gap between the
    kernels of a graph, not the graph launch's) where ``use_graph`` or where its eager time is
    under STAGE_GRAPH_BELOW_S (host-bound); else eager. A stage that cannot be captured is eager."""
    eager = None
    if not use_graph:
        eager = timer.run([fn], target_s=0.05, min_reps=5)
        if not (timer.cuda and eager < STAGE_GRAPH_BELOW_S):
            return eager, False
    try:
        gs = timer.graphs([lambda: [fn() for _ in range(STAGE_REPEAT)]])
        t = timer.run([gs[0][0].replay], target_s=0.03, min_reps=10) / STAGE_REPEAT
        del gs
        return t, True
    except Exception:  # noqa: BLE001 - not capturable: the eager time stands
        if eager is None:
            raise
        return eager, False


def profile_stages(ops, pw, sets, cfg, timer, use_graph):
    """Each stage of our forward timed alone (graph replay for small batches), with the compiled
    GEMMs' registers, spills and an instruction histogram of their SASS."""
    stages = []
    ops.fused_moe_prepared(*sets[0], pw, config=cfg, _stages=stages)
    timer.sync()
    res = {}
    for name, fn, ck in stages:
        t, graphed = stage_seconds(timer, fn, use_graph)
        ent = {"us": round(t * 1e6, 2), "timed": "graph" if graphed else "eager"}
        if ck is not None and hasattr(ck, "n_regs"):
            ent["regs"], ent["spills"] = ck.n_regs, ck.n_spills
            if "gemm" in name:
                try:
                    import re
                    from collections import Counter

                    from triton.tools.disasm import get_sass

                    sass = get_sass(ck.asm["cubin"])
                    pat = re.compile(r"(?:/\*[0-9a-f]+\*/)?\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)[.\s]")
                    ops_ = Counter(m.group(1) for line in sass.splitlines() if ";" in line
                                   for m in [pat.match(line.strip())] if m)
                    if ops_:
                        ent["sass_total"] = sum(ops_.values())
                        ent["sass_top"] = ops_.most_common(14)
                except Exception as exc:
                    ent["sass_error"] = str(exc)[:120]
        res[name] = ent
    return res


def profile_md(rows):
    out = ["## Stage profile (each stage alone)", "",
           f"Rows timed from CUDA graphs: each stage is captured {STAGE_REPEAT} times in one graph and",
           "the replay's time divided by that (one graph launch alone costs more than a small",
           "kernel); the stages' sum is then below the row's own graph time by about one launch.", ""]
    profiles = [(row, row.get(k), what) for row in rows
                for k, what in (("profile", row.get("triton_config")),
                                ("profile_grouped", "torch grouped_mm path"))]
    for r, pr, what in profiles:
        if not pr:
            continue
        out.append(f"### {r['shape']} N={r['tokens']} {r['format']} ({what})")
        if "error" in pr:
            out.append(f"error: {pr['error']}")
            continue
        for name, ent in pr.items():
            line = f"- {name}: {ent.get('us')} us"
            if "regs" in ent:
                line += f", {ent['regs']} regs, {ent['spills']} spills"
            if "sass_total" in ent:
                line += f", SASS {ent['sass_total']} instr, top: " + ", ".join(
                    f"{k} {v}" for k, v in ent["sass_top"])
            out.append(line)
        out.append("")
    return "\n".join(out) + "\n"


def mk_helper_time(mk, timer, sets, E, I, bm, fmt, w, has_invalid, graph_too=False):
    """Time of the torch replacements of moe-kernels' compiled helpers for one forward."""
    h = mk.helpers
    calls = []
    for x, ids, wts in sets:
        N, K = ids.shape
        P = ids.numel()
        maxp = P + E * (bm - 1)
        sid = torch.empty(maxp, dtype=torch.int32, device=x.device)
        eid = torch.empty((maxp + bm - 1) // bm, dtype=torch.int32, device=x.device)
        npp = torch.empty(1, dtype=torch.int32, device=x.device)
        c1 = torch.randn(P, 2 * I, device=x.device, dtype=x.dtype)
        c2 = torch.empty(P, I, device=x.device, dtype=x.dtype)
        c3 = torch.randn(N, K, x.shape[1], device=x.device, dtype=x.dtype)
        o = torch.empty_like(x)

        def f(x=x, ids=ids, sid=sid, eid=eid, npp=npp, c1=c1, c2=c2, c3=c3, o=o):
            mk.valid = (ids >= 0) if has_invalid else None
            h["align"](ids, E, bm, sid, eid, npp)
            if fmt == "fp8_w8a8":
                h["fp8"](x, w.a13_scale.reshape(1))
            h["silu_and_mul"](c2, c1)
            if fmt == "fp8_w8a8":
                h["fp8"](c2, w.a2_scale.reshape(1))
            h["moe_sum"](c3, o)
        calls.append(f)
    eager = timer.run(calls, target_s=0.04, min_reps=3)
    graph = None
    if graph_too:
        gs = timer.graphs(calls)
        graph = timer.run([g.replay for g, _ in gs], target_s=0.03, min_reps=5)
        del gs
    return eager, graph


OURS = ("triton", "triton_grouped")  # our backend's two paths; the tuned table picks per row


def _best_us(ent):
    if not ent or "error" in ent or "skipped" in ent:
        return None
    return min([ent[k] for k in ("eager_us", "graph_us") if k in ent], default=None)


def tma_skip_reason(ops, pw, N, min_tokens):
    """Why ``--tune`` does not sweep the TMA path on this row (``None``: it does)."""
    if N < min_tokens:
        return f"{N} tokens < --tma-min-tokens {min_tokens}"
    return ops.tma_unavailable(pw)


def tma_check(ops, pw, cfg, x, ids, wts, ref, tol):
    """Run one TMA config once (eagerly: its weight views are built here, before any capture) and
    say what is wrong with its output (``None``: within ``tol`` of the reference)."""
    try:
        err = rel_err(ops.fused_moe_prepared(x, ids, wts, pw, config=cfg), ref)
    except Exception as exc:  # e.g. a tile that needs too much shared memory
        return f"{type(exc).__name__}: {str(exc)[:120]}"
    return None if err <= tol else f"wrong result: rel err {err:.3g} > {tol}"


# bench_w4a16.py's variants that --tune tries on NVFP4 rows (its H200 run of 2026-12-04: the best
# at 16-128 tokens, and the two best at 1 token)
W4A16_TUNE_VARIANTS = ("r128k128 sync s3", "r64k256i_d64 sync s3 x16 splitk fold",
                       "r64k256i_d64 sync s3 x16")


def w4a16_candidates() -> list[tuple[str, dict]]:
    """``(name, "w4a16" config of a tuned entry)`` for :data:`W4A16_TUNE_VARIANTS`, from
    ``bench_w4a16.py``'s layouts and overrides (the config ``ops.w4a16_call_config`` reads)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_w4a16", ROOT / "benchmarks" /
                                                  "bench_w4a16.py")
    bw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bw)
    out = []
    for name in W4A16_TUNE_VARIANTS:
        layout, overrides = bw.VARIANTS[name]
        out.append((name, {"layout": list(bw.LAYOUTS[layout]), **overrides}))
    return out


def w4a16_skip_reason(ops, pw, N, max_tokens):
    """Why ``--tune`` does not sweep the W4A16 tile path on this row (``None``: it does)."""
    if N > max_tokens:
        return f"{N} tokens > --w4a16-max-tokens {max_tokens}"
    return ops.w4a16_unavailable(pw)


def grouped_skip_reason(ops, pw, device, N, min_tokens):
    """Why a row does not time our torch grouped GEMM path (None: it does)."""
    if N < min_tokens:
        return f"below --grouped-min-tokens {min_tokens}"
    return pw.grouped_mm_unavailable


def run_plan(shapes, tokens, formats, args):
    """The rows and implementations a command would time (``--dry-run``; no device work)."""
    from moe_runtime_triton.plugin import TORCH_GROUPED_GEMMS

    lines, n = [], 0
    for sname, spec in shapes.items():
        for N in tokens:
            if args.rows and f"{sname}:{N}" not in args.rows:
                continue
            for fmt in formats:
                impls = ["triton"]
                if N >= args.grouped_min_tokens and fmt in TORCH_GROUPED_GEMMS:
                    impls.append("triton_grouped (where the device runs it)")
                if fmt == "bf16":
                    impls += [p for p in ("tf_grouped", "tf_batched", "reference") if p in args.peers]
                if fmt in ("bf16", "fp8_w8a8") and "mk_triton" in args.peers:
                    impls.append("mk_triton" if fmt == "bf16" else "mk_triton_fp8")
                if fmt == "nvfp4_w4a16" and "humming" in args.peers:
                    impls.append("humming")
                timing = "eager + CUDA graph" if N <= GRAPH_MAX_TOKENS else "eager"
                tune = ""
                if args.tune:
                    tma_sweep = N >= args.tma_min_tokens and fmt in ("bf16", "fp8_w8a8")
                    w4_sweep = N <= args.w4a16_max_tokens and fmt == "nvfp4_w4a16"
                    tune = (" [tune" + (" + TMA sweep" if tma_sweep else "")
                            + (" + W4A16 sweep" if w4_sweep else "") + "]")
                lines.append(f"{sname} N={N} {fmt}: {', '.join(impls)} ({timing}){tune}")
                n += 1
    lines.append(f"{n} rows; time budget {args.time_budget:.0f}s; out {args.out}")
    return lines


def grouped_table(ops, rows, margin=0.97):
    """The plugin's tuned table with ``grouped_mm`` set on each measured row where our torch grouped
    GEMM path beat our Triton GEMMs by more than ``1 - margin`` (and cleared where it did not), and
    a line per row saying so."""
    import copy

    table = copy.deepcopy(ops._tuned_table())
    changes = []
    for r in rows:
        if "impl" not in r or "table_key" not in r:
            continue
        tt, tg = _best_us(r["impl"].get("triton")), _best_us(r["impl"].get("triton_grouped"))
        if tt is None or tg is None:
            continue
        win = tg < margin * tt
        entry = table.setdefault(r["table_key"], {})
        cfg = dict(entry.get(str(r["tokens"])) or r["table_config"])
        cfg["grouped_mm"] = win
        if not win:
            cfg.pop("grouped_mm")
        entry[str(r["tokens"])] = cfg
        changes.append(f"{r['table_key']} N={r['tokens']}: triton {tt:.1f} us, grouped {tg:.1f} us"
                       f" -> {'grouped_mm' if win else 'triton'}")
    return table, changes


def compact_table(rows):
    """Our two paths next to the best peer, one line per row (best of eager / graph, us)."""
    out = ["| shape | tokens | format | triton | torch grouped_mm | best peer | ours / peer |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "impl" not in r:
            continue
        g = r["impl"].get("triton_grouped", {})
        gcell = _fmt(_best_us(g)) if _best_us(g) is not None else (
            "error" if "error" in g else "skipped" if "skipped" in g else "-")
        peer = (f"{r['best_peer']} {r['best_peer_us']:.1f}" if "best_peer" in r else "-")
        out.append(f"| {r['shape']} | {r['tokens']} | {r['format']} | "
                   f"{_fmt(_best_us(r['impl'].get('triton')))} | {gcell} | {peer} | "
                   f"{r.get('speedup_vs_best_peer', '-')} ({r.get('ours_best_path', '-')}) |")
    return "\n".join(out) + "\n"


def best_peer(row, bf16_row=None):
    """(name, us) of the fastest correct peer of this row, eager or graph (whichever is lower)."""
    cands = []
    for name, ent in row["impl"].items():
        if name in OURS or "error" in ent or "skipped" in ent:
            continue
        for key in ("eager_us", "graph_us"):
            if key in ent:
                cands.append((ent[key], f"{name}" + (" (graph)" if key == "graph_us" else "")))
    if not cands:
        return None
    t, n = min(cands)
    return n, t


def summarize_row(row):
    paths = [(t, name) for name in OURS
             for t in [_best_us(row["impl"].get(name))] if t is not None]
    best_ours = min(paths)[0] if paths else None
    row["ours_best_us"] = best_ours
    if paths:
        row["ours_best_path"] = min(paths)[1]
    bp = best_peer(row)
    if bp:
        row["best_peer"], row["best_peer_us"] = bp
        if best_ours:
            row["speedup_vs_best_peer"] = round(bp[1] / best_ours, 2)
            row["peer_pct_roofline"] = round(100 * row["roofline_us"] / bp[1], 1)
    if best_ours:
        row["ours_pct_roofline"] = round(100 * row["roofline_us"] / best_ours, 1)


def targets_report(rows):
    """Issue 8's targets, checked row by row (text lines)."""
    out = ["Targets of issue 8 (checked in this run):", ""]
    by = {(r["shape"], r["tokens"], r["format"]): r for r in rows if "impl" in r}
    for r in rows:
        if "impl" not in r or r["format"] == "nvfp4_w4a16" or "speedup_vs_best_peer" not in r:
            continue
        need = 1.25 if r.get("peer_pct_roofline", 100) < 75 else 1.0
        sp = r["speedup_vs_best_peer"]
        ok = sp >= need if need > 1 else sp > 1.0
        out.append(f"- {r['shape']} N={r['tokens']} {r['format']}: {sp}x vs best peer "
                   f"{r['best_peer']} ({r['peer_pct_roofline']}% of roofline, need "
                   f"{'>=1.25x' if need > 1 else '>1x'}): {'MET' if ok else 'MISSED'}"
                   ")")
    r = by.get(("qwen3-30b-a3b", 1, "bf16"))
    if r:
        g = r["impl"].get("triton", {}).get("graph_us")
        out.append(f"- BF16 decode, CUDA graph, 1 token, Qwen3-30B-A3B: {g} us (target <= 30): "
                   f"{'MET' if g is not None and g <= 30 else 'MISSED'}")
    for (shape, n, fmt), r in by.items():
        if fmt != "nvfp4_w4a16" or n > 128:
            continue
        b = by.get((shape, n, "bf16"))
        ours = r.get("ours_best_us")
        if not b or not ours or "best_peer_us" not in b:
            continue
        sp = round(b["best_peer_us"] / ours, 2)
        r["speedup_vs_best_bf16_peer"] = sp
        out.append(f"- NVFP4 {shape} N={n}: {sp}x vs best BF16 peer {b['best_peer']} "
                   f"(need 2.5x): {'MET' if sp >= 2.5 else 'MISSED'}; "
                   f"{r.get('ours_pct_roofline')}% of its 4-bit roofline (need 70%): "
                   f"{'MET' if (r.get('ours_pct_roofline') or 0) >= 70 else 'MISSED'}")
    for (shape, n, fmt), r in by.items():
        if fmt != "fp8_w8a8" or n < 4096:
            continue
        b = by.get((shape, n, "bf16"))
        if b and b.get("ours_best_us") and r.get("ours_best_us"):
            sp = round(b["ours_best_us"] / r["ours_best_us"], 2)
            out.append(f"- FP8 vs our BF16, {shape} N={n}: {sp}x (need 1.4x): "
                       f"{'MET' if sp >= 1.4 else 'MISSED'}")
    return out


def _fmt(v):
    return "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))


def row_line(row):
    parts = [f"{row['shape']:>18} N={row['tokens']:>5} {row['format']:>11}"]
    for name, ent in row["impl"].items():
        if "error" in ent:
            parts.append(f"{name}=ERR")
        elif "skipped" in ent:
            parts.append(f"{name}=skip")
        else:
            parts.append(f"{name}={_fmt(ent.get('eager_us'))}/{_fmt(ent.get('graph_us'))}")
    parts.append(f"roof={row['roofline_us']:.1f}")
    if "speedup_vs_best_peer" in row:
        parts.append(f"x{row['speedup_vs_best_peer']}")
    return " ".join(parts)


def markdown_table(meta, rows):
    c = meta["ceilings"]
    lines = [
        f"Device: {meta['device']} (cc {meta.get('capability')}), torch {meta['torch']}, triton "
        f"{meta.get('triton')}, transformers {meta.get('transformers')}; {meta['date']}",
        f"Command: `{meta['command']}`",
        f"Ceilings measured in this run: HBM read {c['read_GBps']} GB/s (read-only reduction), "
        f"copy {c['copy_GBps']} GB/s (read+write), bf16 mm {c['bf16_TFLOPs']} TFLOP/s, "
        f"fp8 mm {c['fp8_TFLOPs']} TFLOP/s",
        "",
        "Times in us, median of CUDA events; eager / CUDA-graph replay (graph for <= "
        f"{GRAPH_MAX_TOKENS} tokens). roofline = max(bytes of touched experts / read BW, "
        "FLOPs / mm rate). speedup = best peer (eager or graph) / our best (the faster of our "
        "two paths: the Triton GEMMs or torch's grouped GEMMs, which the tuned table picks per "
        "row).",
        "",
        "| shape | tokens | format | triton (ours) | ours: torch grouped_mm | tf grouped_mm | "
        "tf batched_mm | mk_triton best cfg (helpers) | humming | reference | roofline | "
        "ours % roof | best peer | speedup | peer % roof |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(ent):
        if ent is None:
            return "-"
        if "error" in ent:
            return "error"
        if "skipped" in ent:
            return "skipped"
        s = _fmt(ent.get("eager_us"))
        if "graph_us" in ent:
            s += f" / {_fmt(ent['graph_us'])}"
        return s

    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['shape']} | {r['tokens']} | - | skipped ({r['skipped']}) |"
                         + " |" * 11)
            continue
        im = r["impl"]
        mkname = "mk_triton" if r["format"] == "bf16" else "mk_triton_fp8"
        mkc = cell(im.get(mkname))
        if im.get(mkname, {}).get("helpers_us") is not None:
            mkc += f" ({im[mkname]['helpers_us']:.1f}"
            if im[mkname].get("helpers_graph_us") is not None:
                mkc += f" / {im[mkname]['helpers_graph_us']:.1f}"
            mkc += ")"
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['format']} | {cell(im.get('triton'))} | "
            f"{cell(im.get('triton_grouped'))} | {cell(im.get('tf_grouped'))} | {cell(im.get('tf_batched'))} | {mkc} | "
            f"{cell(im.get('humming'))} | "
            f"{cell(im.get('reference'))} | {r['roofline_us']:.1f} | "
            f"{_fmt(r.get('ours_pct_roofline'))} | {r.get('best_peer', '-')} | "
            f"{_fmt(r.get('speedup_vs_best_peer'))} | {_fmt(r.get('peer_pct_roofline'))} |")
    lines.append("")
    errs = [(r["shape"], r["tokens"], r["format"], n, e["error"]) for r in rows if "impl" in r
            for n, e in r["impl"].items() if "error" in e]
    if errs:
        lines.append("Failures (reported, not fatal):")
        lines += [f"- {s} N={t} {f} {n}: {e}" for s, t, f, n, e in errs]
    return "\n".join(lines) + "\n"


def plot(rows, meta, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows if "impl" in r))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.2 * len(shapes), 4.6), squeeze=False)
    series = [
        ("bf16", "triton", "graph_or_eager", "ours bf16", "C0", "-"),
        ("fp8_w8a8", "triton", "graph_or_eager", "ours fp8", "C1", "-"),
        ("nvfp4_w4a16", "triton", "graph_or_eager", "ours nvfp4 (w4a16)", "C2", "-"),
        ("bf16", "triton_grouped", "graph_or_eager", "ours bf16, torch grouped_mm", "C0", "-."),
        ("fp8_w8a8", "triton_grouped", "graph_or_eager", "ours fp8, torch grouped_mm", "C1", "-."),
        ("bf16", "mk_triton", "graph_or_eager", "moe-kernels bf16 (best cfg)", "C3", "--"),
        ("fp8_w8a8", "mk_triton_fp8", "graph_or_eager", "moe-kernels fp8 (best cfg)", "C4", "--"),
        ("bf16", "tf_grouped", "graph_or_eager", "transformers grouped_mm", "C5", ":"),
        ("bf16", "tf_batched", "graph_or_eager", "transformers batched_mm", "C6", ":"),
        ("bf16", "reference", "graph_or_eager", "plain torch reference", "C7", ":"),
    ]
    for ax, shape in zip(axes[0], shapes):
        rs = [r for r in rows if r.get("shape") == shape and "impl" in r]
        for fmt, impl, _, label, color, ls in series:
            pts = []
            for r in rs:
                if r["format"] != fmt:
                    continue
                ent = r["impl"].get(impl, {})
                vals = [ent[k] for k in ("eager_us", "graph_us") if k in ent]
                if vals and "error" not in ent:
                    pts.append((r["tokens"], min(vals)))
            if pts:
                pts.sort()
                ax.plot(*zip(*pts), ls, color=color, marker="o", ms=3, label=label)
        for fmt, color, label in (("bf16", "k", "roofline bf16"),
                                  ("nvfp4_w4a16", "g", "roofline nvfp4")):
            pts = sorted((r["tokens"], r["roofline_us"]) for r in rs if r["format"] == fmt)
            if pts:
                ax.plot(*zip(*pts), "-.", color=color, lw=1, alpha=0.6, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(shape)
        ax.set_xlabel("tokens")
        ax.set_ylabel("us (best of eager / CUDA graph)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"MoE experts forward, {meta['device']} ({meta['date'][:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
