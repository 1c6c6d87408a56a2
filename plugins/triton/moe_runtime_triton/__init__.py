"""moe-runtime-triton: Triton fused-MoE experts backend for moe-runtime (Hopper and Ampere).

Importing this package imports no kernel code; the backend class lives in
``moe_runtime_triton.backend`` and is loaded only when the planner selects it.
"""

__version__ = "0.1.0"
