"""moe-runtime plugin registration of the Triton experts backend.

Loaded at discovery: it imports only moe-runtime's declaration records, never triton or the kernel
modules (the factory is the lazy string below).
"""

from __future__ import annotations

import attrs

from moe_runtime import formats as F
from moe_runtime.declarations import (
    CapabilityRange,
    ExpertsBackendSpec,
    Hardware,
    Support,
)
from moe_runtime.plugin.hookspecs import hookimpl

ACTIVATIONS = (F.SILU, F.GELU)


@attrs.frozen
class TorchGroupedGemm:
    """A large-batch path of this backend: both grouped GEMMs through torch's own (CUTLASS) grouped
    GEMM op, with this package's routing, activation and combine around them.

    Taken per call where the tuned table (``configs.json``, an entry's ``"grouped_mm": true``) or
    ``MOE_TRITON_GROUPED_MM=1`` asks for it and everything below holds; otherwise the Triton GEMMs
    run. ``op``: the ``torch`` attribute; ``compute``: the operands' torch dtype name;
    ``cuda_capabilities``: where torch runs the op without a host synchronisation (torch 2.9-2.11:
    CUTLASS on 9.0 and 10.0; elsewhere it loops over groups on the host); ``size_multiple``: the
    hidden and intermediate sizes must be multiples of it (16-byte rows; fp8 K and N by 16)."""

    op: str
    compute: str
    cuda_capabilities: tuple[CapabilityRange, ...]
    size_multiple: int


_CUTLASS_GROUPED = (CapabilityRange.exactly("9.0"), CapabilityRange.exactly("10.0"))
TORCH_GROUPED_GEMMS = {
    F.BF16: TorchGroupedGemm("_grouped_mm", "bfloat16", _CUTLASS_GROUPED, 8),
    # rowwise scales: the activations' per-tensor scale repeated per row, the weights' per channel
    F.FP8_W8A8: TorchGroupedGemm("_scaled_grouped_mm", "float8_e4m3fn", _CUTLASS_GROUPED, 16),
}


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
            note="Triton grouped GEMMs, BF16/FP16 tensor cores; bf16 batches the tuned table "
                 "marks run torch's grouped GEMM (CUTLASS, compute capability 9.0/10.0)",
        ),
        Support(
            formats=(F.FP8_W8A8,), activations=ACTIVATIONS, layouts=(F.TOKEN_MAJOR, F.MASKED),
            payloads=(F.UNQUANTIZED, F.FP8), hardware=_cuda("8.9"),
            note="Triton grouped GEMMs on FP8 tensor cores; activations quantized per tensor "
                 "with the checkpoint's input scales; batches the tuned table marks run torch's "
                 "scaled grouped GEMM (CUTLASS, compute capability 9.0/10.0)",
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
    # routing on the device with no host sync, tile configs chosen from shapes, TMA descriptors
    # made at prepare: the conformance suite captures and replays every combination on the H200
    cuda_graphs=True,
    description="Triton fused MoE (routing, gathered grouped GEMMs, fused act-and-mul): BF16/FP16, "
                "FP8 W8A8, NVFP4 as W4A16, on compute capability 8.0+ (FP8 8.9+).",
)


@hookimpl
def moe_runtime_register_backends(register):
    register(TRITON_EXPERTS)
