"""The MoE layer: router, the plan's communication and experts backends, shared experts.

Everything that depends on plugins is resolved when the layer is built (at load): the forward path
holds plain Python objects and tensors, no plugin-manager calls and no per-token loops.
"""

from __future__ import annotations

from typing import Callable

import torch

from moe_runtime.backend_api import CommSetup, ExpertsSetup, ExpertWeights
from moe_runtime.declarations import load_factory
from moe_runtime.planner import LayerPlan
from moe_runtime.plugin.registry import Registry
from moe_runtime.router import RouterConfig, route


class MoEExecutor:
    """Dispatch -> experts -> combine for one layer, given routed tokens.

    This is what a model integration calls with its own router's output (transformers' experts
    interface hands over ``top_k_index`` and ``top_k_weights``). When the plan has several
    communication modes (a bounded low-latency mode and an unbounded one), each batch uses the
    first mode whose bound admits the largest batch per rank of the forward. Under expert
    parallelism every rank must pick the same mode without synchronising in the forward: the
    engine passes that bound (``max_tokens_per_rank=``, as it knows its CUDA-graph capture size or
    scheduled batch); without it every rank uses the plan's last mode, which admits every batch of
    the deployment (the deployment is agreed across ranks at start-up).
    """

    def __init__(self, plan: LayerPlan, paths, weights: ExpertWeights | None, *,
                 group=None, ep_size: int = 1) -> None:
        self.plan = plan
        self.paths = paths  # [(ModeChoice, comm, experts)] in plan order
        self.comm, self.experts = paths[-1][1], paths[-1][2]
        self.input_scale = weights.a13_scale if weights is not None else None
        self.group = group
        self.ep_size = ep_size

    def path_for(self, tokens_per_rank: int):
        """(mode, comm, experts) used for a batch of ``tokens_per_rank`` (largest over ranks)."""
        mode = self.plan.mode_for(tokens_per_rank)
        for path in self.paths:
            if path[0] == mode:
                return path
        raise AssertionError("the plan's modes and the executor's paths differ")

    def _path(self, hidden: torch.Tensor, max_tokens_per_rank: int | None):
        """The path of one forward, from host-side numbers only (no device-to-host copy)."""
        if len(self.paths) == 1:
            return self.paths[0]
        if max_tokens_per_rank is not None:
            return self.path_for(max_tokens_per_rank)
        if self.ep_size == 1:
            return self.path_for(hidden.shape[0])  # a shape: host metadata, not a sync
        return self.paths[-1]

    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 *, max_tokens_per_rank: int | None = None):
        _, comm, experts = self._path(hidden, max_tokens_per_rank)
        dispatched, handle = comm.dispatch(hidden, topk_ids, topk_weights,
                                           input_scale=self.input_scale)
        out = experts.forward(dispatched)
        return comm.combine(out, handle)


def build_executor(
    plan: LayerPlan,
    registry: Registry,
    weights: ExpertWeights,
    *,
    device: str | torch.device = "cpu",
    ep_rank: int = 0,
    ep_size: int = 1,
    group=None,
    max_tokens_per_rank: int = 4096,
) -> MoEExecutor:
    """Instantiate the plan's backends and prepare the experts' weights (once, at load).

    One communication backend object per planned mode, one experts backend object per layout the
    modes deliver (each prepares its own kernel layout). ``weights`` holds the *local* experts of
    this rank, on ``device``.
    """
    device = str(device)
    experts_cls = load_factory(registry.experts_spec(plan.experts).factory)
    comm_cls = load_factory(registry.comm_spec(plan.comm).factory)
    from moe_runtime.planner import ModeChoice

    modes = plan.modes or (ModeChoice(plan.comm_mode, plan.layout, plan.payload, None),)
    experts_by_key: dict = {}
    paths = []
    for mode in modes:
        key = (mode.layout, mode.payload)
        if key not in experts_by_key:
            experts = experts_cls(setup=ExpertsSetup(
                problem=plan.problem, runs_as=plan.runs_as, payload=mode.payload,
                layout=mode.layout, ep_rank=ep_rank, ep_size=ep_size, device=device,
            ))
            experts.prepare(weights)
            experts_by_key[key] = experts
        bound = mode.max_tokens_per_rank or max_tokens_per_rank
        comm = comm_cls(setup=CommSetup(
            problem=plan.problem, payload=mode.payload, layout=mode.layout, ep_rank=ep_rank,
            ep_size=ep_size, device=device, max_tokens_per_rank=bound, group=group,
        ))
        paths.append((mode, comm, experts_by_key[key]))
    return MoEExecutor(plan, paths, weights, group=group, ep_size=ep_size)


class MoELayer(torch.nn.Module):
    """A complete MoE block: router gate, routed experts through the plan, optional shared expert.

    :param gate_weight: router weight ``[E, H]``.
    :param router: routing rule.
    :param executor: the plan's backends (see :func:`build_executor`).
    :param correction_bias: ``[E]`` selection bias (DeepSeek-V3), if the router declares one.
    :param shared: a callable ``x -> [N, H]`` added to the routed output (shared experts).
    """

    def __init__(
        self,
        gate_weight: torch.Tensor,
        router: RouterConfig,
        executor: MoEExecutor,
        *,
        correction_bias: torch.Tensor | None = None,
        shared: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.register_buffer("gate_weight", gate_weight)
        self.register_buffer("correction_bias", correction_bias)
        self.router = router
        self.executor = executor
        self.shared = shared

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        logits = torch.nn.functional.linear(x.float(), self.gate_weight.float())
        ids, weights = route(logits, self.router, self.correction_bias)
        out = self.executor(x, ids, weights)
        if self.shared is not None:
            out = out + self.shared(x).to(out.dtype)
        return out.reshape(shape)
