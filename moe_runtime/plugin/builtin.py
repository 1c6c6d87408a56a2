"""The built-in plugin: formats, payloads, the reference experts backend and two communication
backends. It registers through the same hooks a third-party plugin uses."""

from __future__ import annotations

from moe_runtime import formats as F
from moe_runtime.declarations import (
    CommBackendSpec,
    CommSupport,
    ExpertsBackendSpec,
    Hardware,
    Support,
)
from moe_runtime.plugin.hookspecs import hookimpl

ALL_FORMATS = (F.BF16, F.FP16, F.FP8_W8A8, F.NVFP4_W4A4, F.NVFP4_W4A16)

REFERENCE = ExpertsBackendSpec(
    name="reference",
    factory="moe_runtime.backends.reference:ReferenceExperts",
    supports=(
        Support(
            formats=ALL_FORMATS,
            activations=(F.SILU, F.GELU),
            layouts=(F.TOKEN_MAJOR, F.MASKED),
            payloads=(F.UNQUANTIZED, F.FP8),
            hardware=Hardware(devices=("cpu", "cuda")),
            note="pure-torch reference: exact dequantization, activation quantization emulated",
        ),
    ),
    priority=0,
    description="Pure-torch numerical reference for every built-in format (CPU and CUDA).",
)


# cpu_dequantized keeps a float32 copy of the experts (its COMPUTE_DTYPE): the one number its
# declaration (prepared_bytes_per_weight, read by the memory estimate) and its notes share.
FLOAT32_BYTES = 4.0


def _float32_copy(*fmts: str) -> str:
    """What a float32 copy of the weights of ``fmts`` costs, from the formats' own records."""
    stored = {f.name: f.bytes_per_weight for f in F.BUILTIN_FORMATS}[fmts[0]]
    return (f"float32 GEMMs on a copy of the weights dequantized at load: {FLOAT32_BYTES:g} "
            f"bytes per weight, {FLOAT32_BYTES / stored:.1f}x the {'/'.join(fmts)} weights")


CPU = Hardware(devices=("cpu",))
CPU_DEQUANTIZED = ExpertsBackendSpec(
    name="cpu_dequantized",
    factory="moe_runtime.backends.cpu_dequantized:CpuDequantizedExperts",
    supports=(
        Support(
            formats=(F.BF16, F.FP16), activations=(F.SILU, F.GELU),
            layouts=(F.TOKEN_MAJOR, F.MASKED), hardware=CPU,
            prepared_bytes_per_weight=FLOAT32_BYTES, note=_float32_copy(F.BF16, F.FP16),
        ),
        Support(
            formats=(F.NVFP4_W4A16,), activations=(F.SILU, F.GELU),
            layouts=(F.TOKEN_MAJOR, F.MASKED), hardware=CPU,
            prepared_bytes_per_weight=FLOAT32_BYTES, note=_float32_copy(F.NVFP4_W4A16),
        ),
        Support(
            formats=(F.FP8_W8A8,), activations=(F.SILU, F.GELU),
            layouts=(F.TOKEN_MAJOR, F.MASKED), payloads=(F.UNQUANTIZED, F.FP8), hardware=CPU,
            prepared_bytes_per_weight=FLOAT32_BYTES,
            note="activations quantized to fp8 per tensor with the checkpoint's input scales "
                 "(quantize-dequantize); " + _float32_copy(F.FP8_W8A8),
        ),
        Support(
            formats=(F.NVFP4_W4A4,), activations=(F.SILU, F.GELU),
            layouts=(F.TOKEN_MAJOR, F.MASKED), hardware=CPU, runs_as=F.NVFP4_W4A16,
            prepared_bytes_per_weight=FLOAT32_BYTES, note=_float32_copy(F.NVFP4_W4A4),
        ),
    ),
    priority=3,
    description="CPU experts on weights dequantized once at load to float32: a dense path for "
                "small batches, torch._grouped_mm else.",
)

LOCAL = CommBackendSpec(
    name="local",
    factory="moe_runtime.backends.local:LocalComm",
    supports=(
        CommSupport(layout=F.TOKEN_MAJOR, min_world_size=1, max_world_size=1, mode="token_major"),
        CommSupport(layout=F.MASKED, min_world_size=1, max_world_size=1, mode="masked"),
    ),
    priority=10,
    description="No expert parallelism: every expert is local.",
)

TORCH_ALL_TO_ALL = CommBackendSpec(
    name="torch_all_to_all",
    factory="moe_runtime.backends.all_to_all:TorchAllToAll",
    supports=(
        CommSupport(
            layout=F.TOKEN_MAJOR,
            payloads=(F.UNQUANTIZED, F.FP8),
            min_world_size=1,
            hardware=Hardware(devices=("cpu", "cuda"), requires=("torch",)),
            mode="all_to_all",
        ),
    ),
    priority=0,
    description="Expert parallelism over torch.distributed all-to-all (NCCL on GPU, gloo on CPU).",
)


@hookimpl
def moe_runtime_register_formats(register):
    for fmt in F.BUILTIN_FORMATS:
        register(fmt)
    for payload in F.BUILTIN_PAYLOADS:
        register(payload)


@hookimpl
def moe_runtime_register_backends(register):
    register(REFERENCE)
    register(CPU_DEQUANTIZED)
    register(LOCAL)
    register(TORCH_ALL_TO_ALL)
