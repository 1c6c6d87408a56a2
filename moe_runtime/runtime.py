"""Former name of :mod:`moe_runtime.backend_api`, kept so plugins written against it keep working."""

from moe_runtime.backend_api import (  # noqa: F401
    CommBackend,
    CommSetup,
    Dispatched,
    ExpertsBackend,
    ExpertsSetup,
    ExpertWeights,
    LayerProblem,
)
