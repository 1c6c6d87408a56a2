"""A checkpoint's safetensors files: the one reader of their index and headers, and lazy tensors.

A safetensors file starts with an 8-byte little-endian header length and a JSON header mapping each
tensor name to ``{"dtype", "shape", "data_offsets"}``; reading it costs one small read per file,
whatever the checkpoint's size, and needs no tensor library. A sharded checkpoint lists its shards
in ``model.safetensors.index.json``. :func:`read_header` and :func:`weight_map_of` are the only
readers of those two (a :class:`HeaderError` says what is wrong and what would be accepted;
``moe-runtime check`` reports it, loading raises it); :func:`read_tensor_index` reads a folder's
tensors through them, and :class:`CheckpointTensors` reads tensor data on demand from what it
found (a tensor that is missing or of the wrong dtype or shape: :class:`WeightError`).
"""

from __future__ import annotations

import json
import math
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


_CHUNK = 1 << 26  # elements per pass of the finiteness scan (a bool temporary of 64 MiB at most)


def nonfinite(t) -> tuple[int, int]:
    """``(count, first flat index)`` of the NaN and infinite values of ``t`` (``(0, -1)`` when
    there are none). float8 e4m3fn counts its NaN codes (it has no infinity); e5m2 its codes of
    an all-ones exponent; integer tensors, packed NVFP4 included (e2m1 has no such codes), have
    none. Scans on ``t``'s device, in chunks."""
    import torch

    flat = t.detach().reshape(-1)
    if t.dtype == torch.float8_e4m3fn:
        bad_of = lambda c: (c.view(torch.uint8) & 0x7F) == 0x7F
        if flat.numel() == 0 or int((flat.view(torch.uint8) & 0x7F).amax()) != 0x7F:
            return 0, -1  # one reduction, one sync: the usual answer
    elif t.dtype == torch.float8_e5m2:
        bad_of = lambda c: (c.view(torch.uint8) & 0x7C) == 0x7C
    elif t.dtype == getattr(torch, "float8_e8m0fnu", None):
        bad_of = lambda c: c.view(torch.uint8) == 0xFF  # its one NaN code
    elif t.is_floating_point():
        bad_of = lambda c: ~torch.isfinite(c)
        # a finite float32 sum says every value is finite (a NaN or an infinity makes it not);
        # a sum that overflows only costs the exact scan below, never a false refusal
        if flat.numel() == 0 or bool(torch.isfinite(flat.sum(dtype=torch.float32))):
            return 0, -1
    else:
        return 0, -1
    count, first = 0, -1
    for start in range(0, flat.numel(), _CHUNK):
        bad = bad_of(flat[start:start + _CHUNK])
        n = int(bad.sum())
        if n and first < 0:
            first = start + int(bad.nonzero()[0, 0])
        count += n
    return count, first


def require_finite(t, what: str, where: str = "") -> None:
    """Raise :class:`WeightError` naming ``what`` when ``t`` holds a NaN or an infinity: a model
    served with one answers every request with garbage (or NaN logits), so loading stops."""
    count, first = nonfinite(t)
    if count:
        raise WeightError(
            f"{what}{where} holds {count} NaN or infinite value(s) of {t.numel()} (the first at "
            f"flat index {first}, shape {list(t.shape)}); every served weight must be finite: "
            "re-export or repair the checkpoint")


@attrs.frozen
class TensorMeta:
    """One tensor's header entry: safetensors dtype code (``"U8"``, ``"F8_E4M3"``...) and shape."""

    dtype: str
    shape: tuple[int, ...] = attrs.field(converter=tuple)
    file: str


class HeaderError(CheckpointError):
    """A safetensors file's header or an index cannot be read as one: ``problem`` says what is
    wrong with ``where`` (a file), ``expected`` what would be accepted."""

    def __init__(self, where: Path, problem: str, expected: str) -> None:
        super().__init__(f"{where}: {problem}")
        self.where, self.problem, self.expected = where, problem, expected


@attrs.frozen
class SafetensorsHeader:
    """One file's header: its raw entries (``__metadata__`` left out) and the sizes around them."""

    entries: dict
    header_size: int  # bytes of JSON after the 8-byte length field
    file_size: int

    @property
    def data_size(self) -> int:
        return self.file_size - 8 - self.header_size

    def data_range(self, name: str) -> tuple[int, int]:
        """Where tensor ``name``'s bytes lie in the file (absolute offsets)."""
        start, end = self.entries[name]["data_offsets"]
        return 8 + self.header_size + start, 8 + self.header_size + end


def read_header(path: Path) -> SafetensorsHeader:
    """The header of the safetensors file ``path`` (:class:`HeaderError` if it cannot be one)."""
    shape_of_file = ("a safetensors file (8-byte little-endian header length, then that many "
                     "bytes of JSON, then data)")
    try:
        file_size = path.stat().st_size
        with path.open("rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise HeaderError(path, f"is {len(raw)} bytes long, too short to be a "
                                  "safetensors file", shape_of_file)
            (size,) = struct.unpack("<Q", raw)
            if size > min(_MAX_HEADER, file_size - 8):
                raise HeaderError(path, f"its header length field says {size} bytes but the file "
                                  f"has {file_size} bytes: the header is corrupt", shape_of_file)
            header = json.loads(fh.read(size))
    except HeaderError:
        raise  # a ValueError too: not to be reported as invalid JSON below
    except OSError as exc:
        raise HeaderError(path, f"cannot be read ({exc.strerror})", "a readable file") from exc
    except (ValueError, RecursionError) as exc:
        raise HeaderError(path, f"the header is not valid JSON ({exc})",
                          "a safetensors header: a JSON object of name -> "
                          "{dtype, shape, data_offsets}") from None
    if not isinstance(header, dict):
        raise HeaderError(path, "the header is not a JSON object",
                          "a JSON object of tensor name -> {dtype, shape, data_offsets}")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(v, str) for v in metadata.values())):
        raise HeaderError(path, f"the header's __metadata__ is {_short(metadata)}; the "
                          "safetensors library refuses anything else",
                          "__metadata__ as an object of string -> string (or none)")
    return SafetensorsHeader(header, size, file_size)


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def layout_problem(header: SafetensorsHeader) -> str | None:
    """Why the (individually valid) entries do not tile the data bytes as the safetensors
    library requires: in offset order each tensor starts where the one before ends, and the last
    ends at the end of the file; ``None`` if they do."""
    spans = sorted((e["data_offsets"][0], e["data_offsets"][1], name)
                   for name, e in header.entries.items())
    at = 0
    for start, end, name in spans:
        if start != at:
            return (f"tensor {name!r} starts at data byte {start}, but the tensor before it ends "
                    f"at {at}: " + ("their bytes overlap" if start < at else
                                    f"{start - at} bytes between them belong to no tensor"))
        at = end
    if at != header.data_size:
        return (f"its tensors end at data byte {at} but the file holds {header.data_size} data "
                f"bytes: {header.data_size - at} bytes after the last tensor belong to none")
    return None


def header_entry_problem(meta, data_size: int) -> str | None:
    """Why one header entry is malformed (``None`` if it is not): a known dtype, a shape of sizes,
    ``data_offsets`` within the file's ``data_size`` data bytes that span exactly the tensor."""
    if not isinstance(meta, dict):
        return "is not an object"
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        return f"has unknown dtype {dtype!r}"
    if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        return f"has shape {shape!r}, not a list of sizes"
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        return f"has data_offsets {offsets!r}, not [start, end]"
    start, end = offsets
    if 0 <= end < start:
        return f"has data_offsets [{start}, {end}]: it would start after it ends"
    if not 0 <= start <= end <= data_size:
        return (f"has data_offsets [{start}, {end}] outside the file's {data_size} data bytes "
                "(a truncated file?)")
    need = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - start != need:
        return f"is {dtype} {shape} ({need} bytes) but data_offsets span {end - start} bytes"
    return None


def weight_map_of(index_data, index: Path) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file name) of the parsed index file ``index``."""
    weight_map = index_data.get("weight_map") if isinstance(index_data, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise HeaderError(index, "has no 'weight_map' object of tensor -> file",
                          '{"weight_map": {"tensor name": "shard file name", ...}}')
    return weight_map


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of ``folder``: the index's shards, else every ``*.safetensors``."""
    index = folder / INDEX_FILE
    if index.exists():
        from moe_runtime.checkpoint.quant_config import load_json

        weight_map = weight_map_of(load_json(index), index)
        return [folder / name for name in sorted(set(weight_map.values()))]
    return sorted(folder.glob("*.safetensors"))


def read_tensor_index(folder: Path) -> dict[str, TensorMeta]:
    """Every tensor of the checkpoint in ``folder`` by name (empty when it has no weight files)."""
    tensors: dict[str, TensorMeta] = {}
    for path in safetensors_files(folder):
        if not path.exists():
            raise CheckpointError(f"{folder / INDEX_FILE}: names {path.name}, which is missing")
        for name, meta in read_header(path).entries.items():
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
