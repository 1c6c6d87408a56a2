"""moe-runtime plugin: FlashInfer's CuTe-DSL NVFP4 fused MoE as an experts backend.

Importing this package imports nothing heavy: the declaration lives in :mod:`.plugin` (the entry
point), weight preparation in :mod:`.weights` (plain torch) and the kernel calls in :mod:`.backend`,
which imports FlashInfer only inside its methods.
"""

__version__ = "0.1.0"
