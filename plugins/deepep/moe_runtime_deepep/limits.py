"""What DeepEP itself accepts, as read from its source, and the checks built on it.

Pure Python (no torch, no deep_ep): the entry-point module builds the declaration from these
numbers, and the backend checks a layer against them before it allocates anything, so that a layer
DeepEP would abort on (``EP_HOST_ASSERT``) or hang on is refused with a sentence instead. The
sources read are listed in README.md, "Module notes".
"""

from __future__ import annotations

import math

from moe_runtime import formats as F
from moe_runtime.placement import local_experts

#: ``NUM_MAX_NVL_PEERS`` (configs.cuh): ranks that one NVLink (intranode) buffer connects.
NUM_MAX_NVL_PEERS = 8

#: ``SWITCH_RANKS`` (launch.cuh): the intranode normal kernels are compiled for these group sizes
#: only (any other size aborts with "Unsupported ranks").
NORMAL_INTRANODE_WORLD_SIZES: tuple[int, ...] = (2, 4, 8)

#: ``Buffer::Buffer`` asserts
#: ``num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0`` for every mode. The
#: low-latency kernels have no ``SWITCH_RANKS``; the declaration lists the group sizes 2..7, then
#: multiples of 8 up to this bound (a choice, not a DeepEP limit).
LOW_LATENCY_MAX_DECLARED_WORLD_SIZE = 64

#: ``SWITCH_HIDDEN`` (launch.cuh): hidden sizes the low-latency kernels are compiled for.
LOW_LATENCY_HIDDEN_SIZES: tuple[int, ...] = (2048, 2560, 4096, 5120, 6144, 7168, 8192)

#: ``kNumMaxTopK`` / ``kNumMaxTopk`` (internode_ll.cu, 1.0.0 and later): top-k of the low-latency
#: dispatch and combine.
LOW_LATENCY_MAX_TOP_K = 9

#: ``EP_DEVICE_ASSERT(num_topk <= 32)`` in the normal (intranode/internode) kernels.
NORMAL_MAX_TOP_K = 32

#: ``NUM_MAX_LOCAL_EXPERTS`` (configs.cuh), asserted by the normal dispatch.
NUM_MAX_LOCAL_EXPERTS = 1024

#: The normal dispatch's FP8 input is ``(x [N, H] e4m3, scales [N, H // 128] float32)``.
FP8_SCALE_BLOCK = 128
#: the payloads normal mode dispatches (the declaration in plugin.py reads this)
NORMAL_PAYLOADS = (F.UNQUANTIZED, F.FP8)

#: ``NVSHMEM_QP_DEPTH`` that DeepEP's ``Buffer`` sets when the variable is unset. Later releases
#: assert ``nvshmem_qp_depth >= (num_max_dispatch_tokens_per_rank + 1) * 2`` in both low-latency
#: calls (deep_ep/buffers/legacy.py).
DEFAULT_NVSHMEM_QP_DEPTH = 1024

#: The default low-latency bound (DeepEP's README example and its tests use 128; it recommends
#: fewer than 256 for memory).
DEFAULT_LOW_LATENCY_MAX_TOKENS_PER_RANK = 128

#: The only activation dtype DeepEP carries unquantized (normal combine: ``SWITCH_TYPES`` has
#: ``CUDA_R_16BF`` alone; low-latency dispatch and combine assert ``torch::kBFloat16``).
CARRIED_DTYPE = "bfloat16"


def low_latency_world_sizes(max_world: int = LOW_LATENCY_MAX_DECLARED_WORLD_SIZE) -> list[
    tuple[int, int]
]:
    """The declared low-latency group sizes as ``(min, max)`` ranges: ``(2, 7)``, ``(8, 8)``,
    ``(16, 16)``... (``num_ranks < 8 or num_ranks % 8 == 0``, from ``Buffer::Buffer``)."""
    ranges = [(2, NUM_MAX_NVL_PEERS - 1)]
    ranges += [(w, w) for w in range(NUM_MAX_NVL_PEERS, max_world + 1, NUM_MAX_NVL_PEERS)]
    return ranges


def max_low_latency_tokens(qp_depth: int = DEFAULT_NVSHMEM_QP_DEPTH) -> int:
    """The largest ``num_max_dispatch_tokens_per_rank`` with ``(n + 1) * 2 <= qp_depth``."""
    return qp_depth // 2 - 1


def check_layer(
    *,
    mode: str,
    world: int,
    num_experts: int,
    top_k: int,
    hidden: int,
    dtype: str,
    payload: str,
    max_tokens_per_rank: int | None = None,
    qp_depth: int = DEFAULT_NVSHMEM_QP_DEPTH,
    low_latency_hidden_sizes: tuple[int, ...] = LOW_LATENCY_HIDDEN_SIZES,
) -> list[str]:
    """Everything about one layer that DeepEP would refuse in ``mode``; empty when all is well.

    These are limits the core's ``CommSupport`` vocabulary cannot state (it knows world sizes,
    layouts, payloads and a token bound, not dtypes or shapes), so the backend checks them when it
    is built, before any buffer is allocated.
    """
    problems = _common_problems(world, num_experts, dtype)
    if mode == "normal":
        problems += _normal_problems(world, top_k, hidden, payload)
    elif mode == "low_latency":
        problems += _low_latency_problems(world, top_k, hidden, payload, max_tokens_per_rank,
                                          qp_depth, low_latency_hidden_sizes)
    else:
        problems.append(f"unknown DeepEP mode {mode!r}")
    return problems


def _common_problems(world: int, num_experts: int, dtype: str) -> list[str]:
    problems: list[str] = []
    if dtype != CARRIED_DTYPE:
        problems.append(
            f"DeepEP carries {CARRIED_DTYPE} activations only (its combine kernels are compiled "
            f"for bf16); this layer computes in {dtype}"
        )
    if world < 2:
        problems.append(f"DeepEP needs an expert-parallel group of at least 2 ranks, not {world}")
    elif num_experts % world:
        problems.append(
            f"DeepEP places num_experts / ranks experts on each rank and asserts num_experts % "
            f"ranks == 0; {num_experts} experts do not divide over {world} ranks"
        )
    elif len(local_experts(num_experts, world, 0)) > NUM_MAX_LOCAL_EXPERTS:
        problems.append(
            f"{len(local_experts(num_experts, world, 0))} local experts exceed DeepEP's "
            f"NUM_MAX_LOCAL_EXPERTS ({NUM_MAX_LOCAL_EXPERTS})"
        )
    return problems


def _normal_problems(world: int, top_k: int, hidden: int, payload: str) -> list[str]:
    problems: list[str] = []
    if world >= 2 and world not in NORMAL_INTRANODE_WORLD_SIZES:
        problems.append(
            f"DeepEP's intranode normal kernels are compiled for "
            f"{NORMAL_INTRANODE_WORLD_SIZES} ranks (SWITCH_RANKS), not {world}; internode "
            "normal mode is not declared here"
        )
    if top_k > NORMAL_MAX_TOP_K:
        problems.append(f"top-k {top_k} exceeds DeepEP's normal-mode limit {NORMAL_MAX_TOP_K}")
    if hidden % 8:
        problems.append(
            f"hidden {hidden}: DeepEP moves rows in 16-byte vectors (bf16 hidden must be a "
            "multiple of 8)"
        )
    if payload == F.FP8 and hidden % FP8_SCALE_BLOCK:
        problems.append(
            f"hidden {hidden}: DeepEP's FP8 dispatch input carries [tokens, hidden // "
            f"{FP8_SCALE_BLOCK}] scales, so hidden must be a multiple of {FP8_SCALE_BLOCK}"
        )
    if payload not in NORMAL_PAYLOADS:
        problems.append(f"normal mode carries {' or '.join(NORMAL_PAYLOADS)} payloads, not "
                        f"{payload}")
    return problems


def _low_latency_problems(world: int, top_k: int, hidden: int, payload: str,
                          max_tokens_per_rank: int | None, qp_depth: int,
                          hidden_sizes: tuple[int, ...]) -> list[str]:
    problems: list[str] = []
    if world >= 2 and not (world < NUM_MAX_NVL_PEERS or world % NUM_MAX_NVL_PEERS == 0):
        problems.append(
            f"DeepEP's Buffer asserts ranks < {NUM_MAX_NVL_PEERS} or a multiple of "
            f"{NUM_MAX_NVL_PEERS}; {world} is neither"
        )
    if top_k > LOW_LATENCY_MAX_TOP_K:
        problems.append(
            f"top-k {top_k} exceeds DeepEP's low-latency limit {LOW_LATENCY_MAX_TOP_K} "
            "(kNumMaxTopK in csrc/kernels/internode_ll.cu)"
        )
    if hidden not in hidden_sizes:
        problems.append(
            f"hidden {hidden}: DeepEP's low-latency kernels are compiled for hidden sizes "
            f"{hidden_sizes} (SWITCH_HIDDEN); a DeepEP build with more sizes can "
            "be named with MOE_RUNTIME_DEEPEP_LL_HIDDEN_SIZES"
        )
    if payload != "unquantized":
        problems.append(
            f"low-latency mode is declared for unquantized payloads only, not {payload} "
            "(DeepEP's low-latency FP8 is a per-token, per-128-channel dynamic format, not "
            "the layer's per-tensor fp8; see README.md)"
        )
    if max_tokens_per_rank is not None:
        problems += _bound_problems(max_tokens_per_rank, qp_depth)
    return problems


def _bound_problems(max_tokens_per_rank: int, qp_depth: int) -> list[str]:
    limit = max_low_latency_tokens(qp_depth)
    if max_tokens_per_rank < 1:
        return [f"the low-latency bound must be at least 1, not {max_tokens_per_rank}"]
    if max_tokens_per_rank > limit:
        return [
            f"a low-latency bound of {max_tokens_per_rank} tokens per rank needs "
            f"NVSHMEM_QP_DEPTH >= {(max_tokens_per_rank + 1) * 2} (DeepEP asserts "
            f"qp_depth >= (bound + 1) * 2; it is {qp_depth}); lower the bound to {limit} "
            "or raise NVSHMEM_QP_DEPTH"
        ]
    return []


def rounds_for(num_tokens: int, bound: int) -> int:
    """Low-latency calls needed for ``num_tokens`` tokens at ``bound`` per call (at least 1)."""
    return max(1, math.ceil(num_tokens / bound))
