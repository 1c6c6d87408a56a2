"""Routers agree with transformers' own; the standalone MoE layer runs router, plan and shared
expert like transformers' MoE block."""

from __future__ import annotations

import pytest
import torch

from moe_runtime.router import RouterConfig, route


def _sorted(ids, w):
    order = ids.argsort(-1)
    return ids.gather(1, order), w.gather(1, order)


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_router_matches_qwen3_moe(norm):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4,
                         norm_topk_prob=norm)
    hf = Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(hf.weight)
    x = torch.randn(11, 32)
    _, w_hf, ids_hf = hf(x)
    ids, w = route(torch.nn.functional.linear(x, hf.weight),
                   RouterConfig("softmax", 4, renormalize=norm))
    a, b = _sorted(ids.long(), w), _sorted(ids_hf, w_hf.float())
    assert torch.equal(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])


def test_sigmoid_grouped_router_with_bias_matches_deepseek_v3():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                           topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    hf = DeepseekV3TopkRouter(cfg)
    torch.nn.init.normal_(hf.weight)
    hf.e_score_correction_bias.normal_()
    x = torch.randn(23, 32)
    _, w_hf, ids_hf = hf(x)
    ids, w = route(torch.nn.functional.linear(x, hf.weight),
                   RouterConfig("sigmoid", 4, True, 4, 2, 2.5, True), hf.e_score_correction_bias)
    a, b = _sorted(ids.long(), w), _sorted(ids_hf, w_hf.float())
    assert torch.equal(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])


def test_router_rejects_unknown_scoring():
    with pytest.raises(ValueError, match="'relu'.*softmax.*sigmoid"):
        RouterConfig("relu")


def test_moe_layer_with_shared_expert_matches_transformers_block():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    from moe_runtime.backend_api import ExpertWeights, LayerProblem
    from moe_runtime.environment import Environment
    from moe_runtime.executor import MoELayer, build_executor
    from moe_runtime.planner import Deployment, plan_layer
    from moe_runtime.plugin.registry import Registry

    cfg = DeepseekV3Config(hidden_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                           topk_group=1, moe_intermediate_size=16, n_shared_experts=1,
                           routed_scaling_factor=1.5, norm_topk_prob=True, hidden_act="silu")
    cfg._experts_implementation = "eager"
    hf = DeepseekV3MoE(cfg).float()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.2)
    hf.gate.e_score_correction_bias.normal_()
    reg = Registry.load(environ={"MOE_RUNTIME_DISABLE_PLUGIN_AUTOLOAD": "1"})
    problem = LayerProblem("layer", "bf16", "silu", 8, 2, 32, 16, dtype="float32")
    lp, _ = plan_layer(problem, registry=reg, environment=Environment.probe(device="cpu"),
                       deployment=Deployment())
    weights = ExpertWeights("bf16", "silu", hf.experts.gate_up_proj.detach().clone(),
                            hf.experts.down_proj.detach().clone())
    layer = MoELayer(hf.gate.weight.detach().clone(),
                     RouterConfig("sigmoid", 2, True, 2, 1, 1.5, True),
                     build_executor(lp, reg, weights),
                     correction_bias=hf.gate.e_score_correction_bias.clone(),
                     shared=hf.shared_experts)
    x = torch.randn(3, 5, 32)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), hf(x), rtol=1e-4, atol=1e-5)


def test_router_config_from_a_deepseek_checkpoint_layer(tiny_checkpoint):
    from moe_runtime.checkpoint import read_checkpoint

    layer = read_checkpoint(tiny_checkpoint("deepseek_v3", "bf16")).moe_layers[0]
    cfg = RouterConfig.from_layer(layer)
    assert cfg.scoring == "sigmoid" and cfg.has_correction_bias and cfg.top_k == layer.top_k
    assert cfg.n_group == layer.router.n_group
