"""Lazy, memory-mapped access to a checkpoint's safetensors files (sharded or not)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

_ST_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "U8": torch.uint8, "I8": torch.int8, "I32": torch.int32, "I64": torch.int64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "BOOL": torch.bool,
    "I16": torch.int16,
}


class WeightError(ValueError):
    """A tensor is missing, has the wrong shape or dtype, or a shared scale is not shared."""


class CheckpointTensors:
    """Tensor names -> files, opened memory-mapped on demand; a tensor is read only when asked for.

    Works with a single ``model.safetensors``, with ``model.safetensors.index.json`` and its shards,
    or with any ``*.safetensors`` files in the folder.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        self._where: dict[str, Path] = {}
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise WeightError(f"{index}: not a safetensors index ({exc})") from exc
            for name, shard in weight_map.items():
                self._where[name] = self.path / shard
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise WeightError(f"{self.path}: no *.safetensors files and no index file")
            from safetensors import safe_open

            for f in files:
                with safe_open(str(f), "pt") as h:
                    for name in h.keys():
                        self._where[name] = f
        self._handles: dict[Path, object] = {}

    def _handle(self, f: Path):
        h = self._handles.get(f)
        if h is None:
            from safetensors import safe_open

            if not f.exists():
                raise WeightError(f"shard {f} named by the index file does not exist")
            h = safe_open(str(f), "pt")
            self._handles[f] = h
        return h

    def keys(self):
        return self._where.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """dtype and shape without reading the data."""
        sl = self._handle(self._where[name]).get_slice(name)
        return _ST_DTYPES.get(sl.get_dtype(), None), tuple(sl.get_shape())

    def get(self, name: str, *, layer: str = "", expect_dtype=None, expect_shape=None,
            what: str = "") -> torch.Tensor:
        """Read one tensor, checking it exists, its dtype (one of ``expect_dtype``) and shape."""
        where = f" (layer {layer})" if layer else ""
        if name not in self._where:
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
        return self._handle(self._where[name]).get_tensor(name)

    def close(self) -> None:
        self._handles.clear()
