"""Grouped-query attention for continuous batching's small steps, without repeating keys.

transformers' ``paged|sdpa`` attention (5.14-5.17, ``integrations/sdpa_paged.py``) reads a step's
keys and values from the paged cache as one packed sequence, repeats them once per query head of
each key/value head (``repeat_kv``: a copy ``num_key_value_groups`` times the keys' size, for keys
and values), and runs one masked ``scaled_dot_product_attention`` over the whole batch. On an H200
(48-layer Qwen3-30B-A3B-shaped checkpoint, 16 clients, RESULTS.md "host/device overlap") a graphed
decode step spent 3.5 ms in that attention (PyTorch's memory-efficient kernel: one batch of 32
heads and 16 queries is 32 thread blocks on 132 SMs) and 3.7 ms in copies, of 16.45 GPU ms.

:func:`gqa_paged_attention` computes the same thing (softmax of scaled scores plus the same
additive mask, times the values) with the query heads of each key/value head stacked as rows of
one matrix: two batched matrix products over the key/value heads, in float32, with no repeated
keys. It takes a step only while its float32 scores stay small (:data:`MAX_SCORES` elements:
decode and small mixed steps); larger steps (prefill) run transformers' own function, unchanged.

:func:`install` puts a dispatcher in transformers' attention registry under ``paged|sdpa``: a
module of a model passed to :func:`enable` takes this path, every other module (another model in
the same process, the "transformers alone" side of ``benchmarks/bench_serve.py``) takes
transformers' function. The serving engine enables it when :func:`choose_gqa_attention` says so:
by default for a model on a CUDA device (measured faster: RESULTS.md, H100 2026-12-07 05:28),
``MOE_RUNTIME_GQA_ATTENTION=0`` (or the engine's ``gqa_attention=False``) turning it off, ``=1``
turning it on elsewhere too.

Numerics: the scores, softmax and weighted sum run in float32 from the cache's values; transformers'
kernel rounds the probabilities to the model's dtype before the second product. Outputs agree to
that rounding (tests/serve/test_paged_attention.py compares both on the same cache). On a CUDA
device with a 16-bit cache the two products run on tensor cores (``torch.bmm`` / ``baddbmm``
with ``out_dtype=torch.float32``: 16-bit operands, float32 accumulation and result) and the
probabilities are rounded to the cache's dtype before the second, as transformers' kernel does:
on an H100 (RESULTS.md, 2026-12-07) the float32 products ran on CUDA cores, 1.86 ms a step at 16
clients, and the path lost 15% at 64 clients, where a step's queries and keys are four times as
many each. Where this torch has no ``out_dtype`` products the float32 path runs.
"""

from __future__ import annotations

import weakref
from typing import Any

GQA_ENV = "MOE_RUNTIME_GQA_ATTENTION"
REGISTRY_KEY = "paged|sdpa"
MAX_SCORES = 1 << 24  # float32 score elements (64 MiB) above which a step takes transformers' path
MAX_QUERIES = 256  # query tokens of a step above which it takes transformers' path

_enabled: "weakref.WeakSet[Any]" = weakref.WeakSet()
_original = None  # transformers' function under REGISTRY_KEY, kept by install()
_calls = {"gqa": 0, "transformers": 0}  # steps × layers each path took (tests and the log read it)
_tensor_core_ok: dict[str, bool] = {}  # device -> whether out_dtype products run there


def choose_gqa_attention(requested: bool | None = None, device=None) -> bool:
    """Whether the engine enables :func:`gqa_paged_attention`: ``requested`` when given, else
    ``MOE_RUNTIME_GQA_ATTENTION`` (``1`` on, ``0`` off), else on where ``device`` is a CUDA
    device (measured faster there: RESULTS.md, H100 2026-12-07 05:28) and off elsewhere. Any
    other value of the variable is refused with the accepted ones."""
    from moe_runtime.serve.graph_shapes import env_switch, on_cuda

    if requested is not None:
        return bool(requested)
    chosen = env_switch(GQA_ENV, "1 (grouped-query attention for small continuous-batching "
                                 "steps) or 0 (transformers' paged|sdpa) or unset (on for a model "
                                 "on CUDA)")
    return on_cuda(device) if chosen is None else chosen


def install() -> bool:
    """Put the dispatcher under ``paged|sdpa`` in transformers' attention registry (once).
    Returns False where this transformers has no ``paged|sdpa`` to wrap."""
    global _original
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    current = ALL_ATTENTION_FUNCTIONS.get(REGISTRY_KEY)
    if current is None:
        return False
    if current is not _dispatch:
        _original = current
        ALL_ATTENTION_FUNCTIONS[REGISTRY_KEY] = _dispatch
    return True


def enable(model: Any) -> int:
    """Route the attention modules of ``model`` (those with a ``layer_idx``) through
    :func:`gqa_paged_attention`. Returns how many were enabled (0 where the registry has no
    ``paged|sdpa``)."""
    if not install():
        return 0
    count = 0
    param = next(model.parameters(), None)
    if param is not None and param.is_cuda:  # decided here, before any graph is captured
        import torch

        dtype = getattr(model, "dtype", param.dtype)
        probe = torch.empty(1, 1, 1, 1, dtype=dtype, device=param.device)
        _tensor_cores(probe, probe)
    for module in model.modules():
        if isinstance(getattr(module, "layer_idx", None), int) and hasattr(module, "config"):
            _enabled.add(module)
            count += 1
    return count


def disable(model: Any) -> None:
    """Send ``model``'s modules back to transformers' function."""
    for module in model.modules():
        _enabled.discard(module)


def calls() -> dict[str, int]:
    """How many layer calls each path has taken in this process (a copy)."""
    return dict(_calls)


def _dispatch(module, query, key, value, attention_mask, dropout: float = 0.0,
              scaling: float | None = None, **kwargs):
    if module in _enabled and _fits(query, attention_mask, kwargs):
        _calls["gqa"] += 1
        return gqa_paged_attention(module, query, key, value, attention_mask, dropout=dropout,
                                   scaling=scaling, **kwargs)
    _calls["transformers"] += 1
    return _original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                     **kwargs)


def _fits(query, attention_mask, kwargs) -> bool:
    if kwargs.get("cache") is None or attention_mask is None or attention_mask.dim() != 4:
        return False
    if "read_index" not in kwargs or "write_index" not in kwargs:
        return False
    heads, queries, keys = query.shape[1], query.shape[2], attention_mask.shape[-1]
    return query.shape[0] == 1 and queries <= MAX_QUERIES and heads * queries * keys <= MAX_SCORES


def gqa_paged_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                        scaling: float | None = None, **kwargs):
    """transformers' ``paged|sdpa`` contract: ``query`` ``[1, heads, q, head_dim]``, this step's
    ``key``/``value`` ``[1, kv_heads, q, head_dim]``, ``attention_mask`` ``[1, 1, q, k]`` additive
    (``kwargs``: ``cache``, ``read_index``, ``write_index``). Writes the step's keys and values to
    the cache, reads the step's ``k`` keys back, and returns ``([1, q, heads, head_dim], None)``
    in the query's dtype."""
    import torch

    cache = kwargs["cache"]
    key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                              read_index=kwargs["read_index"], write_index=kwargs["write_index"])
    # key, value: [k, kv_heads, head_dim]
    _, heads, queries, head_dim = query.shape
    keys, kv_heads = key.shape[0], key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key/value heads "
                         f"(layer {module.layer_idx})")
    groups = heads // kv_heads
    scale = head_dim ** -0.5 if scaling is None else scaling
    # query head h = kv * groups + g (repeat_kv's order): rows of kv head kv are (g, position)
    tensor_cores = _tensor_cores(query, key)
    # 16-bit operands on tensor cores (float32 accumulation), else float32 throughout
    operand = (lambda t: t) if tensor_cores else (lambda t: t.float())
    q = operand(query[0]).reshape(kv_heads, groups * queries, head_dim)
    k = operand(key).permute(1, 2, 0)  # [kv_heads, head_dim, k]
    v = operand(value).transpose(0, 1)  # [kv_heads, k, head_dim]
    # the mask's minimum stays finite in float32 (a fully masked padding row averages, as
    # transformers' kernel does, rather than giving NaN)
    if attention_mask.shape[-1] != keys:
        raise ValueError(f"layer {module.layer_idx}: the attention mask covers "
                         f"{attention_mask.shape[-1]} keys, the cache read back {keys}")
    mask = attention_mask[0, 0]
    if mask.dtype == torch.bool:  # True: attend
        mask = torch.zeros_like(mask, dtype=torch.float32).masked_fill_(~mask, float("-inf"))
    mask = mask.float().clamp_min(torch.finfo(torch.float32).min / 2)
    mask = mask.unsqueeze(0).expand(groups, queries, keys).reshape(1, groups * queries, keys)
    if tensor_cores:
        scores = torch.baddbmm(mask, q, k, alpha=scale, out_dtype=torch.float32)
        probs = torch.softmax(scores, dim=-1).to(value.dtype)
        out = torch.bmm(probs, v, out_dtype=torch.float32)
    else:
        scores = torch.baddbmm(mask, q, k, alpha=scale)  # [kv_heads, groups * q, k]
        probs = torch.softmax(scores, dim=-1)
        out = torch.bmm(probs, v)  # [kv_heads, groups * q, head_dim]
    out = out.reshape(heads, queries, head_dim).transpose(0, 1).to(query.dtype)
    return out.unsqueeze(0).contiguous(), None


def _tensor_cores(query, key) -> bool:
    """Whether the products run with 16-bit operands and float32 results (CUDA, a 16-bit query
    and cache, and a torch with ``out_dtype`` products: checked once per device, eagerly)."""
    import torch

    if not (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
            and key.dtype == query.dtype):
        return False
    device = str(query.device)
    if device not in _tensor_core_ok:
        if torch.cuda.is_current_stream_capturing():
            return False  # decided outside a capture only (a failed op would end it)
        try:
            a = torch.ones(2, 2, 2, dtype=query.dtype, device=query.device)
            ok = torch.bmm(a, a, out_dtype=torch.float32).dtype == torch.float32
            # the mask is one [1, rows, keys] matrix broadcast over the key/value heads
            ok = ok and torch.baddbmm(torch.zeros(1, 2, 2, device=query.device), a, a,
                                      out_dtype=torch.float32).shape == (2, 2, 2)
        except (TypeError, RuntimeError, NotImplementedError):
            ok = False
        _tensor_core_ok[device] = ok
    return _tensor_core_ok[device]
