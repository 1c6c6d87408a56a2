"""RMSNorm in one kernel (moe_runtime/serve/fused_norm.py).

On CPU the kernel runs in Triton's interpreter (the root conftest sets ``TRITON_INTERPRET=1``
there), in float32 and float16 (the interpreter computes bfloat16 wrongly; bfloat16 is checked by
the GPU test):

- against transformers' own RMSNorm modules (Qwen3-MoE's, Llama's) on rows of several widths,
  powers of two or not, 2-d and 3-d inputs: float16 equal but for one-ulp flips, float32 within
  float32 rounding;
- the probe replaces only norms whose forward is that formula: a norm adding one to its weight
  (Gemma's form) and a norm rounding once (OLMo's form) keep theirs, and so does the module of a
  model whose kernel disagrees with it;
- on the served default model (float32), the engine with fused norms replaces every RMSNorm
  module, and gives the same greedy tokens as without; shutdown gives the modules their forward
  back.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from moe_runtime.serve import fused_norm
from moe_runtime.serve.engine import Engine
from moe_runtime.serve.loading import load_for_serving
from moe_runtime.serve.sampling import SamplingParams

needs_kernel = pytest.mark.skipif(
    fused_norm.unavailable(torch.device("cpu")) is not None and not torch.cuda.is_available(),
    reason="the fused norm kernel needs Triton (compiled on CUDA, or TRITON_INTERPRET=1 on CPU)")


def _transformers_norms():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    return [Qwen3MoeRMSNorm, LlamaRMSNorm]


class OnePlusWeight(torch.nn.Module):
    """Gemma's form: scaled by ``1 + weight``."""

    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(dim))
        self.eps = 1e-6

    def forward(self, x):
        return fused_norm.reference(x, 1.0 + self.weight, self.eps)


class RoundOnce(torch.nn.Module):
    """OLMo's form: the weight product in float32, rounded once."""

    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(dim) + 0.5)
        self.variance_epsilon = 1e-6

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * xf).to(x.dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cols", [64, 100, 128, 2048, 7168])
def test_matches_transformers_norms(dtype, cols):
    gen = torch.Generator().manual_seed(cols)
    for cls in _transformers_norms():
        module = cls(cols, eps=1e-6).to(dtype)
        with torch.no_grad():
            module.weight.copy_(torch.randn(cols, generator=gen) * 0.5 + 1)
            x = (torch.randn(3, 5, cols, generator=gen) * 4).to(dtype)
            ours = fused_norm.rms_norm(x, module.weight, module.variance_epsilon)
            theirs = module(x)
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        assert fused_norm._ulp_close(ours, theirs), (cls.__name__, dtype, cols)
        if dtype == torch.float16:
            # one-ulp flips only where the variance's rounding crosses a boundary: rare
            assert (ours == theirs).float().mean().item() > 0.99
        # a wrong kernel (no rsqrt, the eps dropped, the weight left out) would fail here
        assert not fused_norm._ulp_close(x * module.weight, theirs)


@needs_kernel
def test_refuses_what_it_cannot_run():
    with torch.no_grad():
        w = torch.ones(8)
        with pytest.raises(ValueError, match=r"input shape \(4, 6\) against weight shape \(8,\)"):
            fused_norm.rms_norm(torch.ones(4, 6), w, 1e-6)
        with pytest.raises(ValueError, match="input dtype torch.float64"):
            fused_norm.rms_norm(torch.ones(4, 8, dtype=torch.float64), w, 1e-6)
        with pytest.raises(ValueError, match="strided last dimension"):
            fused_norm.rms_norm(torch.ones(8, 4).t(), w, 1e-6)
    with pytest.raises(ValueError, match="autograd is recording"):
        fused_norm.rms_norm(torch.ones(4, 8, requires_grad=True), w, 1e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_probe_takes_only_the_formula(dtype):
    for cls in _transformers_norms():
        assert fused_norm._probe(cls(96).to(dtype)) is None
    assert "not the RMSNorm formula" in fused_norm._probe(OnePlusWeight(96).to(dtype))
    if dtype != torch.float32:  # in float32 rounding once and twice are the same
        assert "not the RMSNorm formula" in fused_norm._probe(RoundOnce(96).to(dtype))

    class TwoInputs(OnePlusWeight):  # e.g. a gated norm: forward(x, gate)
        def forward(self, x, gate):
            return x * gate

    assert "does not take one tensor" in fused_norm._probe(TwoInputs(96).to(dtype))


@needs_kernel
def test_probe_refuses_a_kernel_that_disagrees(monkeypatch):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    real = fused_norm.rms_norm
    monkeypatch.setattr(fused_norm, "rms_norm", lambda x, w, eps: real(x, w, eps * 1e5))
    assert "disagrees" in fused_norm._probe(Qwen3MoeRMSNorm(64))


def test_choice_reads_the_environment(monkeypatch):
    monkeypatch.delenv(fused_norm.FUSED_NORMS_ENV, raising=False)
    assert fused_norm.choose_fused_norms() is False
    monkeypatch.setenv(fused_norm.FUSED_NORMS_ENV, "1")
    assert fused_norm.choose_fused_norms() is True
    assert fused_norm.choose_fused_norms(False) is False
    monkeypatch.setenv(fused_norm.FUSED_NORMS_ENV, "on")
    with pytest.raises(ValueError, match=r"MOE_RUNTIME_FUSED_NORMS='on'.*expected 1 .* or 0 .* or unset"):
        fused_norm.choose_fused_norms()


def test_cpu_without_the_interpreter_says_why(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "runs on CUDA devices only" in fused_norm.unavailable(torch.device("cpu"))


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from moe_runtime.serve.default_model import make_default_model

    model_dir = make_default_model(tmp_path_factory.mktemp("norms") / "m")
    return load_for_serving(model_dir, dtype="float32", progress=False)


def _norm_modules(model):
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


def _greedy(loaded, fused: bool):
    engine = Engine(loaded, max_batch_size=3, batching="continuous", fused_norms=fused)
    engine.start()
    try:
        replaced = sum(1 for m in _norm_modules(loaded.model) if "forward" in m.__dict__)

        async def run():
            return await asyncio.gather(*(
                engine.complete(engine.encode_prompt(p), max_tokens=8,
                                sampling=SamplingParams(temperature=0.0), ignore_eos=True)
                for p in ("The quick brown fox", "Numbers 0 1 2 3", "Hello there")))

        tokens = [list(d.token_ids) for d in asyncio.run(run())]
    finally:
        engine.shutdown()
    return tokens, replaced, engine.fused_norms


@needs_kernel
def test_engine_replaces_every_norm_and_keeps_greedy_tokens(loaded):
    norms = _norm_modules(loaded.model)
    layers = loaded.model.config.num_hidden_layers
    assert len(norms) == 4 * layers + 1  # input, post-attention, query, key; the final norm
    calls = []
    real = fused_norm.rms_norm

    def counted(x, w, eps):
        calls.append(x.dim())  # the probe's rows are 2-d, the model's hidden states 3-d+
        return real(x, w, eps)

    base, replaced_off, on_off = _greedy(loaded, False)
    assert replaced_off == 0 and on_off is False
    fused_norm.rms_norm = counted
    try:
        tokens, replaced, on = _greedy(loaded, True)
    finally:
        fused_norm.rms_norm = real
    assert on is True and replaced == len(norms)
    assert any(d >= 3 for d in calls), "the model's forward never called the fused kernel"
    assert tokens == base
    assert not any("forward" in m.__dict__ for m in norms)  # shutdown gave them back


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bfloat16 runs "
                                                            "wrong in Triton's interpreter)")
@pytest.mark.parametrize("cols", [128, 2048, 7168])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_matches_transformers_and_replays_in_a_graph(cols, dtype):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    gen = torch.Generator().manual_seed(cols)
    module = Qwen3MoeRMSNorm(cols, eps=1e-6).to("cuda", dtype)
    with torch.no_grad():
        module.weight.copy_((torch.randn(cols, generator=gen) * 0.5 + 1).to("cuda"))
        x = (torch.randn(16, 4, cols, generator=gen) * 4).to("cuda", dtype)
        theirs = module(x)
        ours = fused_norm.rms_norm(x, module.weight, module.variance_epsilon)
        assert fused_norm._ulp_close(ours, theirs)
        if dtype != torch.float32:
            assert (ours == theirs).float().mean().item() > 0.99
        # captured in a CUDA graph (as decode steps are) and replayed on new inputs
        static_in = x.clone()
        fused_norm.rms_norm(static_in, module.weight, module.variance_epsilon)  # compiled
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = fused_norm.rms_norm(static_in, module.weight, module.variance_epsilon)
        static_in.copy_(x.flip(0))
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert fused_norm._ulp_close(static_out, module(x.flip(0)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (graphs are "
                                                            "captured only there)")
def test_gpu_engine_with_fused_norms_serves_graphed_and_keeps_float32_greedy_tokens(tmp_path):
    from moe_runtime.serve.default_model import make_default_model

    try:  # NVFP4 experts where nvidia-modelopt can export them (not on every GPU machine)
        import modelopt.torch.export  # noqa: F401
        quant = "mixed"
    except ImportError:
        quant = "bf16"
    loaded = load_for_serving(make_default_model(tmp_path / "m", quant=quant), device="cuda",
                              dtype="float32", progress=False)
    base, _, _ = _greedy(loaded, False)
    tokens, replaced, on = _greedy(loaded, True)
    assert on is True and replaced == len(_norm_modules(loaded.model))
    assert tokens == base
