"""The memory serving a checkpoint needs, estimated from config.json, and the memory a machine has.

The estimate has three parts, each traced to the config fields it grows with, so that a refusal can
name the field to blame:

- weights: embeddings and ``lm_head`` (``vocab_size x hidden_size``), attention, dense MLPs and,
  per MoE layer, ``num_experts x 3 x hidden x intermediate`` at the layer format's bytes per weight
  (:class:`moe_runtime.formats.WeightFormat`), or, given a plan, at the bytes per weight the
  layer's planned experts backend holds after ``prepare`` where it declares its own copy
  (:attr:`moe_runtime.declarations.Support.prepared_bytes_per_weight`: ``cpu_dequantized``
  keeps float32, 4 bytes per weight); other linears are held in the model dtype, since the
  loader dequantizes them;
- KV cache: what the server's paged cache holds, ``batch x context`` tokens of keys and values in
  every attention layer (one byte per element with an FP8 KV cache);
- activations: one forward of the largest token batch the server schedules, in float32.

The machine is probed once into a :class:`MachineMemory` (a CUDA device's total memory, or the
host's available memory); tests pass one in.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from moe_runtime import formats
from moe_runtime.dtypes import MODEL_DTYPES, config_dtype, model_dtype_name
from moe_runtime.placement import local_experts

if TYPE_CHECKING:
    from moe_runtime.planner import Plan

GiB = 1 << 30
_BYTES_PER_WEIGHT = {f.name: f.bytes_per_weight for f in formats.BUILTIN_FORMATS}
# The server's scheduler batches at most this many tokens per forward (serve/engine.py).
MAX_BATCH_TOKENS = 2048


def human(n: float) -> str:
    """``n`` bytes for people: ``3.2 GiB``, ``512.0 MiB``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


@attrs.frozen
class MemoryPart:
    """One part of the estimate: a name, its bytes, and the config fields it grows with."""

    name: str
    bytes: int
    fields: tuple[tuple[str, Any], ...] = attrs.field(converter=tuple)

    @property
    def described(self) -> str:
        fields = " x ".join(f"{k}={v}" for k, v in self.fields)
        return f"{self.name} {human(self.bytes)} ({fields})" if fields else (
            f"{self.name} {human(self.bytes)}")


@attrs.frozen
class BackendCopy:
    """An experts backend of the plan that holds its own copy of a layer's experts: its
    declared bytes per weight after ``prepare``, and what the checkpoint's format stores."""

    backend: str
    format: str
    bytes_per_weight: float
    stored_bytes_per_weight: float
    layers: int
    alternatives: tuple[str, ...] = attrs.field(converter=tuple, default=())

    @property
    def described(self) -> str:
        return (f"{self.backend} holds {self.bytes_per_weight:g} bytes per weight after prepare, "
                f"{self.bytes_per_weight / self.stored_bytes_per_weight:.1f}x the "
                f"{self.format} storage")

    def to_json(self) -> dict:
        return attrs.asdict(self, recurse=False) | {"alternatives": list(self.alternatives)}


@attrs.frozen
class MemoryEstimate:
    """What serving needs: parts of the weights, the KV cache and the activations.

    ``backend_copies`` lists the planned experts backends counted at their own copy's size
    (empty without a plan, or when every backend holds the format's storage).
    """

    parts: tuple[MemoryPart, ...] = attrs.field(converter=tuple)
    batch_size: int
    context_tokens: int
    backend_copies: tuple[BackendCopy, ...] = attrs.field(converter=tuple, default=())

    @property
    def total(self) -> int:
        return sum(p.bytes for p in self.parts)

    @property
    def largest(self) -> MemoryPart:
        return max(self.parts, key=lambda p: p.bytes)

    def to_json(self) -> dict:
        return {"total_bytes": self.total, "batch_size": self.batch_size,
                "context_tokens": self.context_tokens,
                "parts": [{"name": p.name, "bytes": p.bytes, "fields": dict(p.fields)}
                          for p in self.parts],
                "backend_copies": [c.to_json() for c in self.backend_copies]}


@attrs.frozen
class MachineMemory:
    """The memory a model would be loaded into.

    :param device: ``"cpu"`` or ``"cuda:N"``.
    :param available_bytes: what a load may use (a GPU's free memory, the host's available
        memory, capped by a cgroup limit).
    """

    device: str
    available_bytes: int
    described: str

    @classmethod
    def probe(cls, device: str = "cpu") -> MachineMemory | None:
        """This machine's memory for ``device``; ``None`` when it cannot be told."""
        if device.startswith("cuda"):
            try:
                import torch

                index = torch.device(device).index or 0
                free, total = torch.cuda.mem_get_info(index)
                name = torch.cuda.get_device_name(index)
            except Exception:  # no CUDA here: the planner reports that, not the memory check
                return None
            return cls(f"cuda:{index}", int(free),
                       f"{name} (cuda:{index}) has {human(free)} free of {human(total)}")
        available = _host_available()
        if available is None:
            return None
        return cls("cpu", available, f"this host has {human(available)} available")


def _host_available() -> int | None:
    found = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if found is None:
        try:
            found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    try:  # a cgroup limit (containers) caps what the process may use
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit.isdigit():
            found = min(found, int(limit) - used)
    except (OSError, ValueError):
        pass
    return found


def _int(fields: dict, key: str, default: int = 0) -> int:
    value = fields.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def estimate_memory(config: dict[str, Any], moe_layers, *, kv_cache_quant_algo: str | None = None,
                    batch_size: int = 1, context_tokens: int | None = None,
                    ep_size: int = 1, plan: Plan | None = None) -> MemoryEstimate:
    """The memory serving needs, from config.json (``config``) and the resolved MoE layers.

    :param moe_layers: the :class:`MoELayerInfo` records (their count, shapes and formats).
    :param plan: the plan that will serve: each MoE layer it plans counts its experts at the
        planned backend's declared bytes per weight after ``prepare``
        (:attr:`LayerPlan.prepared_bytes_per_weight`), not the format's storage.
    :param context_tokens: tokens per sequence (default: ``max_position_embeddings``).
    :param ep_size: expert-parallel ranks: one rank holds ``ceil(num_experts / ep_size)`` experts
        of each layer (the estimate is one rank's).
    """
    f = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    dbytes = MODEL_DTYPES[model_dtype_name(config_dtype(config))]
    hidden = _int(f, "hidden_size")
    vocab = _int(f, "vocab_size")
    layers = _int(f, "num_hidden_layers")
    heads = _int(f, "num_attention_heads", 1)
    kv_heads = _int(f, "num_key_value_heads", heads)
    head_dim = _int(f, "head_dim", hidden // heads if heads else 0)
    context = context_tokens or _int(f, "max_position_embeddings", 2048)
    parts: list[MemoryPart] = []

    copies = 1 if f.get("tie_word_embeddings") else 2
    parts.append(MemoryPart("embeddings and lm_head", copies * vocab * hidden * dbytes,
                            [("vocab_size", vocab), ("hidden_size", hidden)]))
    if _int(f, "kv_lora_rank"):  # multi-head latent attention (DeepSeek): keys/values per head
        q_rank, kv_rank = _int(f, "q_lora_rank"), _int(f, "kv_lora_rank")
        qk = _int(f, "qk_nope_head_dim") + _int(f, "qk_rope_head_dim")
        v_dim = _int(f, "v_head_dim", head_dim)
        attn = (hidden * q_rank + q_rank * heads * qk if q_rank else hidden * heads * qk)
        attn += hidden * (kv_rank + _int(f, "qk_rope_head_dim"))
        attn += kv_rank * heads * (_int(f, "qk_nope_head_dim") + v_dim) + heads * v_dim * hidden
        kv_per_token = heads * (qk + v_dim)
    else:
        attn = hidden * head_dim * (2 * heads + 2 * kv_heads)
        kv_per_token = 2 * kv_heads * head_dim
    parts.append(MemoryPart("attention weights", layers * attn * dbytes,
                            [("num_hidden_layers", layers), ("hidden_size", hidden),
                             ("num_attention_heads", heads)]))

    dense = layers - len(moe_layers)
    dense_inter = _int(f, "intermediate_size")
    if dense > 0 and dense_inter:
        parts.append(MemoryPart("dense MLP weights", dense * 3 * hidden * dense_inter * dbytes,
                                [("dense layers", dense), ("hidden_size", hidden),
                                 ("intermediate_size", dense_inter)]))
    copies: tuple[BackendCopy, ...] = ()
    if moe_layers:
        first = moe_layers[0]
        # the busiest rank: rank 0 holds the most experts (moe_runtime.placement)
        # stop - start, not len(): a range past sys.maxsize (a config's 10**30 experts) has none
        local = [(r := local_experts(m.num_experts, max(1, ep_size), 0)).stop - r.start
                 for m in moe_layers]
        held, copies = _held_bytes_per_weight(moe_layers, plan, dbytes)
        expert_bytes = sum(
            n * 3 * m.hidden_size * m.intermediate_size * b
            + m.num_experts * m.hidden_size * dbytes  # router
            + 3 * m.hidden_size * m.shared_expert_intermediate_size * dbytes
            for m, n, b in zip(moe_layers, local, held, strict=True))
        held_by = f" ({'; '.join(c.described for c in copies)})" if copies else ""
        parts.append(MemoryPart(
            f"expert weights of {len(moe_layers)} MoE layers{held_by}", int(expert_bytes),
            [("num_experts", first.num_experts), *([("ep_size", ep_size)] if ep_size > 1 else []),
             ("hidden_size", first.hidden_size),
             ("moe_intermediate_size", first.intermediate_size)]))

    kv_bytes = 1 if kv_cache_quant_algo else dbytes
    parts.append(MemoryPart(
        "KV cache", layers * batch_size * context * kv_per_token * kv_bytes,
        [("num_hidden_layers", layers), ("batch", batch_size), ("context tokens", context),
         ("num_key_value_heads", kv_heads), ("head_dim", head_dim)]))

    tokens = min(batch_size * context, max(256, min(MAX_BATCH_TOKENS, context)))
    # The widest per-token activation, with the fields that make it so.
    widths = [(4 * hidden, [("hidden_size", hidden)]), (vocab, [("vocab_size", vocab)]),
              (2 * dense_inter, [("intermediate_size", dense_inter)])]
    widths += [(2 * m.top_k * m.intermediate_size,
                [("num_experts_per_tok", m.top_k), ("moe_intermediate_size", m.intermediate_size)])
               for m in moe_layers[:1]]
    widest, widest_fields = max(widths, key=lambda w: w[0])
    parts.append(MemoryPart("activations", tokens * (4 * hidden + widest) * 4,
                            [("tokens per forward", tokens), *widest_fields]))
    return MemoryEstimate(parts, batch_size, context, copies)


def _held_bytes_per_weight(moe_layers, plan: Plan | None, dbytes: int
                           ) -> tuple[list[float], tuple[BackendCopy, ...]]:
    """Each layer's bytes per expert weight once served, and the backends that hold a copy."""
    planned = {lp.problem.name: lp for lp in plan.layers} if plan is not None else {}
    held: list[float] = []
    copies: dict[tuple[str, str, float], list] = {}
    for m in moe_layers:
        stored = _BYTES_PER_WEIGHT.get(m.quant.format, dbytes)
        lp = planned.get(m.name)
        if lp is None:
            held.append(stored)
            continue
        # the plan's backend, then each other backend of its batch-size ranges (--token-ranges):
        # each prepares its own copy of the layer's experts
        backends = {lp.experts: lp.prepared_bytes_per_weight}
        for r in getattr(lp, "experts_by_tokens", ()):
            backends.setdefault(r.experts, r.prepared_bytes_per_weight)
        total = 0.0
        for i, (name, declared) in enumerate(backends.items()):
            b = stored if declared is None else declared
            total += b
            if b != stored or i > 0:
                entry = copies.setdefault((name, m.quant.format, b), [stored, 0, {}])
                entry[1] += 1
                entry[2].update(dict.fromkeys(lp.alternatives))
        held.append(total)
    return held, tuple(BackendCopy(backend, fmt, b, stored, n, tuple(alts))
                       for (backend, fmt, b), (stored, n, alts) in copies.items())


def memory_problem(estimate: MemoryEstimate, machine: MachineMemory) -> str | None:
    """A sentence when ``estimate`` does not fit ``machine``, else ``None``."""
    if estimate.total <= machine.available_bytes:
        return None
    top = sorted(estimate.parts, key=lambda p: -p.bytes)[:2]
    shown = ", then ".join(
        f"{p.described}, {math.floor(100 * p.bytes / estimate.total)}%" for p in top)
    named = " ".join(p.name for p in top)  # a copy the parts shown do not name is added
    copies = "".join(
        f"; the experts of {c.layers} MoE layer(s) are counted as the plan's backend keeps them: "
        f"{c.described}" for c in estimate.backend_copies if c.described not in named)
    return (f"serving needs about {human(estimate.total)} at batch {estimate.batch_size} x "
            f"{estimate.context_tokens} tokens, but {machine.described}; the largest parts: "
            f"{shown}{copies}")


def memory_remedies(estimate: MemoryEstimate) -> str:
    """What would make ``estimate`` smaller, for a refusal's ``accepted`` text."""
    remedies = []
    for c in estimate.backend_copies:
        others = (f" (others that run these layers: {', '.join(c.alternatives)})"
                  if c.alternatives else "")
        remedies.append(f"another experts backend pinned with --moe-runner-backend{others}, "
                        f"since {c.backend} holds a {c.bytes_per_weight:g}-byte copy of every "
                        "expert weight")
    remedies += ["a machine with that much memory", "a smaller --max-batch-size or --max-model-len",
                 "a checkpoint whose config declares smaller sizes"]
    return ", ".join(remedies[:-1]) + ", or " + remedies[-1]
