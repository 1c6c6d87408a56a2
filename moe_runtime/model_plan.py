"""Former name of :mod:`moe_runtime.checkpoint.problems`, kept so code importing it keeps working."""

from moe_runtime.checkpoint.problems import (  # noqa: F401
    checkpoint_summary,
    problems_from_checkpoint,
)
