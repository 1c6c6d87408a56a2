"""The boundary between the server and model loading: a folder in, a ready model out.

:func:`load_for_serving` is the one function the server calls. This version loads with plain
transformers and runs every MoE layer through transformers' own experts implementation; ModelOpt
checkpoints (FP8, NVFP4, MIXED_PRECISION), which transformers cannot read, go through
moe-runtime's checkpoint loader with every quantized weight dequantized to the model's dtype.
Serving MoE layers through moe-runtime's plan replaces the body of this function, not its
signature: the server only reads :class:`LoadedModel`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

_DTYPES = {"auto": None, "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
           "fp16": "float16", "half": "float16", "float32": "float32", "fp32": "float32"}


class LoadError(RuntimeError):
    """The checkpoint folder cannot be served; the message says why and names the file."""


@attrs.frozen
class LoadedModel:
    """What the server needs of a model.

    :param model: a transformers causal LM in eval mode (``generate`` and continuous batching work).
    :param tokenizer: its tokenizer (a chat template is needed for ``/v1/chat/completions``).
    :param plan: JSON-ready dict: ``layers`` (one entry per MoE layer with ``layer``, ``format``,
        ``communication`` and ``experts``), ``rejections``, and what else the loader reports.
    :param name: the model id served on ``/v1/models`` (``--served-model-name`` overrides it).
    """

    model: Any
    tokenizer: Any
    plan: dict
    name: str


def load_for_serving(
    model_dir: str | Path,
    *,
    device: str = "cpu",
    moe_runner_backend: str | None = None,
    moe_a2a_backend: str | None = None,
    progress: bool = True,
    dtype: str | None = None,
) -> LoadedModel:
    """Load ``model_dir`` (a local Hugging Face-format folder) for serving on ``device``.

    ``moe_runner_backend`` / ``moe_a2a_backend`` pin moe-runtime's backends; this transformers-only
    loader runs transformers' experts and refuses a pin it cannot honour. ``dtype`` overrides the
    checkpoint's dtype (``None`` or ``"auto"``: the one in config.json).
    """
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise LoadError(f"{path} is not a model folder: it has no config.json")
    if moe_runner_backend or moe_a2a_backend:
        pinned = ", ".join(f"{k} {v!r}" for k, v in (("--moe-runner-backend", moe_runner_backend),
                                                     ("--moe-a2a-backend", moe_a2a_backend)) if v)
        raise LoadError(f"this build loads MoE layers with transformers' own experts; {pinned} "
                        "needs moe-runtime's model integration")
    if dtype not in (None, *_DTYPES):
        raise LoadError(f"unknown dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")

    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=3, desc=f"Loading {path.name}", unit="step", disable=not progress)
    with steps:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        quant = _modelopt_quant_algo(path, config)
        stored_dtype = _config_dtype(config)
        steps.set_postfix_str("tokenizer")
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # transformers raises several types for a missing tokenizer
            raise LoadError(f"{path} has no loadable tokenizer: {exc}") from exc
        steps.update()

        steps.set_postfix_str("weights")
        torch_dtype = _resolve_dtype(dtype, config)
        if quant is None:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch_dtype, local_files_only=True)
            summary = None
        else:
            model, summary = _load_dequantized(path, torch_dtype, device, progress)
        model = model.to(device).eval()
        steps.update()

        steps.set_postfix_str("plan")
        plan = _transformers_plan(path, model, quant, stored_dtype, summary)
        steps.update()
    return LoadedModel(model=model, tokenizer=tokenizer, plan=plan, name=path.name)


def _config_dtype(config) -> str:
    return str(getattr(config, "dtype", None) or "bfloat16").replace("torch.", "")


def _resolve_dtype(dtype: str | None, config):
    import torch

    return getattr(torch, _DTYPES.get(dtype or "auto") or _config_dtype(config))


# ---------------------------------------------------------------------- ModelOpt checkpoints


def _modelopt_quant_algo(path: Path, config) -> str | None:
    """The checkpoint's ModelOpt ``quant_algo`` (reported only), or None for an unquantized one."""
    hf_quant = path / "hf_quant_config.json"
    if hf_quant.is_file():
        try:
            data = json.loads(hf_quant.read_text())
        except json.JSONDecodeError as exc:
            raise LoadError(f"{hf_quant} is not valid JSON: {exc}") from exc
        return str(data.get("quantization", {}).get("quant_algo") or "unknown")
    qc = getattr(config, "quantization_config", None)
    if isinstance(qc, dict):
        if qc.get("quant_method") == "modelopt":
            return str(qc.get("quant_algo") or "unknown")
        raise LoadError(f"{path / 'config.json'}: quantization method {qc.get('quant_method')!r} "
                        "is not one this loader dequantizes (it reads ModelOpt checkpoints)")
    return None


def _load_dequantized(path: Path, dtype, device: str, progress: bool):
    """A ModelOpt checkpoint with every quantized weight dequantized into ``dtype``.

    transformers cannot read ModelOpt checkpoints; moe-runtime's checkpoint loader can, and with
    ``dequantize_experts=True`` it fills transformers' own experts parameters (no plan involved).
    Returns the model and the per-module summary of what the checkpoint stores.
    """
    from transformers import GenerationConfig

    from moe_runtime.checkpoint import CheckpointError
    from moe_runtime.integration.transformers import load_model
    from moe_runtime.tensors import WeightError

    try:
        loaded = load_model(path, dequantize_experts=True, dtype=dtype, device=device,
                            progress=progress)
    except (CheckpointError, WeightError) as exc:
        raise LoadError(str(exc)) from exc
    if (path / "generation_config.json").is_file():
        loaded.model.generation_config = GenerationConfig.from_pretrained(path)
    data = loaded.plan_json()
    return loaded.model, {"checkpoint": data["checkpoint"], "served": data["linears"]}


# ------------------------------------------------------------------------------------ the plan


def _moe_layers(model):
    """(name, experts module) for every MoE experts container of a transformers model."""
    for name, module in model.named_modules():
        if hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and name.endswith(
                "experts"):
            yield name, module


def _transformers_plan(path: Path, model, quant: str | None, stored_dtype: str,
                       summary: dict | None) -> dict:
    """What runs each MoE layer: transformers' experts, in the model's dtype."""
    impl = getattr(model.config, "_experts_implementation", None) or "eager"
    dtype = str(model.dtype).replace("torch.", "")
    short = {"bfloat16": "bf16", "float16": "fp16"}
    stored = {}
    if summary is not None:
        stored = {m["layer"]: m["format"] for m in summary["checkpoint"].get("moe_layers", [])}
    layers = []
    for name, _ in _moe_layers(model):
        fmt = stored.get(name) or stored.get(name.rsplit(".", 1)[0]) or short.get(
            stored_dtype, stored_dtype)
        converted = fmt != short.get(dtype, dtype)
        layers.append({
            "layer": name,
            "format": fmt,
            "communication": "none",
            "experts": f"transformers:{impl}",
            "runs_as": dtype,
            "notes": [f"{fmt} weights converted to {dtype} at load"] if converted else [],
        })
    plan = {
        "loader": "transformers",
        "checkpoint": {
            "path": str(path),
            "architecture": (getattr(model.config, "architectures", None) or [None])[0],
            "quant_algo": quant,
        },
        "dtype": dtype,
        "device": str(model.device),
        "layers": layers,
        "rejections": [],
    }
    if summary is not None:
        plan["checkpoint"] = {**summary["checkpoint"], "quant_algo": quant}
        plan["linears"] = summary["served"]
    return plan
