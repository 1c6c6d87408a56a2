"""FP8 e4m3 with per-tensor float32 scales, as ModelOpt's FP8 checkpoints store weights and inputs.

``scale = amax / 448``; quantized ``q = e4m3(x / scale)``; ``x ~= float(q) * scale``.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


def fp8_scale_from_amax(amax: torch.Tensor | float) -> torch.Tensor:
    """ModelOpt's FP8 ``weight_scale`` / ``input_scale``: ``amax / 448`` in float32, correctly
    rounded on every device (ModelOpt divides in Python floats; torch on CUDA would multiply by a
    rounded reciprocal if the divisor were a Python number)."""
    amax = torch.as_tensor(amax).to(torch.float32)
    return amax / torch.tensor(E4M3_MAX, dtype=torch.float32, device=amax.device)


def _scale_tensor(scale: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(scale, device=device).to(device=device, dtype=torch.float32)


def quantize_fp8_per_tensor(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``e4m3(clamp(x / scale, -448, 448))`` as float8_e4m3fn, ModelOpt's export arithmetic.

    The quotient is rounded to ``x``'s dtype before the e4m3 cast, because ModelOpt's export divides
    the model-dtype weight by a 0-dim float32 scale and torch keeps the weight's dtype: a bf16
    weight goes through a bf16 quotient (a double rounding that changes a few percent of codes
    against a direct float32 -> e4m3 cast). Pass ``x.float()`` for the single-rounding kernel
    arithmetic used on activations. ModelOpt does not clamp (its quotients stay within 448 by
    construction); the clamp makes out-of-range values saturate instead of depending on the cast.

    :param scale: a float32 scalar, or any tensor broadcastable to ``x`` (``[E, 1, 1]``, rows).
    """
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"quantize_fp8_per_tensor takes a 16/32/64-bit float tensor, got {x.dtype}")
    s = _scale_tensor(scale, x.device)
    wide = torch.promote_types(x.dtype, torch.float32)
    quotient = (x.to(wide) / s).to(x.dtype)
    return quotient.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize_fp8(
    q: torch.Tensor,
    scale: torch.Tensor | float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``float(q) * scale``, rounded once into ``dtype`` (``scale`` broadcastable to ``q``)."""
    work = torch.float32 if dtype == torch.float32 else torch.float64  # exact product, one rounding
    return (q.to(work) * torch.as_tensor(scale, device=q.device).to(q.device, work)).to(dtype)


def fake_quantize_fp8(
    x: torch.Tensor,
    scale: torch.Tensor | float,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Quantize ``x`` to e4m3 with ``scale`` in float32 (as FP8 GEMM kernels quantize activations)
    and dequantize, returned in ``dtype`` (default ``x.dtype``)."""
    wide = torch.promote_types(x.dtype, torch.float32)
    return dequantize_fp8(quantize_fp8_per_tensor(x.to(wide), scale), scale, dtype or x.dtype)
