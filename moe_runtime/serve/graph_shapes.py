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

Steps that carry prefill tokens replay graphs too by default (eager, such a step costs 150+ ms
of host time at 48 layers, against ~16 GPU ms for a graphed decode step):
:func:`bucket_prefill_queries` pads their query tokens to :func:`query_bucket` (multiples of 8 up
to the decode batch, as decode steps are padded, then powers of two up to the prefill chunk), so
the graphs stay within :func:`prefill_graph_bound`: query sizes x KV-read sizes x key-length
sizes. ``MOE_RUNTIME_GRAPH_PREFILL=0`` (or the engine's ``graph_prefill=False``) runs them eagerly.
Default on because it was measured faster: on an H200 on 2026-12-04 (21:27 UTC), a 48-layer
Qwen3-30B-A3B-shaped NVFP4 checkpoint served in-process by benchmarks/bench_serve.py gave 527.7 /
729.1 output tok/s at 16 / 64 clients with prefill graphed, against 492.6 / 685.2 with it eager
(run 4, 18:34 UTC), and TTFT p50 96.5 against 116.6 ms at 16 clients (RESULTS.md, "Serve"); the
GPU test of graphed prefill (eager's greedy tokens) passed on the H200.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("moe_runtime.serve.graph_shapes")

KV_FLOOR = 256  # the smallest KV read a varlen step is padded to (tokens)
Q_STEP = 8  # query tokens of a varlen step are padded to a multiple of this up to the batch
SEQLEN_K_FLOOR = 1024  # transformers pads a graphed varlen step's max key length to a power of 2
CUDNN_ENV = "MOE_RUNTIME_CUDNN_SDPA"
PREFILL_ENV = "MOE_RUNTIME_GRAPH_PREFILL"
ASYNC_ENV = "MOE_RUNTIME_ASYNC_BATCHING"


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


def query_bucket(tokens: int, cap: int, dense_up_to: int, step: int = Q_STEP) -> int:
    """The query tokens a varlen step of ``tokens`` is padded to: a multiple of ``step`` while
    ``tokens <= dense_up_to`` (the decode batch: decode steps keep today's padding), else the next
    power of two, at most ``cap`` (the prefill chunk) and never below ``tokens``."""
    if tokens < 0 or cap < 1 or dense_up_to < 0 or step < 1:
        raise ValueError(f"query_bucket({tokens}, cap={cap}, dense_up_to={dense_up_to}, "
                         f"step={step}): tokens and dense_up_to must be >= 0, cap and step >= 1")
    if tokens <= dense_up_to:
        size = max(step, -(-tokens // step) * step)
    else:
        size = step
        while size < tokens:
            size *= 2
    return max(tokens, min(size, cap))


def query_buckets(cap: int, dense_up_to: int, step: int = Q_STEP) -> list[int]:
    """Every size :func:`query_bucket` gives for 1 ... ``cap`` tokens, smallest first."""
    return sorted({query_bucket(t, cap, dense_up_to, step) for t in range(1, cap + 1)})


def kv_buckets(cap: int, floor: int = KV_FLOOR) -> list[int]:
    """Every size :func:`kv_bucket` gives for 0 ... ``cap`` live KV tokens, smallest first."""
    sizes = {cap}
    size = floor
    while size < cap:
        sizes.add(size)
        size *= 2
    return sorted(sizes)


def seqlen_k_buckets(cap: int, longest: int, floor: int = SEQLEN_K_FLOOR) -> list[int]:
    """The max key lengths transformers (5.14) keys a graphed varlen step by, for sequences of
    at most ``longest`` tokens: powers of two from ``floor``, capped at the cache's ``cap``."""
    sizes = {min(floor, cap)}
    size = floor
    while size < longest:
        size *= 2
        sizes.add(min(size, cap))
    return sorted(sizes)


def prefill_graph_bound(max_batch_tokens: int, batch_cap: int, cache_tokens: int,
                        context_length: int) -> dict:
    """How many varlen graphs prefill graphing may capture at most: one per query size, KV-read
    size and max key length a step can be padded to (transformers keys its graphs by the three,
    the key length once per attention kind: one for full-attention-only models). Real traffic
    reaches far fewer: the KV read and the key length grow together."""
    q = query_buckets(max_batch_tokens, batch_cap)
    kv = kv_buckets(cache_tokens)
    keys = seqlen_k_buckets(cache_tokens, context_length)
    return {"query": q, "kv": kv, "seqlen_k": keys, "graphs": len(q) * len(kv) * len(keys)}


def on_cuda(device) -> bool:
    """Whether ``device`` (a torch.device, a string such as ``"cuda:0"``, or None) is a CUDA
    device."""
    return device is not None and str(device).split(":")[0] == "cuda"


def env_switch(name: str, expected: str) -> bool | None:
    """Environment variable ``name`` as a switch: ``1`` True, ``0`` False, unset (or empty)
    None; any other value a ValueError quoting it and ``expected``."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name}={value!r}: expected {expected}")
    return None if value == "" else value == "1"


def prefill_graphs_requested(requested: bool | None = None) -> bool:
    """The engine's ``graph_prefill`` (it wins); ``None`` reads ``MOE_RUNTIME_GRAPH_PREFILL``
    (``1`` or unset: on, the default, measured faster on an H200; ``0``: off, prefill steps run
    eagerly)."""
    if requested is not None:
        return bool(requested)
    return env_switch(PREFILL_ENV, "1 or unset (graph prefill steps, the default) or 0 (prefill "
                                "steps run eagerly)") is not False


def async_batching_requested(requested: bool | None = None) -> bool | None:
    """The engine's ``async_batching``; ``None`` reads ``MOE_RUNTIME_ASYNC_BATCHING`` (``0`` off,
    ``1`` on, unset: None, the default). Here, not in batching.py, so that the command line checks
    it before torch is imported."""
    if requested is not None:
        return bool(requested)
    return env_switch(ASYNC_ENV, "1 (prepare the next step while the current one runs on a CUDA "
                              "device), 0 or unset (one step at a time)")


def graph_this_step(graphed: bool, decode_only: bool, prefill: bool) -> bool:
    """Whether a step replays (or captures) a graph: transformers' choice ``graphed``, for
    decode-only steps always, for steps carrying prefill tokens only with ``prefill``."""
    return graphed and (decode_only or prefill)


def _padding_owner(processor: Any) -> Any:
    return next((o for o in (getattr(processor, "model_runner", None), processor)
                 if o is not None and callable(getattr(o, "maybe_pad_inputs", None))), None)


def bucket_prefill_queries(processor: Any, cap: int, dense_up_to: int,
                           step: int = Q_STEP) -> bool:
    """Make ``processor``'s varlen steps pad their query tokens to :func:`query_bucket` (rather
    than transformers' interval, 2048 / 8 = 256 sizes for a 2048-token chunk). Returns False
    (and changes nothing) where this transformers has no ``maybe_pad_inputs`` to wrap."""
    owner = _padding_owner(processor)
    if owner is None:
        log.info("this transformers has no maybe_pad_inputs: prefill steps stay eager")
        return False
    original = owner.maybe_pad_inputs
    # never beyond the static input tensors, which transformers sizes to its cache's chunk
    limit = min(cap, getattr(getattr(owner, "cache", None), "max_batch_tokens", cap))

    def maybe_pad_inputs(num_q_tokens: int, max_kv_read: int, use_decode_fast_path: bool):
        q, kv = original(num_q_tokens, max_kv_read, use_decode_fast_path)
        if use_decode_fast_path or not getattr(owner, "pad_inputs", True):
            return q, kv
        return max(q, query_bucket(num_q_tokens, cap=limit, dense_up_to=dense_up_to,
                                   step=step)), kv

    owner.maybe_pad_inputs = maybe_pad_inputs
    return True


def bucket_kv_reads(processor: Any, floor: int = KV_FLOOR) -> bool:
    """Make ``processor``'s varlen steps read KV padded to :func:`kv_bucket` rather than
    transformers' interval. Returns False (and changes nothing) where this transformers has no
    ``maybe_pad_inputs`` to wrap; the original still pads queries and caps at the cache."""
    owner = _padding_owner(processor)
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
