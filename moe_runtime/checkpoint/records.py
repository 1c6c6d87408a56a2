"""The value types a checkpoint resolves to: per-module quantization, routers, MoE layers.

Everything here is frozen; collections are tuples so that two reads of one folder compare equal.
A checkpoint's method name (``modelopt_fp4``...) is carried for people to read; the per-layer
:class:`ModuleQuant` is what every decision uses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs


class CheckpointError(ValueError):
    """A checkpoint cannot be read; the message names the file, the key and what is accepted."""


def _tuple(value) -> tuple:
    return tuple(value)


@attrs.frozen
class ModuleQuant:
    """How one module's weights are stored.

    :param format: a weight format name from :mod:`moe_runtime.formats` (``"nvfp4_w4a4"``...).
    :param group_size: elements per block scale (16 for NVFP4), ``None`` for per-tensor formats.
    :param source: how the format was found, for people: ``"exact key 'x'"``,
        ``"container key 'model.layers.0.mlp.experts'"``, ``"per-expert keys (24 agree)"``,
        ``"exclude_modules glob 'lm_head'"``, ``"moe_quant_algo 'NVFP4'"``,
        ``"checkpoint default"``, ``"unquantized"``.
    """

    format: str
    group_size: int | None
    source: str


@attrs.frozen
class RouterSpec:
    """How a MoE layer routes tokens (mirrors transformers' router of the architecture).

    :param scoring: ``"softmax"`` or ``"sigmoid"`` over the router logits.
    :param renormalize: the chosen top-k weights are divided by their sum.
    :param n_group: expert groups for grouped top-k (1 = none).
    :param topk_group: groups kept per token.
    :param routed_scaling_factor: multiplies the final weights.
    :param has_correction_bias: a per-expert bias (``e_score_correction_bias``) added to the
        scores for selection only.
    """

    scoring: str = attrs.field()
    renormalize: bool = attrs.field()
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    has_correction_bias: bool = False

    @scoring.validator
    def _check_scoring(self, _attribute, value):
        if value not in ("softmax", "sigmoid"):
            raise ValueError(f"router scoring {value!r}: accepted are 'softmax' and 'sigmoid'")


@attrs.frozen
class MoELayerInfo:
    """One MoE layer of a checkpoint.

    :param name: the experts container as the checkpoint's tensor names spell it
        (``model.layers.3.mlp.experts``; Mixtral ``model.layers.3.block_sparse_moe.experts``).
    :param index: the decoder layer index.
    :param intermediate_size: one routed expert's intermediate size.
    :param activation: ``"silu"`` or ``"gelu"`` (the gated MLP's ``act(gate) * up``).
    :param shared_expert_intermediate_size: the shared expert's intermediate size; 0 = none.
    :param expert_names: the (gate, up, down) projection names inside each expert:
        ``("gate_proj", "up_proj", "down_proj")`` or Mixtral's ``("w1", "w3", "w2")``.
    :param quant: the layer's resolved format (all its experts and projections agree).
    """

    name: str
    index: int
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: str
    router: RouterSpec
    shared_expert_intermediate_size: int
    expert_names: tuple[str, str, str] = attrs.field(converter=_tuple)
    quant: ModuleQuant

    def expert_module(self, expert: int, projection: str) -> str:
        """The tensor-name prefix of one expert projection (``...experts.7.gate_proj``)."""
        return f"{self.name}.{expert}.{projection}"


@attrs.frozen
class CheckpointInfo:
    """What :func:`read_checkpoint` learns from a folder's config files (and tensor headers).

    :param method: the name shown to users (``modelopt_fp8``, ``modelopt_fp4``, ``modelopt_mixed``,
        ``modelopt_w4a16_nvfp4``, ``unquantized``). Reported only: nothing decides on it.
    :param quant_algo: the checkpoint's top-level ModelOpt ``quant_algo`` (``None`` if unquantized).
    :param kv_cache_quant_algo: ``"FP8"``, ``"NVFP4"``... or ``None``, from either file.
    :param producer: ``"modelopt 0.47.0"`` or ``None``.
    :param dtype: the model's 16-bit dtype name as config.json spells it (``"bfloat16"``).
    :param linears: every other linear module found in the tensor files, with its resolved
        format, for reporting (empty when the folder has no safetensors files).
    :param config: the raw config.json (left out of equality and hashing).
    """

    path: Path
    architecture: str
    model_type: str | None
    method: str
    quant_algo: str | None
    kv_cache_quant_algo: str | None
    producer: str | None
    dtype: str | None
    moe_layers: tuple[MoELayerInfo, ...] = attrs.field(converter=_tuple)
    linears: tuple[tuple[str, ModuleQuant], ...] = attrs.field(converter=_tuple)
    config: dict[str, Any] = attrs.field(eq=False, hash=False, repr=False, factory=dict)

    def layer(self, name_or_index: str | int) -> MoELayerInfo:
        """The MoE layer with this container name or decoder layer index."""
        for layer in self.moe_layers:
            if name_or_index in (layer.name, layer.index):
                return layer
        known = ", ".join(str(m.index) for m in self.moe_layers)
        raise KeyError(f"no MoE layer {name_or_index!r} (MoE layers: {known})")

    def linear(self, name: str) -> ModuleQuant:
        """The resolved format of one reported linear module."""
        for module, quant in self.linears:
            if module == name:
                return quant
        raise KeyError(f"no linear module {name!r} in {self.path}")
