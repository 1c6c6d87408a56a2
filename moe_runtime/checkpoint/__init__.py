"""Reading a local Hugging Face checkpoint folder and resolving every MoE layer to a weight format.

``read_checkpoint(path)`` reads ``config.json`` (the model's structure, per architecture) and the
ModelOpt quantization config (``hf_quant_config.json`` and/or config.json's
``quantization_config``), and resolves each MoE layer, and every other linear for reporting, to a
format of :mod:`moe_runtime.formats`. The checkpoint's method name (``modelopt_fp4``...) is
reported, never decided on. :mod:`moe_runtime.checkpoint.tiny` makes tiny ModelOpt checkpoints
(it imports torch, transformers and modelopt; this package does not).
"""

from moe_runtime.checkpoint.architectures import ARCHITECTURES
from moe_runtime.checkpoint.quant_config import QuantizationSpec, read_quantization
from moe_runtime.checkpoint.reader import read_checkpoint
from moe_runtime.checkpoint.records import (
    CheckpointError,
    CheckpointInfo,
    ModuleQuant,
    MoELayerInfo,
    RouterSpec,
)
from moe_runtime.checkpoint.resolution import canonical_name, resolve_module

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(ARCHITECTURES))

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CheckpointError",
    "CheckpointInfo",
    "MoELayerInfo",
    "ModuleQuant",
    "QuantizationSpec",
    "RouterSpec",
    "canonical_name",
    "read_checkpoint",
    "read_quantization",
    "resolve_module",
]
