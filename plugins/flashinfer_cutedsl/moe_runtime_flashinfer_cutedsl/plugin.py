"""The declaration of the ``flashinfer_cutedsl`` experts backend, and the hook that registers it.

This module is the entry point (group ``moe_runtime``, name ``flashinfer_cutedsl``). It imports the
declaration vocabulary of moe-runtime and nothing else: no torch, no FlashInfer, no CuTe DSL. The
kernel class is named by the lazy factory string and imported only when the planner selects it.

Every claim below was read from FlashInfer's source (flashinfer-python 0.7.0 and 0.7.4 wheels, same
APIs in both; the README lists the files):

- ``CuteDslMoEWrapper`` (token-major, with its own routing sort and finalize) takes
  ``quant_mode="w4a4"`` (packed NVFP4 activations, quantized here with ``fp4_quantize``) or
  ``quant_mode="w4a16"`` (bf16 activations against online-decoded NVFP4 weights, its own W4A16
  runner): both modes are real, so both NVFP4 formats are declared on the token-major layout.
- The masked path is ``grouped_gemm_nt_masked`` twice, with ``scaled_fp4_grouped_quantize`` before
  GEMM 1 and ``silu_and_mul_scaled_nvfp4_experts_quantize`` between the GEMMs: both operands of the
  masked GEMM are FP4, so the masked layout is declared for W4A4 only, and it also accepts
  activations already quantized to NVFP4 by the dispatch (they skip the first quantizer).
- The fused activation between the GEMMs is SiLU-and-mul on the masked path; the wrapper's default
  ``ActivationType.Swiglu`` with alpha 1, beta 0 and no limit is the same ``silu(gate) * up``.
  Only ``silu`` is declared: the masked path has no other activation.
- ``CuteDslMoEWrapper.__init__`` carries ``@supported_compute_capability([100, 103, 107])`` (an
  annotation, not a check), ``grouped_gemm_nt_masked`` routes 10.0/10.3 to the Blackwell kernel and
  10.7 to the Rubin one and refuses 11.0. The FP4 quantizers have no guard at all: their CUDA body
  is compiled only for ``__CUDA_ARCH__ >= 1000`` and on 9.0 they return uninitialised memory
  without raising. Hence exactly 10.0, 10.3 and 10.7, and a hard guard in the backend.
- ``flashinfer.cute_dsl.is_cute_dsl_available()`` probes ``cutlass`` and ``cutlass.cute``: the
  CuTe DSL (PyPI ``nvidia-cutlass-dsl``) is imported as ``cutlass``.
- Shapes: GEMM 1's epilogue takes the up/gate rows in 64-row chunks and its N tile is 128 or 256
  (``is_valid_mma_tiler_and_cluster_shape``: "SwiGlu Fusion requires even epi_tile counts") with
  ``n % mma_tiler_n == 0`` for ``n = 2 * intermediate``: intermediate must be a multiple of 64.
  FP4 operands need 16-byte aligned rows (``check_contigous_16B_alignment``): hidden a multiple of
  32. One multiple covers both sizes in the declaration, so it is 64.
"""

from __future__ import annotations

from moe_runtime import formats as F
from moe_runtime.declarations import (
    CapabilityRange,
    ExpertsBackendSpec,
    Hardware,
    Support,
)
from moe_runtime.hookspecs import hookimpl

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
