"""Local communication: no expert parallelism, dispatch and combine move nothing."""

from __future__ import annotations

import attrs
import torch

from moe_runtime import formats as F
from moe_runtime.backend_api import CommBackend, Dispatched


@attrs.frozen
class LocalHandle:
    num_tokens: int
    top_k: int
    topk_ids: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None
    slot: torch.Tensor | None = None  # masked layout: row of each (token, k) in its expert's block


class LocalComm(CommBackend):
    """Every expert is local. Token-major passes tokens through; masked builds the
    ``[E, max_tokens, H]`` layout on the device (fixed ``max_tokens`` = tokens in the batch)."""

    def dispatch(self, hidden, topk_ids, topk_weights, *, input_scale=None):
        n = hidden.shape[0]
        k = topk_ids.shape[1] if topk_ids.dim() == 2 else 0
        if self.setup.layout == F.TOKEN_MAJOR:
            d = Dispatched(F.TOKEN_MAJOR, hidden, topk_ids=topk_ids, topk_weights=topk_weights,
                           out_dtype=hidden.dtype)
            return d, LocalHandle(n, k)
        if self.setup.layout != F.MASKED:
            raise ValueError(f"local communication has no layout {self.setup.layout!r}")
        e = self.setup.problem.num_experts
        flat = topk_ids.reshape(-1).long()
        # Position of each (token, k) among the rows routed to the same expert, stable in token
        # order: a one-hot cumulative sum, no host sync.
        onehot = torch.nn.functional.one_hot(flat, e).to(torch.int32)
        slot = ((onehot.cumsum(0) - 1) * onehot).sum(1)
        masked_m = onehot.sum(0).to(torch.int32)
        m = max(n, 1)
        buf = hidden.new_zeros((e, m, hidden.shape[1]))
        buf[flat, slot] = hidden.repeat_interleave(k, dim=0)
        d = Dispatched(F.MASKED, buf, masked_m=masked_m, out_dtype=hidden.dtype)
        return d, LocalHandle(n, k, topk_ids, topk_weights, slot)

    def combine(self, expert_out, handle: LocalHandle):
        if self.setup.layout == F.TOKEN_MAJOR:
            return expert_out
        flat = handle.topk_ids.reshape(-1).long()
        rows = expert_out[flat, handle.slot].float().view(
            handle.num_tokens, handle.top_k, expert_out.shape[-1])
        out = (rows * handle.topk_weights.unsqueeze(-1)).sum(1)
        return out.to(expert_out.dtype)
