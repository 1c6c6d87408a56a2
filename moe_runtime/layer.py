"""The MoE layer: router, the plan's communication and experts backends, shared experts.

Everything that depends on plugins is resolved when the layer is built (at load): the forward path
holds plain Python objects and tensors, no plugin-manager calls and no per-token loops.
"""

from __future__ import annotations

from typing import Callable

import torch

from moe_runtime.declarations import load_factory
from moe_runtime.manager import Registry
from moe_runtime.planner import LayerPlan
from moe_runtime.router import RouterConfig, route
from moe_runtime.runtime import CommSetup, ExpertsSetup, ExpertWeights


class MoEExecutor:
    """Dispatch -> experts -> combine for one layer, given routed tokens.

    This is what a model integration calls with its own router's output (transformers' experts
    interface hands over ``top_k_index`` and ``top_k_weights``).
    """

    def __init__(self, plan: LayerPlan, comm, experts, weights: ExpertWeights | None) -> None:
        self.plan = plan
        self.comm = comm
        self.experts = experts
        self.input_scale = weights.a13_scale if weights is not None else None

    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        dispatched, handle = self.comm.dispatch(hidden, topk_ids, topk_weights,
                                                input_scale=self.input_scale)
        out = self.experts.forward(dispatched)
        return self.comm.combine(out, handle)


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
    """Instantiate the plan's two backends and prepare the experts' weights (once, at load).

    ``weights`` holds the *local* experts of this rank, on ``device``.
    """
    device = str(device)
    experts_cls = load_factory(registry.experts_spec(plan.experts).factory)
    comm_cls = load_factory(registry.comm_spec(plan.comm).factory)
    experts = experts_cls(setup=ExpertsSetup(
        problem=plan.problem, runs_as=plan.runs_as, payload=plan.payload, layout=plan.layout,
        ep_rank=ep_rank, ep_size=ep_size, device=device,
    ))
    comm = comm_cls(setup=CommSetup(
        problem=plan.problem, payload=plan.payload, layout=plan.layout, ep_rank=ep_rank,
        ep_size=ep_size, device=device, max_tokens_per_rank=max_tokens_per_rank, group=group,
    ))
    experts.prepare(weights)
    return MoEExecutor(plan, comm, experts, weights)


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
