"""Routers: top-k expert ids and weights per token, all on the device, no host syncs."""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class RouterConfig:
    """How a model routes.

    :param scoring: ``"softmax"`` (Qwen, Mixtral) or ``"sigmoid"`` (DeepSeek-V3).
    :param top_k: experts per token.
    :param renormalize: divide the chosen weights by their sum.
    :param n_group: expert groups for grouped top-k (1 = no grouping).
    :param topk_group: groups kept per token.
    :param routed_scaling_factor: multiplies the final weights.
    :param has_correction_bias: a per-expert bias added to scores for *selection* only.
    """

    scoring: str = attrs.field(default="softmax")
    top_k: int = 2
    renormalize: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    has_correction_bias: bool = False

    @classmethod
    def from_layer(cls, layer) -> RouterConfig:
        """The routing rule of a checkpoint's MoE layer (``moe_runtime.checkpoint.MoELayerInfo``)."""
        r = layer.router
        return cls(r.scoring, layer.top_k, r.renormalize, r.n_group, r.topk_group,
                   r.routed_scaling_factor, r.has_correction_bias)

    @scoring.validator
    def _check(self, _a, v):
        if v not in ("softmax", "sigmoid"):
            raise ValueError(f"router scoring {v!r} is not supported; use 'softmax' or 'sigmoid'")


def route(
    logits: torch.Tensor, cfg: RouterConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [N, E]`` -> ``(topk_ids [N, K] int32, topk_weights [N, K] float32)``."""
    logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if cfg.scoring == "softmax" else torch.sigmoid(logits)
    select = scores
    if cfg.has_correction_bias:
        if correction_bias is None:
            raise ValueError("router declares a correction bias but none was given")
        select = scores + correction_bias.float().unsqueeze(0)
    n, e = select.shape
    if cfg.n_group > 1:
        if e % cfg.n_group:
            raise ValueError(f"{e} experts do not split into {cfg.n_group} groups")
        grouped = select.view(n, cfg.n_group, e // cfg.n_group)
        if cfg.has_correction_bias:
            group_score = grouped.topk(2, dim=-1).values.sum(-1)  # DeepSeek-V3: top-2 sum per group
        else:
            group_score = grouped.max(dim=-1).values
        keep = group_score.topk(cfg.topk_group, dim=-1).indices
        mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        select = select.masked_fill(~mask.repeat_interleave(e // cfg.n_group, dim=1), float("-inf"))
    ids = select.topk(cfg.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return ids.to(torch.int32), weights.float()
