"""The numerical reference of moe-runtime: what an MoE layer's experts compute, in plain torch.

Every backend is checked against these functions. They favour being obviously right over being fast:
weights are dequantized exactly (``moe_runtime.quant``), both GEMMs run in float32, and the
activation quantization a format calibrated for is applied as quantize-then-dequantize. They run on
CPU and CUDA (on CUDA keep TF32 matmuls off, torch's default, for a float32 reference).

Choices a backend must know about:

- ``gelu`` is the exact (erf) GELU, not the tanh approximation; ``silu`` is ``x * sigmoid(x)``.
- The gated intermediate ``act(gate) * up`` stays float32 (no rounding to the model dtype) before
  GEMM 2, or before its activation quantization.
- ``fp8_w8a8`` quantizes GEMM inputs with the per-tensor ``a13_scale``/``a2_scale`` from float32;
  ``nvfp4_w4a4`` quantizes them to NVFP4 with those scales as global scales. The activation
  quantization is taken from the format's declared ``activation_payload``, and a layer run as its
  declared ``weight_only`` format (``nvfp4_w4a4`` as ``nvfp4_w4a16``) skips it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_runtime import formats
from moe_runtime.backend_api import ExpertWeights
from moe_runtime.dtypes import torch_dtype
from moe_runtime.quant import (
    dequantize_fp8,
    dequantize_nvfp4,
    fake_quantize_fp8,
    fake_quantize_nvfp4_activation,
    fp8_scale_from_amax,
    nvfp4_global_scale,
    quantize_fp8_per_tensor,
    quantize_nvfp4,
)

__all__ = [
    "dequantize_expert_weights",
    "quantize_expert_weights",
    "reference_fused_experts",
    "reference_masked_experts",
]

_FORMATS = {f.name: f for f in formats.BUILTIN_FORMATS}
# Everything below dispatches on a format's storage (formats.Encoding) and activation payload,
# never on its name.
FP8_ELEMENT, E2M1_ELEMENT = "float8_e4m3fn", "e2m1"


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


def _format(name: str) -> formats.WeightFormat:
    try:
        return _FORMATS[name]
    except KeyError:
        raise ValueError(
            f"the reference knows the built-in formats {sorted(_FORMATS)}, not {name!r}"
        ) from None


def _element(fmt: str) -> str:
    return _format(fmt).stored_as.element


def _check_weights(w: ExpertWeights) -> None:
    spec = _format(w.format)
    if w.activation not in formats.ACTIVATIONS:
        raise ValueError(
            f"unknown activation {w.activation!r}; expected one of {sorted(formats.ACTIVATIONS)}"
        )
    element = spec.stored_as.element
    needed: tuple[str, ...] = ()
    if element == FP8_ELEMENT:
        needed = ("w13_scale", "w2_scale")
    elif element == E2M1_ELEMENT:
        needed = ("w13_scale", "w2_scale", "w13_scale_2", "w2_scale_2")
    if spec.activation_payload != formats.UNQUANTIZED:
        needed += ("a13_scale", "a2_scale")
    missing = [name for name in needed if getattr(w, name) is None]
    if missing:
        raise ValueError(f"{w.format} expert weights need {', '.join(missing)}")
    packing = spec.stored_as.packing
    e, two_i, h_stored = w.w13.shape
    e2, h, i_stored = w.w2.shape
    if e != e2 or two_i % 2 or h_stored * packing != h or i_stored * packing != two_i // 2:
        raise ValueError(
            f"{w.format} expert weights have inconsistent shapes w13 {tuple(w.w13.shape)}, "
            f"w2 {tuple(w.w2.shape)} (expected [E, 2I, H{'/2' if packing == 2 else ''}] and "
            f"[E, H, I{'/2' if packing == 2 else ''}])"
        )


def _dequantize_projection(
    fmt: str,
    q: torch.Tensor,
    scale: torch.Tensor | None,
    scale_2: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Dequantize one projection; leading dims (experts) of q, scale and scale_2 agree."""
    element = _element(fmt)
    if _format(fmt).stored_as.is_float16:
        return q.to(dtype)
    if element == FP8_ELEMENT:
        return dequantize_fp8(q, scale.unsqueeze(-1), dtype)
    if element == E2M1_ELEMENT:
        return dequantize_nvfp4(q, scale, scale_2.reshape(*scale_2.shape, 1, 1), dtype)
    raise ValueError(f"no dequantization for format {fmt!r}")  # pragma: no cover - _format guards


def dequantize_expert_weights(
    w: ExpertWeights,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's exact expert weights: ``(w13 [E, 2I, H], w2 [E, H, I])`` in ``dtype``.

    bf16/fp16: the stored values. fp8_w8a8: ``float(q) * row_scale``. nvfp4: ``e2m1(code) *
    block_scale * scale_2`` (DESIGN.md). Every value is the correctly rounded product in ``dtype``.
    """
    _check_weights(w)
    return (
        _dequantize_projection(w.format, w.w13, w.w13_scale, w.w13_scale_2, dtype),
        _dequantize_projection(w.format, w.w2, w.w2_scale, w.w2_scale_2, dtype),
    )


def _expert_float32(w: ExpertWeights, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    def part(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[e]

    return (
        _dequantize_projection(
            w.format, w.w13[e], part(w.w13_scale), part(w.w13_scale_2), torch.float32
        ),
        _dequantize_projection(
            w.format, w.w2[e], part(w.w2_scale), part(w.w2_scale_2), torch.float32
        ),
    )


def _positive_scalar(value: torch.Tensor | float, what: str, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(value).to(device=device, dtype=torch.float32)
    if t.numel() != 1 or not bool(torch.isfinite(t).all() & (t > 0).all()):
        raise ValueError(
            f"{what} must be one positive finite number, got {t.flatten()[:4].tolist()}"
        )
    return t.reshape(())


def _weight_amax(t: torch.Tensor, what: str) -> torch.Tensor:
    """Per-expert absolute maximum ``[E]`` as float32 (taken in the weight's dtype, as ModelOpt)."""
    amax = t.abs().amax(dim=tuple(range(1, t.dim()))).to(torch.float32)
    bad = ~(torch.isfinite(amax) & (amax > 0))
    if bool(bad.any()):
        experts = torch.nonzero(bad).flatten().tolist()
        raise ValueError(
            f"{what} of experts {experts[:8]} are all zero or not finite: no quantization scale "
            "exists for them (ModelOpt refuses to export a zero scale)"
        )
    return amax


def quantize_expert_weights(
    w13_float: torch.Tensor,
    w2_float: torch.Tensor,
    fmt: str,
    activation: str,
    *,
    a13_amax: torch.Tensor | float | None = None,
    a2_amax: torch.Tensor | float | None = None,
    shared_gate_up_fp8_scale: bool = False,
) -> ExpertWeights:
    """Quantize float expert weights into ``fmt`` with ModelOpt 0.47's recipe (tests, benchmarks).

    :param w13_float: ``[E, 2I, H]`` ([gate; up]); its dtype is the model dtype ModelOpt would
        export from (the FP8 quotient is rounded to it, as ModelOpt does).
    :param w2_float: ``[E, H, I]``.
    :param fmt: a built-in format name. bf16/fp16 are a cast.
    :param activation: ``"silu"`` or ``"gelu"``.
    :param a13_amax: calibrated absolute maximum of GEMM 1's input, required for ``fp8_w8a8`` and
        ``nvfp4_w4a4`` (``input_scale = amax/448``, resp. ``amax/(6*448)``); ignored otherwise.
    :param a2_amax: likewise for GEMM 2's input (the gated intermediate).
    :param shared_gate_up_fp8_scale: fp8 only. ModelOpt gives gate and up separate scales when they
        are separate modules (the default here), one shared scale when the model stores a fused
        ``gate_up_proj`` (transformers 5 experts).

    NVFP4: ``weight_scale_2 = amax(gate and up of an expert) / (6*448)`` shared by gate and up,
    ``amax(down) / (6*448)`` for down; block scales and codes from :func:`quantize_nvfp4`.
    FP8: ``weight_scale = amax / 448`` per projection of each expert, stored broadcast to rows.
    A projection whose weights are all zero has no ModelOpt scale and raises ``ValueError``.
    """
    spec = _format(fmt)
    if activation not in formats.ACTIVATIONS:
        raise ValueError(
            f"unknown activation {activation!r}; expected one of {sorted(formats.ACTIVATIONS)}"
        )
    if w13_float.dim() != 3 or w2_float.dim() != 3:
        raise ValueError("w13_float must be [E, 2I, H] and w2_float [E, H, I]")
    e, two_i, h = w13_float.shape
    if w2_float.shape != (e, h, two_i // 2) or two_i % 2:
        raise ValueError(
            f"w13_float {tuple(w13_float.shape)} and w2_float {tuple(w2_float.shape)} do not form "
            "[E, 2I, H] and [E, H, I]"
        )
    i = two_i // 2
    device = w13_float.device

    element = spec.stored_as.element
    if spec.stored_as.is_float16:
        dtype = torch_dtype(element)
        return ExpertWeights(
            fmt, activation, w13_float.to(dtype).contiguous(), w2_float.to(dtype).contiguous()
        )

    if spec.activation_payload == formats.UNQUANTIZED:
        a13 = a2 = None
    else:
        if a13_amax is None or a2_amax is None:
            raise ValueError(
                f"{fmt} quantizes activations: pass a13_amax and a2_amax (the calibrated absolute "
                "maxima of GEMM 1's input and of the gated intermediate)"
            )
        to_scale = (fp8_scale_from_amax if spec.activation_payload == formats.FP8
                    else nvfp4_global_scale)
        a13 = to_scale(_positive_scalar(a13_amax, "a13_amax", device))
        a2 = to_scale(_positive_scalar(a2_amax, "a2_amax", device))

    if element == FP8_ELEMENT:
        gate, up = w13_float[:, :i], w13_float[:, i:]
        if shared_gate_up_fp8_scale:
            gate_amax = up_amax = _weight_amax(w13_float, "gate/up weights")
        else:
            gate_amax, up_amax = _weight_amax(gate, "gate weights"), _weight_amax(up, "up weights")
        gate_s, up_s = fp8_scale_from_amax(gate_amax), fp8_scale_from_amax(up_amax)
        down_s = fp8_scale_from_amax(_weight_amax(w2_float, "down weights"))
        w13 = torch.cat(
            (
                quantize_fp8_per_tensor(gate, gate_s.view(e, 1, 1)),
                quantize_fp8_per_tensor(up, up_s.view(e, 1, 1)),
            ),
            dim=1,
        )
        w13_scale = torch.cat((gate_s.view(e, 1).expand(e, i), up_s.view(e, 1).expand(e, i)), dim=1)
        return ExpertWeights(
            fmt,
            activation,
            w13=w13.contiguous(),
            w2=quantize_fp8_per_tensor(w2_float, down_s.view(e, 1, 1)).contiguous(),
            w13_scale=w13_scale.contiguous(),
            w2_scale=down_s.view(e, 1).expand(e, h).contiguous(),
            a13_scale=a13,
            a2_scale=a2,
        )

    if element == E2M1_ELEMENT:
        block = spec.stored_as.block_size
        if h % block or i % block:
            raise ValueError(
                f"{fmt} needs hidden and intermediate sizes that are multiples of {block}, "
                f"got H={h}, I={i}"
            )
        w13_s2 = nvfp4_global_scale(_weight_amax(w13_float, "gate/up weights"))
        w2_s2 = nvfp4_global_scale(_weight_amax(w2_float, "down weights"))
        w13, w13_bs = quantize_nvfp4(w13_float, w13_s2.view(e, 1, 1))
        w2, w2_bs = quantize_nvfp4(w2_float, w2_s2.view(e, 1, 1))
        return ExpertWeights(
            fmt,
            activation,
            w13=w13.contiguous(),
            w2=w2.contiguous(),
            w13_scale=w13_bs.contiguous(),
            w2_scale=w2_bs.contiguous(),
            w13_scale_2=w13_s2,
            w2_scale_2=w2_s2,
            a13_scale=a13,
            a2_scale=a2,
        )
    raise ValueError(
        f"no quantization recipe for format {fmt!r}"
    )  # pragma: no cover - _format guards


# --------------------------------------------------------------------------------------------
# Experts
# --------------------------------------------------------------------------------------------


def _run_format(w: ExpertWeights, run_as_format: str | None) -> str:
    if run_as_format is None or run_as_format == w.format:
        return w.format
    weight_only = _format(w.format).weight_only
    if run_as_format == weight_only:
        return run_as_format
    allowed = [w.format] + ([weight_only] if weight_only else [])
    raise ValueError(f"{w.format} weights cannot run as {run_as_format!r}; they run as {allowed}")


def _quantize_activation(x: torch.Tensor, fmt: str, scale: torch.Tensor | None) -> torch.Tensor:
    """What a GEMM of format ``fmt`` sees of its input ``x``, as float32."""
    payload = _format(fmt).activation_payload
    if payload == formats.FP8:
        return fake_quantize_fp8(x, scale, torch.float32)
    if payload == formats.NVFP4:
        return fake_quantize_nvfp4_activation(x, scale, torch.float32)
    return x.to(torch.float32)


def _activate(gate: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == formats.SILU:
        return F.silu(gate)
    if activation == formats.GELU:
        return F.gelu(gate, approximate="none")
    raise ValueError(
        f"unknown activation {activation!r}"
    )  # pragma: no cover - _check_weights guards


def _expert_mlp(x: torch.Tensor, w: ExpertWeights, e: int, fmt: str) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` of expert ``e`` on float32 rows ``x`` (GEMM 1's input)."""
    w13, w2 = _expert_float32(w, e)
    gate, up = (x @ w13.T).split(w.intermediate_size, dim=-1)
    inter = _quantize_activation(_activate(gate, w.activation) * up, fmt, w.a2_scale)
    return inter @ w2.T


def reference_fused_experts(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w: ExpertWeights,
    *,
    run_as_format: str | None = None,
) -> torch.Tensor:
    """Token-major experts: ``out[n] = sum_k topk_weights[n, k] * expert_{ids[n, k]}(hidden[n])``.

    :param hidden: ``[N, H]``, any float dtype; the output has this dtype.
    :param topk_ids: ``[N, K]`` integer local expert ids; ``-1`` skips a slot.
    :param topk_weights: ``[N, K]``, applied in float32.
    :param w: the layer's local expert weights.
    :param run_as_format: run the weights as this format: ``w.format`` (default) or its declared
        ``weight_only`` format (``nvfp4_w4a4`` -> ``nvfp4_w4a16``: no activation quantization).

    Rows are grouped by expert (one sort, one host sync for the per-expert counts) and each expert
    runs once on its rows; accumulation is float32.
    """
    _check_weights(w)
    fmt = _run_format(w, run_as_format)
    if hidden.dim() != 2 or hidden.shape[1] != w.hidden_size:
        raise ValueError(f"hidden must be [N, {w.hidden_size}], got {tuple(hidden.shape)}")
    if (
        topk_ids.dim() != 2
        or topk_ids.shape[0] != hidden.shape[0]
        or topk_weights.shape != topk_ids.shape
    ):
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
            "must both "
            f"be [N, K] with N = {hidden.shape[0]}"
        )
    n, k = topk_ids.shape
    num_experts = w.num_experts
    out = torch.zeros(n, w.hidden_size, dtype=torch.float32, device=hidden.device)
    if n == 0 or k == 0:
        return out.to(hidden.dtype)

    ids = topk_ids.reshape(-1).long()
    if bool(((ids < -1) | (ids >= num_experts)).any()):
        raise ValueError(f"topk_ids must lie in [-1, {num_experts}) (local experts, -1 = skip)")
    slots = torch.nonzero(ids >= 0).flatten()
    experts, order = torch.sort(ids[slots], stable=True)
    slots = slots[order]
    rows = slots // k
    row_weights = topk_weights.reshape(-1).to(torch.float32)[slots]
    counts = torch.bincount(experts, minlength=num_experts).tolist()

    x = _quantize_activation(hidden, fmt, w.a13_scale)  # per-row quantization: once for all experts
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        r = rows[start : start + count]
        y = _expert_mlp(x.index_select(0, r), w, e, fmt)
        out.index_add_(0, r, y * row_weights[start : start + count].unsqueeze(1))
        start += count
    return out.to(hidden.dtype)


def reference_masked_experts(
    hidden: torch.Tensor,
    masked_m: torch.Tensor,
    w: ExpertWeights,
    *,
    run_as_format: str | None = None,
) -> torch.Tensor:
    """Masked layout: ``out[e, :masked_m[e]] = expert_e(hidden[e, :masked_m[e]])``, unweighted.

    :param hidden: ``[E, M, H]`` with ``E = w.num_experts``; the output has its dtype and shape.
    :param masked_m: ``[E]`` valid rows per expert (``0 <= masked_m[e] <= M``); rows past it are 0.
    """
    _check_weights(w)
    fmt = _run_format(w, run_as_format)
    if hidden.dim() != 3 or hidden.shape[0] != w.num_experts or hidden.shape[2] != w.hidden_size:
        raise ValueError(
            f"hidden must be [{w.num_experts}, M, {w.hidden_size}], got {tuple(hidden.shape)}"
        )
    counts = masked_m.reshape(-1).tolist()
    m = hidden.shape[1]
    if len(counts) != w.num_experts or any(c < 0 or c > m for c in counts):
        raise ValueError(f"masked_m must hold {w.num_experts} counts in [0, {m}], got {counts[:8]}")
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for e, count in enumerate(counts):
        if count:
            x = _quantize_activation(hidden[e, :count], fmt, w.a13_scale)
            out[e, :count] = _expert_mlp(x, w, e, fmt)
    return out.to(hidden.dtype)
