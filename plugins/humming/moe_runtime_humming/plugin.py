"""moe-runtime plugin registration of the Humming experts backend.

Loaded at discovery: it imports only moe-runtime's declaration records, never humming or torch.
"""

from __future__ import annotations

from moe_runtime import formats as F
from moe_runtime.declarations import CapabilityRange, ExpertsBackendSpec, Hardware, Support
from moe_runtime.plugin.hookspecs import hookimpl

# Sizes: Humming's sm90 tiles need output widths (2 I and H) in whole 128-column WGMMA groups.
# Verified on an H200 only (conformance suite, benchmarks/RESULTS.md); Humming's Blackwell and
# Ampere paths are other kernels, not declared until they are checked.
HOPPER = Hardware(devices=("cuda",), cuda_capabilities=(CapabilityRange.exactly("9.0"),),
                  requires=("humming",))

HUMMING_EXPERTS = ExpertsBackendSpec(
    name="humming",
    factory="moe_runtime_humming.backend:HummingExperts",
    supports=(
        Support(
            formats=(F.NVFP4_W4A16,), activations=(F.SILU, F.GELU), layouts=(F.TOKEN_MAJOR,),
            payloads=(F.UNQUANTIZED,), hardware=HOPPER, shape_multiple=128,
            note="Humming's indexed grouped GEMMs (JIT, NVRTC) on the 4-bit weights with the "
                 "fp32 global scale (exact), 16-bit tensor cores",
        ),
        Support(
            formats=(F.NVFP4_W4A4,), activations=(F.SILU, F.GELU), layouts=(F.TOKEN_MAJOR,),
            payloads=(F.UNQUANTIZED,), hardware=HOPPER, shape_multiple=128,
            runs_as=F.NVFP4_W4A16,
            note="NVFP4 W4A4 checkpoint run as W4A16 through Humming: activations are not "
                 "quantized (no FP4 tensor cores on compute capability 9.0)",
        ),
    ),
    # below triton (30): slower at 1 token on the H200, faster from 1024 tokens only as the peer
    # fed by the triton routing (benchmarks/RESULTS.md); `moe-runtime tune` decides per batch
    # size, or pin it with --moe-runner-backend humming
    priority=20,
    # routing and combine are torch ops sized from shapes, the kernels compiled at prepare: the
    # conformance suite captures and replays every declared combination on the H200
    cuda_graphs=True,
    description="Humming (humming-kernels) NVFP4 W4A16 MoE GEMMs with moe-runtime's routing and "
                "combine, compute capability 9.0.",
)


@hookimpl
def moe_runtime_register_backends(register):
    register(HUMMING_EXPERTS)
