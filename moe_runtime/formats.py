"""Weight formats, token layouts, activation payloads and activation functions.

These are the words every declaration speaks. A format says how one MoE layer's expert weights are
stored and which activation quantization the checkpoint calibrated for; it never names a checkpoint's
quantization method. The set is open: plugins add formats through ``moe_runtime_register_formats``.
"""

from __future__ import annotations

import attrs

# Built-in weight formats (names are the stable identifiers used in declarations).
BF16 = "bf16"
FP16 = "fp16"
FP8_W8A8 = "fp8_w8a8"  # FP8 e4m3 weights, per-tensor weight scale, per-tensor static input scale
NVFP4_W4A4 = "nvfp4_w4a4"  # NVFP4 weights and NVFP4 activations (input_scale present)
NVFP4_W4A16 = "nvfp4_w4a16"  # NVFP4 weights, activations stay 16-bit (no input_scale)

# Token layouts between the communication and the experts backend.
TOKEN_MAJOR = "token_major"  # [tokens, hidden] + topk ids/weights (ids local, -1 = elsewhere)
MASKED = "masked"  # [local_experts, max_tokens, hidden] + masked_m counts

# Activation payloads carried by dispatch / accepted by experts.
UNQUANTIZED = "unquantized"  # the model's 16-bit dtype
FP8 = "fp8"  # float8_e4m3fn with a per-tensor scale
NVFP4 = "nvfp4"  # packed E2M1 with e4m3 16-element block scales

# Activation functions of the gated MLP: act(gate) * up.
SILU = "silu"
GELU = "gelu"


@attrs.frozen
class WeightFormat:
    """One way of storing a layer's expert weights.

    :param name: the identifier used in declarations (``"nvfp4_w4a4"``).
    :param weight_bits: bits per stored weight element, scales excluded.
    :param bytes_per_weight: average bytes per weight including its scales (for rooflines and memory).
    :param activation_payload: the payload the checkpoint calibrated activations for
        (``"fp8"``, ``"nvfp4"``) or ``"unquantized"``.
    :param weight_only: the format that runs the same stored weights without quantizing
        activations (``nvfp4_w4a4`` -> ``nvfp4_w4a16``), or ``None``. A backend may declare that it
        runs a format *as* this one; the planner reports that as a degradation.
    :param description: one sentence for people.
    """

    name: str
    weight_bits: int
    bytes_per_weight: float
    activation_payload: str = UNQUANTIZED
    weight_only: str | None = None
    description: str = ""


@attrs.frozen
class Payload:
    """An activation payload (what travels through dispatch, what a GEMM consumes).

    :param name: identifier (``"fp8"``).
    :param bytes_per_element: average bytes per hidden element including scales.
    """

    name: str
    bytes_per_element: float
    description: str = ""


BUILTIN_FORMATS: tuple[WeightFormat, ...] = (
    WeightFormat(BF16, 16, 2.0, description="bfloat16 weights, unquantized"),
    WeightFormat(FP16, 16, 2.0, description="float16 weights, unquantized"),
    WeightFormat(
        FP8_W8A8, 8, 1.0, FP8,
        description="FP8 e4m3 weights and activations, per-tensor scales (ModelOpt FP8)",
    ),
    WeightFormat(
        NVFP4_W4A4, 4, 0.5625, NVFP4, weight_only=NVFP4_W4A16,
        description="NVFP4 weights and activations, 16-element e4m3 block scales (ModelOpt NVFP4)",
    ),
    WeightFormat(
        NVFP4_W4A16, 4, 0.5625,
        description="NVFP4 weights, 16-bit activations (ModelOpt W4A16_NVFP4)",
    ),
)

BUILTIN_PAYLOADS: tuple[Payload, ...] = (
    Payload(UNQUANTIZED, 2.0, "16-bit activations as the model computes them"),
    Payload(FP8, 1.0, "float8_e4m3fn activations with the layer's per-tensor input scale"),
    Payload(NVFP4, 0.5625, "NVFP4 activations with e4m3 block scales and the layer's global scale"),
)

LAYOUTS: frozenset[str] = frozenset({TOKEN_MAJOR, MASKED})
ACTIVATIONS: frozenset[str] = frozenset({SILU, GELU})
