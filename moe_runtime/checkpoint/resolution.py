"""Resolving a module name to the format its weights are stored in.

The order (DESIGN.md, "ModelOpt checkpoints"):

1. a ``quantized_layers`` key equal to the name;
2. keys below the name (per-expert keys of an experts container): every member must resolve, and
   all must agree — a MoE layer runs one format, so disagreement is an error naming the keys;
3. the longest key that is a dotted prefix of the name (a container key);
4. an ``exclude_modules`` glob matching the name or one of its containers;
5. the checkpoint's single format (MoE experts: ``moe_quant_algo`` first), else unquantized.

Names are compared without the prefixes that differ between a checkpoint's tensors and its quant
config (``model.language_model.``, ``language_model.``, ``backbone.``, ``model.``), on either side.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Iterable

from moe_runtime.checkpoint.quant_config import LayerEntry, QuantizationSpec
from moe_runtime.checkpoint.records import CheckpointError, ModuleQuant

# Longest first: the first that matches is stripped.
NAME_PREFIXES: tuple[str, ...] = (
    "model.language_model.",
    "language_model.model.",
    "language_model.",
    "backbone.",
    "model.",
)


def canonical_name(name: str) -> str:
    """``name`` without its model prefix (``model.language_model.layers.0`` -> ``layers.0``)."""
    for prefix in NAME_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _ancestors(name: str) -> Iterable[str]:
    """Dotted prefixes of ``name``, longest first (``a.b.c`` -> ``a.b``, ``a``)."""
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        yield ".".join(parts[:end])


class _KeyIndex:
    """``quantized_layers`` by canonical name, with the keys below every container."""

    def __init__(self, entries: Iterable[LayerEntry], file: str):
        self.exact: dict[str, LayerEntry] = {}
        self.below: dict[str, list[LayerEntry]] = {}
        for entry in entries:
            name = canonical_name(entry.key)
            seen = self.exact.get(name)
            if seen is not None and (seen.quant_algo, seen.group_size) != (
                    entry.quant_algo, entry.group_size):
                raise CheckpointError(
                    f"{file}: quantized_layers keys {seen.key!r} and {entry.key!r} name the same "
                    f"module with different settings ({seen.quant_algo} vs {entry.quant_algo})"
                )
            self.exact.setdefault(name, entry)
            for ancestor in _ancestors(name):
                self.below.setdefault(ancestor, []).append(entry)

    def container(self, name: str) -> LayerEntry | None:
        for ancestor in _ancestors(name):
            entry = self.exact.get(ancestor)
            if entry is not None:
                return entry
        return None


@functools.lru_cache(maxsize=32)
def _index(spec: QuantizationSpec) -> _KeyIndex:
    # QuantizationSpec caches its hash, and a dict lookup tries identity first: cheap per call.
    return _KeyIndex(spec.quantized_layers, spec.file_of("quantized_layers"))


def _from_entry(spec: QuantizationSpec, entry: LayerEntry, source: str) -> ModuleQuant:
    return spec.module_quant(
        entry.quant_algo, entry.group_size, setting="quantized_layers",
        key=f"quantized_layers[{entry.key!r}].quant_algo", source=source,
    )


def _excluded_by(spec: QuantizationSpec, name: str) -> str | None:
    candidates = [name, *_ancestors(name)]
    canonical = [canonical_name(c) for c in candidates]
    for pattern in spec.exclude_modules:
        bare = canonical_name(pattern)
        for raw, canon in zip(candidates, canonical, strict=True):
            if fnmatch.fnmatchcase(raw, pattern) or fnmatch.fnmatchcase(canon, bare):
                return pattern
    return None


def _default(spec: QuantizationSpec, *, moe: bool) -> ModuleQuant:
    if moe and spec.moe_quant_algo is not None:
        algo = spec.moe_quant_algo
        return spec.module_quant(algo, spec.group_size, setting="moe_quant_algo",
                                 key="moe_quant_algo", source=f"moe_quant_algo {algo!r}")
    if spec.default_algo is not None:
        return spec.module_quant(spec.default_algo, spec.group_size, setting="quant_algo",
                                 key="quant_algo", source="checkpoint default")
    return spec.unquantized("unquantized")


def resolve_module(
    spec: QuantizationSpec, name: str, *, members: Iterable[str] = (), moe: bool = False
) -> ModuleQuant:
    """The format of module ``name`` under ``spec``.

    :param name: the module as the checkpoint's tensors spell it (prefixes may differ from the
        quant config's keys).
    :param members: for an experts container, the modules it must hold, relative to ``name``
        (``"0.gate_proj"``...). When keys sit below ``name`` every member must resolve and agree;
        without ``members`` only the keys present are compared.
    :param moe: ``name`` holds routed experts (``moe_quant_algo`` is then its default).
    :raises CheckpointError: disagreeing per-expert keys, or an algorithm that is no format.
    """
    index = _index(spec)
    canon = canonical_name(name)

    entry = index.exact.get(canon)
    if entry is not None:
        return _from_entry(spec, entry, f"exact key {entry.key!r}")

    below = index.below.get(canon)
    if below:
        return _resolve_members(spec, name, below, tuple(members), moe=moe)

    entry = index.container(canon)
    if entry is not None:
        return _from_entry(spec, entry, f"container key {entry.key!r}")

    pattern = _excluded_by(spec, name)
    if pattern is not None:
        return spec.unquantized(f"exclude_modules glob {pattern!r}")
    return _default(spec, moe=moe)


def _resolve_members(spec: QuantizationSpec, name: str, below: list[LayerEntry],
                     members: tuple[str, ...], *, moe: bool) -> ModuleQuant:
    """Step 2: the keys below ``name`` (and, given ``members``, every member) must agree."""
    index = _index(spec)
    found: dict[tuple[str, int | None], list[str]] = {}
    keys_used: set[str] = set()
    quants: dict[tuple[str | None, int | None], ModuleQuant] = {}

    def quant_of(entry: LayerEntry) -> ModuleQuant:
        key = (entry.quant_algo, entry.group_size)
        if key not in quants:
            quants[key] = _from_entry(spec, entry, "")
        return quants[key]

    if members:
        stop = canonical_name(name)
        for member in members:
            full = canonical_name(f"{name}.{member}")
            entry = index.exact.get(full) or _container_below(index, full, stop)
            if entry is not None:
                quant = quant_of(entry)
                keys_used.add(entry.key)
                label = entry.key
            else:
                pattern = _excluded_by(spec, f"{name}.{member}")
                quant = (spec.unquantized("") if pattern is not None
                         else _default(spec, moe=moe))
                label = f"{name}.{member} (not listed: {quant.source or 'excluded'})"
            found.setdefault((quant.format, quant.group_size), []).append(label)
    else:
        for entry in below:
            quant = quant_of(entry)
            keys_used.add(entry.key)
            found.setdefault((quant.format, quant.group_size), []).append(entry.key)

    if len(found) > 1:
        parts = []
        for (fmt, group), labels in found.items():
            what = fmt if group is None else f"{fmt} (group {group})"
            more = f" and {len(labels) - 1} more" if len(labels) > 1 else ""
            parts.append(f"{what} for {labels[0]!r}{more}")
        raise CheckpointError(
            f"{spec.file_of('quantized_layers')}: the per-expert keys of {name!r} disagree: "
            + "; ".join(parts)
            + ". One MoE layer holds one weight format; the keys must agree for every expert."
        )
    (fmt, group), _labels = next(iter(found.items()))
    return ModuleQuant(fmt, group, f"per-expert keys ({len(keys_used)} agree)")


def _container_below(index: _KeyIndex, name: str, stop: str) -> LayerEntry | None:
    """The longest key that is a dotted prefix of ``name`` and lies below ``stop``."""
    for ancestor in _ancestors(name):
        if len(ancestor) <= len(stop):
            return None
        entry = index.exact.get(ancestor)
        if entry is not None:
            return entry
    return None
