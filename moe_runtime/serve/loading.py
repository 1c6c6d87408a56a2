"""The boundary between the server and model loading: a folder in, a ready model out.

:func:`load_for_serving` is the one function the server calls: moe-runtime's loader builds the
transformers model, plans every MoE layer and runs it through the plan's backends (registered as
transformers' ``"moe_runtime"`` experts implementation). The server only reads :class:`LoadedModel`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

_DTYPES = {"auto": None, "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
           "fp16": "float16", "half": "float16", "float32": "float32", "fp32": "float32",
           "float": "float32"}
# generation_config.json fields used as sampling defaults (as vLLM reads them), and their names
# in a request
SAMPLING_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                     "max_new_tokens": "max_tokens"}
# generation_config.json fields vLLM also reads that this server does not apply (logged at start)
UNAPPLIED_DEFAULTS = ("repetition_penalty", "min_p")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "tokenizer_config.json")


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
    :param generation_defaults: sampling defaults from the model's ``generation_config.json``,
        by request field name (``temperature``, ``top_p``, ``top_k``, ``max_tokens``): only
        those the file sets.
    """

    model: Any
    tokenizer: Any
    plan: dict
    name: str
    generation_defaults: dict = attrs.field(factory=dict)


def load_for_serving(
    model_dir: str | Path,
    *,
    device: str = "cpu",
    moe_runner_backend: str | None = None,
    moe_a2a_backend: str | None = None,
    progress: bool = True,
    dtype: str | None = None,
    transformers_experts: bool = False,
    tokenizer: str | Path | None = None,
    chat_template: str | None = None,
    generation_config: str | Path | None = "auto",
    plugin_options=None,
) -> LoadedModel:
    """Load ``model_dir`` (a local Hugging Face-format folder) for serving on ``device``.

    Every MoE layer runs through moe-runtime's plan: ``moe_runner_backend`` / ``moe_a2a_backend``
    pin its backends, and a pin that cannot run a layer is refused (``LoadError`` with the
    planner's reasons) before any weight is read. Quantized non-MoE linears are dequantized to the
    model dtype at load. ``transformers_experts=True`` instead runs transformers' own experts on
    dequantized weights (the baseline of benchmarks; no plan). ``dtype`` overrides the
    checkpoint's dtype (``None`` or ``"auto"``: the one in config.json). ``tokenizer`` is a folder
    to take the tokenizer from (default: ``model_dir``), ``chat_template`` a Jinja template that
    replaces the tokenizer's; a tokenizer that turns text into no tokens is refused before any
    weight is read. ``generation_config``: ``"auto"`` (the model folder's
    generation_config.json), a folder holding one, or ``None`` (no sampling defaults).
    ``plugin_options`` (a :class:`~moe_runtime.plugin.manager.PluginOptions`, the command line's):
    how plugins load, for the plan and the model alike (default: the environment variables).
    """
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise LoadError(f"{path} is not a model folder: it has no config.json")
    if dtype not in (None, *_DTYPES):
        raise LoadError(f"unknown dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")
    if transformers_experts and (moe_runner_backend or moe_a2a_backend):
        raise LoadError("transformers' own experts take no moe-runtime backend pins")

    from moe_runtime.checkpoint import CheckpointError
    from moe_runtime.checkpoint.check import require_sound_checkpoint
    from moe_runtime.checkpoint.tensors import WeightError
    from moe_runtime.planner import Deployment, PlanError

    deployment = Deployment(experts_backend=moe_runner_backend, comm_backend=moe_a2a_backend)
    from moe_runtime.plugin.registry import Registry

    registry = Registry.load(options=plugin_options)
    try:
        _require_served_architecture(path)
        # Check the folder, then plan (no transformers import, no weights): in seconds.
        require_sound_checkpoint(path, device=device)
        # Plan first (no transformers import, no weights): a refused pin fails in a second.
        if not transformers_experts:
            _plan_only(path, device, deployment, registry)
        from tqdm.auto import tqdm
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        from moe_runtime.integration.transformers import load_model

        config = AutoConfig.from_pretrained(path, local_files_only=True)
        tok_dir = Path(tokenizer) if tokenizer is not None else path
        tokenizer = _load_tokenizer(AutoTokenizer, tok_dir, given=tokenizer is not None)
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        torch_dtype = _resolve_dtype(dtype, config)
        bar = (lambda total, desc: tqdm(total=total, desc=f"Loading {path.name}", unit="tensor",
                                        disable=not progress))
        loaded = load_model(path, deployment=deployment, device=device, dtype=torch_dtype,
                            dequantize_experts=transformers_experts, progress=bar,
                            registry=registry)
    except (CheckpointError, WeightError, PlanError) as exc:
        raise LoadError(str(exc)) from exc
    model = loaded.model
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    defaults = {}
    if generation_config is not None:
        defaults = generation_defaults(path if generation_config == "auto"
                                       else Path(generation_config))
    if transformers_experts:
        data = loaded.plan_json()
        plan = _transformers_plan(path, model, data["checkpoint"].get("quant_algo"),
                                  _config_dtype(config),
                                  {"checkpoint": data["checkpoint"], "served": data["linears"]})
    else:
        plan = {"loader": "moe-runtime", "dtype": str(model.dtype).replace("torch.", ""),
                "device": device, **loaded.plan_json()}
    return LoadedModel(model=model, tokenizer=tokenizer, plan=plan, name=path.name,
                       generation_defaults=defaults)


def _load_tokenizer(auto, folder: Path, *, given: bool):
    """The tokenizer of ``folder``; one that is missing, or encodes text to nothing, is refused."""
    how = ("pass --tokenizer with a folder (or cached hub id) that has them" if not given else
           "give --tokenizer a folder that holds tokenizer files")
    present = [f for f in TOKENIZER_FILES if (folder / f).is_file()]
    if not present:
        raise LoadError(f"{folder} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}), "
                        f"so no prompt could be encoded: {how}")
    try:
        tokenizer = auto.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # transformers raises several types for a missing tokenizer
        raise LoadError(f"{folder} has no loadable tokenizer: {exc}") from exc
    if not tokenizer("Hello, world", add_special_tokens=False)["input_ids"]:
        raise LoadError(f"the tokenizer of {folder} ({type(tokenizer).__name__}, from "
                        f"{', '.join(present)}) encodes text to no tokens, so every prompt would "
                        f"be empty: {how}")
    return tokenizer


def generation_defaults(folder: Path) -> dict:
    """Sampling defaults set by ``folder/generation_config.json`` (request field names)."""
    import json

    file = folder / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise LoadError(f"{file}: cannot be read as JSON: {exc}") from exc
    out = {}
    if isinstance(data, dict):
        ignored = {k: data[k] for k in UNAPPLIED_DEFAULTS if k in data and data[k] not in (1.0, 0.0)}
        if ignored:
            import logging

            logging.getLogger("moe_runtime.serve").warning(
                "%s sets %s, which this server does not apply", file,
                ", ".join(f"{k}={v}" for k, v in ignored.items()))
    for key, field in SAMPLING_DEFAULTS.items():
        value = data.get(key) if isinstance(data, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[field] = int(value) if key in ("top_k", "max_new_tokens") else float(value)
    return out


def _require_served_architecture(path: Path) -> None:
    """Refuse an architecture that the table marks as not served, naming those that are."""
    import json

    from moe_runtime.checkpoint.architectures import architecture_of, served_families

    file = path / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise LoadError(f"{file}: cannot be read as JSON: {exc}") from exc
    arch = architecture_of(config, str(file))
    if not arch.served:
        served = "; ".join(f"{family} ({', '.join(names)})"
                           for family, names in served_families().items())
        raise LoadError(f"{file}: architecture {arch.name} ({arch.family}) plans, but moe-runtime "
                        f"serve cannot serve it: {arch.serve_refusal}. Served families: {served}")


def _plan_only(path: Path, device: str, deployment, registry) -> None:
    """Resolve the checkpoint and plan it for ``device``; raises the planner's refusal."""
    from moe_runtime.checkpoint import read_checkpoint
    from moe_runtime.checkpoint.problems import problems_from_checkpoint
    from moe_runtime.environment import Environment
    from moe_runtime.planner import plan_model

    env = Environment.probe(device=device, modules=registry.required_modules())
    plan_model(problems_from_checkpoint(read_checkpoint(path)), registry=registry,
               environment=env, deployment=deployment)


def _config_dtype(config) -> str:
    return str(getattr(config, "dtype", None) or "bfloat16").replace("torch.", "")


def _resolve_dtype(dtype: str | None, config):
    import torch

    return getattr(torch, _DTYPES.get(dtype or "auto") or _config_dtype(config))


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
