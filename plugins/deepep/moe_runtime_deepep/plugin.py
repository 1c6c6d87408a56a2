"""The declaration of the ``deepep`` communication backend, and the hook that registers it.

The entry point (group ``moe_runtime``, name ``deepep``): no torch, no ``deep_ep``; the backend
class is imported only when the planner selects it. Why each mode declares what it does:
README.md, "What is declared" and "Module notes".
"""

from __future__ import annotations

from moe_runtime import formats as F
from moe_runtime.declarations import CapabilityRange, CommBackendSpec, CommSupport, Hardware
from moe_runtime.plugin.hookspecs import hookimpl

from moe_runtime_deepep import limits
from moe_runtime_deepep.settings import DeepEPSettings

NAME = "deepep"
FACTORY = "moe_runtime_deepep.backend:DeepEPComm"
MODE_NORMAL = "normal"
MODE_LOW_LATENCY = "low_latency"

#: Modules that must be importable. ``deep_ep`` is DeepEP's package (its extension is
#: ``deep_ep_cpp`` in 1.0.0-1.2.x and ``deep_ep._C`` after the V2 reorganisation).
REQUIRES = ("deep_ep", "torch")

HOPPER_PLUS = Hardware(
    devices=("cuda",),
    cuda_capabilities=(CapabilityRange("9.0"),),
    requires=REQUIRES,
)

DESCRIPTION = (
    "Expert parallelism through DeepEP: normal mode (token-major, intranode 2/4/8 ranks, bf16 or "
    "fp8 with the layer's input scale) and low-latency mode (masked layout, bf16, bounded tokens "
    "per rank). Not yet run on GPUs."
)


def build_spec(settings: DeepEPSettings | None = None) -> CommBackendSpec:
    """The declaration for ``settings`` (default: read from the environment)."""
    settings = DeepEPSettings.from_env() if settings is None else settings
    ll_sizes = {n for lo, hi in limits.low_latency_world_sizes() for n in range(lo, hi + 1)}
    modes = [
        CommSupport(
            layout=F.MASKED,
            payloads=(F.UNQUANTIZED,),
            world_sizes=ll_sizes,
            max_tokens_per_rank=low_latency_bound(settings),
            hardware=HOPPER_PLUS,
            mode=MODE_LOW_LATENCY,
        ),
        CommSupport(
            layout=F.TOKEN_MAJOR,
            payloads=limits.NORMAL_PAYLOADS,
            world_sizes=limits.NORMAL_INTRANODE_WORLD_SIZES,
            max_tokens_per_rank=None,
            hardware=HOPPER_PLUS,
            mode=MODE_NORMAL,
        ),
    ]
    description = DESCRIPTION
    if settings.ll_oversize == "split":
        rounds = limits.rounds_for(settings.ll_split_max_tokens_per_rank,
                                   settings.ll_max_tokens_per_rank)
        description += (f" Split: every low-latency forward runs {rounds} rounds of at most "
                        f"{settings.ll_max_tokens_per_rank} tokens per rank.")
    return CommBackendSpec(
        name=NAME,
        factory=FACTORY,
        supports=tuple(modes),
        priority=20,
        description=description,
    )


def low_latency_bound(settings: DeepEPSettings) -> int:
    """The most tokens per rank a low-latency forward carries: one call's bound, or under
    ``split`` the bound of all its rounds."""
    if settings.ll_oversize == "split":
        return settings.ll_split_max_tokens_per_rank
    return settings.ll_max_tokens_per_rank


def mode_for_layout(layout: str) -> str:
    """The DeepEP mode that produces ``layout`` (the plan fixes the layout per layer)."""
    if layout == F.MASKED:
        return MODE_LOW_LATENCY
    if layout == F.TOKEN_MAJOR:
        return MODE_NORMAL
    raise ValueError(f"deepep produces the layouts {F.TOKEN_MAJOR} and {F.MASKED}, not {layout!r}")


class DeepEPPlugin:
    """A plugin object registering the declaration for explicit ``settings``.

    For programs that configure the bound in code: block the entry point and pass an instance,
    ``get_plugin_manager(blocked=["deepep"], plugins=[DeepEPPlugin(DeepEPSettings(...))])``.
    The backend reads the plan's bound from its ``CommSetup``; its run-time policies come from the
    environment unless given to ``DeepEPComm(settings=...)``.
    """

    def __init__(self, settings: DeepEPSettings) -> None:
        self.settings = settings

    @hookimpl
    def moe_runtime_register_backends(self, register):
        register(build_spec(self.settings))


@hookimpl
def moe_runtime_register_backends(register):
    register(build_spec())
