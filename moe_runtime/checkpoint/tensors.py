"""A checkpoint's safetensors files: the one reader of their index and headers, and lazy tensors.

A safetensors file starts with an 8-byte little-endian header length and a JSON header mapping each
tensor name to ``{"dtype", "shape", "data_offsets"}``; reading it costs one small read per file,
whatever the checkpoint's size, and needs no tensor library. A sharded checkpoint lists its shards
in ``model.safetensors.index.json``. :func:`read_tensor_index` reads both (every problem a
:class:`CheckpointError`); :class:`CheckpointTensors` reads tensor data on demand from what it
found (a tensor that is missing or of the wrong dtype or shape: :class:`WeightError`).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import attrs

from moe_runtime.checkpoint.records import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024

# safetensors dtype codes: bytes per element and the torch dtype (by name: no torch import here)
DTYPES = {
    "BOOL": (1, "bool"), "U8": (1, "uint8"), "I8": (1, "int8"), "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"), "F8_E8M0": (1, "float8_e8m0fnu"), "I16": (2, "int16"),
    "U16": (2, "uint16"), "F16": (2, "float16"), "BF16": (2, "bfloat16"), "I32": (4, "int32"),
    "U32": (4, "uint32"), "F32": (4, "float32"), "I64": (8, "int64"), "U64": (8, "uint64"),
    "F64": (8, "float64"),
}
DTYPE_SIZES = {code: size for code, (size, _) in DTYPES.items()}


def torch_dtype(code: str):
    """The torch dtype of a safetensors dtype code (``None`` if this torch lacks it)."""
    import torch

    name = DTYPES.get(code, (0, None))[1]
    return getattr(torch, name, None) if name else None


class WeightError(CheckpointError):
    """A tensor is missing, has the wrong shape or dtype, or a shared scale is not shared."""


@attrs.frozen
class TensorMeta:
    """One tensor's header entry: safetensors dtype code (``"U8"``, ``"F8_E4M3"``...) and shape."""

    dtype: str
    shape: tuple[int, ...] = attrs.field(converter=tuple)
    file: str


def _header(path: Path) -> dict:
    try:
        with path.open("rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: too short to be a safetensors file")
            (size,) = struct.unpack("<Q", raw)
            if size > _MAX_HEADER:
                raise CheckpointError(f"{path}: a {size}-byte safetensors header is implausible")
            header = json.loads(fh.read(size))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror})") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return header


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of ``folder``: the index's shards, else every ``*.safetensors``."""
    index = folder / INDEX_FILE
    if index.exists():
        from moe_runtime.checkpoint.quant_config import load_json

        weight_map = load_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: missing the 'weight_map' object")
        return [folder / name for name in sorted(set(weight_map.values()))]
    return sorted(folder.glob("*.safetensors"))


def read_tensor_index(folder: Path) -> dict[str, TensorMeta]:
    """Every tensor of the checkpoint in ``folder`` by name (empty when it has no weight files)."""
    tensors: dict[str, TensorMeta] = {}
    for path in safetensors_files(folder):
        if not path.exists():
            raise CheckpointError(f"{folder / INDEX_FILE}: names {path.name}, which is missing")
        for name, meta in _header(path).items():
            if not isinstance(meta, dict) or "dtype" not in meta or "shape" not in meta:
                raise CheckpointError(f"{path}: header entry {name!r} lacks dtype or shape")
            tensors[name] = TensorMeta(meta["dtype"], meta["shape"], path.name)
    return tensors


class CheckpointTensors:
    """Tensor names -> files, opened memory-mapped on demand; a tensor is read only when asked for.

    Works with a single ``model.safetensors``, with ``model.safetensors.index.json`` and its shards,
    or with any ``*.safetensors`` files in the folder (the files :func:`read_tensor_index` reads).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._meta = read_tensor_index(self.path)
        if not self._meta and not (self.path / INDEX_FILE).exists():
            raise WeightError(f"{self.path}: no *.safetensors files and no index file")
        self._handles: dict[str, object] = {}

    def _handle(self, file: str):
        h = self._handles.get(file)
        if h is None:
            from safetensors import safe_open

            h = safe_open(str(self.path / file), "pt")
            self._handles[file] = h
        return h

    def keys(self):
        return self._meta.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._meta

    def meta(self, name: str) -> tuple:
        """(torch dtype, shape) without reading the data."""
        m = self._meta[name]
        return torch_dtype(m.dtype), tuple(m.shape)

    def get(self, name: str, *, layer: str = "", expect_dtype=None, expect_shape=None,
            what: str = ""):
        """Read one tensor, checking it exists, its dtype (one of ``expect_dtype``) and shape."""
        where = f" (layer {layer})" if layer else ""
        if name not in self._meta:
            raise WeightError(
                f"tensor {name!r}{where} is missing from {self.path}"
                + (f"; expected {what}" if what else "")
            )
        if expect_dtype is not None or expect_shape is not None:
            dtype, shape = self.meta(name)
            dtypes = expect_dtype if isinstance(expect_dtype, tuple) else (expect_dtype,)
            if expect_dtype is not None and dtype not in dtypes:
                raise WeightError(
                    f"tensor {name!r}{where} has dtype {dtype}; expected "
                    f"{' or '.join(str(d) for d in dtypes)}" + (f" ({what})" if what else "")
                )
            if expect_shape is not None and tuple(shape) != tuple(expect_shape):
                raise WeightError(
                    f"tensor {name!r}{where} has shape {list(shape)}; expected "
                    f"{list(expect_shape)}" + (f" ({what})" if what else "")
                )
        return self._handle(self._meta[name].file).get_tensor(name)

    def close(self) -> None:
        self._handles.clear()
