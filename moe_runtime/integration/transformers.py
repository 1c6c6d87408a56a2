"""Run a transformers MoE model with every MoE layer going through moe-runtime's plan.

moe-runtime registers itself in transformers' ``ExpertsInterface`` under ``"moe_runtime"``: the
model's own router computes top-k ids and weights, and each experts module hands them to the
layer's :class:`~moe_runtime.executor.MoEExecutor`. The model code stays untouched; the hot path is one
attribute lookup and the plan's two backends.

Weights are read from the checkpoint folder directly: MoE experts through their quantization
method (local experts only, one layer at a time), every other tensor as stored, with quantized
non-MoE linears (FP8, NVFP4) dequantized to the model dtype at load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import attrs
import torch

from moe_runtime.checkpoint.tensors import CheckpointTensors, WeightError, nonfinite, require_finite
from moe_runtime.dtypes import MODEL_DTYPES, model_dtype_name, torch_dtype

EXPERTS_IMPLEMENTATION = "moe_runtime"


def _experts_forward(self, hidden_states, top_k_index, top_k_weights):
    bound = self._moe_runtime_max_tokens
    if bound is not None and hidden_states.shape[0] > bound:  # a shape: host metadata, no sync
        raise ValueError(
            f"a forward of {hidden_states.shape[0]} tokens reached an MoE layer, but the model was "
            f"loaded with max_tokens_per_forward={bound}: the engine must keep every forward "
            "within the bound it gave to load_model")
    return self._moe_runtime_executor(hidden_states, top_k_index, top_k_weights,
                                      max_tokens_per_rank=self._moe_runtime_mode_tokens)


def register_experts_implementation() -> None:
    """Make ``experts_implementation="moe_runtime"`` known to transformers (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, _experts_forward)


@attrs.frozen
class LoadedModel:
    """A loaded model and what runs it; what ``load_model`` returns and the server serves.

    :param model: a transformers causal LM in eval mode (``generate`` and continuous batching work).
    :param checkpoint: the :class:`~moe_runtime.checkpoint.CheckpointInfo` it was read from.
    :param plan: the :class:`~moe_runtime.planner.Plan` its MoE layers run (``None``: transformers'
        own experts on dequantized weights).
    :param linears: how every other module is served (``"bfloat16"``, ``"fp8 dequantized at
        load"``...), by checkpoint module name.
    :param dtype: the model's torch dtype.
    :param device: where it runs.
    :param tokenizer: its tokenizer (set by the server's loader; ``None`` from ``load_model``).
    :param name: the model id (the checkpoint folder's name unless the server names it).
    :param generation_defaults: sampling defaults from ``generation_config.json`` by request
        field name (``temperature``, ``top_p``, ``top_k``, ``max_tokens``): those the file sets.
    """

    model: torch.nn.Module
    checkpoint: object
    plan: object | None
    linears: dict[str, str]
    dtype: torch.dtype
    device: str
    tokenizer: object = None
    name: str = ""
    generation_defaults: dict = attrs.field(factory=dict)
    #: experts backends of the plan that do not declare ``cuda_graphs=True`` (decode then runs
    #: eagerly in ``moe-runtime serve``)
    graph_blockers: tuple[str, ...] = ()

    def plan_json(self) -> dict:
        """What runs each MoE layer, as JSON (``GET /v1/moe/plan``): ``loader``, ``dtype``,
        ``device``, ``checkpoint``, ``linears``, then the plan's own fields (``layers`` with
        ``layer``, ``format``, ``communication`` and ``experts`` each, ``rejections``...)."""
        from moe_runtime.checkpoint.problems import checkpoint_summary

        dtype = str(self.dtype).replace("torch.", "")
        data = {"loader": "moe-runtime" if self.plan is not None else "transformers",
                "dtype": dtype, "device": self.device,
                "checkpoint": checkpoint_summary(self.checkpoint), "linears": self.linears}
        if self.plan is not None:
            data.update(self.plan.to_json())
        else:
            data.update(layers=self._transformers_layers(data["checkpoint"], dtype),
                        rejections=[])
        return data

    def _transformers_layers(self, summary: dict, dtype: str) -> list[dict]:
        """Each MoE layer as transformers' experts run it, in the model's dtype."""
        from moe_runtime.formats import ENCODINGS

        impl = getattr(self.model.config, "_experts_implementation", None) or "eager"
        short = {e.element: e.name for e in ENCODINGS.values()}  # bfloat16 -> bf16 ...
        stored_dtype = model_dtype_name(self.checkpoint.dtype)
        stored = {m["layer"]: m["format"] for m in summary.get("moe_layers", [])}
        layers = []
        for name, module in self.model.named_modules():
            if not (name.endswith("experts") and hasattr(module, "gate_up_proj")
                    and hasattr(module, "down_proj")):
                continue
            fmt = stored.get(name) or stored.get(name.rsplit(".", 1)[0]) or short.get(
                stored_dtype, stored_dtype)
            converted = fmt != short.get(dtype, dtype)
            layers.append({
                "layer": name, "format": fmt, "communication": "none",
                "experts": f"transformers:{impl}", "runs_as": dtype,
                "notes": [f"{fmt} weights converted to {dtype} at load"] if converted else [],
            })
        return layers


def _hf_config(model_dir: Path, dtype: torch.dtype):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    for attr in ("quantization_config",):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = dtype
    return config


def _find_module(model, ckpt_name: str):
    """The model's module for a checkpoint module name (``block_sparse_moe`` is ``mlp`` in 5.x)."""
    modules = dict(model.named_modules())
    for cand in _name_candidates(ckpt_name):
        if cand in modules:
            return cand, modules[cand]
    raise WeightError(f"the model has no module for checkpoint module {ckpt_name!r}")


def _name_candidates(name: str):
    yield name
    yield name.replace(".block_sparse_moe.", ".mlp.")


def _ckpt_name_for(param_name: str, tensors: CheckpointTensors) -> str | None:
    for cand in (param_name, param_name.replace(".mlp.gate.", ".block_sparse_moe.gate."),
                 param_name.replace(".mlp.", ".block_sparse_moe.")):
        if cand in tensors:
            return cand
    return None


def _dequantize_linear(tensors: CheckpointTensors, name: str, dtype) -> tuple[torch.Tensor, str]:
    """A linear weight as the model dtype, dequantizing FP8 / NVFP4 storage."""
    base = name[: -len(".weight")]
    w = tensors.get(name)
    if f"{base}.weight_scale" not in tensors:
        return w.to(dtype), str(w.dtype).replace("torch.", "")
    scale = tensors.get(f"{base}.weight_scale")
    if w.dtype == torch.float8_e4m3fn:
        return (w.float() * scale.float()).to(dtype), "fp8 dequantized at load"
    if w.dtype == torch.uint8:
        from moe_runtime.quant.nvfp4 import dequantize_nvfp4

        s2 = tensors.get(f"{base}.weight_scale_2").float()
        return dequantize_nvfp4(w, scale, s2).to(dtype), "nvfp4 dequantized at load"
    raise WeightError(f"tensor {name!r} has dtype {w.dtype} with a weight_scale; expected "
                      "float8_e4m3fn or uint8 (NVFP4)")


def _recreate_nonpersistent_buffers(model, device) -> None:
    """Modules built on the meta device lose computed buffers (rotary inv_freq): rebuild them."""
    for name, module in list(model.named_modules()):
        if not getattr(module, "_non_persistent_buffers_set", None):
            continue
        cfg = getattr(module, "config", None)
        if cfg is None:
            raise WeightError(f"cannot rebuild the computed buffers of module {name!r}")
        fresh = type(module)(config=cfg).to(device)  # built on CPU: `device=` is deprecated
        for b in module._non_persistent_buffers_set:
            setattr(module, b, getattr(fresh, b))
        for attr, value in vars(fresh).items():
            if isinstance(value, torch.Tensor) and not attr.startswith("_"):
                setattr(module, attr, value.to(device))


def load_model(
    model_dir: str | Path,
    *,
    registry=None,
    deployment=None,
    environment=None,
    device: str = "cpu",
    dtype: torch.dtype | str | None = None,
    dequantize_experts: bool = False,
    ep_rank: int = 0,
    ep_size: int | None = None,
    group=None,
    progress: Callable | bool = False,
    agreement_timeout: float = 120.0,
    plan=None,
    max_tokens_per_forward: int | None = None,
) -> LoadedModel:
    """Load a local checkpoint as a transformers model whose MoE layers run through moe-runtime.

    The plan is made (and a refusal raised) before any weight is read. With
    ``dequantize_experts=True`` no plan is made: the experts are dequantized into transformers' own
    parameters (the "transformers with ModelOpt-dequantized weights" reference). With ``plan`` (a
    :class:`~moe_runtime.planner.Plan`, or its JSON, e.g. the output of ``moe-runtime plan
    --json``) nothing is planned here: the plan must be of this checkpoint's MoE layers, its
    backends registered, and its deployment is the default one.

    Under expert parallelism (``ep_size > 1`` and ``torch.distributed`` initialised) the ranks of
    ``group`` compare their plans before any weight is read (:func:`moe_runtime.agreement.
    agree_on_plan`): a difference (a refusal on one rank included) stops every rank with one
    message, a rank that does not report within ``agreement_timeout`` seconds stops the others.

    ``max_tokens_per_forward`` is the engine's promise: no forward of the model passes more tokens
    than this through an MoE layer on this rank (as a CUDA-graph capture size or a scheduler's
    batch budget bounds it). Under expert parallelism every layer then picks its communication
    mode from that bound, the same on every rank and with no host synchronisation in the forward
    (without it every forward uses the plan's last mode, which admits every batch); it may not
    exceed the plan's ``max_tokens_per_rank``. A forward over the bound is refused. On one rank a
    layer reads each batch's own size instead (a shape, no synchronisation either).
    """
    from moe_runtime.checkpoint import read_checkpoint
    from moe_runtime.checkpoint.check import require_memory_for_plan, require_sound_checkpoint
    from moe_runtime.planner import Deployment, Plan

    model_dir = Path(model_dir)
    if plan is not None and not isinstance(plan, Plan):
        plan = Plan.from_json(plan)
    if plan is not None and deployment is None:
        deployment = plan.deployment
    report = require_sound_checkpoint(  # every finding, before any allocation
        model_dir, device=device, ep_size=ep_size or getattr(deployment, "ep_size", 1))
    ckpt = read_checkpoint(model_dir)
    dtype = _load_dtype(dtype, ckpt)
    deployment = deployment or Deployment()
    if ep_size is None:
        ep_size = deployment.ep_size
    place = None
    if dequantize_experts:
        plan = None  # transformers runs the experts: nothing of a plan applies
    else:
        _check_token_bound(max_tokens_per_forward, deployment, ep_size)
        registry, plan = _plan_for_load(ckpt, plan, registry=registry, environment=environment,
                                        deployment=deployment, device=device, ep_size=ep_size,
                                        group=group, timeout=agreement_timeout)
        require_memory_for_plan(report, plan)  # the experts as the planned backends hold them
        place = _ExpertsPlacement(plan, registry, deployment, ep_rank, ep_size, group,
                                  max_tokens_per_forward)

    tensors = CheckpointTensors(model_dir)
    config = _hf_config(model_dir, dtype)
    model, experts_modules = _empty_model(config, ckpt, dtype, device, own_experts=place is not None)
    steps = _dense_keys(model, experts_modules)
    _require_dense_tensors(steps, tensors, config, model_dir)  # all at once, before any is read
    layers = list(ckpt.moe_layers)
    bar = _progress(progress, total=len(steps) + len(layers), desc="loading weights")
    with torch.no_grad():
        linears = _load_dense(model, steps, tensors, config, dtype, model_dir, bar)
        for layer in layers:
            _load_experts(experts_modules[layer.name][1], layer, tensors, dtype, device, place)
            linears.setdefault(layer.name, f"MoE experts: {layer.quant.format}")
            bar.update(1)
    bar.close()
    tensors.close()
    model.eval()
    blockers = () if plan is None else tuple(sorted(
        {name for lp in plan.layers for name in lp.experts_backends
         if not registry.experts_spec(name).cuda_graphs}))
    return LoadedModel(model, ckpt, plan, linears, dtype, device, name=model_dir.name,
                       graph_blockers=blockers)


def _load_dtype(dtype, ckpt) -> torch.dtype:
    """The model's dtype: the checkpoint's when ``dtype`` is None, else the one named."""
    if dtype is None:
        return torch_dtype(model_dtype_name(ckpt.dtype))
    if isinstance(dtype, str):
        if dtype not in MODEL_DTYPES:
            raise ValueError(
                f"dtype {dtype!r} is not supported; use one of {sorted(MODEL_DTYPES)}")
        return torch_dtype(dtype)
    return dtype


def _plan_for_load(ckpt, given, *, registry, environment, deployment, device, ep_size, group,
                   timeout):
    """``(registry, plan)``: ``given`` checked against the checkpoint, or a plan made here; under
    expert parallelism agreed across the ranks of ``group`` before any weight is read."""
    from moe_runtime.checkpoint.problems import problems_from_checkpoint
    from moe_runtime.environment import Environment
    from moe_runtime.planner import plan_model
    from moe_runtime.plugin.registry import Registry

    registry = registry or Registry.load()
    if environment is None and given is None:
        environment = Environment.probe(device=device, modules=registry.required_modules())

    def make_plan():
        if given is not None:
            return check_given_plan(given, problems_from_checkpoint(ckpt), registry)
        return plan_model(problems_from_checkpoint(ckpt), registry=registry,
                          environment=environment, deployment=deployment)

    if ep_size > 1:
        from moe_runtime.agreement import plan_and_agree

        return registry, plan_and_agree(make_plan, registry, group=group, timeout=timeout)
    return registry, make_plan()


@attrs.frozen
class _ExpertsPlacement:
    """What each MoE layer's executor is built from: the plan, this rank and the engine's bound."""

    plan: object
    registry: object
    deployment: object
    ep_rank: int
    ep_size: int
    group: object
    max_tokens_per_forward: int | None


def _empty_model(config, ckpt, dtype, device, *, own_experts: bool):
    """The transformers model allocated on ``device`` (uninitialised) and its experts modules by
    checkpoint layer name; with ``own_experts`` transformers' expert parameters are dropped
    (moe-runtime holds those weights; transformers' copies would only cost memory)."""
    from transformers import AutoModelForCausalLM

    register_experts_implementation()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, experts_implementation=EXPERTS_IMPLEMENTATION if own_experts
            else None)
    experts_modules = {}
    for layer in ckpt.moe_layers:
        hf_name, mod = _find_module(model, layer.name)
        experts_modules[layer.name] = (hf_name, mod)
        if own_experts:
            for pname in ("gate_up_proj", "down_proj"):
                if isinstance(getattr(mod, pname, None), torch.nn.Parameter):
                    setattr(mod, pname, torch.nn.Parameter(torch.empty(0, device="meta"),
                                                           requires_grad=False))
    model.to_empty(device=device)
    _recreate_nonpersistent_buffers(model, device)
    return model, experts_modules


def _dense_keys(model, experts_modules) -> list[str]:
    """The state-dict keys loaded from the checkpoint one tensor each (all but the experts')."""
    skip = tuple(hf + "." for hf, _ in experts_modules.values())
    return [k for k in model.state_dict(keep_vars=True) if not k.startswith(skip)]


def _require_dense_tensors(keys, tensors, config, model_dir) -> None:
    """Every state-dict key the model loads from the checkpoint has a tensor there (a tied
    ``lm_head`` excepted): one error listing what is missing, before loading reads anything."""
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [k for k in keys if _ckpt_name_for(k, tensors) is None
               and not (k == "lm_head.weight" and tied)]
    if not missing:
        return
    first = missing[0]
    looked = ", ".join(repr(c) for c in dict.fromkeys(_name_candidates(first)))
    more = ", ".join(repr(k) for k in missing[1:4]) + (
        f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    raise WeightError(
        f"{len(missing)} tensor(s) of the model are missing from {model_dir}: {first!r} (looked "
        f"for {looked})" + (f", {more}" if more else "") + "; the checkpoint must hold every "
        f"weight of the {type(config).__name__.removesuffix('Config')} model it declares")


def _load_dense(model, keys, tensors, config, dtype, model_dir, bar) -> dict[str, str]:
    """Copy every tensor of ``keys`` from the checkpoint (linears dequantized where quantized);
    returns how each linear was loaded, by checkpoint module name."""
    linears: dict[str, str] = {}
    state = model.state_dict(keep_vars=True)
    for key in keys:
        target = state[key]
        src = _ckpt_name_for(key, tensors)
        if src is None:
            if key == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
                bar.update(1)
                continue
            raise WeightError(
                f"tensor {key!r} of the model is missing from {model_dir} (looked for "
                f"{', '.join(repr(c) for c in dict.fromkeys(_name_candidates(key)))})")
        if src.endswith(".weight") and target.dim() == 2:
            value, how = _dequantize_linear(tensors, src, dtype)
            linears[src[: -len(".weight")]] = how
        else:
            value = tensors.get(src)
        if tuple(value.shape) != tuple(target.shape):
            raise WeightError(f"tensor {src!r} has shape {list(value.shape)}; the model "
                              f"expects {list(target.shape)} for {key!r}")
        target.data.copy_(value.to(target.dtype))
        # scanned on the device; the stored tensor, read again, says whose fault a NaN is
        if nonfinite(target.data)[0] and not nonfinite(tensors.get(src))[0]:
            big = torch.finfo(target.dtype).max
            raise WeightError(
                f"tensor {src!r} of {model_dir} holds values beyond "
                f"{str(target.dtype).replace('torch.', '')}'s range (largest {big:g}): they "
                "become infinite when loaded in that dtype; load it in bfloat16 or float32 "
                "(--dtype)")
        require_finite(target.data, f"tensor {src!r}", f" of {model_dir}")
        bar.update(1)
    return linears


def _load_experts(mod, layer, tensors, dtype, device, place: _ExpertsPlacement | None) -> None:
    """One MoE layer's experts: dequantized into transformers' parameters (``place`` None), or
    this rank's experts handed to an executor built from the layer's plan."""
    from moe_runtime.methods import load_expert_weights

    if place is None:
        from moe_runtime.reference_math import dequantize_expert_weights

        w = load_expert_weights(tensors, layer, dtype=dtype)
        w13, w2 = dequantize_expert_weights(w, torch.float32)
        for name, t in (("gate/up", w13), ("down", w2)):
            _require_finite_experts(t, layer, name)
        mod.gate_up_proj.data.copy_(w13.to(dtype))
        mod.down_proj.data.copy_(w2.to(dtype))
        return
    from moe_runtime.executor import build_executor
    from moe_runtime.placement import local_experts

    lp = place.plan.for_layer(layer.name)
    ids = local_experts(lp.problem.num_experts, place.ep_size, place.ep_rank)
    w = load_expert_weights(tensors, layer, experts=ids, dtype=dtype).to(device)
    for name in ("w13", "w2", "w13_scale", "w2_scale", "w13_scale_2", "w2_scale_2", "a13_scale",
                 "a2_scale"):
        if getattr(w, name) is not None:  # scanned on the device the weights went to
            _require_finite_experts(getattr(w, name), layer, name, ids)
    mod._moe_runtime_executor = build_executor(
        lp, place.registry, w, device=device, ep_rank=place.ep_rank, ep_size=place.ep_size,
        group=place.group, max_tokens_per_rank=place.deployment.max_tokens_per_rank)
    mod._moe_runtime_max_tokens = place.max_tokens_per_forward
    # under EP the bound picks the mode, alike on every rank; on one rank the batch
    mod._moe_runtime_mode_tokens = place.max_tokens_per_forward if place.ep_size > 1 else None


def _require_finite_experts(t: torch.Tensor, layer, what: str, ids=None) -> None:
    """The experts' stacked ``what`` (``[E, ...]``) finite, or a :class:`WeightError` naming the
    layer, the expert and its checkpoint tensors' prefix."""
    count, first = nonfinite(t)
    if not count:
        return
    per = max(1, t.numel() // max(1, t.shape[0])) if t.dim() else 1
    e = first // per if t.dim() else 0
    expert = list(ids)[e] if ids is not None and t.dim() else e
    tensor = _checkpoint_tensor(layer, what, t, first % per, expert)
    raise WeightError(
        f"layer {layer.name}: {tensor} holds NaN or infinite values ({count} of the layer's "
        f"{t.numel()} {what} values; the first in expert {expert}); every served weight must "
        "be finite: re-export or repair the checkpoint")


# the loaded experts' stacked fields -> (projections: 0 gate and up, 1 down; checkpoint leaf)
_EXPERT_FIELDS = {"w13": (0, "weight"), "w2": (1, "weight"), "w13_scale": (0, "weight_scale"),
                  "w2_scale": (1, "weight_scale"), "w13_scale_2": (0, "weight_scale_2"),
                  "w2_scale_2": (1, "weight_scale_2"), "a13_scale": (0, "input_scale"),
                  "a2_scale": (1, "input_scale")}


def _checkpoint_tensor(layer, what: str, t: torch.Tensor, offset: int, expert: int) -> str:
    """The checkpoint tensor(s) a value of the stacked field ``what`` comes from, named as the
    checkpoint names them (``...experts.3.down_proj.weight``), not by the loader's field names
    (``w2``); ``offset``: the value's flat index within its expert."""
    names = getattr(layer, "expert_names", None)
    if what not in _EXPERT_FIELDS or not names or len(names) != 3:
        return f"the experts' {what} (tensors {layer.name}.{expert}.*)"
    kind, leaf = _EXPERT_FIELDS[what]
    gate, up, down = names
    if kind == 1:
        projs = [down]
    elif t.dim() >= 2 and t.shape[1] % 2 == 0:  # [E, 2I, ...]: gate rows, then up rows
        row = offset // max(1, t[0].numel() // t.shape[1])
        projs = [gate if row < t.shape[1] // 2 else up]
    else:
        projs = [gate, up]
    module = getattr(layer, "expert_module", None)
    full = [f"{module(expert, p) if callable(module) else f'{layer.name}.{expert}.{p}'}.{leaf}"
            for p in projs]
    return "tensor " + " or ".join(repr(n) for n in full)


def _check_token_bound(bound: int | None, deployment, ep_size: int) -> None:
    if bound is None:
        return
    if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
        raise ValueError(f"max_tokens_per_forward must be a positive int, got {bound!r}")
    if ep_size > 1 and bound > deployment.max_tokens_per_rank:
        raise ValueError(
            f"max_tokens_per_forward={bound} exceeds the plan's max_tokens_per_rank="
            f"{deployment.max_tokens_per_rank}: the backends are set up for at most that many "
            f"tokens per rank; plan with --max-tokens-per-rank {bound} or more")


def check_given_plan(plan, problems, registry):
    """``plan`` if it was made for exactly these layer problems with registered backends, else a
    :class:`~moe_runtime.planner.PlanError` naming the first layer or backend that differs."""
    from moe_runtime.planner import PlanError

    planned = {lp.problem.name: lp for lp in plan.layers}
    names = [p.name for p in problems]
    if sorted(planned) != sorted(names):
        raise PlanError(
            f"the plan is of MoE layers {sorted(planned)[:3]}...; this checkpoint has "
            f"{sorted(names)[:3]}... ({len(planned)} vs {len(names)} layers): re-plan it")
    for p in problems:
        lp = planned[p.name]
        if lp.problem != p:
            raise PlanError(f"layer {p.name}: the plan was made for {lp.problem}, this checkpoint "
                            f"has {p}: re-plan it")
        for name, table, role in ((lp.experts, registry.experts, "experts"),
                                  (lp.comm, registry.comms, "communication")):
            if name not in table:
                raise PlanError(f"layer {p.name}: the plan's {role} backend {name!r} is not "
                                f"registered here; registered: {', '.join(sorted(table))}")
    return plan


class _NoBar:
    def update(self, n=1):
        pass

    def close(self):
        pass


def _progress(progress, total, desc):
    if progress is True:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit="tensor")
    if callable(progress):
        return progress(total=total, desc=desc)
    return _NoBar()


def read_generation_config(model_dir: str | Path) -> dict:
    p = Path(model_dir) / "generation_config.json"
    return json.loads(p.read_text()) if p.exists() else {}
