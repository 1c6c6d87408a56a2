"""Former home of :class:`CheckpointTensors` and :class:`WeightError`, kept as a re-export: the
safetensors index and headers are read in :mod:`moe_runtime.checkpoint.tensors`."""

from moe_runtime.checkpoint.tensors import CheckpointTensors, WeightError  # noqa: F401
