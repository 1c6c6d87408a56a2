"""A SIMULATION of DeepEP's ``Buffer`` outputs on torch.distributed (gloo), for CPU tests only.

This is not DeepEP and proves nothing about DeepEP itself: it reproduces, in plain Python loops
over messages exchanged with a gloo all-to-all, the *shapes and semantics* of what DeepEP's Python
API returns, as read from DeepEP's source (README.md, "Sources"), so that the plugin's conversion
code (``moe_runtime_deepep.backend`` and ``.layout``) can be checked on CPU processes against the
reference all-to-all. Where DeepEP's behaviour is unspecified the simulation is deliberately
unfriendly:

- low-latency rows of one expert arrive in a shuffled order of source ranks, and shuffled inside
  a source rank (DeepEP assigns slots with atomics), and rows past ``recv_count`` hold NaN (DeepEP
  leaves them uninitialised);
- ``recv_count`` is a view into one of two alternating internal buffers that the call after next
  overwrites (DeepEP's ``packed_recv_count`` is ``from_blob`` of its double-buffered RDMA region);
- the ``EP_HOST_ASSERT``s that matter here raise ``RuntimeError`` (bf16 only, ``x.size(0) <=
  num_max_dispatch_tokens_per_rank``, ``num_experts % ranks == 0``, top-k bound).

Two API variants, distinguished only by their signatures (as the plugin detects them):
:class:`SimulatedBufferV100` (PyPI deep-ep 1.0.0: ``low_latency_dispatch`` always casts to FP8) and
:class:`SimulatedBufferV12` (1.1.0-1.2.x: ``use_fp8``, ``allow_nvlink_for_low_latency_mode``,
``is_sm90_compiled``, 5-tuple low-latency handle).
"""

from __future__ import annotations

import io
import pickle
import random

import torch
import torch.distributed as dist

LL_MAX_TOPK = 9
FP8_MAX = 448.0


class SimEvent:
    def current_stream_wait(self) -> None:
        pass


class SimConfig:
    def __init__(self, num_sms: int) -> None:
        self.num_sms = num_sms

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 1 << 20

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0


def _sim_assert(cond: bool, what: str) -> None:
    if not cond:
        raise RuntimeError(f"simulated DeepEP EP_HOST_ASSERT failed: {what}")


def exchange_objects(per_dest: list, group=None) -> list:
    """Send ``per_dest[r]`` (any picklable object) to rank ``r``; return what each rank sent here.
    Built on ``all_to_all_single`` of pickled bytes (works on gloo)."""
    world = dist.get_world_size(group)
    blobs = []
    for obj in per_dest:
        buf = io.BytesIO()
        pickle.dump(obj, buf)
        blobs.append(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))
    send_counts = torch.tensor([b.numel() for b in blobs], dtype=torch.int64)
    recv_counts = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    out = torch.empty(int(recv_counts.sum()), dtype=torch.uint8)
    dist.all_to_all_single(out, torch.cat(blobs), recv_counts.tolist(), send_counts.tolist(),
                           group=group)
    return [pickle.loads(chunk.numpy().tobytes()) for chunk in out.split(recv_counts.tolist())]


class _SimulatedBufferBase:
    """What both variants share. Construct with the process group, like ``deep_ep.Buffer``."""

    num_sms: int = 20
    topk_idx_dtype = torch.int64

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 1) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self._ll_calls = 0
        self._ll_counts = [torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)]
        self._rng = random.Random(1234 + self.rank)
        self.calls: list[tuple[str, int]] = []  # (kind, tokens): the tests read this

    # -------------------------------------------------------------- static API

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        _sim_assert(new_num_sms % 2 == 0, "the SM count must be even")
        _SimulatedBufferBase.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> SimConfig:
        return SimConfig(_SimulatedBufferBase.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> SimConfig:
        return SimConfig(_SimulatedBufferBase.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        return num_experts * num_max_dispatch_tokens_per_rank * hidden * 2 * 4

    # -------------------------------------------------------------- normal mode

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        _sim_assert(topk_idx.dtype == torch.int64, "topk_idx must be int64")
        _sim_assert(num_experts % self.group_size == 0, "num_experts % num_ranks == 0")
        per_rank_experts = num_experts // self.group_size
        n = topk_idx.shape[0]
        in_rank = torch.zeros((n, self.group_size), dtype=torch.bool)
        per_expert = torch.zeros(num_experts, dtype=torch.int32)
        for t in range(n):
            for e in topk_idx[t].tolist():
                if e >= 0:
                    in_rank[t, e // per_rank_experts] = True
                    per_expert[e] += 1
        per_rank = in_rank.sum(0).to(torch.int32)
        self._num_experts = num_experts
        return per_rank, None, per_expert, in_rank, SimEvent()

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment=1, config=None, previous_event=None,
                 async_finish=False, allocate_on_comm_stream=False):
        _sim_assert(handle is None, "the simulation has no cached-handle dispatch")
        values, scales = x if isinstance(x, tuple) else (x, None)
        if scales is None:
            _sim_assert(values.dtype == torch.bfloat16, "x must be bfloat16 (or an fp8 tuple)")
        else:
            _sim_assert(values.element_size() == 1, "fp8 x must have 1-byte elements")
            _sim_assert(scales.dtype == torch.float32 and scales.shape[0] == values.shape[0],
                        "x_scales float32 [num_tokens, ...]")
        _sim_assert(topk_weights.dtype == torch.float32, "topk_weights float32")
        num_experts = num_tokens_per_expert.shape[0]
        w = self.group_size
        local = num_experts // w
        self.calls.append(("dispatch", values.shape[0]))
        per_dest = [[] for _ in range(w)]
        for t in range(values.shape[0]):
            for r in range(w):
                if not bool(is_token_in_rank[t, r]):
                    continue
                lo, hi = r * local, (r + 1) * local
                ids = [(e - lo if lo <= e < hi else -1) for e in topk_idx[t].tolist()]
                wts = [(wt if i >= 0 else 0.0)
                       for i, wt in zip(ids, topk_weights[t].tolist(), strict=True)]
                # rows travel as bytes (fp8 tensors do not pickle) and are viewed back on arrival
                per_dest[r].append((t, values[t].contiguous().view(torch.uint8).clone(),
                                    None if scales is None else scales[t].clone(), ids, wts))
        received = exchange_objects(per_dest, self.group)
        rows, srows, ids, wts, src = [], [], [], [], []
        for s, msgs in enumerate(received):  # grouped by source rank, source token order
            for t, row, srow, i, wt in msgs:
                rows.append(row.view(values.dtype))
                srows.append(srow)
                ids.append(i)
                wts.append(wt)
                src.append((s, t))
        h = values.shape[1]
        k = topk_idx.shape[1]
        recv_x = torch.stack(rows) if rows else values.new_empty((0, h))
        recv_idx = torch.tensor(ids, dtype=torch.int64).view(-1, k)
        recv_w = torch.tensor(wts, dtype=torch.float32).view(-1, k)
        counts = [0] * local
        for row in ids:
            for i in row:
                if i >= 0:
                    counts[i] += 1
        counts = [-(-c // expert_alignment) * expert_alignment for c in counts]
        sim_handle = {"src": src, "num_tokens": values.shape[0]}
        if scales is not None:
            recv_s = torch.stack(srows) if srows else scales.new_empty((0,) + scales.shape[1:])
            recv_x = (recv_x, recv_s)
        return recv_x, recv_idx, recv_w, counts, sim_handle, SimEvent()

    def combine(self, x, handle, topk_weights=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        _sim_assert(x.dtype == torch.bfloat16, "combine x must be bfloat16")
        src = handle["src"]
        _sim_assert(x.shape[0] == len(src), "combine x has one row per received token")
        per_dest = [[] for _ in range(self.group_size)]
        for row, (s, t) in zip(x, src, strict=True):
            per_dest[s].append((t, row.clone()))
        back = exchange_objects(per_dest, self.group)
        out = torch.zeros((handle["num_tokens"], x.shape[1]), dtype=torch.float32)
        for msgs in back:  # source ranks in order, like the kernel's reduction over ranks
            for t, row in msgs:
                out[t] += row.float()
        return out.to(torch.bfloat16), None, SimEvent()

    # -------------------------------------------------------------- low-latency mode

    def _ll_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8):
        m = num_max_dispatch_tokens_per_rank
        w = self.group_size
        _sim_assert(self.low_latency_mode, "low_latency_mode buffer")
        _sim_assert(x.dim() == 2 and x.dtype == torch.bfloat16, "x bf16 [num_tokens, hidden]")
        _sim_assert(x.shape[1] % 128 == 0, "hidden % 128 == 0")
        _sim_assert(x.shape[0] == topk_idx.shape[0] and x.shape[0] <= m,
                    "x.size(0) <= num_max_dispatch_tokens_per_rank")
        _sim_assert(topk_idx.dtype == torch.int64, "topk_idx int64")
        _sim_assert(num_experts % w == 0, "num_experts % num_ranks == 0")
        _sim_assert(topk_idx.shape[1] <= LL_MAX_TOPK, "num_topk <= kNumMaxTopK")
        self.calls.append(("low_latency_dispatch", x.shape[0]))
        local = num_experts // w
        h = x.shape[1]
        per_dest = [[] for _ in range(w)]
        for t in range(x.shape[0]):
            for e in topk_idx[t].tolist():
                if e >= 0:
                    per_dest[e // local].append((t, e % local, x[t].clone()))
        received = exchange_objects(per_dest, self.group)
        recv_x = torch.full((local, m * w, h), float("nan"), dtype=torch.bfloat16)
        src_info = torch.full((local, m * w), -1, dtype=torch.int32)
        layout_range = torch.zeros((local, w, 2), dtype=torch.int64)  # (begin, count)
        counts = torch.zeros(local, dtype=torch.int32)
        for e in range(local):
            sources = list(range(w))
            self._rng.shuffle(sources)  # arrival order of source ranks
            for s in sources:
                msgs = [(t, row) for t, le, row in received[s] if le == e]
                self._rng.shuffle(msgs)  # slot order inside a source rank
                begin = int(counts[e])
                for j, (t, row) in enumerate(msgs):
                    recv_x[e, begin + j] = row
                    src_info[e, begin + j] = t
                layout_range[e, s] = torch.tensor([begin, len(msgs)])
                counts[e] += len(msgs)
        # recv_count aliases one of two alternating internal buffers.
        slot = self._ll_calls % 2
        self._ll_calls += 1
        self._ll_counts[slot] = counts.clone()
        recv_count = self._ll_counts[slot][:]
        state = {"src_info": src_info, "layout_range": layout_range, "hidden": h,
                 "num_tokens": x.shape[0]}
        if use_fp8:
            blocks = recv_x.float().view(local, m * w, h // 128, 128)
            amax = blocks.abs().amax(-1).clamp(min=1e-4)
            scale_inv = amax / FP8_MAX
            q = (blocks / scale_inv[..., None]).to(torch.float8_e4m3fn).view(local, m * w, h)
            return (q, scale_inv), recv_count, state
        return recv_x, recv_count, state

    def _ll_combine(self, x, topk_idx, topk_weights, state, num_experts):
        _sim_assert(x.dtype == torch.bfloat16, "combine x must be bfloat16")
        local, rows, h = x.shape
        _sim_assert(rows == state["src_info"].shape[1] and h == state["hidden"],
                    "x is [num_local_experts, M * num_ranks, hidden]")
        self.calls.append(("low_latency_combine", topk_idx.shape[0]))
        per_dest = [[] for _ in range(self.group_size)]
        for e in range(local):
            for s in range(self.group_size):
                begin, count = state["layout_range"][e, s].tolist()
                for j in range(begin, begin + count):
                    t = int(state["src_info"][e, j])
                    per_dest[s].append((t, self.rank * local + e, x[e, j].clone()))
        back = exchange_objects(per_dest, self.group)
        got = {}
        for msgs in back:
            for t, gid, row in msgs:
                got[(t, gid)] = row
        n = topk_idx.shape[0]
        out = torch.zeros((n, h), dtype=torch.float32)
        for t in range(n):
            for kk, gid in enumerate(topk_idx[t].tolist()):
                if gid >= 0:
                    out[t] += got[(t, gid)].float() * float(topk_weights[t, kk])
        return out.to(torch.bfloat16)


class SimulatedBufferV100(_SimulatedBufferBase):
    """Simulation of the PyPI deep-ep 1.0.0 API: ``low_latency_dispatch`` has no ``use_fp8`` and
    always returns ``(fp8 values, per-token 128-channel float32 scales)``."""

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             async_finish=False, return_recv_hook=False):
        recv, count, state = self._ll_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank,
                                               num_experts, use_fp8=True)
        handle = (state, None, num_max_dispatch_tokens_per_rank, num_experts)
        return recv, count, handle, SimEvent(), None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, async_finish=False,
                            return_recv_hook=False):
        state, _, _, num_experts = handle
        return self._ll_combine(x, topk_idx, topk_weights, state, num_experts), SimEvent(), None


class SimulatedBufferV12(_SimulatedBufferBase):
    """Simulation of the 1.1.0-1.2.x API (``use_fp8``, NVLink flag, ``is_sm90_compiled``)."""

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 12,
                 allow_nvlink_for_low_latency_mode: bool = True) -> None:
        super().__init__(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank)
        self.allow_nvlink_for_low_latency_mode = allow_nvlink_for_low_latency_mode

    @staticmethod
    def is_sm90_compiled() -> bool:
        return True

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             use_fp8=True, async_finish=False, return_recv_hook=False):
        recv, count, state = self._ll_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank,
                                               num_experts, use_fp8=use_fp8)
        handle = (state, None, num_max_dispatch_tokens_per_rank, x.shape[1], num_experts)
        return recv, count, handle, SimEvent(), None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, zero_copy=False,
                            async_finish=False, return_recv_hook=False, out=None):
        state, _, _, _, num_experts = handle
        combined = self._ll_combine(x, topk_idx, topk_weights, state, num_experts)
        if out is not None:
            out.copy_(combined)
            combined = out
        return combined, SimEvent(), None
