"""An honest experts backend written apart from the reference, computing as kernels do: formats
that quantize activations on exact quantized operands with float32 accumulation (as FP8/FP4
tensor cores), weight-only formats on weights staged to the model dtype (as W4A16 kernels); GEMM
outputs and the gated intermediate rounded to the model dtype; every declared layout and
payload."""

import torch

from moe_runtime import formats
from moe_runtime.backend_api import ExpertsBackend
from moe_runtime.quant import fake_quantize_fp8, fake_quantize_nvfp4_activation
from moe_runtime.reference_math import dequantize_expert_weights


class HonestExperts(ExpertsBackend):
    def prepare(self, weights):
        self.w = weights
        self.w13, self.w2 = dequantize_expert_weights(weights, torch.float32)
        self.fmt = self.setup.runs_as
        self.payload = {f.name: f.activation_payload for f in formats.BUILTIN_FORMATS}[self.fmt]

    def _act_q(self, x, scale):
        payload = self.payload
        if payload == "fp8":
            return fake_quantize_fp8(x.float(), scale, torch.float32)
        if payload == "nvfp4":
            return fake_quantize_nvfp4_activation(x.float(), scale, torch.float32)
        return x

    def _mlp(self, x, e, dtype):
        i = self.w.intermediate_size
        if self.payload == "unquantized":  # weights staged to the model dtype
            w13, w2, cdt = self.w13[e].to(dtype), self.w2[e].to(dtype), dtype
        else:  # exact quantized operands, float32 accumulation
            w13, w2, cdt = self.w13[e], self.w2[e], torch.float32
        x = self._act_q(x, self.w.a13_scale).to(cdt)
        gu = (x @ w13.T).to(dtype).float()
        g, u = gu[:, :i], gu[:, i:]
        a = torch.nn.functional.silu(g) if self.w.activation == "silu" else (
            torch.nn.functional.gelu(g))
        inter = self._act_q((a * u).to(dtype), self.w.a2_scale).to(cdt)
        return (inter @ w2.T).to(dtype).float()

    def _input(self, d):
        if d.payload == formats.FP8:
            return (d.hidden.float() * d.hidden_scale.float()).to(d.out_dtype)
        return d.hidden

    def forward(self, d):
        x = self._input(d)
        dtype = d.out_dtype or x.dtype
        if d.layout == formats.MASKED:
            out = torch.zeros(x.shape, dtype=torch.float32)
            for e in range(x.shape[0]):
                m = int(d.masked_m[e])
                if m:
                    out[e, :m] = self._mlp(x[e, :m], e, dtype)
            return out.to(dtype)
        n, k = d.topk_ids.shape
        out = torch.zeros((n, x.shape[1]), dtype=torch.float32)
        for e in range(self.w.num_experts):
            rows, slots = torch.nonzero(d.topk_ids == e, as_tuple=True)
            if rows.numel():
                y = self._mlp(x[rows], e, dtype)
                out.index_add_(0, rows, y * d.topk_weights[rows, slots].float().unsqueeze(1))
        return out.to(dtype)
