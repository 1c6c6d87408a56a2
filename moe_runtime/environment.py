"""The machine a plan is made for: probed once, or given explicitly (``--target-device sm100``).

Capability checks never probe hardware or read environment variables: they read this record.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re

import attrs

from moe_runtime.declarations import format_capability


def _fs_or_none(items):
    return None if items is None else frozenset(items)


@attrs.frozen
class Environment:
    """Device kind, compute capability and importable modules of one machine.

    :param device: ``"cpu"`` or ``"cuda"``.
    :param capability: CUDA compute capability, ``None`` on CPU.
    :param available: importable top-level modules among those some backend requires, or ``None``
        when they were not checked (a target described by hand): requirements are then assumed met
        and the plan says so.
    :param name: a label for people (``"NVIDIA H200"``, ``"target sm100"``).
    :param checked: the modules :meth:`probe` looked for (``available`` is the importable part);
        empty for an environment built by hand or read back. Not part of equality or the
        fingerprint: it says what was looked at, ``available`` what was found.
    """

    device: str
    capability: tuple[int, int] | None = None
    available: frozenset[str] | None = attrs.field(default=None, converter=_fs_or_none)
    name: str = ""
    checked: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset, eq=False,
                                          repr=False)

    @property
    def described(self) -> str:
        if self.device == "cuda" and self.capability:
            return f"{self.name or 'CUDA'} (compute capability {format_capability(self.capability)})"
        return self.name or self.device

    def fingerprint(self) -> str:
        """A short hash: ranks whose fingerprints differ may plan differently, and would hang."""
        data = json.dumps(
            [self.device, self.capability, sorted(self.available or []), self.available is None]
        )
        return hashlib.sha256(data.encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        return {
            "device": self.device,
            "capability": format_capability(self.capability) if self.capability else None,
            "available": sorted(self.available) if self.available is not None else None,
            "name": self.name,
            "fingerprint": self.fingerprint(),
        }

    @classmethod
    def from_json(cls, data: dict) -> Environment:
        """The inverse of :meth:`to_json` (its ``fingerprint`` is recomputed, not read)."""
        from moe_runtime.declarations import parse_capability

        cap = data.get("capability")
        return cls(data["device"], parse_capability(cap) if cap else None,
                   data.get("available"), data.get("name", ""))

    @staticmethod
    def device_problem(device: str) -> str | None:
        """Why ``device`` names no device of this machine (``cpu``, ``cuda``, ``cuda:N``), or
        None: said before anything is loaded or measured for it."""
        import torch

        kind, colon, index = device.partition(":")
        if kind not in ("cpu", "cuda") or (colon and (kind == "cpu" or not index.isdigit())):
            return f"device {device!r} is not supported; use cpu, cuda or cuda:N"
        if kind == "cuda":
            if not torch.cuda.is_available():
                return f"device {device!r} was asked for but CUDA is not available here"
            count = torch.cuda.device_count()
            if colon and int(index) >= count:
                return (f"device {device!r} was asked for but this machine has {count} CUDA "
                        f"device(s): cuda:0 to cuda:{count - 1}")
        return None

    @classmethod
    def probe(cls, *, device: str | None = None, modules=()) -> Environment:
        """Look at this machine once: the torch device and which of ``modules`` are importable."""
        import torch

        modules = frozenset(modules)
        available = frozenset(m for m in modules if importable(m))
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        kind = device.split(":")[0]
        if kind == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {device!r} was asked for but CUDA is not available here")
            index = torch.device(device).index or 0
            cap = tuple(torch.cuda.get_device_capability(index))
            return cls("cuda", cap, available, torch.cuda.get_device_name(index), modules)
        if kind != "cpu":
            raise ValueError(f"device {device!r} is not supported; use 'cpu' or 'cuda[:N]'")
        return cls("cpu", None, available, "cpu", modules)

    @classmethod
    def for_target(cls, target: str) -> Environment:
        """An environment described by name: ``cpu``, ``sm90``, ``sm100``, ``sm_103``, ``cuda:9.0``.

        Importable modules are not checked for a described target.
        """
        t = target.strip().lower()
        if t == "cpu":
            return cls("cpu", None, None, "target cpu")
        m = re.fullmatch(r"sm_?(\d+?)(\d)a?", t) or re.fullmatch(r"cuda:(\d+)\.(\d+)", t)
        if not m:
            raise ValueError(
                f"target device {target!r} not understood; use 'cpu', 'smXY' (e.g. sm90, sm100, "
                "sm103) or 'cuda:MAJOR.MINOR'"
            )
        cap = (int(m.group(1)), int(m.group(2)))
        return cls("cuda", cap, None, f"target {target}")


def importable(module: str) -> bool:
    """Whether the top-level ``module`` can be imported here (found, not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
