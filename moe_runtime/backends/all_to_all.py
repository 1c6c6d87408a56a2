"""Expert parallelism over ``torch.distributed`` all-to-all (NCCL on GPU, gloo on CPU).

Experts are split into contiguous blocks, one per rank (:mod:`moe_runtime.placement`). Each token
goes once to every rank that owns at least one of its experts, with its top-k ids rewritten to that
rank's local ids (``-1`` elsewhere); the experts backend returns the weighted partial sum, and
combine sends the partial sums back and adds them in the original token order. The split sizes are
exchanged first, a host synchronisation this reference backend accepts.
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist

from moe_runtime import formats as F
from moe_runtime.backend_api import CommBackend, Dispatched
from moe_runtime.placement import owner_table


@attrs.frozen
class A2AHandle:
    """What combine needs: which local token each sent row came from, and the split sizes."""

    token_index: torch.Tensor  # [rows_sent] index into the rank's tokens, grouped by destination
    send_counts: list[int]
    recv_counts: list[int]
    num_tokens: int
    dtype: torch.dtype


def expert_owner_table(num_experts: int, world: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(owner [E], local_id [E])``: :func:`moe_runtime.placement.owner_table`."""
    return owner_table(num_experts, world, device)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Rows of any dtype as uint8 rows (gloo does not carry bf16 or fp8); zero rows allowed."""
    width = t.element_size()
    for d in t.shape[1:]:
        width *= d
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], width)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor:
    return b.contiguous().view(dtype).reshape(b.shape[0], cols)


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    if len(send) == 1:  # a group of one rank: nothing to move (no process group needed)
        return rows
    out = rows.new_empty((sum(recv), rows.shape[1]))
    dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
    return out


class TorchAllToAll(CommBackend):
    """Reference expert-parallel dispatch/combine, token-major, any world size."""

    def __init__(self, *, setup):
        super().__init__(setup=setup)
        self.group = setup.group
        self.world = setup.ep_size
        self.rank = setup.ep_rank
        if setup.layout != F.TOKEN_MAJOR:
            raise ValueError(f"torch_all_to_all produces token_major, not {setup.layout!r}")
        self._tables: dict = {}

    def _owner(self, device):
        key = str(device)
        if key not in self._tables:
            self._tables[key] = expert_owner_table(self.setup.problem.num_experts, self.world,
                                                   device)
        return self._tables[key]

    def dispatch(self, hidden, topk_ids, topk_weights, *, input_scale=None):
        n, h = hidden.shape
        owner, local = self._owner(hidden.device)
        ids = topk_ids.long()
        tok_owner = owner[ids]  # [N, K]
        dest_mask = torch.stack([(tok_owner == r).any(1) for r in range(self.world)], 0)  # [W, N]
        send_counts_t = dest_mask.sum(1)
        token_index = torch.cat([torch.nonzero(dest_mask[r]).flatten() for r in range(self.world)])
        dest_rank = torch.repeat_interleave(
            torch.arange(self.world, device=hidden.device), send_counts_t
        )
        # Local ids for the destination, -1 where the expert lives on another rank.
        sent_ids = torch.where(
            tok_owner[token_index] == dest_rank[:, None], local[ids[token_index]], -1
        ).to(torch.int32)
        sent_w = topk_weights[token_index].float()

        recv_counts_t = torch.empty_like(send_counts_t)
        if self.world > 1:
            dist.all_to_all_single(recv_counts_t, send_counts_t, group=self.group)
        else:
            recv_counts_t.copy_(send_counts_t)
        send_counts = send_counts_t.tolist()
        recv_counts = recv_counts_t.tolist()

        payload, scale = self.setup.payload, None
        rows = hidden[token_index]
        if payload == F.FP8:
            if input_scale is None:
                raise ValueError("fp8 dispatch payload needs the layer's input scale")
            from moe_runtime.quant.fp8 import quantize_fp8_per_tensor

            rows = quantize_fp8_per_tensor(rows.float(), input_scale)  # one rounding, as kernels do
            scale = input_scale
        elif payload != F.UNQUANTIZED:
            raise ValueError(f"torch_all_to_all carries unquantized or fp8, not {payload!r}")
        recv_rows = _from_bytes(
            _exchange(_as_bytes(rows), send_counts, recv_counts, self.group), rows.dtype, h
        )
        k = ids.shape[1]
        recv_ids = _from_bytes(
            _exchange(_as_bytes(sent_ids), send_counts, recv_counts, self.group), torch.int32, k
        )
        recv_w = _from_bytes(
            _exchange(_as_bytes(sent_w), send_counts, recv_counts, self.group), torch.float32, k
        )
        d = Dispatched(F.TOKEN_MAJOR, recv_rows, payload=payload, hidden_scale=scale,
                       topk_ids=recv_ids, topk_weights=recv_w, out_dtype=hidden.dtype)
        return d, A2AHandle(token_index, send_counts, recv_counts, n, hidden.dtype)

    def combine(self, expert_out, handle: A2AHandle):
        h = expert_out.shape[1]
        back = _from_bytes(
            _exchange(_as_bytes(expert_out.float()), handle.recv_counts, handle.send_counts,
                      self.group),
            torch.float32, h,
        )
        out = torch.zeros((handle.num_tokens, h), dtype=torch.float32, device=expert_out.device)
        out.index_add_(0, handle.token_index, back)
        return out.to(handle.dtype)
