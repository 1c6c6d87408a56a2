"""The reference experts backend: exact dequantization in plain torch, every built-in format.

It is the numerical reference of the conformance suite, not a fast path: weights are dequantized
per expert in every forward, activation quantization of W8A8/W4A4 formats is emulated exactly as
the kernels would quantize.
"""

from __future__ import annotations

import torch

from moe_runtime import formats as F
from moe_runtime.backend_api import Dispatched, ExpertsBackend, ExpertWeights


class ReferenceExperts(ExpertsBackend):
    def prepare(self, weights: ExpertWeights) -> None:
        from moe_runtime.reference_math import dequantize_expert_weights

        expected = self.setup.num_local_experts
        if weights.num_experts != expected:
            raise ValueError(
                f"layer {self.setup.problem.name}: the reference backend got weights of "
                f"{weights.num_experts} experts, expected the {expected} local experts"
            )
        dequantize_expert_weights(weights, torch.float32)  # validates shapes, dtypes and scales
        self.weights = weights

    def _input(self, d: Dispatched) -> torch.Tensor:
        if d.payload == F.UNQUANTIZED:
            return d.hidden
        if d.payload == F.FP8:
            dtype = d.out_dtype or torch.bfloat16
            return (d.hidden.float() * d.hidden_scale.float()).to(dtype)
        raise ValueError(f"reference backend does not accept payload {d.payload!r}")

    def forward(self, d: Dispatched) -> torch.Tensor:
        from moe_runtime.reference_math import reference_fused_experts, reference_masked_experts

        x = self._input(d)
        run_as = self.setup.runs_as
        if d.layout == F.TOKEN_MAJOR:
            return reference_fused_experts(
                x, d.topk_ids, d.topk_weights, self.weights, run_as_format=run_as,
            )
        if d.layout == F.MASKED:
            return reference_masked_experts(
                x, d.masked_m, self.weights, run_as_format=run_as,
            )
        raise ValueError(f"reference backend has no layout {d.layout!r}")
