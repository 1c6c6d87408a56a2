"""Names, dtypes and shapes of a checkpoint's tensors, read from the safetensors headers only.

A safetensors file starts with an 8-byte little-endian header length and a JSON header mapping each
tensor name to ``{"dtype", "shape", "data_offsets"}``; reading it costs one small read per file,
whatever the checkpoint's size, and needs no tensor library.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import attrs

from moe_runtime.checkpoint.records import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024


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
