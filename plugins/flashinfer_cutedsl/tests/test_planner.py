"""The planner, with the plugin loaded through its real entry point, decides from the declaration.

Expectations are read from ``plugin.SPEC`` where they concern what is declared (no second
capability table); the hardware facts the declaration encodes are stated once, in
``test_registration.py``.
"""

from __future__ import annotations

import importlib.metadata as md
import types

import pytest

from moe_runtime import CommBackendSpec, CommSupport, Hardware, hookimpl
from moe_runtime import formats as F
from moe_runtime.backend_api import LayerProblem
from moe_runtime.environment import Environment
from moe_runtime.planner import Deployment, PlanError, Reason, plan_layer, plan_model
from moe_runtime.plugin.manager import get_plugin_manager
from moe_runtime.plugin.registry import Registry
from moe_runtime_flashinfer_cutedsl import plugin

NAME = plugin.NAME
SM100 = Environment.for_target("sm100")
SM90 = Environment.for_target("sm90")


def layer(fmt=F.NVFP4_W4A4, name="model.layers.0.mlp.experts", **kw):
    base = dict(activation=F.SILU, num_experts=8, top_k=2, hidden_size=128, intermediate_size=64)
    base.update(kw)
    return LayerProblem(name=name, format=fmt, **base)


@pytest.fixture(scope="module")
def registry() -> Registry:
    """The built-ins and this plugin, loaded through its installed entry point; other installed
    plugins are blocked so that their priorities do not decide these tests."""
    others = {ep.name for ep in md.entry_points(group="moe_runtime")} - {NAME}
    reg = Registry.load(blocked=others, environ={})
    assert reg.experts[NAME].plugin == NAME
    return reg


def own(rejections):
    return [r for r in rejections if r.backend == NAME and r.role == "experts"]


def declared_formats() -> set[str]:
    return {f for s in plugin.SPEC.supports for f in s.formats}


# ------------------------------------------------------------------------------------ accepts


@pytest.mark.parametrize("cap", plugin.supported_capabilities(), ids=lambda c: f"sm{c[0]}{c[1]}")
@pytest.mark.parametrize("fmt", sorted(declared_formats()))
def test_chosen_for_every_declared_format_on_every_declared_capability(registry, fmt, cap):
    env = Environment.for_target(f"cuda:{cap[0]}.{cap[1]}")
    lp, _ = plan_layer(layer(fmt), registry=registry, environment=env, deployment=Deployment())
    assert lp.experts == NAME and lp.runs_as == fmt and lp.degradations == ()
    assert lp.layout == F.TOKEN_MAJOR and lp.payload == F.UNQUANTIZED
    assert "flashinfer" in " ".join(lp.notes)  # "assumes cutlass, flashinfer importable ..."


def test_masked_dispatch_with_nvfp4_payload_is_planned_for_w4a4(registry):
    """A low-latency style dispatch that carries NVFP4 on the masked layout pairs with the
    masked Support block, and the payload derived from both declarations is nvfp4."""
    ll = CommBackendSpec(
        name="test_ll", factory="x:Y", supports=[CommSupport(
            layout=F.MASKED, payloads=(F.UNQUANTIZED, F.NVFP4),
            hardware=Hardware(devices=("cuda",)), mode="low_latency")])
    extra = types.ModuleType("test_ll_plugin")
    extra.moe_runtime_register_backends = hookimpl(lambda register: register(ll))
    others = {ep.name for ep in md.entry_points(group="moe_runtime")} - {NAME}
    reg = Registry.from_plugin_manager(
        get_plugin_manager(plugins=[extra], blocked=others, environ={}))
    lp, _ = plan_layer(layer(), registry=reg, environment=SM100,
                       deployment=Deployment(comm_backend="test_ll"))
    assert (lp.experts, lp.layout, lp.payload) == (NAME, F.MASKED, F.NVFP4)
    # W4A16 has no masked path and no quantized payload: the pair is refused
    with pytest.raises(PlanError, match="test_ll"):
        plan_layer(layer(F.NVFP4_W4A16), registry=reg, environment=SM100,
                   deployment=Deployment(comm_backend="test_ll", experts_backend=NAME))


# ------------------------------------------------------------------------------------ refuses


@pytest.mark.parametrize("fmt", [F.FP8_W8A8, F.BF16, F.FP16])
def test_other_formats_are_refused_naming_the_format(registry, fmt):
    lp, rejections = plan_layer(layer(fmt), registry=registry, environment=SM100,
                                deployment=Deployment())
    assert lp.experts != NAME
    [r] = own(rejections)
    assert r.reason == Reason.UNSUPPORTED_FORMAT
    assert fmt in r.message


def test_every_registered_format_it_does_not_declare_is_refused(registry):
    for fmt in sorted(set(registry.formats) - declared_formats()):
        with pytest.raises(PlanError) as info:
            plan_layer(layer(fmt), registry=registry, environment=SM100,
                       deployment=Deployment(experts_backend=NAME))
        [r] = own(info.value.rejections)
        assert r.reason == Reason.UNSUPPORTED_FORMAT and fmt in r.message


def test_on_sm90_it_is_refused_for_compute_capability_saying_10x_is_needed(registry):
    _, rejections = plan_layer(layer(), registry=registry, environment=SM90,
                               deployment=Deployment())
    [r] = own(rejections)
    assert r.reason == Reason.COMPUTE_CAPABILITY
    assert "10.0, 10.3, 10.7" in r.message and "9.0" in r.message


def test_on_sm90_it_is_never_selected_without_pinning(registry):
    for fmt in sorted(declared_formats()):
        lp, _ = plan_layer(layer(fmt), registry=registry, environment=SM90,
                           deployment=Deployment())
        assert lp.experts != NAME


def test_pinned_on_sm90_the_plan_fails_with_the_capability_reason(registry):
    with pytest.raises(PlanError, match=r"compute_capability: needs CUDA compute capability "
                                        r"10\.0, 10\.3, 10\.7"):
        plan_layer(layer(), registry=registry, environment=SM90,
                   deployment=Deployment(experts_backend=NAME))


@pytest.mark.parametrize("target", ["cuda:8.0", "cuda:9.0", "cuda:11.0", "sm120", "sm121"])
def test_other_cuda_capabilities_are_refused(registry, target):
    _, rejections = plan_layer(layer(), registry=registry,
                               environment=Environment.for_target(target),
                               deployment=Deployment())
    assert [r.reason for r in own(rejections)] == [Reason.COMPUTE_CAPABILITY]


def test_cpu_is_refused_as_a_device(registry):
    cpu = Environment.for_target("cpu")
    _, rejections = plan_layer(layer(), registry=registry, environment=cpu, deployment=Deployment())
    assert [r.reason for r in own(rejections)] == [Reason.UNSUPPORTED_DEVICE]


def test_gelu_is_refused(registry):
    _, rejections = plan_layer(layer(activation=F.GELU), registry=registry, environment=SM100,
                               deployment=Deployment())
    assert [r.reason for r in own(rejections)] == [Reason.UNSUPPORTED_ACTIVATION]


def test_sizes_off_the_declared_multiple_are_refused(registry):
    m = plugin.SHAPE_MULTIPLE
    _, rejections = plan_layer(layer(intermediate_size=m + m // 2), registry=registry,
                               environment=SM100, deployment=Deployment())
    [r] = own(rejections)
    assert r.reason == Reason.UNSUPPORTED_SHAPE and str(m) in r.message


def test_a_probed_machine_without_flashinfer_is_refused_for_the_missing_module(registry):
    env = Environment("cuda", (10, 0), available=frozenset({"torch"}), name="B200")
    _, rejections = plan_layer(layer(), registry=registry, environment=env,
                               deployment=Deployment())
    [r] = own(rejections)
    assert r.reason == Reason.MISSING_DEPENDENCY
    assert "flashinfer" in r.message and "cutlass" in r.message


# --------------------------------------------------------------------- real ModelOpt checkpoints


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tiny = pytest.importorskip(
        "moe_runtime.checkpoint.tiny", reason="moe_runtime.checkpoint.tiny (tiny ModelOpt "
        "checkpoints) is not in this checkout")
    from moe_runtime.checkpoint import read_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    size = dict(hidden_size=2 * plugin.SHAPE_MULTIPLE, intermediate_size=plugin.SHAPE_MULTIPLE)
    return {
        "nvfp4": read_checkpoint(tiny.make_tiny_checkpoint(
            root / "nvfp4", arch="qwen3_moe", quant="nvfp4", **size)),
        "mixed": read_checkpoint(tiny.make_tiny_checkpoint(
            root / "mixed", arch="qwen3_moe", quant="mixed", fp8_moe_layers=(1,), **size)),
    }


def _plan(ckpt, registry, env):
    from moe_runtime.checkpoint.problems import problems_from_checkpoint

    return plan_model(problems_from_checkpoint(ckpt), registry=registry, environment=env)


def test_nvfp4_checkpoint_every_moe_layer_runs_on_it_on_sm100(checkpoints, registry):
    ckpt = checkpoints["nvfp4"]
    assert ckpt.quant_algo == "NVFP4"
    plan = _plan(ckpt, registry, SM100)
    assert [lp.experts for lp in plan.layers] == [NAME] * len(ckpt.moe_layers)
    assert all(lp.problem.format == F.NVFP4_W4A4 for lp in plan.layers)


def test_mixed_precision_checkpoint_nvfp4_layers_on_it_fp8_layers_refused_by_name(
    checkpoints, registry
):
    ckpt = checkpoints["mixed"]
    assert ckpt.quant_algo == "MIXED_PRECISION"
    plan = _plan(ckpt, registry, SM100)
    by_format = {lp.problem.format: lp.experts for lp in plan.layers}
    assert by_format[F.NVFP4_W4A4] == NAME
    assert by_format[F.FP8_W8A8] != NAME
    [r] = own(plan.rejections)
    assert r.reason == Reason.UNSUPPORTED_FORMAT and F.FP8_W8A8 in r.message
    assert r.layer == next(lp.problem.name for lp in plan.layers
                           if lp.problem.format == F.FP8_W8A8)


@pytest.mark.parametrize("which", ["nvfp4", "mixed"])
def test_checkpoints_on_sm90_never_get_it(checkpoints, registry, which):
    plan = _plan(checkpoints[which], registry, SM90)
    assert all(lp.experts != NAME for lp in plan.layers)
    assert {r.reason for r in own(plan.rejections)} <= {Reason.COMPUTE_CAPABILITY,
                                                        Reason.UNSUPPORTED_FORMAT}
    assert Reason.COMPUTE_CAPABILITY in {r.reason for r in own(plan.rejections)}


# ---------------------------------------------------------------------------- a probed machine


def test_on_the_probed_machine_it_is_planned_only_where_the_kernels_run(registry):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device to probe (none here)")
    env = Environment.probe(device="cuda", modules=registry.required_modules())
    lp, rejections = plan_layer(layer(), registry=registry, environment=env,
                                deployment=Deployment())
    if env.capability in plugin.supported_capabilities():
        assert lp.experts == NAME or [r.reason for r in own(rejections)] == [
            Reason.MISSING_DEPENDENCY]
    else:
        assert lp.experts != NAME
        assert [r.reason for r in own(rejections)] == [Reason.COMPUTE_CAPABILITY]
