"""Quantized number formats used by MoE expert weights and activations (NVFP4, FP8).

Pure torch; runs on CPU and CUDA. The arithmetic follows nvidia-modelopt 0.47's export so that
tensors made here are byte-identical to a ModelOpt checkpoint's.
"""

from moe_runtime.quant.fp8 import (
    dequantize_fp8,
    fake_quantize_fp8,
    fp8_scale_from_amax,
    quantize_fp8_per_tensor,
)
from moe_runtime.quant.nvfp4 import (
    E2M1_VALUES,
    dequantize_nvfp4,
    e2m1_to_float,
    fake_quantize_nvfp4_activation,
    nvfp4_block_scales,
    nvfp4_global_scale,
    pack_e2m1,
    quantize_nvfp4,
    round_to_e2m1,
    unpack_e2m1,
)

__all__ = [
    "E2M1_VALUES",
    "dequantize_fp8",
    "dequantize_nvfp4",
    "e2m1_to_float",
    "fake_quantize_fp8",
    "fake_quantize_nvfp4_activation",
    "fp8_scale_from_amax",
    "nvfp4_block_scales",
    "nvfp4_global_scale",
    "pack_e2m1",
    "quantize_fp8_per_tensor",
    "quantize_nvfp4",
    "round_to_e2m1",
    "unpack_e2m1",
]
