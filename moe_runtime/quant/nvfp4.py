"""NVFP4: packed E2M1 values with float8_e4m3fn scales over blocks of 16 and a float32 global scale.

A value is ``e2m1(code) * block_scale * global_scale``. Quantization follows ModelOpt 0.47's export
arithmetic step by step, so the bytes and scales it produces are those of a ModelOpt checkpoint:

1. ``global_scale = amax / (6 * 448)`` (float32), see :func:`nvfp4_global_scale`;
2. ``block_scale = block_amax / (6 * global_scale)`` in float32 (the product ``6 * global_scale`` is
   rounded first); a block whose amax is 0 gets 1.0; the result is clamped to ``[2**-9, 448]`` and
   cast to e4m3 (round to nearest even);
3. ``x / (float(block_scale) * global_scale)`` (the product rounded to float32 first) is rounded to
   the nearest E2M1 magnitude, ties to the even code, saturating at 6; the sign bit is ``x < 0``,
   so a small negative value that rounds to 0 keeps code 8 (-0), and ``-0.0`` itself gets code 0;
4. two codes per byte, the even column in the low nibble.
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Smallest positive e4m3 value (a subnormal); ModelOpt clamps block scales up to it.
E4M3_MIN_SUBNORMAL = 2.0**-9

# Code -> value, indexed by the 4-bit code (bit 3 = sign).
_MAGNITUDES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES: tuple[float, ...] = _MAGNITUDES + tuple(-m for m in _MAGNITUDES)  # 8 is -0.0

# Midpoints between consecutive E2M1 magnitudes; magnitude code i+1 starts above _MIDPOINTS[i].
_MIDPOINTS: tuple[float, ...] = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_table(device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
    """The 16-entry code table as a tensor."""
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


def e2m1_to_float(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Map 4-bit codes (any integer dtype, values 0..15) to their E2M1 values."""
    return e2m1_table(codes.device, dtype)[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes ``[..., K]`` (0..15) into uint8 ``[..., K/2]``; even column in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of E2M1 codes (last dim {codes.shape[-1]})")
    codes = codes.to(torch.uint8)
    return (codes[..., 1::2] << 4) | (codes[..., 0::2] & 0x0F)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Unpack uint8 ``[..., K/2]`` into codes uint8 ``[..., K]`` (inverse of :func:`pack_e2m1`)."""
    packed = packed.to(torch.uint8)
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def round_to_e2m1(scaled: torch.Tensor) -> torch.Tensor:
    """Codes (uint8, 0..15) of the E2M1 values nearest to ``scaled`` (already divided by scales).

    Ties go to the even code (0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0,
    3.5 -> 4.0, 5.0 -> 4.0); magnitudes above 6 saturate to 6; NaN maps to code 7 (as in ModelOpt).
    """
    magnitude = scaled.abs()
    code = torch.zeros(scaled.shape, dtype=torch.uint8, device=scaled.device)
    for lower_code, midpoint in enumerate(_MIDPOINTS):
        if (lower_code + 1) % 2 == 0:
            steps_up = ~(magnitude < midpoint)  # a tie goes up to the even code
        else:
            steps_up = ~(magnitude <= midpoint)  # a tie stays on the even code below
        code += steps_up.to(torch.uint8)  # written as ~(...) so that NaN counts as above
    return code | ((scaled < 0).to(torch.uint8) << 3)


def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """ModelOpt's ``weight_scale_2`` / NVFP4 ``input_scale``: ``amax / (6 * 448)`` in float32.

    The quotient is correctly rounded on every device (ModelOpt's CPU result). On CUDA, torch turns
    a division by a Python number into a multiplication by its reciprocal, which can be one ulp
    off; ModelOpt exporting on a GPU inherits that, this function does not.
    """
    amax = torch.as_tensor(amax).to(torch.float32)
    return amax / torch.tensor(E2M1_MAX * E4M3_MAX, dtype=torch.float32, device=amax.device)


def _global_scale_tensor(global_scale: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    gs = torch.as_tensor(global_scale, device=device).to(device=device, dtype=torch.float32)
    if gs.numel() and not bool(torch.all(torch.isfinite(gs) & (gs > 0))):
        raise ValueError(
            "NVFP4 global scale must be positive and finite (an all-zero tensor has no NVFP4 "
            f"encoding; ModelOpt refuses to export a zero scale), got {gs.flatten()[:8].tolist()}"
        )
    return gs


def _check_blocks(x: torch.Tensor) -> int:
    if x.dim() == 0 or x.shape[-1] % BLOCK_SIZE:
        raise ValueError(
            f"NVFP4 needs a last dimension that is a multiple of {BLOCK_SIZE}, got shape "
            f"{tuple(x.shape)}"
        )
    return x.shape[-1] // BLOCK_SIZE


def nvfp4_block_scales(x: torch.Tensor, global_scale: torch.Tensor | float) -> torch.Tensor:
    """The float8_e4m3fn block scales ``[..., K/16]`` ModelOpt computes for ``x`` (step 2 above)."""
    return _block_scales(x, _check_blocks(x), _global_scale_tensor(global_scale, x.device))


def _block_scales(x: torch.Tensor, blocks: int, gs: torch.Tensor) -> torch.Tensor:
    block_amax = x.reshape(*x.shape[:-1], blocks, BLOCK_SIZE).abs().amax(dim=-1).to(torch.float32)
    scale = block_amax / (E2M1_MAX * gs)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return scale.clamp(min=E4M3_MIN_SUBNORMAL, max=E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_nvfp4(
    x: torch.Tensor,
    global_scale: torch.Tensor | float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., K]`` (K a multiple of 16) to NVFP4 exactly as ModelOpt exports it.

    :param x: any floating tensor; arithmetic runs in float32 (float64 stays float64, as ModelOpt).
    :param global_scale: positive float32 scalar, or a tensor broadcastable to ``[..., K/16]``
        (per-expert weights ``[E, R, K]`` take ``[E, 1, 1]``).
    :returns: ``(packed uint8 [..., K/2], block_scale float8_e4m3fn [..., K/16])``.
    """
    blocks = _check_blocks(x)
    gs = _global_scale_tensor(global_scale, x.device)
    block_scale = _block_scales(x, blocks, gs)
    wide = torch.promote_types(x.dtype, torch.float32)
    divisor = (block_scale.to(torch.float32) * gs).unsqueeze(-1)
    scaled = x.to(wide).reshape(*x.shape[:-1], blocks, BLOCK_SIZE) / divisor
    codes = round_to_e2m1(scaled).reshape(x.shape)
    return pack_e2m1(codes), block_scale


def _exact_dtype(dtype: torch.dtype) -> torch.dtype:
    # e2m1 (2 significant bits) * e4m3 (4 bits) * float32 (24 bits) fits float64 exactly, so
    # computing there and casting once gives the correctly rounded value in any dtype; in float32
    # the first product is exact and the second is the single rounding, so it needs no detour.
    return torch.float32 if dtype == torch.float32 else torch.float64


def dequantize_nvfp4(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor | float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``e2m1(code) * block_scale * global_scale`` as ``[..., K]``, rounded once into ``dtype``.

    ``global_scale`` broadcasts against ``block_scale`` like in :func:`quantize_nvfp4`.
    ModelOpt's own dequantize multiplies ``block_scale * global_scale`` first (two float32
    roundings); the two agree to within one float32 ulp.
    """
    codes = unpack_e2m1(packed)
    blocks = block_scale.shape[-1]
    if codes.shape[-1] != blocks * BLOCK_SIZE:
        raise ValueError(
            f"packed {tuple(packed.shape)} and block_scale {tuple(block_scale.shape)} disagree: "
            f"expected block_scale's last dim to be {codes.shape[-1] // BLOCK_SIZE}"
        )
    work = _exact_dtype(dtype)
    gs = torch.as_tensor(global_scale, device=packed.device).to(device=packed.device, dtype=work)
    values = e2m1_to_float(codes, work).reshape(*codes.shape[:-1], blocks, BLOCK_SIZE)
    values = values * block_scale.to(work).unsqueeze(-1) * gs.unsqueeze(-1)
    return values.reshape(codes.shape).to(dtype)


def fake_quantize_nvfp4_activation(
    x: torch.Tensor,
    input_scale: torch.Tensor | float,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Quantize activations ``x [..., K]`` to NVFP4 with the layer's ``input_scale`` as global scale
    and dequantize them again (what a W4A4 GEMM sees), returned in ``dtype`` (default ``x.dtype``).

    Blocks whose amax exceeds ``6 * 448 * input_scale`` saturate, as in the kernels. This is the
    export arithmetic above. ModelOpt's CUDA-only calibration kernel differs for blocks whose
    effective scale ``block_scale * input_scale`` falls below 1e-5 (it quantizes them with scale
    1.0, which zeroes them; this keeps the clamped e4m3 scale), and FlashInfer's quantizer
    multiplies by reciprocals, which can move a value sitting on a rounding midpoint by one code.
    """
    packed, block_scale = quantize_nvfp4(x, input_scale)
    return dequantize_nvfp4(packed, block_scale, input_scale, dtype or x.dtype)
