"""The plugin module the entry point names: declarations only, no torch, no kernels.

moe-runtime imports this module when it discovers plugins, so it must stay light. The backend
class is named by the lazy ``factory`` string and imported only if the planner selects it.
"""

from moe_runtime import CapabilityRange, ExpertsBackendSpec, Hardware, Support, hookimpl
from moe_runtime import formats as F

ACTIVATIONS = (F.SILU, F.GELU)
LAYOUTS = (F.TOKEN_MAJOR, F.MASKED)

EXAMPLE_BMM = ExpertsBackendSpec(
    name="example_bmm",
    factory="moe_runtime_example.experts:BmmExperts",
    supports=(
        Support(
            formats=(F.FP16,),
            activations=ACTIVATIONS,
            layouts=LAYOUTS,
            payloads=(F.UNQUANTIZED,),
            hardware=Hardware(devices=("cpu", "cuda")),
            note="pure torch: every expert in one torch.bmm per GEMM",
        ),
        Support(
            formats=(F.BF16,),
            activations=ACTIVATIONS,
            layouts=LAYOUTS,
            payloads=(F.UNQUANTIZED,),
            # bfloat16 matrix multiplies need compute capability 8.0 (Ampere) or newer on CUDA.
            hardware=Hardware(devices=("cpu", "cuda"),
                              cuda_capabilities=(CapabilityRange("8.0"),)),
            note="pure torch: every expert in one torch.bmm per GEMM",
        ),
    ),
    priority=5,
    description="Pure-torch BF16/FP16 experts with batched matmuls (CPU and CUDA).",
)


@hookimpl
def moe_runtime_register_backends(register):
    register(EXAMPLE_BMM)
