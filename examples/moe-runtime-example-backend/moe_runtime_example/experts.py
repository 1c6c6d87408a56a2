"""The example experts backend: one MoE layer's experts as two batched matmuls, in plain torch.

Imported only when the planner selects ``example_bmm`` (the factory string in ``plugin.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_runtime import formats
from moe_runtime.backend_api import Dispatched, ExpertsBackend, ExpertWeights

_DTYPES = {formats.BF16: torch.bfloat16, formats.FP16: torch.float16}
_ACTIVATIONS = {formats.SILU: F.silu, formats.GELU: F.gelu}  # exact (erf) GELU, as the reference


class BmmExperts(ExpertsBackend):
    """BF16/FP16 experts: every local expert in one ``torch.bmm`` per GEMM.

    ``masked`` input already is a ``[experts, rows, hidden]`` block. ``token_major`` input is
    grouped by expert into such a block first, padded to the busiest expert's row count: sizing it
    synchronises with the host in every forward, which is simple but not the fastest way.
    """

    def prepare(self, weights: ExpertWeights) -> None:
        setup = self.setup
        if weights.format not in _DTYPES or setup.runs_as != weights.format:
            raise ValueError(
                f"example_bmm runs bf16 and fp16 weights as stored, not {weights.format!r} run "
                f"as {setup.runs_as!r}"
            )
        if weights.num_experts != setup.num_local_experts:
            raise ValueError(
                f"layer {setup.problem.name}: got weights of {weights.num_experts} experts, "
                f"expected the {setup.num_local_experts} local ones"
            )
        self.dtype = _DTYPES[weights.format]
        self.act = _ACTIVATIONS[weights.activation]
        # bmm multiplies [E, rows, H] by [E, H, 2I]: transpose once here, not in every forward.
        self.w13 = weights.w13.to(setup.device, self.dtype).transpose(1, 2).contiguous()
        self.w2 = weights.w2.to(setup.device, self.dtype).transpose(1, 2).contiguous()

    def forward(self, d: Dispatched) -> torch.Tensor:
        if d.payload != formats.UNQUANTIZED:
            raise ValueError(f"example_bmm takes unquantized activations, not {d.payload!r}")
        out_dtype = d.out_dtype or d.hidden.dtype
        if d.layout == formats.MASKED:
            # [E, M, H] in, [E, M, H] out, unweighted; rows past masked_m are ignored by combine.
            return self._experts(d.hidden).to(out_dtype)
        if d.layout == formats.TOKEN_MAJOR:
            return self._token_major(d.hidden, d.topk_ids, d.topk_weights).to(out_dtype)
        raise ValueError(f"example_bmm has no layout {d.layout!r}")

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        """``down(act(gate(x)) * up(x))`` for every expert's rows: ``[E, M, H] -> [E, M, H]``."""
        gate, up = torch.bmm(x.to(self.dtype), self.w13).float().chunk(2, dim=-1)
        return torch.bmm((self.act(gate) * up).to(self.dtype), self.w2)

    def _token_major(self, hidden, topk_ids, topk_weights) -> torch.Tensor:
        """``out[n] = sum over valid k of topk_weights[n, k] * expert_{ids[n, k]}(hidden[n])``."""
        num_tokens, top_k = topk_ids.shape
        out = torch.zeros((num_tokens, hidden.shape[1]), dtype=torch.float32,
                          device=hidden.device)
        ids = topk_ids.reshape(-1)
        slot = torch.nonzero(ids >= 0).flatten()  # (token, k) pairs whose expert is local
        if slot.numel() == 0:
            return out
        expert, order = torch.sort(ids[slot].long(), stable=True)
        slot = slot[order]
        token = slot // top_k
        counts = torch.bincount(expert, minlength=self.w13.shape[0])
        first = torch.cumsum(counts, 0) - counts
        row = torch.arange(slot.numel(), device=hidden.device) - first[expert]
        block = hidden.new_zeros((self.w13.shape[0], int(counts.max()), hidden.shape[1]))
        block[expert, row] = hidden[token]
        y = self._experts(block)[expert, row].float()
        weight = topk_weights.reshape(-1)[slot].float().unsqueeze(1)
        return out.index_add_(0, token, y * weight)
