"""The CPU experts backend: chosen on CPU, as exact as the conformance suite demands on both of its
paths, its memory cost and degradation in the plan, and the reference still a pin away."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from moe_runtime import formats as F
from moe_runtime.backend_api import Dispatched, ExpertsSetup, LayerProblem
from moe_runtime.backends import cpu_dequantized
from moe_runtime.backends.cpu_dequantized import CpuDequantizedExperts
from moe_runtime.environment import Environment
from moe_runtime.planner import Deployment, plan_model
from moe_runtime.plugin.builtin import CPU_DEQUANTIZED
from moe_runtime.plugin.registry import Registry
from moe_runtime.reference_math import quantize_expert_weights, reference_fused_experts
from moe_runtime.testing.cases import experts_cases
from moe_runtime.testing.harness import run_experts_case

CPU = Environment.for_target("cpu")


@pytest.fixture(scope="module")
def registry():
    return Registry.load()


@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    """The embedded default model's recipe (MIXED_PRECISION: NVFP4 W4A4 experts, FP8 attention)."""
    from moe_runtime.serve.default_model import make_default_model

    return make_default_model(tmp_path_factory.mktemp("default") / "model")


@pytest.fixture(scope="module")
def default_problems(default_model):
    from moe_runtime.checkpoint import read_checkpoint
    from moe_runtime.checkpoint.problems import problems_from_checkpoint

    return problems_from_checkpoint(read_checkpoint(default_model))


# ------------------------------------------------------------------------------------ planning


def test_the_planner_picks_it_on_cpu_for_the_default_model(registry, default_problems):
    plan = plan_model(default_problems, registry=registry, environment=CPU)
    assert [lp.experts for lp in plan.layers] == ["cpu_dequantized"] * len(plan.layers)
    assert all(lp.runs_as == F.NVFP4_W4A16 for lp in plan.layers)  # W4A4 run as W4A16
    assert all("reference" in lp.alternatives for lp in plan.layers)


def test_running_w4a4_without_activation_quantization_is_a_declared_degradation(
        registry, default_problems):
    plan = plan_model(default_problems, registry=registry, environment=CPU)
    for lp in plan.layers:
        (text,) = lp.degradations
        assert "nvfp4_w4a4 weights run as nvfp4_w4a16 by cpu_dequantized" in text
        assert "activations are not quantized to nvfp4" in text


def test_the_plan_states_the_memory_of_the_dequantized_copy(registry, default_problems):
    plan = plan_model(default_problems, registry=registry, environment=CPU)
    stored = {f.name: f.bytes_per_weight for f in F.BUILTIN_FORMATS}[F.NVFP4_W4A4]
    for lp in plan.layers:
        text = " ".join(lp.degradations + lp.notes)
        assert "4 bytes per weight" in text and f"{4 / stored:.1f}x the nvfp4_w4a4" in text


def test_a_native_block_states_its_memory_as_a_note(registry):
    problem = LayerProblem("model.layers.0.mlp.experts", F.BF16, F.SILU, 8, 2, 64, 32)
    (lp,) = plan_model([problem], registry=registry, environment=CPU).layers
    assert lp.experts == "cpu_dequantized" and lp.degradations == ()
    assert any("4 bytes per weight, 2.0x the bf16/fp16 weights" in n for n in lp.notes)


def test_no_degradation_leaves_w4a4_layers_to_the_reference(registry, default_problems):
    plan = plan_model(default_problems, registry=registry, environment=CPU,
                      deployment=Deployment(allow_degradation=False))
    assert {lp.experts for lp in plan.layers} == {"reference"}


def test_the_reference_is_still_a_pin_away(registry, default_problems):
    plan = plan_model(default_problems, registry=registry, environment=CPU,
                      deployment=Deployment(experts_backend="reference"))
    assert {lp.experts for lp in plan.layers} == {"reference"}
    assert all(lp.runs_as == F.NVFP4_W4A4 for lp in plan.layers)  # the reference runs it native


def test_the_cli_plans_the_reference_when_pinned(default_model):
    r = subprocess.run([sys.executable, "-m", "moe_runtime", "plan", str(default_model),
                        "--moe-runner-backend", "reference", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    import json

    layers = json.loads(r.stdout)["layers"]
    assert {layer["experts"] for layer in layers} == {"reference"}


def test_it_is_not_offered_on_cuda(registry):
    problem = LayerProblem("model.layers.0.mlp.experts", F.BF16, F.SILU, 8, 2, 64, 32)
    verdict = CPU_DEQUANTIZED.check(problem, Environment.for_target("cuda:9.0"))
    assert verdict.reason.value == "unsupported_device"


# ------------------------------------------------------------------------------------ numerics


def _cases(registry, shape_names):
    spec = registry.experts_spec("cpu_dequantized")
    return [c for c in experts_cases(registry, spec) if c.shape.name in shape_names]


@pytest.mark.parametrize("path", ["dense", "grouped", "grouped_loop"])
def test_every_path_meets_the_conformance_budget(registry, monkeypatch, path):
    """The suite's cases on either side of the dense/grouped switch, forced to one path; the
    grouped path also with the per-expert loop used where torch._grouped_mm does not run."""
    monkeypatch.setattr(cpu_dequantized, "DENSE_MAX_MACS", 1 << 62 if path == "dense" else 0)
    if path == "grouped_loop":
        monkeypatch.setattr(cpu_dequantized, "grouped_mm_runs", lambda: False)
    cases = _cases(registry, {"batch", "remote_slots", "bias", "not_multiple_of_16",
                              "idle_experts", "smallest_sizes"})
    assert {c.format for c in cases} == {f.name for f in F.BUILTIN_FORMATS}
    failures = []
    for case in cases:
        result = run_experts_case(registry, case, CPU)
        if result["failures"]:
            failures.append(f"{case.id}: {result['failures']}")
    assert not failures, "\n".join(failures)


def _backend(fmt=F.NVFP4_W4A16, runs_as=None, *, experts=8, hidden=64, inter=32, top_k=2,
             layout=F.TOKEN_MAJOR, payload=F.UNQUANTIZED, ep_rank=0, ep_size=1):
    gen = torch.Generator().manual_seed(1)
    problem = LayerProblem("model.layers.0.mlp.experts", fmt, F.SILU, experts, top_k, hidden,
                           inter)
    setup = ExpertsSetup(problem=problem, runs_as=runs_as or fmt, payload=payload, layout=layout,
                         ep_rank=ep_rank, ep_size=ep_size)
    local = setup.num_local_experts
    w13 = torch.randn(local, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(local, hidden, inter, generator=gen) / inter**0.5
    weights = quantize_expert_weights(w13, w2, fmt, F.SILU, a13_amax=4.0, a2_amax=4.0)
    return CpuDequantizedExperts(setup=setup), weights


def test_prepare_keeps_only_the_float32_copy():
    backend, weights = _backend()
    backend.prepare(weights)
    tensors = {k: v for k, v in vars(backend).items() if isinstance(v, torch.Tensor)}
    assert tensors and all(t.dtype == torch.float32 for t in tensors.values())
    stored = {weights.w13.data_ptr(), weights.w2.data_ptr(), weights.w13_scale.data_ptr()}
    assert not stored & {t.data_ptr() for t in tensors.values()}
    # one copy shared by both paths: 3 * E * H * I float32 weights in all
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in tensors.values()}
    assert sum(held.values()) == 4 * 3 * 8 * 64 * 32


def test_slots_of_experts_on_other_ranks_are_skipped_on_both_paths(monkeypatch):
    backend, weights = _backend(ep_rank=1, ep_size=2)
    backend.prepare(weights)
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(5, 64, generator=gen).bfloat16()
    ids = torch.tensor([[0, -1], [-1, -1], [3, 1], [-1, 2], [1, 0]], dtype=torch.int32)
    tw = torch.rand(5, 2, generator=gen)
    want = reference_fused_experts(hidden.float(), ids, tw, weights).float()
    d = Dispatched(F.TOKEN_MAJOR, hidden, topk_ids=ids, topk_weights=tw)
    for limit in (10**9, 0):  # dense, then grouped
        backend.dense_limit = limit
        got = backend.forward(d)
        assert got.dtype == torch.bfloat16 and got[1].abs().max() == 0
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


def test_grouped_mm_runs_float32_on_cpu_in_this_torch():
    """torch 2.13 (the CPU pin) has it; an older torch falls back to the loop."""
    assert cpu_dequantized.grouped_mm_runs()


def test_sizes_grouped_mm_refuses_take_the_loop():
    backend, weights = _backend(F.BF16, hidden=6, inter=3)  # rows of 24 and 12 bytes
    backend.prepare(weights)
    assert backend.grouped_mm is cpu_dequantized.grouped_mm_loop
    backend, weights = _backend(F.BF16)
    backend.prepare(weights)
    assert backend.grouped_mm is torch._grouped_mm


def test_the_loop_equals_grouped_mm_with_empty_groups():
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(7, 16, generator=gen), torch.randn(4, 16, 8, generator=gen)
    ends = torch.tensor([2, 2, 6, 7], dtype=torch.int32)  # expert 1 has no rows
    torch.testing.assert_close(cpu_dequantized.grouped_mm_loop(x, w, offs=ends),
                               torch._grouped_mm(x, w, offs=ends))


def test_a_batch_with_no_local_slot_gives_zeros_on_both_paths():
    backend, weights = _backend(ep_rank=1, ep_size=2)
    backend.prepare(weights)
    hidden = torch.randn(200, 64).bfloat16()  # above the dense limit
    d = Dispatched(F.TOKEN_MAJOR, hidden, topk_ids=torch.full((200, 2), -1, dtype=torch.int32),
                   topk_weights=torch.rand(200, 2))
    for limit in (10**9, 0):
        backend.dense_limit = limit
        got = backend.forward(d)
        assert got.shape == (200, 64) and got.abs().max() == 0


def test_int64_ids_from_transformers_routers_are_accepted():
    backend, weights = _backend(F.BF16)
    backend.prepare(weights)
    hidden = torch.randn(3, 64).bfloat16()
    ids = torch.tensor([[0, 7], [2, 2], [5, 1]])  # int64, a repeated expert in row 1
    tw = torch.rand(3, 2)
    got = backend.forward(Dispatched(F.TOKEN_MAJOR, hidden, topk_ids=ids, topk_weights=tw))
    want = reference_fused_experts(hidden.float(), ids, tw, weights)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_a_setup_outside_the_declaration_is_refused_at_prepare():
    backend, weights = _backend(F.NVFP4_W4A4)  # asked to run W4A4 as itself: not declared
    with pytest.raises(ValueError, match="cannot run this setup: unsupported_"):
        backend.prepare(weights)
    backend, weights = _backend(F.BF16, payload=F.FP8)
    with pytest.raises(ValueError, match="payload"):
        backend.prepare(weights)


def test_the_dense_path_is_for_small_batches_only():
    backend, weights = _backend(experts=64, hidden=256, inter=128, top_k=8)
    backend.prepare(weights)
    assert backend.dense_limit == 0  # experts this large always take the grouped path
    small, weights = _backend()
    small.prepare(weights)
    assert small.dense_limit == cpu_dequantized.DENSE_MAX_MACS // (8 * 3 * 64 * 32)


# ------------------------------------------------------------------------------------ the model


def test_the_default_model_runs_on_it_and_matches_transformers_alone(default_model):
    """Same weights, activations not quantized on either side: logits agree to rounding."""
    from moe_runtime.integration.transformers import load_model

    ours = load_model(default_model, dtype="float32")
    alone = load_model(default_model, dtype="float32", dequantize_experts=True)
    experts = [m._moe_runtime_executor.experts for m in ours.model.modules()
               if hasattr(m, "_moe_runtime_executor")]
    assert experts and all(isinstance(e, CpuDequantizedExperts) for e in experts)
    ids = torch.randint(0, ours.model.config.vocab_size, (2, 11),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = ours.model(ids).logits, alone.model(ids).logits
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5


def test_the_default_model_still_runs_on_the_pinned_reference(default_model):
    from moe_runtime.integration.transformers import load_model

    loaded = load_model(default_model, deployment=Deployment(experts_backend="reference"))
    assert {lp.experts for lp in loaded.plan.layers} == {"reference"}
    with torch.no_grad():
        out = loaded.model(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(out).all()


def test_its_priority_is_above_the_reference_and_below_the_documented_example():
    """docs/writing-a-backend.md: the example third-party backend (priority 5) beats the reference
    (0) on CPU; this built-in path sits between them."""
    assert 0 < CPU_DEQUANTIZED.priority < 5
