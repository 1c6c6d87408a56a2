"""Rotary embedding in one kernel per tensor (moe_runtime/serve/fused_rope.py).

On CPU the kernel runs in Triton's interpreter (float32 and float16; bfloat16 on the GPU):

- bit-identical (``torch.equal``) to transformers' ``apply_rotary_pos_emb`` of Qwen3-MoE and
  Llama on attention's transposed query and key views, both ``unsqueeze_dim`` layouts, with
  cos and sin in the model's dtype and in float32;
- the probe replaces only functions of that formula: an interleaved rotation and a function of
  another signature keep their place;
- on the served default model (float32) the engine with it gives the same greedy tokens as
  without, the kernel really runs in the model's forwards, and a model that was not enabled (or
  was disabled) runs transformers' function.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from moe_runtime.serve import fused_rope
from moe_runtime.serve.engine import Engine
from moe_runtime.serve.loading import load_for_serving
from moe_runtime.serve.sampling import SamplingParams


def _functions():
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    # transformers' own (an earlier test may have put the dispatcher in its place)
    own = [m.apply_rotary_pos_emb for m in (modeling_qwen3_moe, modeling_llama)]
    return [f.__wrapped__ if getattr(f, "_moe_runtime_rope", False) else f for f in own]


def _inputs(dtype, trig_dtype, layout, gen, heads=6, kv=2, seq=5, dim=128):
    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 2).to(dtype)

    if layout == 1:  # [batch, heads, seq, dim] as transposed views of [batch, seq, heads, dim]
        q, k = rand(3, seq, heads, dim).transpose(1, 2), rand(3, seq, kv, dim).transpose(1, 2)
    else:  # [batch, seq, heads, dim]
        q, k = rand(3, seq, heads, dim), rand(3, seq, kv, dim)
    angle = torch.rand(3, seq, dim // 2, generator=gen) * 50
    cos = torch.cat((angle.cos(), angle.cos()), -1).to(trig_dtype)
    sin = torch.cat((angle.sin(), angle.sin()), -1).to(trig_dtype)
    return q, k, cos, sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("trig", ["model", "float32"])
@pytest.mark.parametrize("layout", [1, 2])
def test_bit_identical_to_transformers(dtype, trig, layout):
    gen = torch.Generator().manual_seed(layout)
    q, k, cos, sin = _inputs(dtype, dtype if trig == "model" else torch.float32, layout, gen)
    with torch.no_grad():
        ours = fused_rope.rotary(q, k, cos, sin, unsqueeze_dim=layout)
        for function in _functions():
            theirs = function(q, k, cos, sin, unsqueeze_dim=layout)
            for a, b in zip(ours, theirs, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert torch.equal(a, b)
    assert not torch.equal(ours[0], q.to(ours[0].dtype))  # it rotated something


def test_refuses_what_it_cannot_run():
    q = torch.ones(1, 2, 3, 8)
    cos = torch.ones(1, 3, 8)
    with torch.no_grad():
        with pytest.raises(ValueError, match="on q: a head dimension of 7"):
            fused_rope.rotary(torch.ones(1, 2, 3, 7), q, torch.ones(1, 3, 7), torch.ones(1, 3, 7))
        with pytest.raises(ValueError, match="on k: dtypes torch.float64"):
            fused_rope.rotary(q, q.double(), cos, cos)
        with pytest.raises(ValueError, match="broadcasts past|does not broadcast"):
            fused_rope.rotary(q, q, torch.ones(2, 3, 8), torch.ones(2, 3, 8))


def _interleaved(q, k, cos, sin, unsqueeze_dim=1):
    def rot(x):
        pairs = x.reshape(*x.shape[:-1], -1, 2)
        return torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)

    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_probe_takes_only_the_formula(dtype):
    cpu = torch.device("cpu")
    for function in _functions():
        assert fused_rope._probe(function, cpu, dtype) is None
    assert "not the rotary formula" in fused_rope._probe(_interleaved, cpu, dtype)
    assert "does not take" in fused_rope._probe(lambda q, k, cos, sin, ids: (q, k), cpu, dtype)


def test_probe_refuses_a_kernel_that_is_not_bit_identical(monkeypatch):
    real = fused_rope.rotary
    monkeypatch.setattr(fused_rope, "rotary",
                        lambda q, k, c, s, u=1: tuple(t * 1.001 for t in real(q, k, c, s, u)))
    assert "not bit-identical" in fused_rope._probe(_functions()[0], torch.device("cpu"),
                                                    torch.float32)


def test_choice_reads_the_environment(monkeypatch):
    monkeypatch.delenv(fused_rope.FUSED_ROPE_ENV, raising=False)
    assert fused_rope.choose_fused_rope() is False
    monkeypatch.setenv(fused_rope.FUSED_ROPE_ENV, "1")
    assert fused_rope.choose_fused_rope() is True
    assert fused_rope.choose_fused_rope(False) is False
    monkeypatch.setenv(fused_rope.FUSED_ROPE_ENV, "true")
    with pytest.raises(ValueError, match=r"MOE_RUNTIME_FUSED_ROPE='true'.*expected 1 .* or 0 .* or unset"):
        fused_rope.choose_fused_rope()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from moe_runtime.serve.default_model import make_default_model

    model_dir = make_default_model(tmp_path_factory.mktemp("rope") / "m")
    return load_for_serving(model_dir, dtype="float32", progress=False)


def _greedy(loaded, fused: bool, **kwargs):
    engine = Engine(loaded, max_batch_size=3, batching="continuous", fused_rope=fused, **kwargs)
    engine.start()
    try:
        async def run():
            return await asyncio.gather(*(
                engine.complete(engine.encode_prompt(p), max_tokens=8,
                                sampling=SamplingParams(temperature=0.0), ignore_eos=True)
                for p in ("The quick brown fox", "Numbers 0 1 2 3", "Hello there")))

        return [list(d.token_ids) for d in asyncio.run(run())], engine.fused_rope
    finally:
        engine.shutdown()


def test_engine_keeps_greedy_tokens_and_other_models_keep_theirs(loaded):
    base, on_off = _greedy(loaded, False)
    assert on_off is False
    before = fused_rope.calls()
    tokens, on = _greedy(loaded, True)
    during = fused_rope.calls()
    assert on is True
    assert during["fused"] > before["fused"], "the model's forwards never ran the kernel"
    assert tokens == base
    # shut down, the model is no longer enabled: its forwards (and any other model's) run
    # transformers' function through the dispatcher
    again, _ = _greedy(loaded, False)
    after = fused_rope.calls()
    assert again == base
    assert after["fused"] == during["fused"] and after["own"] > during["own"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bfloat16 runs "
                                                            "wrong in Triton's interpreter)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", [1, 2])
def test_gpu_bit_identical_and_replays_in_a_graph(dtype, layout):
    gen = torch.Generator().manual_seed(7)
    q, k, cos, sin = (t.to("cuda") for t in _inputs(dtype, dtype, layout, gen, heads=32, kv=4,
                                                     seq=16))
    function = _functions()[0]
    with torch.no_grad():
        ours = fused_rope.rotary(q, k, cos, sin, unsqueeze_dim=layout)
        theirs = function(q, k, cos, sin, unsqueeze_dim=layout)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_rope.rotary(q, k, cos, sin, unsqueeze_dim=layout)
        q2, k2, cos2, sin2 = (t.to("cuda") for t in _inputs(dtype, dtype, layout, gen, heads=32,
                                                            kv=4, seq=16))
        for static, new in ((q, q2), (k, k2), (cos, cos2), (sin, sin2)):
            static.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        want = function(q2, k2, cos2, sin2, unsqueeze_dim=layout)
        assert all(torch.equal(a, b) for a, b in zip(out, want, strict=True))
