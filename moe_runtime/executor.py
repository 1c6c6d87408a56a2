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
                 group=None, ep_size: int = 1, range_experts: dict | None = None) -> None:
        self.plan = plan
        self.paths = paths  # [(ModeChoice, comm, experts)] in plan order
        self.comm, self.experts = paths[-1][1], paths[-1][2]
        # the plan's experts_by_tokens backends: (name, layout, payload) -> prepared backend
        self.range_experts = dict(range_experts or {})
        missing = [(name, m.layout, m.payload) for name in plan.experts_backends[1:]
                   for m, _, _ in paths if (name, m.layout, m.payload) not in self.range_experts]
        if missing:
            raise ValueError(f"layer {plan.problem.name}: the plan runs some batch sizes on "
                             f"{', '.join(sorted({n for n, _, _ in missing}))}; the executor "
                             "has no prepared backend for them (build_executor makes them)")
        self.input_scale = weights.a13_scale if weights is not None else None
        self.group = group
        self.ep_size = ep_size

    def path_for(self, tokens_per_rank: int):
        """(mode, comm, experts) used for a batch of ``tokens_per_rank`` (largest over ranks)."""
        mode = self.plan.mode_for(tokens_per_rank)
        for path in self.paths:
            if path[0] == mode:
                return self._with_range(path, tokens_per_rank)
        raise AssertionError("the plan's modes and the executor's paths differ")

    def _with_range(self, path, tokens_per_rank: int):
        """``path`` with the experts backend the plan's ranges give this batch size."""
        if not self.range_experts:  # no ranges: every forward of most plans, no lookups
            return path
        name = self.plan.experts_for(tokens_per_rank)
        if name == self.plan.experts:
            return path
        mode, comm, _ = path
        return mode, comm, self.range_experts[(name, mode.layout, mode.payload)]

    def _path(self, hidden: torch.Tensor, max_tokens_per_rank: int | None):
        """The path of one forward, from host-side numbers only (no device-to-host copy).

        The batch size is ``max_tokens_per_rank`` when given, the local batch without expert
        parallelism (a shape: host metadata, not a sync), else unknown: every rank then takes
        the last mode and the plan's own experts backend, which admit every batch."""
        tokens = max_tokens_per_rank
        if tokens is None and self.ep_size == 1:
            tokens = hidden.shape[0]
        if len(self.paths) == 1:
            path = self.paths[0]
        elif tokens is not None:
            return self.path_for(tokens)
        else:
            return self.paths[-1]
        return path if tokens is None else self._with_range(path, tokens)

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
    modes deliver (each prepares its own kernel layout), and as many again for each other experts
    backend of the plan's ``experts_by_tokens`` (each holds its own prepared weights).
    ``weights`` holds the *local* experts of this rank, on ``device``.
    """
    device = str(device)
    classes = {name: load_factory(registry.experts_spec(name).factory, name)
               for name in plan.experts_backends}
    comm_cls = load_factory(registry.comm_spec(plan.comm).factory, plan.comm)
    from moe_runtime.planner import ModeChoice

    modes = plan.modes or (ModeChoice(plan.comm_mode, plan.layout, plan.payload, None),)
    experts_by_key: dict = {}
    paths = []
    for mode in modes:
        for name, experts_cls in classes.items():
            key = (name, mode.layout, mode.payload)
            if key not in experts_by_key:
                experts = experts_cls(setup=ExpertsSetup(
                    problem=plan.problem, runs_as=plan.runs_as, payload=mode.payload,
                    layout=mode.layout, ep_rank=ep_rank, ep_size=ep_size, device=device,
                ))
                experts.prepare(weights)
                experts_by_key[key] = experts
        key = (plan.experts, mode.layout, mode.payload)
        bound = mode.max_tokens_per_rank or max_tokens_per_rank
        comm = comm_cls(setup=CommSetup(
            problem=plan.problem, payload=mode.payload, layout=mode.layout, ep_rank=ep_rank,
            ep_size=ep_size, device=device, max_tokens_per_rank=bound, group=group,
        ))
        paths.append((mode, comm, experts_by_key[key]))
    ranged = {k: v for k, v in experts_by_key.items() if k[0] != plan.experts}
    return MoEExecutor(plan, paths, weights, group=group, ep_size=ep_size, range_experts=ranged)


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
