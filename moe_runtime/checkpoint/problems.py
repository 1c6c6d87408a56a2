"""From a checkpoint's resolved quantization to the planner's per-layer problems."""

from __future__ import annotations

from moe_runtime.backend_api import LayerProblem
from moe_runtime.dtypes import model_dtype_name


def problems_from_checkpoint(ckpt) -> list[LayerProblem]:
    """One :class:`LayerProblem` per MoE layer of a ``CheckpointInfo``."""
    dtype = model_dtype_name(ckpt.dtype)
    return [
        LayerProblem(
            name=layer.name,
            format=layer.quant.format,
            activation=layer.activation,
            num_experts=layer.num_experts,
            top_k=layer.top_k,
            hidden_size=layer.hidden_size,
            intermediate_size=layer.intermediate_size,
            dtype=dtype,
        )
        for layer in ckpt.moe_layers
    ]


def checkpoint_summary(ckpt) -> dict:
    """What the plan output says about the checkpoint itself (method name: reported only)."""
    return {
        "path": str(ckpt.path),
        "architecture": ckpt.architecture,
        "method": ckpt.method,
        "quant_algo": ckpt.quant_algo,
        "kv_cache_quant_algo": ckpt.kv_cache_quant_algo,
        "moe_layers": [
            {"layer": m.name, "format": m.quant.format, "resolved_by": m.quant.source}
            for m in ckpt.moe_layers
        ],
        "linears": [
            {"module": name, "format": q.format, "resolved_by": q.source}
            for name, q in ckpt.linears
        ],
    }
