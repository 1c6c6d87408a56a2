"""The plugin as moe-runtime sees it: discovery through the entry point, the declaration, the plan,
and the conformance suite generated from the declaration (declared combinations run on CUDA only,
so on CPU they are skipped with the reason; refusals and the lazy-import check run everywhere)."""

from __future__ import annotations

import subprocess
import sys

from moe_runtime import formats as F
from moe_runtime.backend_api import LayerProblem
from moe_runtime.environment import Environment
from moe_runtime.plugin.registry import Registry
from moe_runtime.testing.suite import *  # noqa: F401,F403

MOE_CONFORMANCE_BACKENDS = ["triton"]


def test_entry_point_registers_triton_without_importing_kernels():
    code = (
        "import sys\n"
        "from moe_runtime.plugin.registry import Registry\n"
        "reg = Registry.load()\n"
        "assert 'triton' in reg.experts, sorted(reg.experts)\n"
        "bad = [m for m in ('triton', 'moe_runtime_triton.ops', 'moe_runtime_triton.kernels',"
        " 'moe_runtime_triton.backend') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_declaration_per_capability():
    from moe_runtime_triton.plugin import TRITON_EXPERTS

    by_format = {}
    for s in TRITON_EXPERTS.supports:
        for f in s.formats:
            by_format[f] = s
    assert by_format[F.FP8_W8A8].hardware.cuda_capabilities[0].min == (8, 9)
    assert by_format[F.BF16].hardware.cuda_capabilities[0].min == (8, 0)
    assert by_format[F.NVFP4_W4A4].runs_as == F.NVFP4_W4A16
    assert F.FP8 in by_format[F.FP8_W8A8].payloads
    assert all(s.layouts == {F.TOKEN_MAJOR, F.MASKED} for s in TRITON_EXPERTS.supports)


def test_planner_picks_triton_on_hopper_and_reports_w4a4_degradation():
    from moe_runtime.planner import Deployment, plan_layer

    reg = Registry.load()
    env = Environment("cuda", (9, 0), available=frozenset({"triton", "torch"}), name="H200")
    p = LayerProblem("model.layers.0.mlp.experts", F.NVFP4_W4A4, "silu", 512, 10, 4096, 1024)
    lp, _ = plan_layer(p, registry=reg, environment=env, deployment=Deployment())
    assert lp.experts == "triton"
    assert lp.runs_as == F.NVFP4_W4A16 and lp.degradations
    p8 = LayerProblem("l", F.FP8_W8A8, "silu", 128, 8, 2048, 768)
    env_a100 = Environment("cuda", (8, 0), available=frozenset({"triton", "torch"}), name="A100")
    lp8, _ = plan_layer(p8, registry=reg, environment=env_a100, deployment=Deployment())
    assert lp8.experts != "triton"  # fp8 needs 8.9+


def test_the_w4a4_degradation_note_is_true_on_every_target_it_is_planned_for():
    from moe_runtime.planner import Deployment, plan_layer

    reg = Registry.load()
    p = LayerProblem("model.layers.0.mlp.experts", F.NVFP4_W4A4, "silu", 128, 8, 2048, 768)
    for cap in ((8, 0), (9, 0), (10, 0), (12, 0)):
        env = Environment("cuda", cap, available=frozenset({"triton", "torch"}), name=f"sm{cap}")
        lp, _ = plan_layer(p, registry=reg, environment=env,
                           deployment=Deployment(experts_backend="triton"))
        text = " ".join([*lp.degradations, str(getattr(lp, "note", "") or "")])
        assert "below compute capability" not in text, (cap, text)
