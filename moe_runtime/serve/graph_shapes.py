"""Shapes of continuous batching's graph-replayed steps, and the attention backend under them.

Measured on an H200 with a 48-layer Qwen3-30B-A3B-shaped checkpoint (benchmarks/profile_serve.py,
RESULTS.md "Serving"), two things made a served decode step several times slower than its layers:

- **KV reads padded to the whole cache.** transformers' varlen path (the decode path when flash
  attention's is missing) pads the keys and values it reads to ``kv_padding_interval_size``
  tokens, 16384 by default, capped at the cache's size. Each graph-replayed step then gathered,
  repeated and attended over every cache slot: 23 of a 1-client step's 31 GPU ms went to
  attention and KV copies over 10304 slots for 160 live tokens. :func:`bucket_kv_reads` pads
  instead to the next power of two (from :data:`KV_FLOOR` tokens), so a step reads at most twice
  what it needs and the graphs stay few (one per query bucket and KV bucket).
- **cuDNN attention plans each new shape.** PyTorch picks cuDNN's SDPA kernel for masked
  attention on Hopper; its host side cost about 1 ms per call whenever the shape was new, which
  is every eager step (the KV length grows by one token a step): 49 ms of a 186 ms eager step.
  :func:`prefer_replanning_free_attention` turns PyTorch's cuDNN SDPA backend off for the served
  process (the memory-efficient kernel takes the same masks), unless
  ``MOE_RUNTIME_CUDNN_SDPA=1``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("moe_runtime.serve.graph_shapes")

KV_FLOOR = 256  # the smallest KV read a varlen step is padded to (tokens)
CUDNN_ENV = "MOE_RUNTIME_CUDNN_SDPA"


def kv_bucket(tokens: int, cap: int, floor: int = KV_FLOOR) -> int:
    """The KV read a step of ``tokens`` live KV tokens is padded to: the next power of two from
    ``floor``, at most ``cap`` (the cache's size), never below ``tokens``."""
    if tokens < 0 or cap < 1 or floor < 1:
        raise ValueError(f"kv_bucket({tokens}, cap={cap}, floor={floor}): tokens must be >= 0, "
                         "cap and floor >= 1")
    size = floor
    while size < tokens:
        size *= 2
    return max(tokens, min(size, cap))


def bucket_kv_reads(processor: Any, floor: int = KV_FLOOR) -> bool:
    """Make ``processor``'s varlen steps read KV padded to :func:`kv_bucket` rather than
    transformers' interval. Returns False (and changes nothing) where this transformers has no
    ``maybe_pad_inputs`` to wrap; the original still pads queries and caps at the cache."""
    owner = next((o for o in (getattr(processor, "model_runner", None), processor)
                  if o is not None and callable(getattr(o, "maybe_pad_inputs", None))), None)
    if owner is None:
        log.info("this transformers has no maybe_pad_inputs: KV reads keep its padding")
        return False
    original = owner.maybe_pad_inputs

    def maybe_pad_inputs(num_q_tokens: int, max_kv_read: int, use_decode_fast_path: bool):
        q, kv = original(num_q_tokens, max_kv_read, use_decode_fast_path)
        if use_decode_fast_path or kv <= max_kv_read:
            return q, kv
        return q, kv_bucket(max_kv_read, cap=kv, floor=floor)

    owner.maybe_pad_inputs = maybe_pad_inputs
    return True


def prefer_replanning_free_attention(device: Any) -> str | None:
    """Turn PyTorch's cuDNN SDPA backend off on a CUDA device (see the module docstring).
    Returns a sentence for the start-up log, or None where nothing changed."""
    import torch

    if not str(device).startswith("cuda") or os.environ.get(CUDNN_ENV) == "1":
        return None
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return None
    torch.backends.cuda.enable_cudnn_sdp(False)
    return (f"cuDNN attention off (it plans every new shape, about 1 ms per call on an H200); "
            f"{CUDNN_ENV}=1 keeps it")
