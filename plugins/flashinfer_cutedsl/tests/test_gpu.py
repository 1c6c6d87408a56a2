"""On a compute-capability 10.x device with the [kernels] extra: the kernels against the reference.

NEVER RUN: no such device was available to this project. Everywhere else every test here is
skipped with the reason (no CUDA / wrong capability / FlashInfer missing).

- MoE layers of a real model's shape (Qwen3-30B-A3B: hidden 2048, expert intermediate 768, top-8),
  through the plan's executor, on each path the declaration names: token-major W4A4 and W4A16,
  masked W4A4 with 16-bit and with NVFP4 dispatch payloads; the reference backend runs the same
  weights on the same device.
- A whole model: a tiny ModelOpt NVFP4 Qwen3-MoE checkpoint through moe-runtime's transformers
  integration, logits with this backend pinned against logits with the reference backend pinned.
"""

from __future__ import annotations

import importlib.metadata as md
import types

import pytest
import torch

from moe_runtime import CommBackendSpec, CommSupport, Hardware, hookimpl
from moe_runtime import formats as F
from moe_runtime.backend_api import LayerProblem
from moe_runtime.environment import Environment
from moe_runtime.executor import build_executor
from moe_runtime.planner import Deployment, plan_layer
from moe_runtime.plugin.manager import get_plugin_manager
from moe_runtime.plugin.registry import Registry
from moe_runtime_flashinfer_cutedsl import plugin

from cutedsl_helpers import blackwell_kernels_here, make_nvfp4_weights

_OK, _WHY = blackwell_kernels_here()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_WHY)]

NAME = plugin.NAME
# Max |out - ref| / max |ref|, as the core's conformance suite measures NVFP4 (its tolerances).
TOLERANCE = {F.NVFP4_W4A4: 8e-2, F.NVFP4_W4A16: 3e-2}


def _registry() -> Registry:
    """Built-ins, this plugin, and two test-only communication backends over LocalComm that
    offer only the masked layout (one carries NVFP4, quantizing in the test's own dispatch)."""
    masked = CommBackendSpec(
        name="test_local_masked", factory="moe_runtime.backends.local:LocalComm",
        supports=[CommSupport(layout=F.MASKED, max_world_size=1, mode="masked",
                              hardware=Hardware(devices=("cuda",)))])
    extra = types.ModuleType("test_masked_comm")
    extra.moe_runtime_register_backends = hookimpl(lambda register: register(masked))
    others = {ep.name for ep in md.entry_points(group="moe_runtime")} - {NAME}
    return Registry.from_plugin_manager(
        get_plugin_manager(plugins=[extra], blocked=others, environ={}))


def _route(n, e, k, gen, device):
    scores = torch.rand((n, e), generator=gen)
    ids = scores.topk(k, dim=-1).indices.to(torch.int32)
    w = torch.softmax(torch.rand((n, k), generator=gen), dim=-1)
    return ids.to(device), w.float().to(device)


@pytest.fixture(scope="module")
def registry():
    return _registry()


@pytest.fixture(scope="module")
def environment(registry):
    return Environment.probe(device="cuda", modules=registry.required_modules())


QWEN3_30B = dict(hidden=2048, intermediate=768, experts=32, top_k=8)  # 128 experts in the model


@pytest.mark.parametrize("fmt,comm", [
    (F.NVFP4_W4A4, "local"),
    (F.NVFP4_W4A16, "local"),
    (F.NVFP4_W4A4, "test_local_masked"),
])
@pytest.mark.parametrize("tokens", [1, 77, 512])
def test_moe_layer_matches_the_reference_backend(registry, environment, fmt, comm, tokens):
    s = QWEN3_30B
    problem = LayerProblem("model.layers.0.mlp.experts", fmt, F.SILU, s["experts"], s["top_k"],
                           s["hidden"], s["intermediate"])
    weights = make_nvfp4_weights(s["experts"], s["hidden"], s["intermediate"], fmt=fmt, seed=11)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn((tokens, s["hidden"]), generator=gen).to(torch.bfloat16).cuda()
    ids, tw = _route(tokens, s["experts"], s["top_k"], gen, "cuda")

    outs = {}
    for backend in (NAME, "reference"):
        lp, _ = plan_layer(problem, registry=registry, environment=environment,
                           deployment=Deployment(experts_backend=backend, comm_backend=comm))
        assert lp.experts == backend
        ex = build_executor(lp, registry, weights.to("cuda"), device="cuda")
        outs[backend] = ex(x, ids, tw).float()
    got, ref = outs[NAME], outs["reference"]
    assert torch.isfinite(got).all()
    err = (got - ref).abs().max().item() / ref.abs().max().item()
    assert err <= TOLERANCE[fmt], f"{fmt} via {comm}: error {err:.4g}"


def test_masked_nvfp4_payload_matches_the_16bit_payload(registry, environment):
    """Activations quantized before dispatch (moe-runtime's NVFP4 codec, the layer's input scale
    as global scale) give what the backend's own grouped quantizer gives."""
    from moe_runtime.backend_api import ExpertsSetup
    from moe_runtime.quant.nvfp4 import quantize_nvfp4
    from moe_runtime_flashinfer_cutedsl.backend import CuteDslExperts

    s = QWEN3_30B
    problem = LayerProblem("l", F.NVFP4_W4A4, F.SILU, s["experts"], s["top_k"], s["hidden"],
                           s["intermediate"])
    weights = make_nvfp4_weights(s["experts"], s["hidden"], s["intermediate"], seed=12).to("cuda")
    gen = torch.Generator().manual_seed(5)
    m = 96
    hidden = torch.randn((s["experts"], m, s["hidden"]), generator=gen).to(torch.bfloat16).cuda()
    masked_m = torch.randint(0, m + 1, (s["experts"],), generator=gen, dtype=torch.int32).cuda()

    def run(payload, d_hidden, d_scale=None):
        from moe_runtime.backend_api import Dispatched

        be = CuteDslExperts(setup=ExpertsSetup(problem=problem, runs_as=F.NVFP4_W4A4,
                                               payload=payload, layout=F.MASKED, device="cuda"))
        be.prepare(weights)
        return be.forward(Dispatched(F.MASKED, d_hidden, payload=payload, hidden_scale=d_scale,
                                     masked_m=masked_m, out_dtype=torch.bfloat16)).float()

    plain = run(F.UNQUANTIZED, hidden)
    packed, block = quantize_nvfp4(hidden.float(), weights.a13_scale)
    pre = run(F.NVFP4, packed, block)
    for e in range(s["experts"]):
        rows = int(masked_m[e])
        if rows:
            a, b = pre[e, :rows], plain[e, :rows]
            assert (a - b).abs().max().item() <= 2e-2 * b.abs().max().item() + 1e-3


def test_tiny_nvfp4_model_logits_match_the_reference_backend(tmp_path):
    tiny = pytest.importorskip("moe_runtime.checkpoint.tiny")
    from moe_runtime.integration.transformers import load_model

    folder = tiny.make_tiny_checkpoint(tmp_path / "qwen3", arch="qwen3_moe", quant="nvfp4",
                                       hidden_size=256, intermediate_size=128, num_experts=16,
                                       top_k=4)
    registry = _registry()
    ours = load_model(folder, registry=registry, device="cuda",
                      deployment=Deployment(experts_backend=NAME))
    assert {lp.experts for lp in ours.plan.layers} == {NAME}
    ref = load_model(folder, registry=registry, device="cuda",
                     deployment=Deployment(experts_backend="reference"))
    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        a = ours.model(ids).logits.float()
        b = ref.model(ids).logits.float()
    rel = ((a - b).norm() / b.norm()).item()
    assert rel < 5e-2, f"logits differ by {rel:.3g} (relative Frobenius norm)"
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() > 0.9
