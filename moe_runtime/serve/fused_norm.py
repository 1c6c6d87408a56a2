"""RMSNorm in one kernel for the served model's norms (CUDA, Triton).

transformers' RMSNorm modules (Qwen3-MoE's, Llama's, Mixtral's, DeepSeek-V3's, ...) compute

    y = weight * (x_f32 * rsqrt(mean(x_f32 ** 2, -1) + eps)).to(x.dtype)

as eight separate kernels (two casts, square, mean, add, rsqrt, two products). A Qwen3-MoE
decoder layer has four of them (the input and post-attention norms and the per-head query and
key norms), so a 48-layer model launches about 1540 norm kernels a decode step; on an H200
(RESULTS.md, 2026-12-04 profile of a 16-client step) its 193 means a step alone took 0.69 ms of
16.45 GPU ms, and the casts and products are among the step's elementwise kernels.
:func:`rms_norm` computes the same formula in one kernel per call: one program per row, the
row's square sum in float32, the normalized row rounded to the input's dtype and then multiplied
by the weight in float32 and rounded to the result type of ``weight * x`` (as torch does), so the
two roundings are transformers'. The sum runs in another order than torch's reduction: results
agree with transformers' to float32 rounding of the variance (in bfloat16 and float16 a
normalized element differs by one unit in the last place where that rounding moves it across a
rounding boundary, and its product with the weight by up to two; on an H100, 2026-12-07, more than
99% of the elements were equal; in float32 outputs differ by about 1e-7 relative).

:func:`enable` replaces the forward of a model's norm modules, but only of module classes whose
own forward gives, on a probe of random rows on the module's device, exactly the formula above
computed by torch (a norm that adds one to its weight, as Gemma's, or rounds once, as OLMo's,
keeps its forward), and only where the fused kernel then matches the module's own forward on that
probe within two units in the last place (1e-5 relative in float32). Nothing is chosen by a class
name. The serving engine enables it when :func:`choose_fused_norms` says so: by default for a
model on a CUDA device with Triton (measured faster: benchmarks/RESULTS.md, H100 2026-12-07
05:28), ``MOE_RUNTIME_FUSED_NORMS=0`` (or the engine's ``fused_norms=False``) turning it off.
The "transformers alone" side of ``benchmarks/bench_serve.py`` never takes it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

FUSED_NORMS_ENV = "MOE_RUNTIME_FUSED_NORMS"
MAX_COLS = 16384  # a row longer than this keeps the module's own forward (one program per row)
PROBE_ROWS = 8

log = logging.getLogger(__name__)

_kernel = None  # the Triton kernel, built on first use (triton is optional for the core)
_ORIGINAL = "_moe_runtime_norm_forward"  # attribute holding a replaced module's bound forward


def choose_fused_norms(requested: bool | None = None, device=None) -> bool:
    """Whether the engine enables :func:`enable`: ``requested`` when given, else
    ``MOE_RUNTIME_FUSED_NORMS`` (``1`` on, ``0`` off), else on where ``device`` is a CUDA device
    (measured faster there: RESULTS.md, H100 2026-12-07 05:28) and off elsewhere. Any other
    value of the variable is refused with the accepted ones."""
    from moe_runtime.serve.graph_shapes import env_switch, on_cuda

    if requested is not None:
        return bool(requested)
    chosen = env_switch(FUSED_NORMS_ENV, "1 (RMSNorm in one kernel, CUDA with Triton) or 0 "
                                         "(the model's own norms) or unset (on for a "
                                         "model on CUDA)")
    return on_cuda(device) if chosen is None else chosen


def unavailable(device) -> str | None:
    """Why :func:`rms_norm` cannot run on ``device`` (None: it can). The Triton interpreter
    (``TRITON_INTERPRET=1``) runs it on CPU tensors."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if getattr(device, "type", str(device)) != "cuda" and not interpret:
        return f"the model is on {device}, and the fused norm kernel runs on CUDA devices only"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (CUDA builds of torch ship it)"
    return None


def _build():
    global _kernel
    if _kernel is not None:
        return _kernel
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_rows(x_ptr, w_ptr, y_ptr, n_cols, x_row_stride, y_row_stride, eps, inv_n,
                      BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) * inv_n
        normed = (x * tl.math.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = w * normed.to(tl.float32)
        tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)

    _kernel = rms_norm_rows
    return _kernel


def reference(x, weight, eps: float):
    """The formula, in torch operations (transformers' RMSNorm forward)."""
    import torch

    normed = x.to(torch.float32)
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fusable(x, weight) -> str | None:
    """Why ``rms_norm(x, weight, eps)`` would not run (None: it runs)."""
    import torch

    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"input dtype {x.dtype} (float16, bfloat16 and float32 run fused)"
    if weight.dim() != 1 or x.dim() == 0 or x.shape[-1] != weight.shape[0]:
        return (f"input shape {tuple(x.shape)} against weight shape {tuple(weight.shape)} "
                "(a 1-d weight over the input's last dimension runs fused)")
    if x.shape[-1] > MAX_COLS:
        return f"rows of {x.shape[-1]} elements (at most {MAX_COLS} run fused)"
    if x.device != weight.device:
        return f"input on {x.device}, weight on {weight.device}"
    if x.stride(-1) != 1 or not weight.is_contiguous():
        return "a strided last dimension"
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return "autograd is recording (the kernel has no backward)"
    return None


def rms_norm(x, weight, eps: float):
    """:func:`reference` in one kernel (see the module's docstring for the numerics)."""
    import torch
    import triton

    why = fusable(x, weight)
    if why is not None:
        raise ValueError(f"fused RMSNorm cannot run: {why}")
    cols = x.shape[-1]
    rows_view = x.reshape(-1, cols)  # a view where the leading dimensions allow it
    out = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
    rows = rows_view.shape[0]
    if rows == 0:
        return out
    block = triton.next_power_of_2(cols)
    warps = 1 if block <= 256 else 4 if block <= 2048 else 8
    _build()[(rows,)](rows_view, weight, out.view(-1, cols), cols, rows_view.stride(0), cols,
                      float(eps), 1.0 / cols, BLOCK=block, num_warps=warps)
    return out


def _eps_of(module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _candidate(module) -> bool:
    import torch

    weight = getattr(module, "weight", None)
    return (isinstance(weight, torch.nn.Parameter) and weight.dim() == 1
            and _eps_of(module) is not None and not list(module.children())
            and getattr(module, "bias", None) is None)


def _ulp_close(a, b) -> bool:
    """Equal but for the flips the variance's summation order can make in a 16-bit dtype: the
    normalized row's element one unit in the last place off, scaled by the weight, then the
    product's own rounding (at most two units of the result, relative); in float32, where no
    rounding to the input's dtype hides that order, within 1e-5 relative."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    # two ulps of |b| in b's dtype (its relative spacing, twice, times |b|); on an H100 a
    # float16 row of 2048 had products 1.5 ulps apart where the normalized element flipped
    rel = max(2 * torch.finfo(b.dtype).eps, 1e-5)
    bound = rel * b.float().abs() + torch.finfo(b.dtype).tiny
    return bool(((a.float() - b.float()).abs() <= bound).all())


def _probe(module) -> str | None:
    """Why ``module``'s forward may not be replaced (None: it may)."""
    import torch

    weight = module.weight
    eps = _eps_of(module)
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(PROBE_ROWS, weight.shape[0], generator=gen) * 3).to(weight.device,
                                                                         weight.dtype)
    with torch.no_grad():
        try:
            own = module.forward(x)
        except Exception as exc:  # a forward of another signature keeps its place
            return f"its forward does not take one tensor: {type(exc).__name__}: {exc}"
        formula = reference(x, weight, eps)
        if not isinstance(own, torch.Tensor) or not torch.equal(own, formula):
            return "its forward is not the RMSNorm formula this kernel computes"
        why = fusable(x, weight)
        if why is not None:
            return why
        if not _ulp_close(rms_norm(x, weight, eps), own):
            return "the fused kernel disagrees with its forward by more than two ulps"
    return None


def _fused_forward(module):
    original = module.forward
    eps = _eps_of(module)

    def forward(hidden_states, *args, **kwargs):
        if args or kwargs or fusable(hidden_states, module.weight) is not None:
            return original(hidden_states, *args, **kwargs)
        return rms_norm(hidden_states, module.weight, eps)

    return original, forward


def enable(model: Any) -> int:
    """Run the RMSNorm modules of ``model`` through :func:`rms_norm` where the probe allows it
    (see the module's docstring). Returns how many modules were replaced."""
    device = next(model.parameters()).device
    why = unavailable(device)
    if why is not None:
        log.info("norms: the model's own (%s)", why)
        return 0
    verdicts: dict[tuple, str | None] = {}
    count = 0
    for module in model.modules():
        if not _candidate(module) or hasattr(module, _ORIGINAL):
            continue
        key = (type(module), module.weight.dtype, module.weight.shape[0])
        if key not in verdicts:
            verdicts[key] = _probe(module)
            if verdicts[key] is not None:
                log.info("norms: %s of %d keeps its forward: %s", type(module).__name__,
                         module.weight.shape[0], verdicts[key])
        if verdicts[key] is not None:
            continue
        original, forward = _fused_forward(module)
        setattr(module, _ORIGINAL, original)
        module.forward = forward
        count += 1
    return count


def disable(model: Any) -> None:
    """Give ``model``'s norm modules back their own forward."""
    for module in model.modules():
        original = module.__dict__.pop(_ORIGINAL, None)
        if original is not None:
            module.__dict__.pop("forward", None)
