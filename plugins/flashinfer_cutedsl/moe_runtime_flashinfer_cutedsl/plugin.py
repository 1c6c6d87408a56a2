"""The declaration of the ``flashinfer_cutedsl`` experts backend, and the hook that registers it.

The entry point (group ``moe_runtime``, name ``flashinfer_cutedsl``): no torch, no FlashInfer, no
CuTe DSL; the kernel class is imported only when the planner selects it. What FlashInfer's source
says about each declared claim: README.md, "Module notes".
"""

from __future__ import annotations

from moe_runtime import formats as F
from moe_runtime.declarations import (
    CapabilityRange,
    ExpertsBackendSpec,
    Hardware,
    Support,
)
from moe_runtime.plugin.hookspecs import hookimpl

NAME = "flashinfer_cutedsl"
FACTORY = "moe_runtime_flashinfer_cutedsl.backend:CuteDslExperts"

#: Top-level modules that must be importable: FlashInfer, and the CuTe DSL (nvidia-cutlass-dsl).
REQUIRES = ("flashinfer", "cutlass")

#: hidden and intermediate sizes must be multiples of this (see the module docstring).
SHAPE_MULTIPLE = 64

#: SM100 (B200/GB200), SM103 (B300/GB300), SM107: the CuTe-DSL NVFP4 MoE's architectures.
BLACKWELL_FP4 = Hardware(
    devices=("cuda",),
    cuda_capabilities=(
        CapabilityRange.exactly("10.0"),
        CapabilityRange.exactly("10.3"),
        CapabilityRange.exactly("10.7"),
    ),
    requires=REQUIRES,
)

SPEC = ExpertsBackendSpec(
    name=NAME,
    factory=FACTORY,
    supports=(
        Support(
            formats=(F.NVFP4_W4A4,),
            activations=(F.SILU,),
            layouts=(F.TOKEN_MAJOR,),
            payloads=(F.UNQUANTIZED,),
            hardware=BLACKWELL_FP4,
            shape_multiple=SHAPE_MULTIPLE,
            note="FlashInfer CuteDslMoEWrapper, quant_mode w4a4 (NVFP4 activations, FP4 MMA)",
        ),
        Support(
            formats=(F.NVFP4_W4A4,),
            activations=(F.SILU,),
            layouts=(F.MASKED,),
            payloads=(F.UNQUANTIZED, F.NVFP4),
            hardware=BLACKWELL_FP4,
            shape_multiple=SHAPE_MULTIPLE,
            note="FlashInfer grouped_gemm_nt_masked with fused SiLU-and-mul NVFP4 quantization",
        ),
        Support(
            formats=(F.NVFP4_W4A16,),
            activations=(F.SILU,),
            layouts=(F.TOKEN_MAJOR,),
            payloads=(F.UNQUANTIZED,),
            hardware=BLACKWELL_FP4,
            shape_multiple=SHAPE_MULTIPLE,
            note="FlashInfer CuteDslMoEWrapper, quant_mode w4a16 (bf16 activations)",
        ),
    ),
    priority=100,
    description=(
        "FlashInfer CuTe-DSL NVFP4 fused MoE (token-major wrapper and masked grouped GEMM); "
        "compute capability 10.0/10.3/10.7 only."
    ),
)


def supported_capabilities() -> tuple[tuple[int, int], ...]:
    """Every compute capability the declaration names (the backend's guard reads this)."""
    caps: set[tuple[int, int]] = set()
    for s in SPEC.supports:
        for r in s.hardware.cuda_capabilities:
            if r.max != r.min:
                raise AssertionError("the declaration names exact capabilities only")
            caps.add(r.min)
    return tuple(sorted(caps))


@hookimpl
def moe_runtime_register_backends(register):
    register(SPEC)
