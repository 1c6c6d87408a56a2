"""A layer whose communication backend has a bounded mode uses it for the batches under the bound
and the unbounded mode for the rest, with the same results."""

from __future__ import annotations

import types

import torch

from moe_runtime import CommBackendSpec, CommSupport, hookimpl
from moe_runtime.backend_api import LayerProblem
from moe_runtime.environment import Environment
from moe_runtime.executor import build_executor
from moe_runtime.planner import Deployment, plan_layer
from moe_runtime.plugin.manager import get_plugin_manager
from moe_runtime.plugin.registry import Registry
from moe_runtime.reference_math import quantize_expert_weights, reference_fused_experts

# Two modes of the built-in local communication code, declared as one backend: the masked layout
# for batches of at most 8 tokens, token-major for the rest.
TWO_MODES = CommBackendSpec(
    name="local_two_modes", factory="moe_runtime.backends.local:LocalComm", priority=100,
    supports=[CommSupport(layout="masked", max_world_size=1, max_tokens_per_rank=8, mode="small"),
              CommSupport(layout="token_major", max_world_size=1, mode="large")])


def _registry():
    plugin = types.ModuleType("two_modes_plugin")

    @hookimpl
    def moe_runtime_register_backends(register):
        register(TWO_MODES)

    plugin.moe_runtime_register_backends = moe_runtime_register_backends
    return Registry.from_plugin_manager(
        get_plugin_manager(autoload=False, plugins=[plugin], environ={}))


def test_executor_picks_the_mode_per_batch_and_both_match_the_reference():
    reg = _registry()
    problem = LayerProblem("layer", "nvfp4_w4a16", "silu", 8, 2, 64, 32, dtype="float32")
    lp, _ = plan_layer(problem, registry=reg, environment=Environment("cpu", None, None, "cpu"),
                       deployment=Deployment(max_tokens_per_rank=256))
    assert lp.comm == "local_two_modes"
    assert [m.comm_mode for m in lp.modes] == ["small", "large"]
    gen = torch.Generator().manual_seed(0)
    weights = quantize_expert_weights(torch.randn(8, 64, 64, generator=gen) / 8,
                                      torch.randn(8, 64, 32, generator=gen) / 6,
                                      "nvfp4_w4a16", "silu")
    ex = build_executor(lp, reg, weights)
    # one experts object per layout, each prepared once
    assert {p[2].setup.layout for p in ex.paths} == {"masked", "token_major"}
    for n, mode in ((5, "small"), (8, "small"), (9, "large"), (40, "large")):
        assert ex.path_for(n)[0].comm_mode == mode
        x = torch.randn(n, 64, generator=gen)
        ids = torch.rand(n, 8, generator=gen).topk(2, -1).indices.int()
        w = torch.softmax(torch.randn(n, 2, generator=gen), -1)
        torch.testing.assert_close(ex(x, ids, w), reference_fused_experts(x, ids, w, weights),
                                   rtol=1e-5, atol=1e-5)
