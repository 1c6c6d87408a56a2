"""``DeepEPComm``: moe-runtime's communication backend on DeepEP's ``Buffer``, normal mode for
the token-major layout and low-latency mode for the masked one.

Imported only when the planner selects ``deepep``; ``deep_ep`` itself only when no buffer is
handed in. How DeepEP's outputs map onto ``Dispatched``: README.md, "Module notes".
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from moe_runtime import formats as F
from moe_runtime.backend_api import CommBackend, Dispatched
from moe_runtime.placement import local_experts

from moe_runtime_deepep import layout as L
from moe_runtime_deepep import limits
from moe_runtime_deepep.api import BufferApi, inspect_buffer_api
from moe_runtime_deepep.plugin import MODE_LOW_LATENCY, MODE_NORMAL, mode_for_layout
from moe_runtime_deepep.settings import (
    ENV_LL_MAX_TOKENS,
    ENV_LL_OVERSIZE,
    ENV_LL_SPLIT_MAX_TOKENS,
    DeepEPSettings,
)


class DeepEPError(RuntimeError):
    """DeepEP cannot run this layer or batch as asked; the message says why and what to change."""


class DeepEPTokenBoundError(DeepEPError):
    """A rank's low-latency batch is above the bound its layer was built for."""


@attrs.frozen
class NormalHandle:
    deep_handle: Any = attrs.field(eq=False)
    num_tokens: int
    dtype: torch.dtype


@attrs.frozen
class LowLatencyRound:
    deep_handle: Any = attrs.field(eq=False)
    topk_idx: torch.Tensor = attrs.field(eq=False)
    topk_weights: torch.Tensor = attrs.field(eq=False)


@attrs.frozen
class LowLatencyHandle:
    rounds: tuple[LowLatencyRound, ...]
    merge: L.MergeInfo | None = attrs.field(eq=False)
    num_tokens: int
    dtype: torch.dtype
    refused: str | None = None  # why this rank's batch was not sent; combine raises it


def low_latency_bounds(plan_bound: int, settings: DeepEPSettings) -> tuple[int, int, int]:
    """``(tokens per call, tokens per forward, rounds per forward)`` of a low-latency layer.

    From numbers every rank has at start-up (the plan's bound and the settings), so every rank
    runs the same number of rounds without agreeing on it in the forward.
    """
    per_call = min(plan_bound, settings.ll_max_tokens_per_rank)
    if settings.ll_oversize != "split":
        return per_call, per_call, 1
    per_forward = min(plan_bound, settings.ll_split_max_tokens_per_rank)
    return per_call, per_forward, limits.rounds_for(per_forward, per_call)


@attrs.define
class _Cached:
    buffer: Any
    sizes: tuple[int, ...]


#: One DeepEP buffer per (process group, mode), shared by every layer (DeepEP's README keeps one
#: global buffer and re-creates it only when a larger one is needed).
_BUFFERS: dict[tuple[int, str], _Cached] = {}


def release_buffers() -> None:
    """Drop the cached DeepEP buffers (tests, shutdown)."""
    _BUFFERS.clear()


class DeepEPComm(CommBackend):
    """DeepEP dispatch/combine for one layer.

    :param setup: the plan's :class:`moe_runtime.backend_api.CommSetup`.
    :param buffer: a ``deep_ep.Buffer`` to use (or a stand-in with its methods); by default one is
        created (or reused) for the group and mode, sized for this layer.
    :param settings: run-time policies; by default read from the environment.

    A low-latency forward makes no device-to-host copy and no collective besides DeepEP's own
    calls: its bounds are fixed when it is built (:func:`low_latency_bounds`). A rank whose batch
    is above them sends DeepEP an empty batch, so that its peers finish the forward, and its
    ``combine`` raises :class:`DeepEPTokenBoundError`.
    """

    def __init__(self, *, setup, buffer=None, settings: DeepEPSettings | None = None) -> None:
        super().__init__(setup=setup)
        self.settings = DeepEPSettings.from_env() if settings is None else settings
        self.mode = mode_for_layout(setup.layout)
        p = setup.problem
        self.world, self.rank = setup.ep_size, setup.ep_rank
        self.num_experts, self.hidden, self.top_k = p.num_experts, p.hidden_size, p.top_k
        self.payload = setup.payload
        # bound: DeepEP's num_max_dispatch_tokens_per_rank, the plan's bound capped by the
        # setting; forward_bound: the most tokens per rank of one forward, in `rounds` calls.
        self.bound, self.forward_bound, self.rounds = (
            low_latency_bounds(setup.max_tokens_per_rank, self.settings)
            if self.mode == MODE_LOW_LATENCY else (None, None, 1))
        problems = limits.check_layer(
            mode=self.mode, world=self.world, num_experts=p.num_experts, top_k=p.top_k,
            hidden=p.hidden_size, dtype=p.dtype, payload=setup.payload,
            max_tokens_per_rank=self.bound, qp_depth=self.settings.qp_depth,
            low_latency_hidden_sizes=self.settings.ll_hidden_sizes,
        )
        if problems:
            raise DeepEPError(
                f"layer {p.name}: deepep {self.mode} mode cannot run it: " + "; ".join(problems)
            )
        self.num_local_experts = len(local_experts(p.num_experts, self.world, self.rank))
        self.group = setup.group
        module = None
        if buffer is None:
            buffer, module = self._make_buffer()
        else:
            self._check_api(inspect_buffer_api(type(buffer)))
            if self.group is None:
                import torch.distributed as dist

                if dist.is_available() and dist.is_initialized():
                    self.group = dist.group.WORLD
        self.buffer = buffer
        self.api = inspect_buffer_api(type(buffer))
        self.topk_dtype = getattr(module, "topk_idx_t", None) or getattr(
            buffer, "topk_idx_dtype", torch.int64)

    # ------------------------------------------------------------------ construction

    def _check_api(self, api: BufferApi) -> None:
        where = "the installed deep_ep.Buffer"
        if self.mode == MODE_NORMAL and not api.normal_dispatch:
            raise DeepEPError(f"{where} lacks the normal-mode API this plugin calls "
                              f"(dispatch/get_dispatch_layout keywords); it has: {api.describe()}")
        if self.mode == MODE_LOW_LATENCY:
            if not api.low_latency:
                raise DeepEPError(f"{where} has no low_latency_dispatch/low_latency_combine")
            if not api.ll_unquantized:
                raise DeepEPError(
                    f"{where}.low_latency_dispatch has no use_fp8 parameter (the DeepEP 1.0.0 "
                    "API): it always casts to FP8 with per-token, per-128-channel scales, which is "
                    "not a payload this plan can use (it needs unquantized bf16). Install a DeepEP "
                    "release whose low_latency_dispatch takes use_fp8 (1.1.0 or later), or plan "
                    "this layer with the token-major layout (normal mode)"
                )

    def _resolve_group(self):
        import torch.distributed as dist

        group = self.group
        if group is None:
            if not dist.is_available() or not dist.is_initialized():
                raise DeepEPError("deepep needs torch.distributed initialised and the "
                                  "expert-parallel process group in CommSetup.group")
            group = dist.group.WORLD
        if group.size() != self.world:
            raise DeepEPError(f"the process group has {group.size()} ranks, the plan "
                              f"{self.world}")
        return group

    def _make_buffer(self):
        try:
            import deep_ep
        except ImportError as exc:
            raise DeepEPError(
                "the deepep backend was selected but deep_ep cannot be imported "
                f"({type(exc).__name__}: {exc}); see the plugin's README for installing DeepEP"
            ) from exc
        if not torch.cuda.is_available():
            raise DeepEPError("DeepEP runs on CUDA devices only")
        buffer_cls = deep_ep.Buffer
        api = inspect_buffer_api(buffer_cls)
        self._check_api(api)
        if self.payload == F.FP8 and api.sm90_query and not buffer_cls.is_sm90_compiled():
            raise DeepEPError("the installed DeepEP was built without SM90 features "
                              "(DISABLE_SM90_FEATURES): it has no FP8 dispatch; plan an "
                              "unquantized payload (--moe-a2a-payload unquantized)")
        group = self.group = self._resolve_group()
        if self.settings.num_sms is not None:
            buffer_cls.set_num_sms(self.settings.num_sms)
        key = (id(group), self.mode)
        if self.mode == MODE_NORMAL:
            hidden_bytes = self.hidden * 2  # bf16 rows; fp8 rows plus scales are smaller
            configs = (buffer_cls.get_dispatch_config(self.world),
                       buffer_cls.get_combine_config(self.world))
            nvl = max(int(c.get_nvl_buffer_size_hint(hidden_bytes, self.world)) for c in configs)
            sizes = (nvl,)
            kwargs = dict(num_nvl_bytes=nvl, num_rdma_bytes=0, low_latency_mode=False)
        else:
            rdma = int(buffer_cls.get_low_latency_rdma_size_hint(
                self.bound, self.hidden, self.world, self.num_experts))
            sizes = (rdma, self.bound, self.hidden, self.num_experts)
            kwargs = dict(num_nvl_bytes=0, num_rdma_bytes=rdma, low_latency_mode=True,
                          num_qps_per_rank=self.num_local_experts)
            allow_nvlink = self.settings.allow_nvlink_for_low_latency
            if api.nvlink_for_low_latency and allow_nvlink is not None:
                kwargs["allow_nvlink_for_low_latency_mode"] = allow_nvlink
        cached = _BUFFERS.get(key)
        if cached is not None and cached.sizes[0] >= sizes[0] and cached.sizes[1:] == sizes[1:]:
            return cached.buffer, deep_ep
        buffer = buffer_cls(group, **kwargs)
        _BUFFERS[key] = _Cached(buffer, sizes)
        return buffer, deep_ep

    # ------------------------------------------------------------------ normal mode

    def _dispatch_normal(self, hidden, topk_ids, topk_weights, input_scale):
        n, h = hidden.shape
        idx = topk_ids.to(self.topk_dtype).contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(
            idx, self.num_experts)
        scale = None
        if self.payload == F.FP8:
            if input_scale is None:
                raise DeepEPError("the fp8 dispatch payload needs the layer's input scale "
                                  "(ExpertWeights.a13_scale)")
            from moe_runtime.quant.fp8 import quantize_fp8_per_tensor

            scale = torch.as_tensor(input_scale, dtype=torch.float32, device=hidden.device)
            values = quantize_fp8_per_tensor(hidden.float(), scale)
            x = (values.contiguous(), L.fp8_scale_blocks(n, h, scale, device=hidden.device))
        elif self.payload == F.UNQUANTIZED:
            x = hidden.to(torch.bfloat16).contiguous()
        else:
            raise DeepEPError(f"deepep normal mode carries unquantized or fp8, not {self.payload}")
        recv_x, recv_idx, recv_w, per_expert_list, handle, _ = self.buffer.dispatch(
            x, topk_idx=idx, topk_weights=weights, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )
        if isinstance(recv_x, tuple):
            recv_x = recv_x[0]  # the scales are the constant blocks of `scale`
        d = Dispatched(
            F.TOKEN_MAJOR, recv_x, payload=self.payload, hidden_scale=scale,
            topk_ids=recv_idx.to(torch.int32), topk_weights=recv_w.to(torch.float32),
            out_dtype=hidden.dtype, extra={"tokens_per_expert": list(per_expert_list)},
        )
        return d, NormalHandle(handle, n, hidden.dtype)

    def _combine_normal(self, expert_out, handle: NormalHandle):
        combined, _, _ = self.buffer.combine(expert_out.to(torch.bfloat16).contiguous(),
                                             handle.deep_handle)
        return combined.to(handle.dtype)

    # ------------------------------------------------------------------ low-latency mode

    def _bound_message(self, n: int) -> str:
        s = self.settings
        if s.ll_oversize == "split":
            built = (f"{self.rounds} rounds of at most {self.bound} ({ENV_LL_OVERSIZE}=split, "
                     f"{ENV_LL_SPLIT_MAX_TOKENS}={s.ll_split_max_tokens_per_rank}, capped by the "
                     f"plan's --max-tokens-per-rank)")
            remedy = f"or raise {ENV_LL_SPLIT_MAX_TOKENS} and plan again"
        else:
            built = (f"DeepEP's num_max_dispatch_tokens_per_rank: the plan's "
                     f"--max-tokens-per-rank, at most {ENV_LL_MAX_TOKENS}="
                     f"{s.ll_max_tokens_per_rank}")
            remedy = (f"plan with a larger --max-tokens-per-rank (up to {ENV_LL_MAX_TOKENS}), "
                      f"or set {ENV_LL_OVERSIZE}=split and {ENV_LL_SPLIT_MAX_TOKENS}=<the largest "
                      "batch per rank> to run bounded rounds")
        return (
            f"layer {self.setup.problem.name}: this rank's low-latency batch of {n} tokens is "
            f"above the bound of {self.forward_bound} tokens per rank the layer was built for "
            f"({built}). This rank sent DeepEP no tokens, so the other ranks finished the "
            "forward without it. Keep every forward within the plan's bound (an engine passes "
            "its per-forward bound to the executor as max_tokens_per_rank=, which then picks a "
            f"mode that admits it), {remedy}"
        )

    def _ll_dispatch_one(self, x, idx):
        kwargs = {}
        if self.api.ll_unquantized:
            kwargs["use_fp8"] = False
        recv_x, recv_count, handle, _, _ = self.buffer.low_latency_dispatch(
            x, idx, self.bound, self.num_experts, **kwargs)
        if isinstance(recv_x, tuple):  # cannot happen after _check_api; never pass FP8 on
            raise DeepEPError("low_latency_dispatch returned an FP8 payload; expected bf16")
        return recv_x, recv_count, handle

    def _dispatch_low_latency(self, hidden, topk_ids, topk_weights, input_scale):
        if self.payload != F.UNQUANTIZED:
            raise DeepEPError(f"deepep low-latency mode carries unquantized payloads, not "
                              f"{self.payload}")
        n = hidden.shape[0]  # a shape: host metadata, not a device-to-host copy
        refused = None
        if n > self.forward_bound:
            refused = self._bound_message(n)
            hidden, topk_ids, topk_weights, n = hidden[:0], topk_ids[:0], topk_weights[:0], 0
        x_all = hidden.to(torch.bfloat16).contiguous()
        idx_all = topk_ids.to(self.topk_dtype).contiguous()
        w_all = topk_weights.to(torch.float32).contiguous()
        if self.rounds == 1:
            recv_x, recv_count, handle = self._ll_dispatch_one(x_all, idx_all)
            d = Dispatched(F.MASKED, recv_x, masked_m=recv_count.to(torch.int32),
                           out_dtype=hidden.dtype)
            return d, LowLatencyHandle((LowLatencyRound(handle, idx_all, w_all),), None, n,
                                       hidden.dtype, refused)
        parts, counts, done = [], [], []
        for start, stop in L.chunk_spans(n, self.bound, self.rounds):
            x, idx = x_all[start:stop], idx_all[start:stop]
            recv_x, recv_count, handle = self._ll_dispatch_one(x, idx)
            # DeepEP's results live in two alternating buffers: copy before the next round.
            parts.append(recv_x.clone())
            counts.append(recv_count.clone())
            done.append(LowLatencyRound(handle, idx, w_all[start:stop]))
        merged, masked_m, info = L.merge_masked_chunks(parts, counts)
        d = Dispatched(F.MASKED, merged, masked_m=masked_m, out_dtype=hidden.dtype)
        return d, LowLatencyHandle(tuple(done), info, n, hidden.dtype, refused)

    def _combine_low_latency(self, expert_out, handle: LowLatencyHandle):
        out = expert_out.to(torch.bfloat16)
        pieces = [out] if handle.merge is None else L.split_masked_chunks(out, handle.merge)
        results = []
        for piece, rnd in zip(pieces, handle.rounds, strict=True):
            combined, _, _ = self.buffer.low_latency_combine(
                piece.contiguous(), rnd.topk_idx, rnd.topk_weights, rnd.deep_handle)
            results.append(combined[: rnd.topk_idx.shape[0]])
        if handle.refused is not None:
            raise DeepEPTokenBoundError(handle.refused)
        result = results[0] if len(results) == 1 else torch.cat(results, 0)
        return result.to(handle.dtype)

    # ------------------------------------------------------------------ the role

    def dispatch(self, hidden, topk_ids, topk_weights, *, input_scale=None):
        if self.mode == MODE_NORMAL:
            return self._dispatch_normal(hidden, topk_ids, topk_weights, input_scale)
        return self._dispatch_low_latency(hidden, topk_ids, topk_weights, input_scale)

    def combine(self, expert_out, handle):
        if isinstance(handle, NormalHandle):
            return self._combine_normal(expert_out, handle)
        return self._combine_low_latency(expert_out, handle)
