"""The plugin distributions kept in this repository, named in messages so users know what to install.

A pinned backend that is not registered, or a plan whose layers run degraded, is easier to act on
when the message says which first-party distribution would add backends and the exact command that
installs it. This table is for those messages only: what a backend can run comes from its installed
declaration alone, and no plan changes with this table's contents. A third party's plugin needs no
entry here.
"""

from __future__ import annotations

from importlib import metadata
from typing import Callable, Iterable

import attrs

CHECKOUT_NOTE = "from a moe-runtime checkout"


@attrs.frozen
class FirstPartyPlugin:
    """One plugin distribution of this repository."""

    distribution: str  # the distribution name on the index and in ``pip list``
    path: str  # its folder in a moe-runtime checkout
    role: str  # "experts" or "communication"
    backends: tuple[str, ...] = attrs.field(converter=tuple)  # the names it registers
    summary: str  # what it runs, in words
    extra: str = ""  # the further step its kernels need, in words

    @property
    def install_command(self) -> str:
        return f"pip install ./{self.path}"

    def install_hint(self) -> str:
        hint = f"{self.install_command} ({CHECKOUT_NOTE})"
        return f"{hint}; {self.extra}" if self.extra else hint


FIRST_PARTY: tuple[FirstPartyPlugin, ...] = (
    FirstPartyPlugin(
        distribution="moe-runtime-triton",
        path="plugins/triton",
        role="experts",
        backends=("triton",),
        summary="Triton grouped GEMMs: BF16/FP16, FP8 W8A8, NVFP4 weights with 16-bit activations",
    ),
    FirstPartyPlugin(
        distribution="moe-runtime-flashinfer-cutedsl",
        path="plugins/flashinfer_cutedsl",
        role="experts",
        backends=("flashinfer_cutedsl",),
        summary="FlashInfer CuTe-DSL NVFP4 MoE (CUDA compute capability 10.x)",
        extra="its kernels need the [kernels] extra: pip install './plugins/flashinfer_cutedsl[kernels]'",
    ),
    FirstPartyPlugin(
        distribution="moe-runtime-humming",
        path="plugins/humming",
        role="experts",
        backends=("humming",),
        summary="Humming's NVFP4 W4A16 grouped GEMMs (CUDA compute capability 9.0)",
        extra="its kernels need the [kernels] extra: pip install './plugins/humming[kernels]'",
    ),
    FirstPartyPlugin(
        distribution="moe-runtime-deepep",
        path="plugins/deepep",
        role="communication",
        backends=("deepep",),
        summary="DeepEP expert-parallel dispatch/combine (normal and low-latency modes)",
        extra="DeepEP itself is built from a release checkout (see plugins/deepep/README.md)",
    ),
)


def is_installed(distribution: str) -> bool:
    """Whether ``distribution`` is installed in this environment."""
    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def providing(backend: str) -> FirstPartyPlugin | None:
    """The first-party plugin that registers ``backend``, if one does."""
    return next((p for p in FIRST_PARTY if backend in p.backends), None)


def unregistered_backend_hint(
    backend: str, *, installed: Callable[[str], bool] | None = None
) -> str:
    """A sentence for the error about a pinned ``backend`` that is not registered ("" if unknown)."""
    plugin = providing(backend)
    if plugin is None:
        return ""
    if (installed or is_installed)(plugin.distribution):
        return (f"; {backend!r} comes from {plugin.distribution}, which is installed but did not "
                "register it (blocked, or failed to load: see `moe-runtime plugins`)")
    return (f"; {backend!r} comes from the first-party plugin {plugin.distribution}, which is not "
            f"installed: {plugin.install_hint()}")


def not_installed(
    role: str, *, installed: Callable[[str], bool] | None = None
) -> list[FirstPartyPlugin]:
    """First-party plugins of ``role`` ("experts" or "communication") missing from this environment."""
    installed = installed or is_installed
    return [p for p in FIRST_PARTY if p.role == role and not installed(p.distribution)]


def degraded_plan_hints(
    degraded_layers: Iterable[str], *, installed: Callable[[str], bool] | None = None
) -> list[str]:
    """Lines for a plan whose ``degraded_layers`` run degraded: the experts plugins not installed.

    Whether a missing plugin would run those layers natively is for its declaration to say once it
    is installed; these lines only say what could be tried, and how.
    """
    layers = list(degraded_layers)
    missing = not_installed("experts", installed=installed) if layers else []
    if not missing:
        return []
    lines = [f"{len(layers)} layer(s) run degraded; first-party experts backends not installed "
             "here, which may run them natively (`moe-runtime plan` again after installing):"]
    for p in missing:
        lines.append(f"  {', '.join(p.backends)} ({p.distribution}: {p.summary}): {p.install_hint()}")
    return lines
