"""Rotary position embedding in one kernel per tensor for the served model (CUDA, Triton).

transformers' ``apply_rotary_pos_emb`` (Llama's form, copied into Qwen3-MoE, Mixtral, Qwen2-MoE
and others) computes ``q * cos + rotate_half(q) * sin`` and the same for ``k`` as about ten
kernels a layer (two products, a negation and a concatenation for ``rotate_half``, a sum, for
each of the two). :func:`rotary` computes the same three roundings per element (each product
rounded to the output's dtype, then their sum), with floating-point contraction off, so its
result is bit-identical to transformers' (the tests compare with ``torch.equal``): two kernels
a layer, one for the queries and one for the keys.

:func:`enable` puts a dispatcher in place of ``apply_rotary_pos_emb`` in the modeling modules of
a model's attention classes, but only where a probe on the model's device proves that module's
function equal to the formula above and the kernel equal to the function (a function of
another form, such as an interleaved rotation, keeps its place: nothing is chosen by a name).
The dispatcher runs the kernel only while a forward of an enabled model is under way (a forward
pre-hook and hook on the model mark it, per thread), so another model in the process (the
"transformers alone" side of ``benchmarks/bench_serve.py``) runs transformers' function. The
serving engine enables it when :func:`choose_fused_rope` says so: by default for a model on a
CUDA device with Triton (measured faster: benchmarks/RESULTS.md, H100 2026-12-07 05:28),
``MOE_RUNTIME_FUSED_ROPE=0`` (or the engine's ``fused_rope=False``) turning it off.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from typing import Any

from moe_runtime.serve.fused_norm import unavailable

FUSED_ROPE_ENV = "MOE_RUNTIME_FUSED_ROPE"
FUNCTION = "apply_rotary_pos_emb"
MAX_HALF = 1024  # a head dimension above 2048 keeps the model's function

log = logging.getLogger(__name__)

_kernel = None
_state = threading.local()  # .depth: forwards of enabled models under way in this thread
_patched: dict[str, Any] = {}  # modeling module name -> its own function
_hooks: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()
_calls = {"fused": 0, "own": 0}

__all__ = ["choose_fused_rope", "enable", "disable", "rotary", "reference", "unavailable"]


def choose_fused_rope(requested: bool | None = None, device=None) -> bool:
    """Whether the engine enables :func:`enable`: ``requested`` when given, else
    ``MOE_RUNTIME_FUSED_ROPE`` (``1`` on, ``0`` off), else on where ``device`` is a CUDA device
    (measured faster there: RESULTS.md, H100 2026-12-07 05:28) and off elsewhere. Any other
    value is refused with the accepted ones."""
    from moe_runtime.serve.graph_shapes import env_switch, on_cuda

    if requested is not None:
        return bool(requested)
    chosen = env_switch(FUSED_ROPE_ENV, "1 (rotary embedding in one kernel per tensor, CUDA "
                                        "with Triton) or 0 (the model's own) or unset (on for "
                                        "a model on CUDA)")
    return on_cuda(device) if chosen is None else chosen


def _build():
    global _kernel
    if _kernel is not None:
        return _kernel
    import triton
    import triton.language as tl

    @triton.jit
    def rope_rows(x_ptr, cos_ptr, sin_ptr, out_ptr, n1, n2,
                  xs0, xs1, xs2, cs0, cs1, cs2, ss0, ss1, ss2, os0, os1, os2,
                  HALF: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        i2 = pid % n2
        rest = pid // n2
        i1 = rest % n1
        i0 = rest // n1
        offs = tl.arange(0, BLOCK)
        m = offs < HALF
        xb = x_ptr + i0 * xs0 + i1 * xs1 + i2 * xs2
        cb = cos_ptr + i0 * cs0 + i1 * cs1 + i2 * cs2
        sb = sin_ptr + i0 * ss0 + i1 * ss1 + i2 * ss2
        ob = out_ptr + i0 * os0 + i1 * os1 + i2 * os2
        ty = out_ptr.dtype.element_ty
        x1 = tl.load(xb + offs, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(xb + HALF + offs, mask=m, other=0.0).to(tl.float32)
        c1 = tl.load(cb + offs, mask=m, other=0.0).to(tl.float32)
        c2 = tl.load(cb + HALF + offs, mask=m, other=0.0).to(tl.float32)
        s1 = tl.load(sb + offs, mask=m, other=0.0).to(tl.float32)
        s2 = tl.load(sb + HALF + offs, mask=m, other=0.0).to(tl.float32)
        # rotate_half(x) = cat(-x2, x1); every product and the sum rounded as torch rounds them
        lo = (x1 * c1).to(ty).to(tl.float32) + (-x2 * s1).to(ty).to(tl.float32)
        hi = (x2 * c2).to(ty).to(tl.float32) + (x1 * s2).to(ty).to(tl.float32)
        tl.store(ob + offs, lo.to(ty), mask=m)
        tl.store(ob + HALF + offs, hi.to(ty), mask=m)

    _kernel = rope_rows
    return _kernel


def reference(q, k, cos, sin, unsqueeze_dim: int = 1):
    """The formula, in torch operations (transformers' Llama-form ``apply_rotary_pos_emb``)."""
    import torch

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def fusable(x, cos, sin, unsqueeze_dim: int) -> str | None:
    """Why :func:`rotary` would not run on ``x`` (None: it runs)."""
    import torch

    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    if x.dtype not in dtypes or cos.dtype not in dtypes or sin.dtype != cos.dtype:
        return f"dtypes {x.dtype}, {cos.dtype}, {sin.dtype} (float16, bfloat16, float32 run fused)"
    if x.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return (f"shapes {tuple(x.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)} (a 4-d tensor "
                "and 3-d cos and sin of one shape run fused)")
    if unsqueeze_dim not in (1, 2, -3, -2):
        return f"unsqueeze_dim {unsqueeze_dim}"
    d = x.shape[-1]
    if d % 2 or d // 2 > MAX_HALF:
        return f"a head dimension of {d} (even, at most {2 * MAX_HALF}, runs fused)"
    try:
        torch.broadcast_shapes(x.shape, cos.unsqueeze(unsqueeze_dim).shape)
    except RuntimeError:
        return f"cos of shape {tuple(cos.shape)} does not broadcast to {tuple(x.shape)}"
    if torch.broadcast_shapes(x.shape, cos.unsqueeze(unsqueeze_dim).shape) != x.shape:
        return f"cos of shape {tuple(cos.shape)} broadcasts past {tuple(x.shape)}"
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        return "a strided last dimension"
    if not (x.device == cos.device == sin.device):
        return "tensors on different devices"
    if torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad):
        return "autograd is recording (the kernel has no backward)"
    return None


def _one(x, cos, sin, unsqueeze_dim: int):
    import torch
    import triton

    out = torch.empty_like(x, dtype=torch.result_type(x, cos))
    if x.numel() == 0:
        return out
    c = cos.unsqueeze(unsqueeze_dim).expand(x.shape)
    s = sin.unsqueeze(unsqueeze_dim).expand(x.shape)
    half = x.shape[-1] // 2
    n0, n1, n2 = x.shape[:3]
    block = triton.next_power_of_2(half)
    _build()[(n0 * n1 * n2,)](
        x, c, s, out, n1, n2, *x.stride()[:3], *c.stride()[:3], *s.stride()[:3],
        *out.stride()[:3], HALF=half, BLOCK=block, num_warps=1 if block <= 128 else 4,
        enable_fp_fusion=False)
    return out


def rotary(q, k, cos, sin, unsqueeze_dim: int = 1):
    """:func:`reference` as one kernel for ``q`` and one for ``k`` (bit-identical)."""
    for name, x in (("q", q), ("k", k)):
        why = fusable(x, cos, sin, unsqueeze_dim)
        if why is not None:
            raise ValueError(f"fused rotary embedding cannot run on {name}: {why}")
    return _one(q, cos, sin, unsqueeze_dim), _one(k, cos, sin, unsqueeze_dim)


def _dispatcher(own):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        unsqueeze_dim = kwargs.get("unsqueeze_dim", args[0] if args else 1)
        extra = len(args) > 1 or set(kwargs) - {"unsqueeze_dim"}
        if (getattr(_state, "depth", 0) and not extra
                and fusable(q, cos, sin, unsqueeze_dim) is None
                and fusable(k, cos, sin, unsqueeze_dim) is None):
            _calls["fused"] += 1
            return rotary(q, k, cos, sin, unsqueeze_dim)
        _calls["own"] += 1
        return own(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.__wrapped__ = own
    apply_rotary_pos_emb._moe_runtime_rope = True
    return apply_rotary_pos_emb


def _probe(function, device, dtype) -> str | None:
    """Why ``function`` may not be replaced on ``device`` in ``dtype`` (None: it may)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    # queries [batch, heads, seq, dim] as a transposed view, as attention makes them
    q = rand(2, 5, 4, 64).transpose(1, 2)
    k = rand(2, 5, 2, 64).transpose(1, 2)
    angle = torch.rand(2, 5, 32, generator=gen) * 6.3
    cos = torch.cat((angle.cos(), angle.cos()), -1).to(device, dtype)
    sin = torch.cat((angle.sin(), angle.sin()), -1).to(device, dtype)
    with torch.no_grad():
        try:
            own = function(q, k, cos, sin)
        except Exception as exc:  # a function of another signature keeps its place
            return f"it does not take (q, k, cos, sin): {type(exc).__name__}: {exc}"
        formula = reference(q, k, cos, sin)
        if not (isinstance(own, tuple) and len(own) == 2
                and all(isinstance(t, torch.Tensor) for t in own)
                and all(torch.equal(a, b) for a, b in zip(own, formula, strict=True))):
            return "it is not the rotary formula this kernel computes"
        why = fusable(q, cos, sin, 1) or fusable(k, cos, sin, 1)
        if why is not None:
            return why
        fused = rotary(q, k, cos, sin)
        if not all(torch.equal(a, b) for a, b in zip(fused, own, strict=True)):
            return "the fused kernel is not bit-identical to it"
    return None


def _modeling_modules(model) -> list:
    names = {type(m).__module__ for m in model.modules()}
    found = []
    for name in sorted(names):
        module = sys.modules.get(name)
        if module is not None and callable(getattr(module, FUNCTION, None)):
            found.append(module)
    return found


def _enter(*_):
    _state.depth = getattr(_state, "depth", 0) + 1


def _leave(*_):
    _state.depth = max(0, getattr(_state, "depth", 0) - 1)


def enable(model: Any) -> int:
    """Put the dispatcher in place of the model's modeling modules' ``apply_rotary_pos_emb``
    where the probe allows it, and mark the model's forwards. Returns how many modules' function
    the model's forwards now run fused (0: none)."""
    import torch

    param = next(model.parameters())
    # the activations' dtype (a quantized model's first parameter may be packed codes)
    dtype = getattr(model, "dtype", param.dtype)
    why = unavailable(param.device)
    if why is None and dtype not in (torch.float16, torch.bfloat16, torch.float32):
        why = f"the model's dtype is {dtype}"
    if why is not None:
        log.info("rotary embedding: the model's own (%s)", why)
        return 0
    count = 0
    for module in _modeling_modules(model):
        current = getattr(module, FUNCTION)
        own = current.__wrapped__ if getattr(current, "_moe_runtime_rope", False) else current
        verdict = _probe(own, param.device, dtype)
        if verdict is not None:
            log.info("rotary embedding: %s.%s keeps its place: %s", module.__name__, FUNCTION,
                     verdict)
            continue
        if not getattr(current, "_moe_runtime_rope", False):
            _patched[module.__name__] = own
            setattr(module, FUNCTION, _dispatcher(own))
        count += 1
    if count and model not in _hooks:
        _hooks[model] = (model.register_forward_pre_hook(_enter),
                         model.register_forward_hook(_leave, always_call=True))
    return count


def disable(model: Any) -> None:
    """Stop marking ``model``'s forwards (the dispatchers stay, and run the model's own function
    for every model that is not enabled)."""
    handles = _hooks.pop(model, None)
    for handle in handles or ():
        handle.remove()


def calls() -> dict[str, int]:
    """How many calls the dispatchers sent to the kernel and to the model's own function."""
    return dict(_calls)
