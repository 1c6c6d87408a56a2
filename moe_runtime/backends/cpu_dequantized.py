"""The CPU experts backend: weights dequantized once at load, float32 GEMMs in every forward.

``prepare`` dequantizes the local experts exactly (:mod:`moe_runtime.reference_math`) into one
float32 copy laid out for both paths; ``forward`` picks a path from the batch's shape alone: dense
(every local expert on every token, two matrix multiplies; small batches) or grouped (rows sorted
by expert, ``torch._grouped_mm``, or one ``torch.mm`` per expert where that cannot run). FP8 W8A8
activations are quantized and dequantized as the reference does. Why float32, and the paths in
detail: docs/cpu-dequantized.md.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F_nn

from moe_runtime import formats as F
from moe_runtime.backend_api import Dispatched, ExpertsBackend, ExpertWeights
from moe_runtime.dtypes import torch_dtype
from moe_runtime.quant import fake_quantize_fp8

COMPUTE_DTYPE = torch.float32
# The dense path is taken while (tokens x local experts) x (multiply-adds of one expert on one
# token) stays under this, about 85 tokens for the embedded default model's layers (8 experts,
# hidden 64, intermediate 32), where the grouped path overtook it between 64 and 128 tokens.
# Experts of real models exceed it at one token: they always take the grouped path.
DENSE_MAX_MACS = 1 << 22

_FORMATS = {f.name: f for f in F.BUILTIN_FORMATS}


@functools.cache
def grouped_mm_runs() -> bool:
    """Whether ``torch._grouped_mm`` multiplies float32 on CPU in this torch (once per process)."""
    try:
        a, b = torch.ones(4, 4), torch.ones(1, 4, 4)
        out = torch._grouped_mm(a, b, offs=torch.tensor([4], dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError, TypeError):
        return False
    return bool(torch.equal(out, a @ b[0]))


def grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, *, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(x, w, offs=offs)`` as one ``torch.mm`` per expert that has rows."""
    out = x.new_empty((x.shape[0], w.shape[2]))
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(x[start:end], w[e], out=out[start:end])
        start = end
    return out


def _activation(name: str):
    if name == F.SILU:
        return F_nn.silu
    if name == F.GELU:
        return lambda x: F_nn.gelu(x, approximate="none")  # the reference's exact GELU
    raise ValueError(f"cpu_dequantized has no activation {name!r}; it runs silu and gelu")


class CpuDequantizedExperts(ExpertsBackend):
    """Experts on dequantized float32 weights: a dense path for small batches, grouped GEMMs else."""

    def prepare(self, weights: ExpertWeights) -> None:
        from moe_runtime.plugin.builtin import CPU_DEQUANTIZED
        from moe_runtime.reference_math import dequantize_expert_weights

        setup = self.setup
        CPU_DEQUANTIZED.require_setup(setup)
        if weights.format != setup.problem.format:
            raise ValueError(f"layer {setup.problem.name}: got {weights.format} weights for a "
                             f"{setup.problem.format} layer")
        if weights.num_experts != setup.num_local_experts:
            raise ValueError(
                f"layer {setup.problem.name}: got weights of {weights.num_experts} experts, "
                f"expected the {setup.num_local_experts} local ones")
        quantizes = _FORMATS[setup.runs_as].activation_payload
        if quantizes not in (F.UNQUANTIZED, F.FP8):  # the declaration admits no other
            raise ValueError(f"cpu_dequantized does not quantize activations to {quantizes}")
        self.fp8_scales = None
        if quantizes == F.FP8:
            self.fp8_scales = (weights.a13_scale.to(COMPUTE_DTYPE).reshape(()),
                               weights.a2_scale.to(COMPUTE_DTYPE).reshape(()))
        self.act = _activation(weights.activation)
        e, i, h = weights.num_experts, weights.intermediate_size, weights.hidden_size
        self.num_experts, self.inter, self.hidden = e, i, h
        self.dense_limit = DENSE_MAX_MACS // max(1, e * 3 * h * i)  # tokens the dense path takes
        self.out_dtype = torch_dtype(setup.problem.dtype)
        w13, w2 = dequantize_expert_weights(weights, COMPUTE_DTYPE)  # exact, [E,2I,H], [E,H,I]
        # Both paths read one copy. W2 as [E, I, H] (grouped: per-expert blocks w2_t; dense: the
        # same memory as [E*I, H], one product that sums over experts). W13 as [E, H, 2I] where
        # only the grouped path runs; where the dense path may run, as [H, E*2I] (dense: one
        # x @ w13_cat) with the grouped path on per-expert strided views of it.
        if self.dense_limit:
            self.w13_cat = w13.permute(2, 0, 1).reshape(h, e * 2 * i).contiguous()
            self.w13_t = self.w13_cat.view(h, e, 2 * i).permute(1, 0, 2)
        else:
            self.w13_cat = None
            self.w13_t = w13.transpose(1, 2).contiguous()
        self.w2_t = w2.transpose(1, 2).contiguous()
        self.w2_cat = self.w2_t.view(e * i, h)
        # _grouped_mm takes operands whose rows are multiples of 16 bytes only
        per_16_bytes = 16 // COMPUTE_DTYPE.itemsize
        aligned = h % per_16_bytes == 0 and i % per_16_bytes == 0
        self.grouped_mm = torch._grouped_mm if aligned and grouped_mm_runs() else grouped_mm_loop

    # ------------------------------------------------------------------------------ forward

    def forward(self, d: Dispatched) -> torch.Tensor:
        out_dtype = d.out_dtype or self.out_dtype
        x = self._input(d)
        if d.layout == F.TOKEN_MAJOR:
            n, k = d.topk_ids.shape
            if n == 0 or k == 0:
                return x.new_zeros((n, self.hidden)).to(out_dtype)
            if n <= self.dense_limit:
                return self._dense(x, d.topk_ids, d.topk_weights).to(out_dtype)
            return self._grouped(x, d.topk_ids, d.topk_weights).to(out_dtype)
        if d.layout == F.MASKED:
            return self._masked(x).to(out_dtype)
        raise ValueError(f"cpu_dequantized has no layout {d.layout!r}")

    def _input(self, d: Dispatched) -> torch.Tensor:
        """GEMM 1's input in float32: fp8 payloads dequantized, fp8 formats' inputs quantized."""
        if d.payload == F.FP8:
            return d.hidden.to(COMPUTE_DTYPE) * d.hidden_scale.to(COMPUTE_DTYPE)
        x = d.hidden.to(COMPUTE_DTYPE)
        if self.fp8_scales is not None:
            x = fake_quantize_fp8(x, self.fp8_scales[0])
        return x

    def _gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        inter = self.act(gate) * up
        if self.fp8_scales is not None:
            inter = fake_quantize_fp8(inter, self.fp8_scales[1])
        return inter

    def _dense(self, x, topk_ids, topk_weights) -> torch.Tensor:
        """Every local expert on every token; routing weights (0 where not routed) fold GEMM 2's
        sum over experts into one product. Ids of ``-1`` land in a dropped column. (An expert
        whose float32 intermediate overflowed for a token not routed to it would add NaN; finite
        16-bit inputs and weights of a model do not get there.)"""
        n, e, i = x.shape[0], self.num_experts, self.inter
        ids = topk_ids.long().remainder(e + 1)  # -1 -> e, the dropped column
        routed = x.new_zeros((n, e + 1)).scatter_add_(1, ids, topk_weights.to(COMPUTE_DTYPE))
        gate_up = (x @ self.w13_cat).view(n, e, 2 * i)
        inter = self._gated(gate_up[..., :i], gate_up[..., i:])
        inter = inter * routed[:, :e].unsqueeze(-1)
        return inter.view(n, e * i) @ self.w2_cat

    def _grouped(self, x, topk_ids, topk_weights) -> torch.Tensor:
        """Rows sorted by expert, both GEMMs grouped; slots of ``-1`` sort to the end, unused."""
        n, k = topk_ids.shape
        e, i = self.num_experts, self.inter
        flat = topk_ids.reshape(-1).long().remainder(e + 1)  # -1 -> e, sorted past every expert
        experts, order = torch.sort(flat)
        ends = torch.bincount(experts, minlength=e + 1)[:e].cumsum(0, dtype=torch.int32)
        used = int(ends[-1])  # a CPU tensor: no device round trip
        order = order[:used]
        token = order.div(k, rounding_mode="floor")
        gate_up = self.grouped_mm(x.index_select(0, token), self.w13_t, offs=ends)
        inter = self._gated(gate_up[:, :i], gate_up[:, i:])
        y = self.grouped_mm(inter, self.w2_t, offs=ends)
        y = y * topk_weights.reshape(-1).to(COMPUTE_DTYPE).index_select(0, order).unsqueeze(1)
        return x.new_zeros((n, self.hidden)).index_add_(0, token, y)

    def _masked(self, x) -> torch.Tensor:
        """``[E, M, H]`` blocks in, unweighted ``[E, M, H]`` out (rows past masked_m: ignored)."""
        i = self.inter
        gate_up = torch.bmm(x, self.w13_t)
        inter = self._gated(gate_up[..., :i], gate_up[..., i:])
        return torch.bmm(inter, self.w2_t)
