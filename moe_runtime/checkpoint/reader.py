"""``read_checkpoint``: a local Hugging Face checkpoint folder -> :class:`CheckpointInfo`."""

from __future__ import annotations

import re
from pathlib import Path

from moe_runtime import formats
from moe_runtime.checkpoint.architectures import Architecture, MoEStructure, architecture_of
from moe_runtime.checkpoint.quant_config import (
    CONFIG,
    MIXED_PRECISION,
    QuantizationSpec,
    load_json,
    read_quantization,
)
from moe_runtime.checkpoint.records import (
    CheckpointError,
    CheckpointInfo,
    ModuleQuant,
    MoELayerInfo,
)
from moe_runtime.checkpoint.resolution import canonical_name, resolve_module
from moe_runtime.checkpoint.tensors import TensorMeta, read_tensor_index

# The name shown to users for a checkpoint's top-level algorithm. Reported only.
_METHODS = {
    "FP8": "modelopt_fp8",
    "NVFP4": "modelopt_fp4",
    "W4A16_NVFP4": "modelopt_w4a16_nvfp4",
    MIXED_PRECISION: "modelopt_mixed",
}

# safetensors dtype code a format's expert weights are stored in.
_WEIGHT_DTYPES = {
    formats.BF16: "BF16",
    formats.FP16: "F16",
    formats.FP8_W8A8: "F8_E4M3",
    formats.NVFP4_W4A4: "U8",
    formats.NVFP4_W4A16: "U8",
}
_NEEDS_INPUT_SCALE = {formats.FP8_W8A8: True, formats.NVFP4_W4A4: True,
                      formats.NVFP4_W4A16: False}
_EXPERT_MODULE = re.compile(r"\.experts\.\d+\.")


def method_name(spec: QuantizationSpec) -> str:
    """``modelopt_fp4``... for people; a checkpoint with only ``moe_quant_algo`` is mixed."""
    if spec.quant_algo is None:
        return "modelopt_mixed" if spec.moe_quant_algo else "unquantized"
    return _METHODS[spec.quant_algo]


def _tensor_prefix(arch: Architecture, layer: MoEStructure, tensors: dict[str, TensorMeta]) -> str:
    """The decoder-layer prefix the tensors use (``model.``, ``model.language_model.``...)."""
    marker = re.compile(rf"^(.*?)layers\.{layer.index}\.{re.escape(arch.block)}\.experts\.")
    for name in tensors:
        match = marker.match(name)
        if match:
            return match.group(1)
    return arch.prefix


def _check_tensors(layer: MoELayerInfo, tensors: dict[str, TensorMeta], folder: Path) -> None:
    """The first expert's stored dtype must be the resolved format's (when the tensor exists)."""
    module = layer.expert_module(0, layer.expert_names[0])
    meta = tensors.get(f"{module}.weight")
    expected = _WEIGHT_DTYPES.get(layer.quant.format)
    if meta is None or expected is None:
        return
    problem = None
    if meta.dtype != expected:
        problem = f"tensor '{module}.weight' is {meta.dtype}, the format stores {expected}"
    elif layer.quant.format in _NEEDS_INPUT_SCALE:
        has_scale = f"{module}.input_scale" in tensors
        if has_scale != _NEEDS_INPUT_SCALE[layer.quant.format]:
            problem = (f"tensor '{module}.input_scale' is "
                       f"{'present' if has_scale else 'missing'}")
    if problem:
        raise CheckpointError(
            f"{folder / meta.file}: {problem}, but the quantization config resolves MoE layer "
            f"{layer.name!r} to {layer.quant.format} ({layer.quant.source})"
        )


def _natural_key(name: str) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


def _linears(spec: QuantizationSpec, tensors: dict[str, TensorMeta],
             moe_layers: list[MoELayerInfo]) -> list[tuple[str, ModuleQuant]]:
    """Every 2-D ``*.weight`` outside the experts containers and the embeddings."""
    containers = tuple(canonical_name(m.name) + "." for m in moe_layers)
    modules = []
    for name, meta in tensors.items():
        if not name.endswith(".weight") or len(meta.shape) != 2:
            continue
        module = name[: -len(".weight")]
        leaf = module.rsplit(".", 1)[-1]
        if ("embed" in leaf or canonical_name(module).startswith(containers)
                or _EXPERT_MODULE.search(module + ".")):
            continue
        modules.append(module)
    return [(m, resolve_module(spec, m)) for m in sorted(modules, key=_natural_key)]


def read_checkpoint(path: str | Path) -> CheckpointInfo:
    """Read ``path``'s config.json and ModelOpt quantization config; resolve every MoE layer.

    :raises CheckpointError: a missing or invalid file, an unsupported architecture, a
        quantization algorithm that is no runnable format, disagreeing per-expert keys, or tensors
        that contradict the config. The message names the file, the key and what is accepted.
    """
    folder = Path(path)
    if not folder.is_dir():
        what = "a file, not a directory" if folder.exists() else "no such directory"
        raise CheckpointError(f"{folder}: not a checkpoint folder ({what}); accepted: a folder "
                              "holding config.json and the .safetensors files")
    config_file = folder / CONFIG
    config = load_json(config_file)
    arch = architecture_of(config, str(config_file))
    spec = read_quantization(folder, config)
    structures = arch.structure(config, str(config_file))
    tensors = read_tensor_index(folder)
    prefix = _tensor_prefix(arch, structures[0], tensors) if structures else arch.prefix

    moe_layers = []
    for s in structures:
        name = arch.experts_name(prefix, s.index)
        members = [f"{e}.{p}" for e in range(s.num_experts) for p in arch.expert_names]
        layer = MoELayerInfo(
            name=name,
            index=s.index,
            num_experts=s.num_experts,
            top_k=s.top_k,
            hidden_size=s.hidden_size,
            intermediate_size=s.intermediate_size,
            activation=s.activation,
            router=s.router,
            shared_expert_intermediate_size=s.shared_expert_intermediate_size,
            expert_names=arch.expert_names,
            quant=resolve_module(spec, name, members=members, moe=True),
        )
        _check_tensors(layer, tensors, folder)
        moe_layers.append(layer)

    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return CheckpointInfo(
        path=folder,
        architecture=arch.name,
        model_type=config.get("model_type") or text_config.get("model_type"),
        method=method_name(spec),
        quant_algo=spec.quant_algo,
        kv_cache_quant_algo=spec.kv_cache_quant_algo,
        producer=spec.producer,
        dtype=spec.dtype,
        moe_layers=tuple(moe_layers),
        linears=tuple(_linears(spec, tensors, moe_layers)),
        config=config,
    )
