"""The planner decides from declarations alone."""

from __future__ import annotations

import attrs
import pytest

from moe_runtime import (
    CapabilityRange,
    CommBackendSpec,
    CommSupport,
    ExpertsBackendSpec,
    Hardware,
    Support,
)
from moe_runtime.backend_api import LayerProblem
from moe_runtime.environment import Environment
from moe_runtime.planner import Deployment, PlanError, Reason, plan_layer, plan_model
from moe_runtime.testing.registries import registry_of

SM100 = Hardware(devices=["cuda"], cuda_capabilities=[CapabilityRange.exactly("10.0"),
                                                      CapabilityRange.exactly("10.3")])


def layer(fmt="nvfp4_w4a4", name="model.layers.0.mlp.experts", **kw):
    base = dict(activation="silu", num_experts=8, top_k=2, hidden_size=64, intermediate_size=32)
    base.update(kw)
    return LayerProblem(name=name, format=fmt, **base)


registry_with = registry_of


def builtin_choice(p, environment, deployment=Deployment()) -> str:
    """The experts backend the built-in plugin alone plans for ``p``: where a test backend is
    refused, the layer falls back to it."""
    lp, _ = plan_layer(p, registry=registry_with(), environment=environment, deployment=deployment)
    return lp.experts


FAST_FP4 = ExpertsBackendSpec(
    name="fast_fp4", factory="m:C", priority=100,
    supports=[Support(formats=["nvfp4_w4a4"], layouts=["token_major", "masked"],
                      payloads=["unquantized", "nvfp4"], hardware=SM100)],
)
HOPPER_W4A16 = ExpertsBackendSpec(
    name="hopper", factory="m:C", priority=50,
    supports=[
        Support(formats=["bf16", "fp8_w8a8", "nvfp4_w4a16"], payloads=["unquantized", "fp8"],
                hardware=Hardware(devices=["cuda"], cuda_capabilities=[CapabilityRange("9.0")])),
        Support(formats=["nvfp4_w4a4"], runs_as="nvfp4_w4a16",
                hardware=Hardware(devices=["cuda"], cuda_capabilities=[CapabilityRange("9.0")]),
                note="no FP4 tensor cores before compute capability 10.0"),
    ],
)

SM100_ENV = Environment.for_target("sm100")
SM90_ENV = Environment.for_target("sm90")
CPU_ENV = Environment("cpu", None, frozenset({"torch"}), "cpu")


def test_highest_priority_backend_that_accepts_wins():
    reg = registry_with(FAST_FP4, HOPPER_W4A16)
    lp, _ = plan_layer(layer(), registry=reg, environment=SM100_ENV, deployment=Deployment())
    assert lp.experts == "fast_fp4"
    assert set(lp.alternatives) == {"hopper", "reference"}


def test_sm90_target_refuses_sm100_backend_with_capability_reason():
    reg = registry_with(FAST_FP4, HOPPER_W4A16)
    with pytest.raises(PlanError) as exc:
        plan_layer(layer(), registry=reg, environment=SM90_ENV,
                   deployment=Deployment(experts_backend="fast_fp4"))
    msg = str(exc.value)
    assert "model.layers.0.mlp.experts" in msg and "nvfp4_w4a4" in msg
    assert "compute capability 10.0, 10.3" in msg and "has 9.0" in msg
    assert "hopper" in msg and "reference" in msg  # who would run it
    reasons = {r.backend: r.reason for r in exc.value.rejections}
    assert reasons["fast_fp4"] is Reason.COMPUTE_CAPABILITY


def test_degradation_is_declared_and_reported():
    reg = registry_with(FAST_FP4, HOPPER_W4A16)
    lp, _ = plan_layer(layer(), registry=reg, environment=SM90_ENV, deployment=Deployment())
    assert lp.experts == "hopper"
    assert lp.runs_as == "nvfp4_w4a16"
    assert "activations are not quantized to nvfp4" in lp.degradations[0]
    assert "no FP4 tensor cores" in lp.degradations[0]


def test_degradation_can_be_refused():
    reg = registry_with(HOPPER_W4A16)
    lp, rej = plan_layer(layer(), registry=reg, environment=SM90_ENV,
                         deployment=Deployment(allow_degradation=False))
    assert lp.experts == "reference" and lp.runs_as == "nvfp4_w4a4"
    own = [r for r in rej if r.backend == "hopper"]
    assert [r.reason for r in own] == [Reason.DEGRADATION_DISABLED]
    # the message says why (degradation off), not that the declared format is missing
    assert "degradation is switched off" in own[0].message
    assert "does not run" not in own[0].message


def test_layers_of_different_formats_get_different_backends():
    reg = registry_with(FAST_FP4)
    plan = plan_model([layer(name="l0"), layer("fp8_w8a8", name="l1"), layer(name="l2")],
                      registry=reg, environment=SM100_ENV)
    assert [lp.experts for lp in plan.layers] == ["fast_fp4", "reference", "fast_fp4"]
    rej = [r for r in plan.rejections if r.layer == "l1" and r.backend == "fast_fp4"]
    assert rej[0].reason is Reason.UNSUPPORTED_FORMAT


def test_pinned_backend_refusal_names_the_layer_it_cannot_run():
    reg = registry_with(FAST_FP4)
    with pytest.raises(PlanError) as exc:
        plan_model([layer(name="l0"), layer("fp8_w8a8", name="l1")], registry=reg,
                   environment=SM100_ENV, deployment=Deployment(experts_backend="fast_fp4"))
    msg = str(exc.value)
    assert "layer l1 (format fp8_w8a8" in msg and "unsupported_format" in msg
    assert "layer l0" not in msg


def test_unknown_pinned_backend_lists_the_registered_ones():
    reg = registry_with(FAST_FP4)
    with pytest.raises(PlanError, match="'nope' is not a registered experts backend.*fast_fp4"):
        plan_layer(layer(), registry=reg, environment=SM100_ENV,
                   deployment=Deployment(experts_backend="nope"))


def test_unregistered_format_is_refused_with_the_registered_ones():
    reg = registry_with()
    with pytest.raises(PlanError, match="'mxfp4' is not registered.*nvfp4_w4a16"):
        plan_layer(layer("mxfp4"), registry=reg, environment=CPU_ENV, deployment=Deployment())


def test_missing_dependency_is_a_reason():
    spec = ExpertsBackendSpec(
        name="needs_lib", factory="m:C", priority=5,
        supports=[Support(formats=["bf16"], hardware=Hardware(requires=["surely_absent_lib"]))])
    reg = registry_with(spec)
    lp, rej = plan_layer(layer("bf16"), registry=reg, environment=CPU_ENV,
                         deployment=Deployment())
    assert lp.experts == builtin_choice(layer("bf16"), CPU_ENV)
    (r,) = [r for r in rej if r.backend == "needs_lib"]
    assert r.reason is Reason.MISSING_DEPENDENCY and "surely_absent_lib" in r.message


def test_target_environment_assumes_dependencies_and_says_so():
    spec = ExpertsBackendSpec(
        name="needs_lib", factory="m:C", priority=5,
        supports=[Support(formats=["bf16"], hardware=Hardware(requires=["surely_absent_lib"]))])
    lp, _ = plan_layer(layer("bf16"), registry=registry_with(spec),
                       environment=Environment.for_target("sm90"), deployment=Deployment())
    assert lp.experts == "needs_lib"
    assert any("surely_absent_lib" in n and "not checked" in n for n in lp.notes)


def test_fp8_payload_is_derived_from_both_declarations():
    reg = registry_with(HOPPER_W4A16)
    lp, _ = plan_layer(layer("fp8_w8a8"), registry=reg, environment=SM90_ENV,
                       deployment=Deployment(ep_size=2))
    assert (lp.comm, lp.payload) == ("torch_all_to_all", "fp8")
    lp, _ = plan_layer(layer("bf16"), registry=reg, environment=SM90_ENV,
                       deployment=Deployment(ep_size=2))
    assert lp.payload == "unquantized"


def test_degraded_layer_gets_no_quantized_payload():
    masked_comm = CommBackendSpec(
        name="ll", factory="m:C", priority=5,
        supports=[CommSupport(layout="token_major", payloads=["unquantized", "nvfp4"],
                              min_world_size=2)])
    reg = registry_with(HOPPER_W4A16, masked_comm)
    lp, _ = plan_layer(layer(), registry=reg, environment=SM90_ENV,
                       deployment=Deployment(ep_size=2))
    assert lp.runs_as == "nvfp4_w4a16" and lp.payload == "unquantized"


def test_nvfp4_payload_when_both_sides_declare_it():
    comm = CommBackendSpec(
        name="ll", factory="m:C", priority=5,
        supports=[CommSupport(layout="masked", payloads=["unquantized", "nvfp4"],
                              min_world_size=2, max_tokens_per_rank=256, mode="low_latency")])
    reg = registry_with(FAST_FP4, comm)
    lp, _ = plan_layer(layer(), registry=reg, environment=SM100_ENV,
                       deployment=Deployment(ep_size=4, max_tokens_per_rank=128))
    assert (lp.experts, lp.comm, lp.layout, lp.payload) == ("fast_fp4", "ll", "masked", "nvfp4")


def test_pinned_payload_that_a_side_cannot_carry_is_refused():
    reg = registry_with(HOPPER_W4A16)
    with pytest.raises(PlanError, match="payload nvfp4 is not possible"):
        plan_layer(layer("fp8_w8a8"), registry=reg, environment=SM90_ENV,
                   deployment=Deployment(ep_size=2, payload="nvfp4"))


def test_token_bound_of_a_mode_is_enforced():
    comm = CommBackendSpec(
        name="ll", factory="m:C", priority=5,
        supports=[CommSupport(layout="token_major", min_world_size=2, max_tokens_per_rank=128)])
    reg = registry_with(comm)
    lp, rej = plan_layer(layer("bf16"), registry=reg, environment=CPU_ENV,
                         deployment=Deployment(ep_size=2, max_tokens_per_rank=4096))
    assert lp.comm == "torch_all_to_all"
    (r,) = [r for r in rej if r.backend == "ll"]
    assert r.reason is Reason.TOKEN_BOUND and "128" in r.message


SMALL_BATCH = ExpertsBackendSpec(
    name="small_batch", factory="m:C", priority=100,
    supports=[Support(formats=["bf16"], max_tokens_per_forward=64)])


def test_an_experts_token_bound_is_honoured():
    reg = registry_with(SMALL_BATCH)
    lp, rej = plan_layer(layer("bf16"), registry=reg, environment=CPU_ENV,
                         deployment=Deployment(max_tokens_per_rank=64))
    assert lp.experts == "small_batch"  # exactly the bound
    lp, rej = plan_layer(layer("bf16"), registry=reg, environment=CPU_ENV,
                         deployment=Deployment(max_tokens_per_rank=65))
    assert lp.experts == builtin_choice(layer("bf16"), CPU_ENV)
    (r,) = [r for r in rej if r.backend == "small_batch"]
    assert r.reason is Reason.TOKEN_BOUND and r.role == "experts"
    assert r.message.startswith("runs at most 64 tokens per forward; the deployment may send 65")
    assert "small_batch" not in lp.alternatives


def test_an_experts_token_bound_counts_every_rank_s_tokens():
    # under expert parallelism every rank may route all its tokens to one rank's experts
    reg = registry_with(SMALL_BATCH)
    lp, rej = plan_layer(layer("bf16"), registry=reg, environment=CPU_ENV,
                         deployment=Deployment(ep_size=2, max_tokens_per_rank=32))
    assert lp.experts == "small_batch"
    lp, rej = plan_layer(layer("bf16"), registry=reg, environment=CPU_ENV,
                         deployment=Deployment(ep_size=2, max_tokens_per_rank=33))
    assert lp.experts != "small_batch"
    assert [r.message for r in rej if r.backend == "small_batch"][0].startswith(
        "runs at most 64 tokens per forward; the deployment may send 66")


def test_a_pinned_experts_backend_past_its_token_bound_is_refused_with_the_reason():
    with pytest.raises(PlanError, match="token_bound: runs at most 64 tokens per forward; the "
                                        "deployment may send 4096"):
        plan_layer(layer("bf16"), registry=registry_with(SMALL_BATCH), environment=CPU_ENV,
                   deployment=Deployment(experts_backend="small_batch"))


def test_an_experts_token_bound_is_per_block():
    # the bounded block is skipped; the unbounded block of the same backend runs the layer
    spec = ExpertsBackendSpec(
        name="two_paths", factory="m:C", priority=100,
        supports=[Support(formats=["bf16"], max_tokens_per_forward=16, note="small path"),
                  Support(formats=["bf16"], note="large path")])
    reg = registry_with(spec)
    small, _ = plan_layer(layer("bf16"), registry=reg, environment=CPU_ENV,
                          deployment=Deployment(max_tokens_per_rank=16))
    large, _ = plan_layer(layer("bf16"), registry=reg, environment=CPU_ENV,
                          deployment=Deployment(max_tokens_per_rank=17))
    assert (small.experts, small.notes) == ("two_paths", ("small path",))
    assert (large.experts, large.notes) == ("two_paths", ("large path",))


def test_no_common_layout_falls_back_to_a_pair_that_matches():
    masked_only = ExpertsBackendSpec(
        name="masked_only", factory="m:C", priority=100,
        supports=[Support(formats=["bf16"], layouts=["masked"])])
    reg = registry_with(masked_only)
    lp, _ = plan_layer(layer("bf16"), registry=reg, environment=CPU_ENV,
                       deployment=Deployment(ep_size=2))
    # torch_all_to_all is token-major only
    assert lp.experts == builtin_choice(layer("bf16"), CPU_ENV, Deployment(ep_size=2))
    lp, _ = plan_layer(layer("bf16"), registry=reg, environment=CPU_ENV, deployment=Deployment())
    assert (lp.experts, lp.layout) == ("masked_only", "masked")


def test_pinned_pair_without_common_layout_is_refused():
    masked_only = ExpertsBackendSpec(
        name="masked_only", factory="m:C", priority=100,
        supports=[Support(formats=["bf16"], layouts=["masked"])])
    with pytest.raises(PlanError) as exc:
        plan_layer(layer("bf16"), registry=registry_with(masked_only), environment=CPU_ENV,
                   deployment=Deployment(ep_size=2, experts_backend="masked_only"))
    assert any(r.reason is Reason.NO_COMMON_LAYOUT for r in exc.value.rejections)


def test_world_size_rules_pick_the_communication_backend():
    reg = registry_with()
    assert plan_layer(layer("bf16"), registry=reg, environment=CPU_ENV,
                      deployment=Deployment())[0].comm == "local"
    lp, rej = plan_layer(layer("bf16"), registry=reg, environment=CPU_ENV,
                         deployment=Deployment(ep_size=4))
    assert lp.comm == "torch_all_to_all"
    assert any(r.backend == "local" and r.reason is Reason.WORLD_SIZE for r in rej)


def test_shape_multiple_is_checked():
    spec = ExpertsBackendSpec(name="big_tiles", factory="m:C", priority=9,
                              supports=[Support(formats=["bf16"], shape_multiple=128)])
    lp, rej = plan_layer(layer("bf16", hidden_size=192), registry=registry_with(spec),
                         environment=CPU_ENV, deployment=Deployment())
    assert lp.experts == builtin_choice(layer("bf16", hidden_size=192), CPU_ENV)
    assert [r.reason for r in rej if r.backend == "big_tiles"] == [Reason.UNSUPPORTED_SHAPE]


def test_device_kind_is_checked():
    lp, rej = plan_layer(layer(), registry=registry_with(FAST_FP4), environment=CPU_ENV,
                         deployment=Deployment())
    assert lp.experts == builtin_choice(layer(), CPU_ENV)
    assert [r.reason for r in rej if r.backend == "fast_fp4"] == [Reason.UNSUPPORTED_DEVICE]


@pytest.mark.parametrize("env", [SM100_ENV, SM90_ENV, CPU_ENV], ids=["sm100", "sm90", "cpu"])
def test_plans_do_not_depend_on_backend_names(env):
    """Renaming every backend (same declarations, same priorities) gives the same plan."""
    specs = [FAST_FP4, HOPPER_W4A16]
    renamed = [attrs.evolve(s, name="zz_" + s.name[::-1]) for s in specs]
    problems = [layer(name="a"), layer("fp8_w8a8", name="b"), layer("bf16", name="c")]
    p1 = plan_model(problems, registry=registry_with(*specs), environment=env)
    p2 = plan_model(problems, registry=registry_with(*renamed), environment=env)
    mapping = {s.name: r.name for s, r in zip(specs, renamed)}
    assert [mapping.get(lp.experts, lp.experts) for lp in p1.layers] == [
        lp.experts for lp in p2.layers]
    assert [(lp.runs_as, lp.payload, lp.layout) for lp in p1.layers] == [
        (lp.runs_as, lp.payload, lp.layout) for lp in p2.layers]


def test_plan_json_carries_every_rejection():
    reg = registry_with(FAST_FP4)
    plan = plan_model([layer()], registry=reg, environment=SM90_ENV)
    data = plan.to_json()
    assert data["environment"]["capability"] == "9.0"
    assert {r["backend"]: r["reason"] for r in data["rejections"]}["fast_fp4"] == (
        "compute_capability")


BOTH_LAYOUTS = ExpertsBackendSpec(
    name="both_layouts", factory="m:C", priority=100,
    supports=[Support(formats=["bf16"], layouts=["token_major", "masked"])])
BOUNDED_PLUS_NORMAL = CommBackendSpec(
    name="two_modes", factory="m:C", priority=50,
    supports=[CommSupport(layout="masked", min_world_size=2, max_tokens_per_rank=128,
                          mode="low_latency"),
              CommSupport(layout="token_major", min_world_size=2, mode="normal")])


def test_a_backend_with_a_bounded_mode_switches_mode_per_batch():
    reg = registry_with(BOTH_LAYOUTS, BOUNDED_PLUS_NORMAL)
    lp, _ = plan_layer(layer("bf16"), registry=reg, environment=CPU_ENV,
                       deployment=Deployment(ep_size=4, max_tokens_per_rank=4096))
    assert (lp.experts, lp.comm) == ("both_layouts", "two_modes")
    assert [(m.comm_mode, m.layout, m.max_tokens_per_rank) for m in lp.modes] == [
        ("low_latency", "masked", 128), ("normal", "token_major", None)]
    assert lp.mode_for(1).comm_mode == "low_latency"
    assert lp.mode_for(128).comm_mode == "low_latency"
    assert lp.mode_for(129).comm_mode == "normal"
    assert any("per batch: low_latency" in n for n in lp.notes)


def test_only_the_bounded_mode_when_the_deployment_fits_it():
    reg = registry_with(BOTH_LAYOUTS, BOUNDED_PLUS_NORMAL)
    lp, _ = plan_layer(layer("bf16"), registry=reg, environment=CPU_ENV,
                       deployment=Deployment(ep_size=4, max_tokens_per_rank=64))
    assert [m.comm_mode for m in lp.modes] == ["low_latency"]
    with pytest.raises(ValueError, match="exceeds every mode"):
        lp.mode_for(129)


def test_modes_may_use_different_support_blocks_of_one_backend():
    """A backend declaring its layouts in separate blocks (one per kernel path) still gets the
    per-batch modes: masked block for the bounded mode, token-major block for the rest."""
    split = ExpertsBackendSpec(
        name="split_blocks", factory="m:C", priority=100,
        supports=[Support(formats=["bf16"], layouts=["token_major"], note="token-major path"),
                  Support(formats=["bf16"], layouts=["masked"], note="masked path")])
    reg = registry_with(split, BOUNDED_PLUS_NORMAL)
    lp, _ = plan_layer(layer("bf16"), registry=reg, environment=CPU_ENV,
                       deployment=Deployment(ep_size=8, max_tokens_per_rank=4096))
    assert lp.experts == "split_blocks"
    assert [(m.comm_mode, m.layout) for m in lp.modes] == [
        ("low_latency", "masked"), ("normal", "token_major")]


def test_a_guard_asking_for_another_runs_as_gets_that_reason_and_sentence():
    """A backend guard (SPEC.check with runs_as) on a degraded block: the sentence says what the
    block runs the format as, not that the format is missing (the block declares it)."""
    v = HOPPER_W4A16.check(layer(), runs_as="nvfp4_w4a4")
    assert v.reason is Reason.UNSUPPORTED_RUNS_AS
    assert v.message == "runs format nvfp4_w4a4 as nvfp4_w4a16, not as nvfp4_w4a4"


def test_a_format_no_block_declares_lists_every_declared_format():
    v = HOPPER_W4A16.check(layer("fp16"))
    assert v.reason is Reason.UNSUPPORTED_FORMAT
    assert v.message == ("does not run format fp16; it declares bf16, fp8_w8a8, nvfp4_w4a16, "
                         "nvfp4_w4a4")


def test_every_reason_is_documented_with_its_cause():
    """The Reason set is closed and public: each value has a row in docs/writing-a-backend.md."""
    import pathlib

    doc = (pathlib.Path(__file__).parents[2] / "docs" / "writing-a-backend.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in doc.splitlines()
            if line.startswith("| `")}
    assert {r.value for r in Reason} <= rows


def test_the_placement_rule_gives_every_expert_one_rank_in_contiguous_blocks():
    from moe_runtime.placement import local_experts, owner_table

    for experts, ranks in ((6, 4), (8, 2), (7, 3), (2, 4)):
        blocks = [local_experts(experts, ranks, r) for r in range(ranks)]
        assert [i for b in blocks for i in b] == list(range(experts))
        assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
        owner, local = owner_table(experts, ranks)
        for r, b in enumerate(blocks):
            assert owner[b.start:b.stop].tolist() == [r] * len(b)
            assert local[b.start:b.stop].tolist() == list(range(len(b)))


def test_the_placement_rule_is_written_once():
    """Setups, loading, the all-to-all tables, DeepEP and the memory estimate read
    moe_runtime/placement.py; no other module splits experts over ranks itself."""
    import pathlib
    import re

    root = pathlib.Path(__file__).parents[2]
    sources = [p for d in ("moe_runtime", "plugins") for p in (root / d).rglob("*.py")
               if "tests" not in p.parts and p.name != "placement.py"]
    split = re.compile(r"divmod\([^)]*num_experts|num_experts\s*//\s*(?:max\()?\s*\(?\s*"
                       r"(?:self\.)?(?:world|ep_size)")
    offenders = [str(p.relative_to(root)) for p in sources if split.search(p.read_text())]
    assert offenders == [], offenders


def test_model_dtype_names_are_read_through_one_table():
    from moe_runtime.dtypes import MODEL_DTYPES, model_dtype_name

    assert model_dtype_name("torch.float16") == model_dtype_name("half") == "float16"
    assert model_dtype_name(None) == model_dtype_name("float64") == "bfloat16"
    assert MODEL_DTYPES[model_dtype_name("float32")] == 4
