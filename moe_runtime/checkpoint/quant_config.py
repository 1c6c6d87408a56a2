"""A checkpoint's ModelOpt quantization settings, merged from config.json and hf_quant_config.json.

ModelOpt writes the same facts twice: ``hf_quant_config.json`` (``{"producer", "quantization":
{"quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules", "quantized_layers"}}``) and
``config.json``'s ``quantization_config`` (``"quant_method": "modelopt"``, ``ignore`` for
``exclude_modules``, ``kv_cache_scheme``). Real checkpoints carry some keys in only one of them, and
some (ModelOpt MIXED_PRECISION exports of FP8 models) say ``"quant_method": "fp8"`` in config.json
with ``moe_quant_algo`` beside it. The rule:

- a ``quant_method: modelopt`` block in config.json is read first and hf_quant_config.json fills the
  keys it lacks;
- otherwise hf_quant_config.json is read first, and a foreign config.json block (``fp8``...) only
  fills ``moe_quant_algo`` and the KV-cache algorithm;
- two ModelOpt sources that both state ``quant_algo`` (or the KV-cache algorithm) must agree.

The result, :class:`QuantizationSpec`, is what :func:`~moe_runtime.checkpoint.resolve_module`
resolves module names against.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from moe_runtime import formats
from moe_runtime.checkpoint.records import CheckpointError, ModuleQuant
from moe_runtime.dtypes import config_dtype, model_dtype_name

HF_QUANT_CONFIG = "hf_quant_config.json"
CONFIG = "config.json"

MIXED_PRECISION = "MIXED_PRECISION"
NVFP4_GROUP_SIZE = 16

# ModelOpt quant_algo -> the weight format a module in that algorithm holds.
ALGO_FORMATS: dict[str, str] = {
    "FP8": formats.FP8_W8A8,
    "NVFP4": formats.NVFP4_W4A4,
    "W4A16_NVFP4": formats.NVFP4_W4A16,
}
_BLOCK_ALGOS = frozenset({"NVFP4", "W4A16_NVFP4"})
_UNQUANTIZED_DTYPES = {"bfloat16": formats.BF16, "float16": formats.FP16}


def _accepted(include_mixed: bool) -> str:
    names = sorted(ALGO_FORMATS) + ([MIXED_PRECISION] if include_mixed else [])
    return ", ".join(repr(n) for n in names)


class _Constant(float):
    """A NaN or Infinity literal met while parsing (Python's json reads them; JSON has none)."""

    def __new__(cls, literal: str):
        value = super().__new__(cls, literal.replace("Infinity", "inf"))
        value.literal = literal
        return value


def _constant_at(value: Any, where: str = "") -> str | None:
    """``"key.sub[2] is NaN"`` for the first non-JSON literal inside ``value``, else ``None``."""
    if isinstance(value, _Constant):
        return f"{where or 'the value'} is {value.literal}"
    items = (value.items() if isinstance(value, dict)
             else enumerate(value) if isinstance(value, list) else ())
    for key, item in items:
        found = _constant_at(item, f"{where}[{key}]" if isinstance(key, int)
                             else f"{where}.{key}" if where else str(key))
        if found:
            return found
    return None


def read_json_file(path: Path) -> tuple[Any, tuple[str, str] | None]:
    """``(data, None)``, or ``(None, (problem, accepted))`` when ``path`` holds no strict JSON.

    Strict: UTF-8 text (no byte-order mark), no ``NaN``/``Infinity`` literals (Python's json
    reads them, JSON and every other reader refuse them), not nested past Python's recursion
    limit. An unreadable file raises ``OSError`` (the folder rule reports it).
    """
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, (f"is not UTF-8 text: byte 0x{raw[exc.start]:02x} at offset {exc.start} "
                      f"cannot be decoded ({exc.reason})", "a JSON object in UTF-8")
    try:
        data = json.loads(text, parse_constant=_Constant)
    except json.JSONDecodeError as exc:
        truncated = not text.rstrip().endswith(("}", "]"))
        return None, (f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
                      + (" (the file looks truncated)" if truncated else ""),
                      "a complete JSON object")
    except RecursionError:
        return None, ("JSON nested too deeply to read", "a JSON object")
    found = _constant_at(data)
    if found:
        return None, (f"{found}, which is not JSON (JSON numbers are finite; Python writes NaN "
                      "and Infinity for float values it cannot express)",
                      "finite numbers (or null where the field may be absent)")
    return data, None


def load_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; a missing file, bad JSON or a non-object: CheckpointError."""
    try:
        data, problem = read_json_file(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror})") from exc
    if problem:
        raise CheckpointError(f"{path}: {problem[0]}; accepted: {problem[1]}")
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


@attrs.frozen
class LayerEntry:
    """One ``quantized_layers`` entry: a module name (or container) and its algorithm."""

    key: str
    quant_algo: str | None
    group_size: int | None


@attrs.frozen(cache_hash=True)
class QuantizationSpec:
    """The merged quantization settings of one checkpoint.

    :param quant_algo: top-level ``quant_algo`` (``"FP8"``, ``"NVFP4"``, ``"W4A16_NVFP4"``,
        ``"MIXED_PRECISION"``) or ``None``.
    :param moe_quant_algo: MIXED_PRECISION shape 1's default for MoE experts, or ``None``.
    :param group_size: the top-level group size (NVFP4: 16), or ``None``.
    :param exclude_modules: globs of modules left unquantized (config.json calls them ``ignore``).
    :param quantized_layers: the per-module map, in file order.
    :param dtype: config.json's dtype name; unquantized modules hold it.
    :param files: the file each setting was read from, for messages: keys ``quant_algo``,
        ``moe_quant_algo``, ``exclude_modules``, ``quantized_layers``, ``dtype``.
    """

    quant_algo: str | None = None
    kv_cache_quant_algo: str | None = None
    moe_quant_algo: str | None = None
    group_size: int | None = None
    exclude_modules: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    quantized_layers: tuple[LayerEntry, ...] = attrs.field(default=(), converter=tuple)
    producer: str | None = None
    dtype: str | None = "bfloat16"
    files: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=tuple)

    def file_of(self, setting: str) -> str:
        return dict(self.files).get(setting, "the quantization config")

    @property
    def default_algo(self) -> str | None:
        """The single algorithm of a non-mixed checkpoint, else ``None``."""
        return None if self.quant_algo == MIXED_PRECISION else self.quant_algo

    def unquantized(self, source: str) -> ModuleQuant:
        """A ModuleQuant for an unquantized module of this checkpoint's dtype."""
        fmt = _UNQUANTIZED_DTYPES.get(model_dtype_name(self.dtype or "bfloat16", default=None))
        if fmt is None:
            raise CheckpointError(
                f"{self.file_of('dtype')}: 'dtype' is {self.dtype!r}; unquantized modules are run "
                f"in one of {', '.join(repr(d) for d in _UNQUANTIZED_DTYPES)}"
            )
        return ModuleQuant(fmt, None, source)

    def module_quant(self, algo: str | None, group_size: int | None, *, setting: str, key: str,
                     source: str) -> ModuleQuant:
        """The ModuleQuant for ``algo``; an algorithm that is no runnable format is an error."""
        if algo is None:
            return self.unquantized(source)
        fmt = ALGO_FORMATS.get(algo)
        if fmt is None:
            raise CheckpointError(
                f"{self.file_of(setting)}: {key} is {algo!r}, which is not a weight format "
                f"moe-runtime runs; accepted quant_algo values: {_accepted(False)}"
            )
        if algo not in _BLOCK_ALGOS:
            return ModuleQuant(fmt, None, source)
        size = next((g for g in (group_size, self.group_size) if g is not None),
                    NVFP4_GROUP_SIZE)
        if size != NVFP4_GROUP_SIZE:
            raise CheckpointError(
                f"{self.file_of(setting)}: {key} gives group_size {size} for {algo!r}; "
                f"NVFP4 block scales cover exactly {NVFP4_GROUP_SIZE} elements"
            )
        return ModuleQuant(fmt, size, source)


# ------------------------------------------------------------------------------------- reading


def _algo(value: Any, *, file: str, key: str, top_level: bool) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise CheckpointError(f"{file}: {key} must be a string, found {value!r}")
    algo = value.strip().upper()
    if algo in ("", "NONE"):
        return None
    accepted = set(ALGO_FORMATS) | ({MIXED_PRECISION} if top_level else set())
    if algo not in accepted:
        raise CheckpointError(
            f"{file}: {key} is {value!r}, which is not a weight format moe-runtime runs; "
            f"accepted: {_accepted(top_level)}"
        )
    return algo


def _int(value: Any, *, file: str, key: str) -> int | None:
    if value is None:
        return None
    # 0 stays 0 (some exporters write it for "no groups"): a format without block scales
    # ignores it, and NVFP4, whose blocks are 16 wide, refuses it rather than assuming 16
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(f"{file}: {key} must be an integer, found {value!r}")
    return value


_KV_ALGOS = ("FP8", "NVFP4", "INT8")  # what ModelOpt's kv_cache_quant_algo names


def _kv_algo(value: Any, *, file: str, key: str) -> str | None:
    """``kv_cache_quant_algo`` (a string) or ``kv_cache_scheme`` (a string or a dict)."""
    if value is None:
        return None
    if isinstance(value, str):
        name = value.strip().upper()
        if name in ("", "NONE"):
            return None
        if name in _KV_ALGOS:
            return name
        raise CheckpointError(
            f"{file}: {key} is {value!r}, which is no KV-cache quantization moe-runtime knows; "
            f"accepted: {', '.join(repr(a) for a in _KV_ALGOS)} or null")
    if isinstance(value, dict):
        bits, kind = value.get("num_bits"), str(value.get("type", "float")).lower()
        if kind == "float" and bits == 8:
            return "FP8"
        if kind == "float" and bits == 4:
            return "NVFP4"
        if kind == "int" and bits == 8:
            return "INT8"
    raise CheckpointError(
        f"{file}: {key} {value!r} is not understood; accepted: a name such as 'FP8' or "
        "{'num_bits': 8, 'type': 'float'}"
    )


def _layers(value: Any, *, file: str) -> tuple[LayerEntry, ...] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: quantized_layers must map module names to objects")
    entries = []
    for name, entry in value.items():
        key = f"quantized_layers[{name!r}]"
        if not isinstance(entry, dict):
            raise CheckpointError(f"{file}: {key} must be an object with 'quant_algo'")
        raw_algo = entry.get("quant_algo")
        algo = None if raw_algo is None else str(raw_algo).strip().upper() or None
        size = entry.get("group_size", entry.get("awq_block_size"))
        entries.append(LayerEntry(name, algo, _int(size, file=file, key=f"{key}.group_size")))
    return tuple(entries)


def _globs(value: Any, *, file: str, key: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CheckpointError(f"{file}: {key} must be a list of module names or globs")
    return tuple(value)


def _producer(value: Any) -> str | None:
    if isinstance(value, dict):
        text = " ".join(str(value[k]) for k in ("name", "version") if value.get(k) is not None)
        return text or None
    return None if value is None else str(value)


def _from_hf_quant_config(data: dict[str, Any], file: str) -> dict[str, Any]:
    q = data.get("quantization")
    if not isinstance(q, dict):
        raise CheckpointError(
            f"{file}: missing the 'quantization' object (expected "
            "{'producer': {...}, 'quantization': {'quant_algo': ...}})"
        )
    return {
        "quant_algo": _algo(q.get("quant_algo"), file=file, key="quantization.quant_algo",
                            top_level=True),
        "moe_quant_algo": _algo(q.get("moe_quant_algo"), file=file,
                                key="quantization.moe_quant_algo", top_level=False),
        "kv_cache_quant_algo": _kv_algo(q.get("kv_cache_quant_algo"), file=file,
                                        key="quantization.kv_cache_quant_algo"),
        "group_size": _int(q.get("group_size"), file=file, key="quantization.group_size"),
        "exclude_modules": _globs(q.get("exclude_modules"), file=file,
                                  key="quantization.exclude_modules"),
        "quantized_layers": _layers(q.get("quantized_layers"), file=file),
        "producer": _producer(data.get("producer")),
    }


def _group_size_of_config_groups(qc: dict[str, Any]) -> int | None:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict):
        return None
    sizes = {
        g.get("weights", {}).get("group_size")
        for g in groups.values()
        if isinstance(g, dict) and isinstance(g.get("weights"), dict)
    } - {None}
    return sizes.pop() if len(sizes) == 1 else None


def _from_config_json(qc: dict[str, Any], file: str, *, modelopt: bool) -> dict[str, Any]:
    """What config.json's ``quantization_config`` states (a foreign one: only ModelOpt's keys)."""
    kv = qc.get("kv_cache_quant_algo", qc.get("kv_cache_scheme"))
    out = {
        "moe_quant_algo": _algo(qc.get("moe_quant_algo"), file=file,
                                key="quantization_config.moe_quant_algo", top_level=False),
        "kv_cache_quant_algo": _kv_algo(kv, file=file, key="quantization_config.kv_cache_scheme"),
    }
    if modelopt:
        group = qc.get("group_size")
        out.update(
            quant_algo=_algo(qc.get("quant_algo"), file=file,
                             key="quantization_config.quant_algo", top_level=True),
            group_size=_int(group, file=file, key="quantization_config.group_size")
            if group is not None else _group_size_of_config_groups(qc),
            exclude_modules=_globs(qc.get("ignore", qc.get("exclude_modules")), file=file,
                                   key="quantization_config.ignore"),
            quantized_layers=_layers(qc.get("quantized_layers"), file=file),
            producer=_producer(qc.get("producer")),
        )
    return out


_CONFLICT_CHECKED = ("quant_algo", "moe_quant_algo", "kv_cache_quant_algo")
_SETTINGS = ("quant_algo", "moe_quant_algo", "kv_cache_quant_algo", "group_size",
             "exclude_modules", "quantized_layers", "producer")


def quantization_sources(folder: Path,
                         config: dict[str, Any]) -> list[tuple[str, dict[str, Any], bool]]:
    """What each file of ``folder`` states, in merge order: ``(file, settings, is ModelOpt's own)``.

    ``settings`` maps the names of ``_SETTINGS`` to the parsed values (``None``: not stated).
    """
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    qc = config.get("quantization_config", text_config.get("quantization_config"))
    if qc is not None and not isinstance(qc, dict):
        raise CheckpointError(f"{folder / CONFIG}: quantization_config must be an object")
    hf_path, cfg_file = folder / HF_QUANT_CONFIG, str(folder / CONFIG)
    from_file = (_from_hf_quant_config(load_json(hf_path), str(hf_path)) if hf_path.exists()
                 else None)

    sources: list[tuple[str, dict[str, Any], bool]] = []  # (file, settings, is ModelOpt's own)
    if qc is not None:
        method = str(qc.get("quant_method", "")).lower()
        is_modelopt = method == "modelopt"
        from_config = _from_config_json(qc, cfg_file, modelopt=is_modelopt)
        if not is_modelopt and from_file is None and from_config["moe_quant_algo"] is None:
            raise CheckpointError(
                f"{cfg_file}: quantization_config.quant_method is {qc.get('quant_method')!r}"
                f" and there is no {HF_QUANT_CONFIG}; accepted: ModelOpt checkpoints "
                "(quant_method 'modelopt', or an hf_quant_config.json beside config.json)"
            )
        sources.append((cfg_file, from_config, is_modelopt))
    if from_file is not None:
        # ModelOpt's own block in config.json comes first; a foreign one only fills gaps.
        position = len(sources) if sources and sources[0][2] else 0
        sources.insert(position, (str(hf_path), from_file, True))
    return sources


def read_quantization(folder: Path, config: dict[str, Any], *,
                      strict: bool = True) -> QuantizationSpec:
    """The merged quantization settings of ``folder`` (config.json already read as ``config``).

    ``strict=False`` lets the first source win a disagreement instead of raising (the checkpoint
    check reports disagreements itself and goes on to check the tensors).
    """
    dtype = config_dtype(config)
    sources = quantization_sources(folder, config)
    cfg_file = str(folder / CONFIG)

    merged: dict[str, Any] = {}
    files: dict[str, str] = {"dtype": cfg_file}
    for file, settings, _own in sources:
        for name in _SETTINGS:
            value = settings.get(name)
            if value is None:
                continue
            if name not in merged:
                merged[name], files[name] = value, file
            elif strict and name in _CONFLICT_CHECKED and value != merged[name]:
                raise CheckpointError(
                    f"{files[name]} and {file} disagree on {name}: "
                    f"{merged[name]!r} vs {value!r}; a checkpoint must state one"
                )
    return QuantizationSpec(
        quant_algo=merged.get("quant_algo"),
        kv_cache_quant_algo=merged.get("kv_cache_quant_algo"),
        moe_quant_algo=merged.get("moe_quant_algo"),
        group_size=merged.get("group_size"),
        exclude_modules=merged.get("exclude_modules", ()),
        quantized_layers=merged.get("quantized_layers", ()),
        producer=merged.get("producer"),
        dtype=str(dtype).replace("torch.", ""),
        files=tuple(sorted(files.items())),
    )
