"""What the backend refuses when it is built, API detection, and the settings (single process)."""

from __future__ import annotations

import importlib.util

import pytest
from deepep_sim import SimulatedBufferV12, SimulatedBufferV100
from moe_runtime import formats as F
from moe_runtime.backend_api import CommSetup, LayerProblem

from moe_runtime_deepep import limits
from moe_runtime_deepep.api import inspect_buffer_api
from moe_runtime_deepep.backend import DeepEPComm, DeepEPError
from moe_runtime_deepep.settings import DeepEPSettings, SettingsError

# Shapes of real models (DESIGN.md)
QWEN3_30B = dict(hidden_size=2048, intermediate_size=768, num_experts=128, top_k=8)
QWEN35_397B = dict(hidden_size=4096, intermediate_size=1024, num_experts=512, top_k=10)
DEEPSEEK_V3 = dict(hidden_size=7168, intermediate_size=2048, num_experts=256, top_k=8)
MIXTRAL = dict(hidden_size=4096, intermediate_size=14336, num_experts=8, top_k=2)


def layer(dtype="bfloat16", fmt=F.NVFP4_W4A4, **shape):
    base = dict(QWEN3_30B)
    base.update(shape)
    return LayerProblem(name="model.layers.3.mlp.experts", format=fmt, activation=F.SILU,
                        dtype=dtype, **base)


def build(problem, layout, world, payload=F.UNQUANTIZED, buffer_cls=SimulatedBufferV12,
          max_tokens=128, settings=None):
    fake = object.__new__(buffer_cls)  # only its type is inspected before any call
    setup = CommSetup(problem=problem, payload=payload, layout=layout, ep_rank=0, ep_size=world,
                      max_tokens_per_rank=max_tokens)
    return DeepEPComm(setup=setup, buffer=fake, settings=settings or DeepEPSettings())


@pytest.mark.parametrize("shape,layout,world", [
    (QWEN3_30B, F.MASKED, 8), (DEEPSEEK_V3, F.MASKED, 16), (DEEPSEEK_V3, F.TOKEN_MAJOR, 8),
    (MIXTRAL, F.TOKEN_MAJOR, 8), (MIXTRAL, F.MASKED, 4), (QWEN35_397B, F.TOKEN_MAJOR, 4),
])
def test_real_model_shapes_are_accepted(shape, layout, world):
    comm = build(layer(**shape), layout, world)
    assert comm.mode == ("low_latency" if layout == F.MASKED else "normal")


@pytest.mark.parametrize("kwargs,layout,world,payload,needle", [
    (dict(dtype="float16"), F.TOKEN_MAJOR, 8, F.UNQUANTIZED, "bfloat16 activations only"),
    (dict(num_experts=10), F.TOKEN_MAJOR, 4, F.UNQUANTIZED, "num_experts % ranks == 0"),
    ({}, F.TOKEN_MAJOR, 6, F.UNQUANTIZED, "SWITCH_RANKS"),
    ({}, F.TOKEN_MAJOR, 16, F.UNQUANTIZED, "internode normal mode is not declared"),
    (dict(hidden_size=1536), F.MASKED, 8, F.UNQUANTIZED, "MOE_RUNTIME_DEEPEP_LL_HIDDEN_SIZES"),
    (dict(QWEN35_397B), F.MASKED, 8, F.UNQUANTIZED, "top-k 10 exceeds DeepEP's low-latency "
                                                    "limit 9"),
    ({}, F.MASKED, 8, F.FP8, "per-token, per-128-channel"),
    ({}, F.MASKED, 12, F.UNQUANTIZED, "a multiple of 8"),
    (dict(hidden_size=2056), F.TOKEN_MAJOR, 8, F.FP8, "multiple of 128"),
])
def test_layers_deepep_cannot_run_are_refused_with_the_reason(kwargs, layout, world, payload,
                                                              needle):
    with pytest.raises(DeepEPError, match="deepep .* mode cannot run it") as exc:
        build(layer(**kwargs), layout, world, payload)
    assert needle in str(exc.value)
    assert "model.layers.3.mlp.experts" in str(exc.value)


def test_low_latency_bound_is_the_plans_capped_by_the_declared_one():
    assert build(layer(), F.MASKED, 8, max_tokens=64).bound == 64
    assert build(layer(), F.MASKED, 8, max_tokens=4096).bound == 128  # the declared default
    comm = build(layer(), F.MASKED, 8, max_tokens=600,
                 settings=DeepEPSettings(ll_max_tokens_per_rank=600, qp_depth=2048))
    assert comm.bound == 600
    with pytest.raises(SettingsError, match="between 1 and 511"):
        DeepEPSettings(ll_max_tokens_per_rank=600)  # NVSHMEM_QP_DEPTH 1024 allows 511


def test_low_latency_bound_is_checked_against_the_nvshmem_queue_depth():
    assert any("NVSHMEM_QP_DEPTH >= 1202" in p for p in limits.check_layer(
        mode="low_latency", world=8, num_experts=128, top_k=8, hidden=2048, dtype="bfloat16",
        payload="unquantized", max_tokens_per_rank=600, qp_depth=1024))


def test_low_latency_needs_an_api_that_can_carry_bf16():
    with pytest.raises(DeepEPError, match="use_fp8 parameter .*1.0.0"):
        build(layer(), F.MASKED, 8, buffer_cls=SimulatedBufferV100)
    build(layer(), F.TOKEN_MAJOR, 8, buffer_cls=SimulatedBufferV100)  # normal mode is fine


@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is not None, reason="deep_ep is installed")
def test_without_deep_ep_the_backend_says_so_instead_of_crashing():
    setup = CommSetup(problem=layer(), payload=F.UNQUANTIZED, layout=F.TOKEN_MAJOR, ep_size=8)
    with pytest.raises(DeepEPError, match="deep_ep cannot be imported.*README"):
        DeepEPComm(setup=setup, settings=DeepEPSettings())


def test_layout_decides_the_mode():
    with pytest.raises(ValueError, match="token_major and masked"):
        build(layer(), "interleaved", 8)


# ----------------------------------------------------------------------------- API detection


class _ForkBuffer:
    """The signature of the sgl-project fork's low_latency_dispatch (NVFP4 arguments)."""

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                 explicitly_destroy=False, comm=None):
        pass

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None, x_global_scale=None,
                             use_fp8=True, round_scale=False, use_ue8m0=False, use_nvfp4=False,
                             use_ue8m0_for_sf=False, async_finish=False, return_recv_hook=False):
        pass

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False,
                            zero_copy=False, async_finish=False, return_recv_hook=False, out=None,
                            combine_wait_recv_cost_stats=None):
        pass


def test_api_features_come_from_signatures():
    v100 = inspect_buffer_api(SimulatedBufferV100)
    assert not v100.ll_unquantized and not v100.nvlink_for_low_latency and not v100.sm90_query
    assert v100.normal_dispatch and v100.low_latency
    v12 = inspect_buffer_api(SimulatedBufferV12)
    assert v12.ll_unquantized and v12.nvlink_for_low_latency and v12.sm90_query
    assert not v12.ll_nvfp4
    fork = inspect_buffer_api(_ForkBuffer)
    assert fork.ll_unquantized and fork.ll_nvfp4 and not fork.normal_dispatch
    assert "ll_nvfp4" in fork.describe()
    assert inspect_buffer_api(object).describe() == "none of the features this plugin uses"


# ----------------------------------------------------------------------------- settings


def test_settings_defaults_and_environment():
    s = DeepEPSettings.from_env({})
    assert s == DeepEPSettings()
    assert s.ll_max_tokens_per_rank == 128 and s.ll_oversize == "refuse"
    assert s.ll_split_max_tokens_per_rank is None
    # the removed per-forward agreement may stay switched off in an old environment
    assert DeepEPSettings.from_env({"MOE_RUNTIME_DEEPEP_AGREE_ON_BATCH": "0"}) == s
    s = DeepEPSettings.from_env({
        "MOE_RUNTIME_DEEPEP_LL_MAX_TOKENS_PER_RANK": "256",
        "MOE_RUNTIME_DEEPEP_LL_OVERSIZE": "split",
        "MOE_RUNTIME_DEEPEP_LL_SPLIT_MAX_TOKENS_PER_RANK": "1024",
        "MOE_RUNTIME_DEEPEP_NUM_SMS": "24",
        "MOE_RUNTIME_DEEPEP_ALLOW_NVLINK_LL": "0",
        "MOE_RUNTIME_DEEPEP_LL_HIDDEN_SIZES": "3072, 2048",
    })
    assert (s.ll_max_tokens_per_rank, s.ll_oversize, s.num_sms) == (256, "split", 24)
    assert s.ll_split_max_tokens_per_rank == 1024
    assert s.allow_nvlink_for_low_latency is False and s.ll_hidden_sizes == (2048, 3072)


@pytest.mark.parametrize("env,needle", [
    ({"MOE_RUNTIME_DEEPEP_LL_MAX_TOKENS_PER_RANK": "lots"}, "is not an integer"),
    ({"MOE_RUNTIME_DEEPEP_LL_MAX_TOKENS_PER_RANK": "0"}, "must be at least 1"),
    ({"MOE_RUNTIME_DEEPEP_LL_MAX_TOKENS_PER_RANK": "512"}, "between 1 and 511"),
    ({"MOE_RUNTIME_DEEPEP_LL_OVERSIZE": "drop"}, "use one of refuse, split"),
    ({"MOE_RUNTIME_DEEPEP_LL_OVERSIZE": "split"},
     "split needs MOE_RUNTIME_DEEPEP_LL_SPLIT_MAX_TOKENS_PER_RANK: the largest batch per rank"),
    ({"MOE_RUNTIME_DEEPEP_LL_SPLIT_MAX_TOKENS_PER_RANK": "512"},
     "is read only with MOE_RUNTIME_DEEPEP_LL_OVERSIZE=split \\(it is 'refuse'\\)"),
    ({"MOE_RUNTIME_DEEPEP_LL_OVERSIZE": "split",
      "MOE_RUNTIME_DEEPEP_LL_SPLIT_MAX_TOKENS_PER_RANK": "128"},
     "=128 must be above MOE_RUNTIME_DEEPEP_LL_MAX_TOKENS_PER_RANK=128"),
    ({"MOE_RUNTIME_DEEPEP_LL_SPLIT_MAX_TOKENS_PER_RANK": "many"}, "is not an integer"),
    ({"MOE_RUNTIME_DEEPEP_NUM_SMS": "23"}, "even SM count"),
    ({"MOE_RUNTIME_DEEPEP_AGREE_ON_BATCH": "1"},
     "AGREE_ON_BATCH is no longer read: .*host sync.*LL_OVERSIZE=split"),
    ({"MOE_RUNTIME_DEEPEP_AGREE_ON_BATCH": "maybe"}, "not a boolean"),
    ({"MOE_RUNTIME_DEEPEP_LL_HIDDEN_SIZES": "a,b"}, "comma list of integers"),
])
def test_invalid_settings_name_the_variable(env, needle):
    with pytest.raises(SettingsError, match=needle):
        DeepEPSettings.from_env(env)


def test_larger_queue_depth_allows_a_larger_bound():
    s = DeepEPSettings.from_env({"MOE_RUNTIME_DEEPEP_LL_MAX_TOKENS_PER_RANK": "1000",
                                 "NVSHMEM_QP_DEPTH": "4096"})
    assert s.ll_max_tokens_per_rank == 1000
    assert limits.max_low_latency_tokens(4096) == 2047


@pytest.mark.parametrize("max_tokens,settings,want", [
    (128, DeepEPSettings(), (128, 128, 1)),
    (64, DeepEPSettings(), (64, 64, 1)),  # a plan bound below the setting sizes the buffer
    (4096, DeepEPSettings(), (128, 128, 1)),
    (512, DeepEPSettings(ll_oversize="split", ll_split_max_tokens_per_rank=512), (128, 512, 4)),
    (300, DeepEPSettings(ll_oversize="split", ll_split_max_tokens_per_rank=512), (128, 300, 3)),
    (100, DeepEPSettings(ll_oversize="split", ll_split_max_tokens_per_rank=512), (100, 100, 1)),
])
def test_low_latency_bounds_are_fixed_when_the_backend_is_built(max_tokens, settings, want):
    comm = build(layer(), F.MASKED, 8, max_tokens=max_tokens, settings=settings)
    assert (comm.bound, comm.forward_bound, comm.rounds) == want
    normal = build(layer(), F.TOKEN_MAJOR, 8, max_tokens=max_tokens, settings=settings)
    assert (normal.bound, normal.forward_bound, normal.rounds) == (None, None, 1)
