"""The planner with the installed ``deepep`` entry point: pairings, payloads, bounds, world sizes.

Two small experts backends are registered by a plugin module here: one consumes only the masked
layout (as FlashInfer's CuTe-DSL masked path does), one only the token-major layout. Other plugins
installed next to this one may be present, so the tests pin the backends they assert on.
"""

from __future__ import annotations

import json
import types

import pytest
from moe_runtime import CapabilityRange, ExpertsBackendSpec, Hardware, Support, hookimpl
from moe_runtime import formats as F
from moe_runtime.backend_api import LayerProblem
from moe_runtime.environment import Environment
from moe_runtime.planner import Deployment, PlanError, Reason, plan_layer
from moe_runtime.plugin.registry import Registry

HOPPER = Hardware(devices=["cuda"], cuda_capabilities=[CapabilityRange("9.0")])
ALL = (F.BF16, F.FP8_W8A8, F.NVFP4_W4A4, F.NVFP4_W4A16)

MASKED_CONSUMER = ExpertsBackendSpec(
    name="masked_consumer", factory="x:Y", priority=100,
    supports=[Support(formats=ALL, layouts=[F.MASKED],
                      payloads=[F.UNQUANTIZED, F.FP8, F.NVFP4], hardware=HOPPER)],
)
TOKEN_MAJOR_CONSUMER = ExpertsBackendSpec(
    name="token_major_consumer", factory="x:Y", priority=90,
    supports=[Support(formats=ALL, layouts=[F.TOKEN_MAJOR],
                      payloads=[F.UNQUANTIZED, F.FP8, F.NVFP4], hardware=HOPPER)],
)

H200 = Environment("cuda", (9, 0), frozenset({"deep_ep", "torch"}), "NVIDIA H200")
ENV_VARS = ("MOE_RUNTIME_DEEPEP_LL_MAX_TOKENS_PER_RANK", "MOE_RUNTIME_DEEPEP_LL_OVERSIZE",
            "MOE_RUNTIME_DEEPEP_LL_SPLIT_MAX_TOKENS_PER_RANK", "MOE_RUNTIME_DEEPEP_AGREE_ON_BATCH",
            "NVSHMEM_QP_DEPTH")


def _test_plugin():
    mod = types.ModuleType("deepep_test_experts")

    @hookimpl
    def moe_runtime_register_backends(register):
        register(MASKED_CONSUMER)
        register(TOKEN_MAJOR_CONSUMER)

    mod.moe_runtime_register_backends = moe_runtime_register_backends
    return mod


@pytest.fixture
def registry(monkeypatch):
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    return Registry.load(autoload=True, plugins=[_test_plugin()], environ={})


def layer(fmt=F.NVFP4_W4A4, name="model.layers.0.mlp.experts", **kw):
    base = dict(activation=F.SILU, num_experts=128, top_k=8, hidden_size=2048,
                intermediate_size=768)
    base.update(kw)
    return LayerProblem(name=name, format=fmt, **base)


def plan(registry, problem=None, env=H200, **dep):
    return plan_layer(problem or layer(), registry=registry, environment=env,
                      deployment=Deployment(**dep))


def deepep_rejections(rejections):
    return [r for r in rejections if r.backend == "deepep"]


def test_the_entry_point_registers_deepep(registry):
    assert registry.comms["deepep"].plugin == "deepep"
    info = [i for i in registry.plugin_infos if i.name == "deepep"]
    assert info and info[0].status == "loaded" and info[0].distribution == "moe-runtime-deepep"
    spec = registry.comm_spec("deepep")
    assert spec.factory == "moe_runtime_deepep.backend:DeepEPComm"
    assert spec.priority > registry.comm_spec("torch_all_to_all").priority


def test_low_latency_pairs_with_a_masked_consumer(registry):
    lp, _ = plan(registry, ep_size=8, max_tokens_per_rank=64,
                 experts_backend="masked_consumer", comm_backend="deepep")
    assert (lp.comm, lp.comm_mode, lp.layout) == ("deepep", "low_latency", F.MASKED)
    assert lp.payload == F.UNQUANTIZED  # DeepEP's low-latency mode carries no nvfp4 payload


def test_normal_mode_pairs_with_a_token_major_consumer(registry):
    lp, _ = plan(registry, ep_size=8, experts_backend="token_major_consumer",
                 comm_backend="deepep")
    assert (lp.comm_mode, lp.layout, lp.payload) == ("normal", F.TOKEN_MAJOR, F.UNQUANTIZED)


def test_deepep_is_preferred_over_the_reference_all_to_all(registry):
    lp, _ = plan(registry, ep_size=4, experts_backend="token_major_consumer")
    assert lp.comm == "deepep"


def test_a_masked_consumer_is_refused_where_only_normal_mode_fits(registry):
    # 4096 tokens per rank exceed the low-latency bound; normal mode's token-major layout does not
    # fit a backend that consumes only the masked layout.
    with pytest.raises(PlanError) as exc:
        plan(registry, ep_size=8, max_tokens_per_rank=4096, experts_backend="masked_consumer",
             comm_backend="deepep")
    rej = deepep_rejections(exc.value.rejections)
    assert {r.reason for r in rej} == {Reason.NO_COMMON_LAYOUT, Reason.TOKEN_BOUND}
    layout = [r for r in rej if r.reason == Reason.NO_COMMON_LAYOUT][0]
    assert "mode normal produces layout token_major" in layout.message
    assert "masked_consumer consumes masked" in layout.message
    bound = [r for r in rej if r.reason == Reason.TOKEN_BOUND][0]
    assert "at most 128 tokens per rank" in bound.message and "4096" in bound.message


def test_a_token_major_consumer_is_refused_where_only_low_latency_fits(registry):
    # 16 ranks: the normal mode is declared for 2, 4 and 8 ranks (intranode) only.
    with pytest.raises(PlanError) as exc:
        plan(registry, ep_size=16, max_tokens_per_rank=64,
             experts_backend="token_major_consumer", comm_backend="deepep")
    rej = deepep_rejections(exc.value.rejections)
    assert rej and all(r.reason == Reason.NO_COMMON_LAYOUT for r in rej)
    assert "mode low_latency produces layout masked" in rej[0].message


def test_token_bound_is_enforced(registry):
    with pytest.raises(PlanError) as exc:
        plan(registry, ep_size=16, max_tokens_per_rank=4096, comm_backend="deepep",
             experts_backend="masked_consumer")
    (rej,) = deepep_rejections(exc.value.rejections)
    assert rej.reason == Reason.TOKEN_BOUND
    assert "at most 128 tokens per rank" in rej.message and "4096" in rej.message
    lp, _ = plan(registry, ep_size=16, max_tokens_per_rank=128, comm_backend="deepep",
                 experts_backend="masked_consumer")
    assert lp.comm_mode == "low_latency"


def test_the_declared_bound_follows_the_setting(monkeypatch):
    monkeypatch.setenv("MOE_RUNTIME_DEEPEP_LL_MAX_TOKENS_PER_RANK", "256")
    reg = Registry.load(autoload=True, plugins=[_test_plugin()], environ={})
    bounds = {m.max_tokens_per_rank for m in reg.comm_spec("deepep").supports
              if m.mode == "low_latency"}
    assert bounds == {256}
    lp, _ = plan(reg, ep_size=16, max_tokens_per_rank=200, comm_backend="deepep",
                 experts_backend="masked_consumer")
    assert lp.comm_mode == "low_latency"


def test_split_admits_the_batches_of_its_rounds(monkeypatch, registry):
    monkeypatch.setenv("MOE_RUNTIME_DEEPEP_LL_OVERSIZE", "split")
    monkeypatch.setenv("MOE_RUNTIME_DEEPEP_LL_SPLIT_MAX_TOKENS_PER_RANK", "512")
    reg = Registry.load(autoload=True, plugins=[_test_plugin()], environ={})
    lp, _ = plan(reg, ep_size=16, max_tokens_per_rank=512, comm_backend="deepep",
                 experts_backend="masked_consumer")
    assert lp.comm_mode == "low_latency"
    assert [m.max_tokens_per_rank for m in lp.modes] == [512]
    with pytest.raises(PlanError) as exc:
        plan(reg, ep_size=16, max_tokens_per_rank=513, comm_backend="deepep",
             experts_backend="masked_consumer")
    assert "at most 512 tokens per rank" in deepep_rejections(exc.value.rejections)[0].message


def test_world_size_one_is_refused(registry):
    with pytest.raises(PlanError) as exc:
        plan(registry, ep_size=1, comm_backend="deepep", experts_backend="token_major_consumer")
    (rej,) = deepep_rejections(exc.value.rejections)
    assert rej.reason == Reason.WORLD_SIZE
    assert "the deployment has 1" in rej.message
    assert "world_size" in str(exc.value)
    lp, rejections = plan(registry, ep_size=1, experts_backend="token_major_consumer")
    assert lp.comm != "deepep"
    assert deepep_rejections(rejections)[0].reason == Reason.WORLD_SIZE


@pytest.mark.parametrize("ep_size", [3, 5, 6, 7])
def test_normal_mode_world_sizes_are_exactly_2_4_8(registry, ep_size):
    with pytest.raises(PlanError) as exc:
        plan(registry, ep_size=ep_size, comm_backend="deepep",
             experts_backend="token_major_consumer")
    assert {r.reason for r in deepep_rejections(exc.value.rejections)} <= {
        Reason.NO_COMMON_LAYOUT, Reason.TOKEN_BOUND}


@pytest.mark.parametrize("env,reason", [
    (Environment("cpu", None, frozenset({"deep_ep", "torch"}), "cpu"), Reason.UNSUPPORTED_DEVICE),
    (Environment("cuda", (8, 0), frozenset({"deep_ep", "torch"}), "A100"),
     Reason.COMPUTE_CAPABILITY),
    (Environment("cuda", (9, 0), frozenset({"torch"}), "H200 without DeepEP"),
     Reason.MISSING_DEPENDENCY),
])
def test_hardware_and_dependency_are_declared(registry, env, reason):
    _, rejections = plan(registry, env=env, ep_size=8, experts_backend="reference")
    (rej,) = deepep_rejections(rejections)
    assert rej.reason == reason


# ----------------------------------------------------------------------------- payloads


def test_fp8_layers_get_the_fp8_payload_in_normal_mode_only(registry):
    lp, _ = plan(registry, layer(F.FP8_W8A8), ep_size=8, comm_backend="deepep",
                 experts_backend="token_major_consumer")
    assert (lp.comm_mode, lp.payload) == ("normal", F.FP8)
    assert any("dispatch carries fp8" in n for n in lp.notes)
    lp, _ = plan(registry, layer(F.FP8_W8A8), ep_size=8, max_tokens_per_rank=64,
                 comm_backend="deepep", experts_backend="masked_consumer")
    assert (lp.comm_mode, lp.payload) == ("low_latency", F.UNQUANTIZED)


def test_payload_override_is_validated_against_the_declaration(registry):
    with pytest.raises(PlanError) as exc:
        plan(registry, ep_size=8, max_tokens_per_rank=64, payload=F.NVFP4,
             comm_backend="deepep", experts_backend="masked_consumer")
    payload_rej = [r for r in deepep_rejections(exc.value.rejections)
                   if r.reason == Reason.UNSUPPORTED_PAYLOAD]
    assert payload_rej and "communication mode low_latency carries unquantized" in \
        payload_rej[0].message
    with pytest.raises(PlanError):
        plan(registry, layer(F.NVFP4_W4A4), ep_size=8, payload=F.FP8, comm_backend="deepep",
             experts_backend="token_major_consumer")  # fp8 is not the NVFP4 format's payload
    lp, _ = plan(registry, layer(F.FP8_W8A8), ep_size=8, payload=F.UNQUANTIZED,
                 comm_backend="deepep", experts_backend="token_major_consumer")
    assert lp.payload == F.UNQUANTIZED


# Layer names as the two checkpoint kinds spell them; the planner sees only the format.
NVFP4_CKPT_LAYER = layer(F.NVFP4_W4A4, name="model.layers.5.mlp.experts")
MIXED_CKPT_LAYER = layer(F.NVFP4_W4A4, name="model.language_model.layers.5.mlp.experts")


@pytest.mark.parametrize("experts,dep", [
    ("masked_consumer", dict(ep_size=8, max_tokens_per_rank=64)),
    ("token_major_consumer", dict(ep_size=8)),
    ("token_major_consumer", dict(ep_size=4, max_tokens_per_rank=64)),
])
def test_nvfp4_layers_of_nvfp4_and_mixed_precision_checkpoints_get_the_same_plan(
        registry, experts, dep):
    a, _ = plan(registry, NVFP4_CKPT_LAYER, experts_backend=experts, **dep)
    b, _ = plan(registry, MIXED_CKPT_LAYER, experts_backend=experts, **dep)
    keys = ("comm", "comm_mode", "layout", "payload", "runs_as", "degradations", "notes")
    assert {k: getattr(a, k) for k in keys} == {k: getattr(b, k) for k in keys}


def _write_quant_config(folder, quantization):
    (folder / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt", "version": "0.47.0"}, "quantization": quantization}))
    return folder


def test_formats_resolved_from_real_quant_configs_plan_alike(registry, tmp_path):
    """Through the core's checkpoint resolution: an NVFP4 checkpoint and a MIXED_PRECISION one
    (per-expert NVFP4 keys, FP8 attention) resolve their MoE layer to the same format, hence the
    same DeepEP plan; nothing in the plugin or the planner sees the method name."""
    ckpt = pytest.importorskip("moe_runtime.checkpoint")
    if not all(hasattr(ckpt, n) for n in ("read_quantization", "resolve_module")):
        pytest.skip("moe_runtime.checkpoint has no read_quantization/resolve_module")
    experts = 8
    members = [f"{e}.{p}" for e in range(experts) for p in ("gate_proj", "up_proj", "down_proj")]
    (tmp_path / "nvfp4").mkdir()
    nvfp4 = _write_quant_config(tmp_path / "nvfp4", {
        "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
        "exclude_modules": ["lm_head", "*mlp.gate"]})
    layers = {f"model.layers.0.mlp.experts.{m}": {"quant_algo": "NVFP4", "group_size": 16}
              for m in members}
    layers.update({f"model.layers.0.self_attn.{p}_proj": {"quant_algo": "FP8"}
                   for p in ("q", "k", "v", "o")})
    (tmp_path / "mixed").mkdir()
    mixed = _write_quant_config(tmp_path / "mixed", {
        "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
        "exclude_modules": ["lm_head"], "quantized_layers": layers})
    plans = []
    for folder in (nvfp4, mixed):
        spec = ckpt.read_quantization(folder, {"torch_dtype": "bfloat16"})
        fmt = ckpt.resolve_module(spec, "model.layers.0.mlp.experts", members=members,
                                  moe=True).format
        problem = layer(fmt, num_experts=experts, top_k=2)
        lp, _ = plan(registry, problem, ep_size=8, comm_backend="deepep",
                     experts_backend="token_major_consumer")
        plans.append((fmt, lp.comm_mode, lp.layout, lp.payload))
    assert plans[0] == plans[1] == (F.NVFP4_W4A4, "normal", F.TOKEN_MAJOR, F.UNQUANTIZED)
