"""moe-runtime plugin registration of the Triton experts backend.

Loaded at discovery: it imports only moe-runtime's declaration records, never triton or the kernel
modules (the factory is the lazy string below).
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

ACTIVATIONS = (F.SILU, F.GELU)


def _cuda(min_cap: str) -> Hardware:
    return Hardware(devices=("cuda",), cuda_capabilities=(CapabilityRange(min_cap),),
                    requires=("triton",))


TRITON_EXPERTS = ExpertsBackendSpec(
    name="triton",
    factory="moe_runtime_triton.backend:TritonExperts",
    supports=(
        Support(
            formats=(F.BF16, F.FP16), activations=ACTIVATIONS, layouts=(F.TOKEN_MAJOR, F.MASKED),
            payloads=(F.UNQUANTIZED,), hardware=_cuda("8.0"),
            note="Triton grouped GEMMs, BF16/FP16 tensor cores",
        ),
        Support(
            formats=(F.FP8_W8A8,), activations=ACTIVATIONS, layouts=(F.TOKEN_MAJOR, F.MASKED),
            payloads=(F.UNQUANTIZED, F.FP8), hardware=_cuda("8.9"),
            note="Triton grouped GEMMs on FP8 tensor cores; activations quantized per tensor "
                 "with the checkpoint's input scales",
        ),
        Support(
            formats=(F.NVFP4_W4A16,), activations=ACTIVATIONS, layouts=(F.TOKEN_MAJOR, F.MASKED),
            payloads=(F.UNQUANTIZED,), hardware=_cuda("8.0"), shape_multiple=16,
            note="NVFP4 weights dequantized in the GEMM main loop (weights stay 4-bit in "
                 "memory), 16-bit tensor cores",
        ),
        Support(
            formats=(F.NVFP4_W4A4,), activations=ACTIVATIONS, layouts=(F.TOKEN_MAJOR, F.MASKED),
            payloads=(F.UNQUANTIZED,), hardware=_cuda("8.0"), shape_multiple=16,
            runs_as=F.NVFP4_W4A16,
            note="NVFP4 W4A4 checkpoint run as W4A16: activations are not quantized (these "
                 "kernels use 16-bit tensor cores on every compute capability, FP4 ones on none)",
        ),
    ),
    priority=30,
    description="Triton fused MoE (routing, gathered grouped GEMMs, fused act-and-mul): BF16/FP16, "
                "FP8 W8A8, NVFP4 as W4A16, on compute capability 8.0+ (FP8 8.9+).",
)


@hookimpl
def moe_runtime_register_backends(register):
    register(TRITON_EXPERTS)
