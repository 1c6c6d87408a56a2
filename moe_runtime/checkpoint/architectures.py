"""Where each supported architecture keeps its MoE layers, read from config.json alone.

One entry per ``architectures[0]`` value: which decoder layers are MoE, their sizes, the router,
the shared expert, how the experts' tensors are named, and what its attention writes to a KV cache
(which decides how ``moe-runtime serve`` batches it). Optional fields default to what transformers'
config class of the architecture defaults them to, so a checkpoint reads the way transformers would
build it. Nothing here concerns quantization.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs

from moe_runtime import formats
from moe_runtime.checkpoint.records import CheckpointError, RouterSpec

GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_NAMES = ("w1", "w3", "w2")  # gate, up, down

_ACTIVATIONS = {"silu": formats.SILU, "swish": formats.SILU, "gelu": formats.GELU}


# decoder layers a config may declare: the largest MoE models have under 100; a config declaring
# 10**9 is broken, and enumerating its layers would hang the check
MAX_LAYERS = 10_000

@attrs.frozen
class MoEStructure:
    """A MoE layer's shape and router, before its name and format are known."""

    index: int
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: str
    router: RouterSpec
    shared_expert_intermediate_size: int = 0


class _Fields:
    """Reads config.json fields, naming the file and the key when one is missing or wrong."""

    def __init__(self, data: dict[str, Any], file: str, where: str = ""):
        self.data, self.file, self.where = data, file, where

    def _key(self, key: str) -> str:
        return f"{self.where}{key}"

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def int(self, *keys: str, default: int | None = None, minimum: int = 0,
            maximum: int | None = None) -> int:
        for key in keys:
            value = self.data.get(key)
            if value is None:
                continue
            if (isinstance(value, bool) or not isinstance(value, int) or value < minimum
                    or (maximum is not None and value > maximum)):
                from moe_runtime.checkpoint.tensors import _short

                bound = (f"an integer from {minimum} to {maximum}" if maximum is not None
                         else f"an integer >= {minimum}")
                raise CheckpointError(
                    f"{self.file}: {self._key(key)} is {_short(value)}; expected {bound}")
            return value
        if default is None:
            names = " or ".join(repr(self._key(k)) for k in keys)
            raise CheckpointError(f"{self.file}: missing {names}, which this architecture needs")
        return default

    def float(self, key: str, default: float) -> float:
        value = self.data.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CheckpointError(f"{self.file}: {self._key(key)} is {value!r}; expected a number")
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise CheckpointError(
                f"{self.file}: {self._key(key)} is {value!r}; expected true or false")
        return value

    def int_list(self, key: str) -> list[int]:
        value = self.data.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
            raise CheckpointError(f"{self.file}: {self._key(key)} must be a list of layer indices")
        return value

    def activation(self) -> str:
        act = str(self.get("hidden_act", "silu"))
        if act not in _ACTIVATIONS:
            raise CheckpointError(
                f"{self.file}: {self._key('hidden_act')} is {act!r}; the gated expert MLP runs "
                f"{', '.join(repr(a) for a in _ACTIVATIONS)}"
            )
        return _ACTIVATIONS[act]


@attrs.frozen
class AttentionCache:
    """What one token costs the KV cache of a full-attention layer, as transformers' model writes it.

    :param kv_heads: key/value heads.
    :param key_head_size: one key head (MLA: ``qk_nope_head_dim + qk_rope_head_dim``).
    :param value_head_size: one value head (MLA: ``v_head_dim``).
    :param sliding_window: some layers attend to a window only.
    :param recurrent_layers: some layers keep a recurrent state instead (linear attention).
    """

    kv_heads: int
    key_head_size: int
    value_head_size: int
    sliding_window: bool = False
    recurrent_layers: bool = False

    def describe(self) -> str:
        if self.key_head_size == self.value_head_size:
            text = f"keys and values of {self.kv_heads} heads x {self.key_head_size}"
        else:
            text = (f"keys of {self.kv_heads} heads x {self.key_head_size} and values of "
                    f"{self.kv_heads} heads x {self.value_head_size}")
        if self.sliding_window:
            text += ", some layers over a sliding window"
        if self.recurrent_layers:
            text += ", and linear-attention layers that keep a recurrent state"
        return text


def _heads(f: _Fields) -> tuple[int, int]:
    heads = f.int("num_attention_heads", minimum=1)
    return heads, f.int("num_key_value_heads", default=heads, minimum=1)


def _mha_cache(f: _Fields) -> AttentionCache:
    """Multi-head / grouped-query attention: keys and values of ``head_dim`` per head."""
    heads, kv_heads = _heads(f)
    size = f.int("head_dim", default=f.int("hidden_size", minimum=1) // heads, minimum=1)
    layer_types = f.get("layer_types") or []
    if not isinstance(layer_types, list):
        raise CheckpointError(f"{f.file}: {f._key('layer_types')} is {layer_types!r}; expected a "
                              "list of layer types ('full_attention', 'sliding_attention'...)")
    sliding = (f.get("sliding_window") is not None and f.bool("use_sliding_window", True)
               if not layer_types else "sliding_attention" in layer_types)
    return AttentionCache(kv_heads, size, size, sliding_window=sliding,
                          recurrent_layers="linear_attention" in layer_types)


@attrs.frozen
class AttentionTensors:
    """The shapes transformers' attention of an architecture gives its tensors, from config.json.

    :param shapes: ``(tensor, shape, how)`` per tensor inside a decoder layer's ``self_attn``
        (``"q_proj.weight"``): a linear weight's shape is ``[out, in]`` in elements, before any
        packing of a quantized format; ``how`` says, for people, which fields give it.
    :param head_dim: the head size the attention uses, and how it was found
        (``"head_dim 16"``, or ``"hidden_size 64 / num_attention_heads 4 = 16 (no head_dim)"``);
        ``None`` where the attention has no single head size (multi-head latent attention).
    :param heads: query heads (what ``o_proj``'s input is a multiple of).
    """

    shapes: tuple[tuple[str, tuple[int, ...], str], ...] = attrs.field(converter=tuple)
    head_dim: tuple[int, str] | None = None
    heads: int = 1


def _head_dim(f: _Fields, *, null_derived: bool, default: int | None = None) -> tuple[int, str]:
    """The head size as transformers' attention reads it: config.json's ``head_dim``, else the
    config class's default (``default``; Qwen3-Next's is 256), else ``hidden_size //
    num_attention_heads``. An explicit null is derived the same way where the
    attention reads ``getattr(config, "head_dim", None) or ...`` (``null_derived``); the others
    read ``getattr(config, "head_dim", hidden_size // heads)``, which takes the null itself, and
    building the model fails."""
    heads = f.int("num_attention_heads", minimum=1)
    if "head_dim" in f.data and f.data["head_dim"] is None and not null_derived:
        raise CheckpointError(
            f"{f.file}: {f._key('head_dim')} is null, which transformers' attention of this "
            "architecture takes as the head size itself (building the model fails); accepted: a "
            "positive integer, or no 'head_dim' key (then hidden_size / num_attention_heads)")
    if f.has("head_dim"):
        size = f.int("head_dim", minimum=1)
        return size, f"{f._key('head_dim')} {size}"
    if default is not None:
        return default, f"head_dim {default} (no head_dim: the config class's default)"
    hidden = f.int("hidden_size", minimum=1)
    return hidden // heads, (f"{f._key('hidden_size')} {hidden} / {f._key('num_attention_heads')} "
                             f"{heads} = {hidden // heads} (no head_dim)")


def _mha_tensors(*, null_head_dim: bool, gated_query: bool = False,
                 default_head_dim: int | None = None) -> Callable[[_Fields], AttentionTensors]:
    """Multi-head / grouped-query attention: ``q_proj [heads x head_dim, hidden]`` (twice that
    with ``gated_query``: Qwen3-Next's output gate), ``k_proj`` and ``v_proj [kv_heads x
    head_dim, hidden]``, ``o_proj [hidden, heads x head_dim]``, their biases, and the per-head
    ``q_norm``/``k_norm [head_dim]``."""

    def tensors(f: _Fields) -> AttentionTensors:
        heads, kv_heads = _heads(f)
        hidden = f.int("hidden_size", minimum=1)
        size, size_from = _head_dim(f, null_derived=null_head_dim, default=default_head_dim)
        gate = 2 if gated_query else 1
        q = (heads * size * gate,
             f"num_attention_heads {heads} x head size {size}" + (" x 2" if gated_query else ""))
        kv = (kv_heads * size, f"num_key_value_heads {kv_heads} x head size {size}")
        o_in = (heads * size, f"num_attention_heads {heads} x head size {size}")
        h = (hidden, f"hidden_size {hidden}")
        rows = []
        for name, out, inp in (("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h),
                               ("o_proj", h, o_in)):
            rows.append((f"{name}.weight", (out[0], inp[0]), f"[{out[1]}, {inp[1]}]"))
            rows.append((f"{name}.bias", (out[0],), f"[{out[1]}]"))
        rows += [(f"{n}.weight", (size,), f"[head size {size}]") for n in ("q_norm", "k_norm")]
        return AttentionTensors(rows, (size, size_from), heads)

    return tensors


def _mla_tensors(f: _Fields) -> AttentionTensors:
    """Multi-head latent attention as transformers builds it (DeepseekV3Attention, with
    DeepseekV3Config's defaults): config.json's ``head_dim`` is not read (the config class sets
    it to ``qk_rope_head_dim``)."""
    heads, _ = _heads(f)
    hidden = f.int("hidden_size", minimum=1)
    nope = f.int("qk_nope_head_dim", default=128)
    rope = f.int("qk_rope_head_dim", default=64)
    v = f.int("v_head_dim", default=128, minimum=1)
    kv_rank = f.int("kv_lora_rank", default=512, minimum=1)
    q_rank = f.int("q_lora_rank", default=1536, minimum=1) if (
        "q_lora_rank" not in f.data or f.has("q_lora_rank")) else None
    qk = (heads * (nope + rope),
          f"num_attention_heads {heads} x (qk_nope_head_dim {nope} + qk_rope_head_dim {rope})")
    h = f"hidden_size {hidden}"
    rows = []
    if q_rank is None:
        rows.append(("q_proj.weight", (qk[0], hidden), f"[{qk[1]}, {h}]"))
    else:
        rows += [("q_a_proj.weight", (q_rank, hidden), f"[q_lora_rank {q_rank}, {h}]"),
                 ("q_a_layernorm.weight", (q_rank,), f"[q_lora_rank {q_rank}]"),
                 ("q_b_proj.weight", (qk[0], q_rank), f"[{qk[1]}, q_lora_rank {q_rank}]")]
    rows += [("kv_a_proj_with_mqa.weight", (kv_rank + rope, hidden),
              f"[kv_lora_rank {kv_rank} + qk_rope_head_dim {rope}, {h}]"),
             ("kv_a_layernorm.weight", (kv_rank,), f"[kv_lora_rank {kv_rank}]"),
             ("kv_b_proj.weight", (heads * (nope + v), kv_rank),
              f"[num_attention_heads {heads} x (qk_nope_head_dim {nope} + v_head_dim {v}), "
              f"kv_lora_rank {kv_rank}]"),
             ("o_proj.weight", (hidden, heads * v),
              f"[{h}, num_attention_heads {heads} x v_head_dim {v}]")]
    return AttentionTensors(rows, None, heads)


def _mla_cache(f: _Fields) -> AttentionCache:
    """Multi-head latent attention as transformers runs it: the compressed KV expanded per head,
    keys of ``qk_nope_head_dim + qk_rope_head_dim``, values of ``v_head_dim`` (DeepseekV3Config's
    defaults)."""
    _, kv_heads = _heads(f)
    key = f.int("qk_nope_head_dim", default=128) + f.int("qk_rope_head_dim", default=64)
    return AttentionCache(kv_heads, key, f.int("v_head_dim", default=128, minimum=1))


def _sparse_step_layers(f: _Fields, num_experts: int) -> list[int]:
    """Qwen2/3-MoE, Qwen3-Next: every ``decoder_sparse_step``-th layer not in mlp_only_layers."""
    step = f.int("decoder_sparse_step", default=1, minimum=1)
    dense = set(f.int_list("mlp_only_layers"))
    n = f.int("num_hidden_layers", minimum=1, maximum=MAX_LAYERS)
    return [i for i in range(n) if i not in dense and num_experts > 0 and (i + 1) % step == 0]


def _qwen_moe(*, shared: bool, norm_topk_default: bool | None) -> Callable[[_Fields], list]:
    """Softmax routers; ``norm_topk_default`` None means always renormalized (no config field)."""

    def layers(f: _Fields) -> list[MoEStructure]:
        num_experts = f.int("num_experts", "num_local_experts", minimum=1)
        renormalize = (True if norm_topk_default is None
                       else f.bool("norm_topk_prob", norm_topk_default))
        indices = (_sparse_step_layers(f, num_experts) if norm_topk_default is not None
                   else list(range(f.int("num_hidden_layers", minimum=1, maximum=MAX_LAYERS))))
        common = dict(
            num_experts=num_experts,
            top_k=f.int("num_experts_per_tok", minimum=1),
            hidden_size=f.int("hidden_size", minimum=1),
            intermediate_size=f.int("moe_intermediate_size", minimum=1),
            activation=f.activation(),
            router=RouterSpec("softmax", renormalize),
            shared_expert_intermediate_size=(
                f.int("shared_expert_intermediate_size") if shared else 0),
        )
        return [MoEStructure(index=i, **common) for i in indices]

    return layers


def _mixtral(f: _Fields) -> list[MoEStructure]:
    common = dict(
        num_experts=f.int("num_local_experts", "num_experts", minimum=1),
        top_k=f.int("num_experts_per_tok", minimum=1),
        hidden_size=f.int("hidden_size", minimum=1),
        intermediate_size=f.int("intermediate_size", minimum=1),
        activation=f.activation(),
        router=RouterSpec("softmax", renormalize=True),  # softmax over the top-k logits
    )
    n = f.int("num_hidden_layers", minimum=1, maximum=MAX_LAYERS)
    return [MoEStructure(index=i, **common) for i in range(n)]


_TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")


def _deepseek_v3(f: _Fields) -> list[MoEStructure]:
    scoring = str(f.get("scoring_func", "sigmoid"))
    if scoring not in ("sigmoid", "softmax"):
        raise CheckpointError(
            f"{f.file}: {f._key('scoring_func')} is {scoring!r}; accepted: 'sigmoid', 'softmax'")
    # transformers' DeepseekV3Config defaults; topk_method 'noaux_tc' is the bias-corrected router.
    # Any other name was taken as a router without the bias, silently: only DeepSeek's own names
    # are (the bias-free ones select as transformers' router does, less the bias).
    topk_method = f.get("topk_method", "noaux_tc")
    if topk_method not in _TOPK_METHODS:
        raise CheckpointError(
            f"{f.file}: {f._key('topk_method')} is {topk_method!r}; accepted: "
            + ", ".join(repr(m) for m in _TOPK_METHODS)
            + " ('noaux_tc' selects with e_score_correction_bias)")
    scaling = f.float("routed_scaling_factor", 2.5)
    if not (math.isfinite(scaling) and scaling > 0):  # it multiplies every routed output
        raise CheckpointError(
            f"{f.file}: {f._key('routed_scaling_factor')} is {scaling!r}; expected a positive "
            "number (the routed experts' output is multiplied by it: a negative one flips it, "
            "0 drops it)")
    router = RouterSpec(
        scoring,
        renormalize=f.bool("norm_topk_prob", True),
        n_group=f.int("n_group", default=8, minimum=1),
        topk_group=f.int("topk_group", default=4, minimum=1),
        routed_scaling_factor=scaling,
        has_correction_bias=topk_method == "noaux_tc",
    )
    moe_intermediate = f.int("moe_intermediate_size", minimum=1)
    first_dense = f.int("first_k_dense_replace", default=3)
    freq = f.int("moe_layer_freq", default=1, minimum=1)
    common = dict(
        num_experts=f.int("n_routed_experts", "num_local_experts", minimum=1),
        top_k=f.int("num_experts_per_tok", minimum=1),
        hidden_size=f.int("hidden_size", minimum=1),
        intermediate_size=moe_intermediate,
        activation=f.activation(),
        router=router,
        shared_expert_intermediate_size=moe_intermediate * f.int("n_shared_experts", default=1),
    )
    n = f.int("num_hidden_layers", minimum=1, maximum=MAX_LAYERS)
    return [MoEStructure(index=i, **common) for i in range(n)
            if i >= first_dense and i % freq == 0]


_LINEAR_ATTENTION = (
    "its linear-attention (Gated DeltaNet) layers keep a recurrent state, which neither batching "
    "path of the server holds: transformers' paged cache groups only full and sliding attention "
    "layers, and the padded dynamic cache cannot pad a recurrent state")


@attrs.frozen
class Architecture:
    """How one architecture names and shapes its MoE layers.

    :param prefix: the tensor-name prefix of the decoder layers (``"model."``); the tensors of a
        real folder override it when they spell it differently.
    :param block: the MoE block's attribute in a decoder layer (``"mlp"``, ``"block_sparse_moe"``).
    :param family: the model family's name for people (``"DeepSeek-V3"``).
    :param cache: what its attention writes to a KV cache, from config.json.
    :param text_config: the model fields sit under config.json's ``text_config``.
    :param served: ``moe-runtime serve`` serves it (each served family has an end-to-end test);
        one that is not is refused at start-up with :attr:`serve_refusal`.
    :param model_types: the config.json ``model_type`` values transformers maps to this class
        (it picks the config class by ``model_type``, the model class by ``architectures``).
    :param attention: the shapes its attention tensors take, from config.json (the head size
        as transformers' attention of the architecture derives it).
    """

    name: str
    family: str
    prefix: str
    block: str
    expert_names: tuple[str, str, str]
    layers: Callable[[_Fields], list[MoEStructure]]
    cache: Callable[[_Fields], AttentionCache] = _mha_cache
    text_config: bool = False
    served: bool = True
    serve_refusal: str = ""
    model_types: tuple[str, ...] = ()
    attention: Callable[[_Fields], AttentionTensors] = _mha_tensors(null_head_dim=False)

    def experts_name(self, prefix: str, index: int) -> str:
        return f"{prefix}layers.{index}.{self.block}.experts"

    def _fields(self, config: dict[str, Any], file: str) -> _Fields:
        if self.text_config and isinstance(config.get("text_config"), dict):
            return _Fields(config["text_config"], file, "text_config.")
        return _Fields(config, file)

    def structure(self, config: dict[str, Any], file: str) -> list[MoEStructure]:
        return self.layers(self._fields(config, file))

    def attention_cache(self, config: dict[str, Any], file: str) -> AttentionCache:
        return self.cache(self._fields(config, file))

    def attention_tensors(self, config: dict[str, Any], file: str) -> AttentionTensors:
        return self.attention(self._fields(config, file))


ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch
    for arch in (
        Architecture("Qwen3MoeForCausalLM", "Qwen3-MoE", "model.", "mlp", GATE_UP_DOWN,
                     _qwen_moe(shared=False, norm_topk_default=False), model_types=("qwen3_moe",)),
        Architecture("Qwen2MoeForCausalLM", "Qwen2-MoE", "model.", "mlp", GATE_UP_DOWN,
                     _qwen_moe(shared=True, norm_topk_default=False), model_types=("qwen2_moe",)),
        Architecture("Qwen3NextForCausalLM", "Qwen3-Next", "model.", "mlp", GATE_UP_DOWN,
                     _qwen_moe(shared=True, norm_topk_default=True),
                     served=False, serve_refusal=_LINEAR_ATTENTION, model_types=("qwen3_next",),
                     attention=_mha_tensors(null_head_dim=False, gated_query=True,
                                            default_head_dim=256)),
        Architecture("Qwen3_5MoeForConditionalGeneration", "Qwen3.5-MoE", "model.language_model.",
                     "mlp", GATE_UP_DOWN, _qwen_moe(shared=True, norm_topk_default=None),
                     text_config=True, served=False, serve_refusal=_LINEAR_ATTENTION,
                     model_types=("qwen3_5_moe",),
                     attention=_mha_tensors(null_head_dim=False, gated_query=True,
                                            default_head_dim=256)),
        Architecture("Qwen3_5MoeForCausalLM", "Qwen3.5-MoE", "model.", "mlp", GATE_UP_DOWN,
                     _qwen_moe(shared=True, norm_topk_default=None), text_config=True,
                     served=False, serve_refusal=_LINEAR_ATTENTION,
                     model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
                     attention=_mha_tensors(null_head_dim=False, gated_query=True,
                                            default_head_dim=256)),
        Architecture("MixtralForCausalLM", "Mixtral", "model.", "block_sparse_moe",
                     MIXTRAL_NAMES, _mixtral, model_types=("mixtral",),
                     attention=_mha_tensors(null_head_dim=True)),
        Architecture("DeepseekV3ForCausalLM", "DeepSeek-V3", "model.", "mlp", GATE_UP_DOWN,
                     _deepseek_v3, cache=_mla_cache, model_types=("deepseek_v3",),
                     attention=_mla_tensors),
    )
}


def served_families() -> dict[str, list[str]]:
    """The families ``moe-runtime serve`` serves, each with its architectures (table order)."""
    families: dict[str, list[str]] = {}
    for arch in ARCHITECTURES.values():
        if arch.served:
            families.setdefault(arch.family, []).append(arch.name)
    return families


def unserved_families() -> dict[str, str]:
    """Families in the table that ``moe-runtime serve`` refuses, each with the reason."""
    return {a.family: a.serve_refusal for a in ARCHITECTURES.values() if not a.served}


def architecture_of(config: dict[str, Any], file: str) -> Architecture:
    """The :class:`Architecture` named by config.json's ``architectures[0]``."""
    names = config.get("architectures")
    supported = ", ".join(sorted(ARCHITECTURES))
    if not isinstance(names, list) or not names or not isinstance(names[0], str):
        raise CheckpointError(
            f"{file}: 'architectures' must name the model class (supported: {supported})")
    arch = ARCHITECTURES.get(names[0])
    if arch is None:
        raise CheckpointError(
            f"{file}: architecture {names[0]!r} is not supported; supported: {supported}")
    return arch
