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
    :param encoding: how the weights are stored, one of :data:`ENCODINGS` (the core loads,
        quantizes, dequantizes and references a format through its encoding; a plugin format must
        name one).
    """

    name: str
    weight_bits: int
    bytes_per_weight: float
    activation_payload: str = UNQUANTIZED
    weight_only: str | None = None
    description: str = ""
    encoding: str | None = None

    @property
    def stored_as(self) -> Encoding:
        """The :class:`Encoding` record of this format (raises for an unknown encoding)."""
        try:
            return ENCODINGS[self.encoding]
        except KeyError:
            raise ValueError(
                f"weight format {self.name!r} has encoding {self.encoding!r}; moe-runtime stores "
                f"weights in the encodings {', '.join(sorted(ENCODINGS))}") from None


@attrs.frozen
class Encoding:
    """How a format's expert weights are stored, as the core quantizes and dequantizes them.

    :param name: identifier (``"nvfp4"``: E2M1 codes, e4m3 16-element block scales and a float32
        global scale, the storage of ``nvfp4_w4a4`` and ``nvfp4_w4a16``).
    :param element: the stored element (``"bfloat16"``, ``"float16"``, ``"float8_e4m3fn"``,
        ``"e2m1"``).
    :param packing: stored elements per byte along the input dimension (2 for E2M1 nibbles).
    :param block_size: input elements sharing one scale (``None``: per-tensor scales or none).
        Hidden and intermediate sizes must be multiples of it.
    :param mantissa_bits: explicit mantissa bits of the stored element (rounding of the format).
    """

    name: str
    element: str
    packing: int = 1
    block_size: int | None = None
    mantissa_bits: int = 7

    @property
    def size_multiple(self) -> int:
        return max(self.block_size or 1, self.packing)

    @property
    def is_float16(self) -> bool:
        """Stored as a 16-bit float that the model computes in (no scales)."""
        return self.element in ("bfloat16", "float16")


@attrs.frozen
class Payload:
    """An activation payload (what travels through dispatch, what a GEMM consumes).

    :param name: identifier (``"fp8"``).
    :param bytes_per_element: average bytes per hidden element including scales.
    """

    name: str
    bytes_per_element: float
    description: str = ""


ENCODINGS: dict[str, Encoding] = {e.name: e for e in (
    Encoding("bf16", "bfloat16", mantissa_bits=7),
    Encoding("fp16", "float16", mantissa_bits=10),
    Encoding("fp8_e4m3", "float8_e4m3fn", mantissa_bits=3),
    Encoding("nvfp4", "e2m1", packing=2, block_size=16, mantissa_bits=1),
)}

BUILTIN_FORMATS: tuple[WeightFormat, ...] = (
    WeightFormat(BF16, 16, 2.0, description="bfloat16 weights, unquantized", encoding="bf16"),
    WeightFormat(FP16, 16, 2.0, description="float16 weights, unquantized", encoding="fp16"),
    WeightFormat(
        FP8_W8A8, 8, 1.0, FP8,
        description="FP8 e4m3 weights and activations, per-tensor scales (ModelOpt FP8)",
        encoding="fp8_e4m3",
    ),
    WeightFormat(
        NVFP4_W4A4, 4, 0.5625, NVFP4, weight_only=NVFP4_W4A16,
        description="NVFP4 weights and activations, 16-element e4m3 block scales (ModelOpt NVFP4)",
        encoding="nvfp4",
    ),
    WeightFormat(
        NVFP4_W4A16, 4, 0.5625,
        description="NVFP4 weights, 16-bit activations (ModelOpt W4A16_NVFP4)",
        encoding="nvfp4",
    ),
)

BUILTIN_PAYLOADS: tuple[Payload, ...] = (
    Payload(UNQUANTIZED, 2.0, "16-bit activations as the model computes them"),
    Payload(FP8, 1.0, "float8_e4m3fn activations with the layer's per-tensor input scale"),
    Payload(NVFP4, 0.5625, "NVFP4 activations with e4m3 block scales and the layer's global scale"),
)

LAYOUTS: frozenset[str] = frozenset({TOKEN_MAJOR, MASKED})
ACTIVATIONS: frozenset[str] = frozenset({SILU, GELU})


def builtin_twin(fmt: WeightFormat) -> str:
    """The built-in format with the same storage and activation payload as ``fmt``: what the
    reference computes a plugin format as (``fmt.name`` itself for a built-in format)."""
    for b in BUILTIN_FORMATS:
        if b.encoding == fmt.encoding and b.activation_payload == fmt.activation_payload:
            return b.name
    raise ValueError(
        f"weight format {fmt.name!r}: no built-in format stores {fmt.encoding!r} weights with "
        f"{fmt.activation_payload!r} activations, so the reference cannot compute it; built-in "
        "formats: " + ", ".join(f"{b.name} ({b.encoding}, {b.activation_payload})"
                                for b in BUILTIN_FORMATS))
