"""Humming (PyPI ``humming-kernels``, Apache-2.0) as an NVFP4 W4A16 MoE peer for the benchmarks.

Humming is a JIT (NVRTC) quantized-GEMM library; for MoE it offers an *indexed* grouped GEMM (the
Marlin / vLLM ``fused_moe`` convention: ``sorted_ids`` of (token, k) pairs grouped per expert and
padded to the kernel's ``block_shape_m``, one expert id per row block, the padded row count on the
device) and an activation kernel (``process_input``). It ships no routing and no combine, so the
whole layer here is:

1. routing: moe_runtime_triton's own routing kernels (``ops.route_into``: per-expert counts,
   padded sorted order; the same convention, padding rows hold ``N * top_k``), aligned to the block
   M that Humming's heuristics picked for the batch, plus the padded row count (two torch ops);
2. GEMM 1: ``HummingLayer`` over ``w13`` (``[E, 2I, H]``), indexed, ``top_k`` rows per token;
3. SiLU-and-mul: Humming's ``process_input`` with a ``binary_split`` activation (gate = first half);
4. GEMM 2: ``HummingLayer`` over ``w2``, indexed, one row per pair;
5. combine: ``torch.bmm`` of the routing weights with the ``[N, top_k, H]`` pair outputs.

Weights are loaded through Humming's ModelOpt schema (``{"quant_method": "modelopt", "quant_algo":
"NVFP4"}``: ``weight`` uint8 ``[E, out, in/2]``, ``weight_scale`` e4m3 ``[E, out, in/16]``,
``weight_scale_2`` float32 ``[E]``), which keeps the fp32 global scale per expert (exact) when gate
and up share it, as ModelOpt exports do. Everything is sized from shapes (no host sync), so a
forward can be captured in a CUDA graph.

Humming's API (0.1.20) was read from its wheel: ``humming.layer.HummingLayer``,
``humming.tune.get_heuristics_config``, ``humming.kernel.humming.HummingKernel.prepare_kernels``,
``humming.ops.process_input``.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import torch

SILU_MUL = "a / (1.0f + __expf(-a)) * b"
COMPUTE = json.dumps({"gemm_type": "indexed"})


def available() -> str | None:
    """``None`` if Humming imports and a CUDA device is present, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import humming  # noqa: F401
        import humming.layer  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the environment
        return f"{type(exc).__name__}: {exc}"
    return None


class _Proj:
    """One projection of all experts as a Humming indexed-GEMM layer, tile configs fixed per M."""

    def __init__(self, weight, scale, scale_2, dtype):
        from humming.layer import HummingLayer

        E, n, k2 = weight.shape
        self.n, self.k = n, k2 * 2
        with torch.device(weight.device):
            layer = HummingLayer(shape_n=self.n, shape_k=self.k,
                                 weight_config={"quant_method": "modelopt", "quant_algo": "NVFP4"},
                                 num_experts=E, torch_dtype=dtype)
        layer.load_from_tensors({"weight": weight.contiguous(),
                                 "weight_scale": scale.contiguous(),
                                 "weight_scale_2": scale_2.float().reshape(E).contiguous()})
        layer.transform()
        self.layer = layer
        self.config = layer.humming_config
        self.intervals = None
        self.tuning = None

    def plan(self, shape_ms):
        """Fix the tile config per M range from Humming's own heuristics at these M values."""
        from humming.tune import get_heuristics_config

        dev = self.layer.locks.device
        ms = sorted(set(int(m) for m in shape_ms))
        intervals = []
        lo = 0
        for i, m in enumerate(ms):
            cfg = dict(get_heuristics_config(self.config, shape_m=m, gemm_type="indexed",
                                             device=dev))
            hi = (1 << 30) if i == len(ms) - 1 else m
            if intervals and intervals[-1][2] == cfg:
                intervals[-1][1] = hi
            else:
                intervals.append([lo, hi, cfg])
            lo = hi
        self.intervals = intervals
        self.tuning = json.dumps(intervals)

    def compile(self):
        from humming.kernel.humming import HummingKernel

        dev = self.layer.locks.device
        HummingKernel.prepare_kernels(self.config.to_str(), COMPUTE, self.tuning, device=dev)

    def block_m(self, m: int) -> int:
        for lo, hi, cfg in self.intervals:
            if lo < m <= hi:
                return int(cfg["block_shape"][0])
        raise ValueError(f"M={m} outside the planned ranges")

    def __call__(self, inputs, sorted_ids, expert_ids, ntp, top_k, outputs=None):
        return self.layer(inputs, outputs=outputs, sorted_ids=sorted_ids, expert_ids=expert_ids,
                          num_tokens_padded=ntp, top_k=top_k, compute_config=COMPUTE,
                          tuning_config=self.tuning)


class HummingNvfp4Experts:
    """The experts part of an MoE layer (moe-runtime's ``ExpertWeights``, ``nvfp4_w4a16`` or
    ``nvfp4_w4a4`` run weight-only) through Humming: ``__call__(hidden, topk_ids, topk_weights)``.

    ``skips``: topk_ids may hold -1 (experts of other ranks); their pair rows are zeroed.
    """

    def __init__(self, w, dtype=torch.bfloat16, skips=False):
        if w.format not in ("nvfp4_w4a16", "nvfp4_w4a4"):
            raise ValueError(f"Humming peer runs NVFP4 weights, not {w.format}")
        if w.activation != "silu":
            raise ValueError("Humming peer: silu only")
        self.E, self.H, self.I = w.num_experts, w.hidden_size, w.intermediate_size
        self.dtype = dtype
        self.skips = skips
        self.w13 = _Proj(w.w13, w.w13_scale, w.w13_scale_2, dtype)
        self.w2 = _Proj(w.w2, w.w2_scale, w.w2_scale_2, dtype)
        self.act_fallback = None

    def plan(self, pair_counts):
        self.w13.plan(pair_counts)
        self.w2.plan(pair_counts)

    def projections(self):
        return [self.w13, self.w2]

    def compile(self):
        for p in self.projections():
            p.compile()

    def _route(self, topk_ids, bm):
        from moe_runtime_triton import ops

        P = topk_ids.numel()
        R = ops.max_sorted_rows(P, self.E, bm)
        sid = torch.empty(R, dtype=torch.int32, device=topk_ids.device)
        bexp = torch.empty(R // bm, dtype=torch.int32, device=topk_ids.device)
        ops.route_into(topk_ids, self.E, bm, sid, bexp)
        ntp = (bexp >= 0).sum(dtype=torch.int32) * bm
        return sid, bexp, ntp

    def activation(self, y1):
        if self.act_fallback is None:
            from humming import ops as hops

            out, _, _ = hops.process_input(y1, activation_type="binary_split",
                                           activation_impl=SILU_MUL)
            return out
        return (torch.nn.functional.silu(y1[:, :self.I].float()) * y1[:, self.I:].float()).to(
            y1.dtype)

    def __call__(self, hidden, topk_ids, topk_weights, _stages=None):
        N = hidden.shape[0]
        K = topk_ids.shape[1]
        P = N * K
        hidden = hidden.to(self.dtype).contiguous()
        topk_ids = topk_ids.to(torch.int32).contiguous()
        bm1, bm2 = self.w13.block_m(P), self.w2.block_m(P)
        r1 = self._route(topk_ids, bm1)
        r2 = r1 if bm2 == bm1 else self._route(topk_ids, bm2)
        y1 = self.w13(hidden, *r1, top_k=K)
        h = self.activation(y1)
        y2 = torch.zeros(P, self.H, dtype=self.dtype, device=hidden.device) if self.skips else None
        y2 = self.w2(h, *r2, top_k=1, outputs=y2)
        wts = topk_weights.to(self.dtype)
        if self.skips:
            wts = torch.where(topk_ids >= 0, wts, torch.zeros((), dtype=wts.dtype,
                                                              device=wts.device))
        out = torch.bmm(wts.view(N, 1, K), y2.view(N, K, self.H)).view(N, self.H)
        if _stages is not None:
            _stages.update(route=lambda: self._route(topk_ids, bm1),
                           gemm1=lambda: self.w13(hidden, *r1, top_k=K),
                           act=lambda: self.activation(y1),
                           gemm2=lambda: self.w2(h, *r2, top_k=1),
                           combine=lambda: torch.bmm(wts.view(N, 1, K), y2.view(N, K, self.H)))
        return out


def compile_all(peers, workers=8):
    """Compile every projection's kernels, projections in parallel (each compiles its M ranges in
    parallel too: Humming's ``compile_many``)."""
    projs = [p for peer in peers for p in peer.projections()]
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(projs)))) as ex:
        list(ex.map(lambda p: p.compile(), projs))
