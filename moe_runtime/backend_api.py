"""Runtime records that travel between a layer, its communication backend and its experts backend.

A quantization method fills :class:`ExpertWeights` once at load; the experts backend prepares its own
layout from it; every forward passes a :class:`Dispatched` from ``dispatch`` to the experts backend and
a handle from ``dispatch`` back to ``combine``. Nothing here holds hidden state between calls.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch


@attrs.define
class ExpertWeights:
    """One MoE layer's weights for its *local* experts, in the checkpoint's format.

    Shapes (E local experts, H hidden, I expert intermediate):

    - ``w13`` ``[E, 2I, H]``: rows ``0..I-1`` are gate_proj, rows ``I..2I-1`` up_proj.
      bf16/fp16 in that dtype; ``fp8_w8a8`` float8_e4m3fn; ``nvfp4_*`` uint8 ``[E, 2I, H/2]``
      (packed E2M1, low nibble = even column).
    - ``w2`` ``[E, H, I]`` likewise (nvfp4: uint8 ``[E, H, I/2]``).
    - ``w13_scale``/``w2_scale``: fp8: float32 ``[E, 2I]``/``[E, H]`` per output row (ModelOpt's
      per-tensor weight_scale broadcast to rows, gate and up may differ); nvfp4: float8_e4m3fn
      block scales ``[E, 2I, H/16]``/``[E, H, I/16]``; ``None`` for 16-bit formats.
    - ``w13_scale_2``/``w2_scale_2``: nvfp4 only, float32 ``[E]`` (``weight_scale_2``).
    - ``a13_scale``/``a2_scale``: float32 0-dim, the checkpoint's ``input_scale`` of GEMM 1 / GEMM 2,
      shared by the layer's experts; for ``fp8_w8a8`` and ``nvfp4_w4a4``, else ``None``.
    """

    format: str
    activation: str
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    w13_scale_2: torch.Tensor | None = None
    w2_scale_2: torch.Tensor | None = None
    a13_scale: torch.Tensor | None = None
    a2_scale: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return int(self.w13.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.w2.shape[1])

    @property
    def intermediate_size(self) -> int:
        return int(self.w13.shape[1]) // 2

    def to(self, device: torch.device | str) -> ExpertWeights:
        """A copy with every tensor moved to ``device``."""
        return attrs.evolve(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in attrs.fields(ExpertWeights)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )


@attrs.define
class Dispatched:
    """What a communication backend's ``dispatch`` hands to the experts backend.

    ``layout == "token_major"``: ``hidden`` ``[N, H]``; ``topk_ids`` ``[N, K]`` int (local expert
    ids, ``-1`` where the expert lives on another rank); ``topk_weights`` ``[N, K]`` float32. The
    experts backend returns ``[N, H]``: for each row the weighted sum over its valid ``k`` of the
    expert MLP output.

    ``layout == "masked"``: ``hidden`` ``[E_local, M, H]``; ``masked_m`` ``[E_local]`` int32 valid rows
    per expert. The experts backend returns ``[E_local, M, H]`` unweighted expert outputs (rows past
    ``masked_m`` are ignored); combine applies the routing weights.

    ``payload`` names the activation payload; for quantized payloads ``hidden`` holds the quantized
    values and ``hidden_scale`` their scales (fp8: 0-dim float32; nvfp4: e4m3 block scales).
    """

    layout: str
    hidden: torch.Tensor
    payload: str = "unquantized"
    hidden_scale: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None
    masked_m: torch.Tensor | None = None
    out_dtype: torch.dtype | None = None
    extra: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class LayerProblem:
    """What one MoE layer asks of its backends: the planner's input, and each backend's ``problem``.

    :param name: the experts container module path (``model.layers.3.mlp.experts``).
    :param format: the layer's weight format (``moe_runtime.formats``).
    :param activation: ``"silu"`` or ``"gelu"`` (gated: ``act(gate) * up``).
    :param num_experts: routed experts of the layer, all ranks together.
    :param top_k: experts per token.
    :param hidden_size: H.
    :param intermediate_size: I, one expert's intermediate size.
    :param dtype: the model's activation dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``).
    """

    name: str
    format: str
    activation: str
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    dtype: str = "bfloat16"


@attrs.frozen
class ExpertsSetup:
    """Everything an experts backend is constructed with (keyword ``setup=``).

    :param problem: the layer.
    :param runs_as: the format the backend is asked to run (differs from ``problem.format`` when the
        plan degrades, e.g. ``nvfp4_w4a4`` weights run as ``nvfp4_w4a16``).
    :param payload: the activation payload ``dispatch`` will deliver.
    :param layout: the token layout ``dispatch`` will deliver.
    :param ep_rank: this rank; ``ep_size``: ranks in the expert-parallel group.
    :param device: the torch device string the backend runs on.
    """

    problem: LayerProblem
    runs_as: str
    payload: str
    layout: str
    ep_rank: int = 0
    ep_size: int = 1
    device: str = "cpu"

    @property
    def local_experts(self) -> range:
        """The global ids of this rank's experts (:func:`moe_runtime.placement.local_experts`)."""
        from moe_runtime.placement import local_experts

        return local_experts(self.problem.num_experts, self.ep_size, self.ep_rank)

    @property
    def num_local_experts(self) -> int:
        return len(self.local_experts)

    @property
    def first_local_expert(self) -> int:
        return self.local_experts.start


class ExpertsBackend:
    """Base class of experts (compute) backends. The factory is called as ``Cls(setup=...)``.

    ``prepare`` runs once at load with the local experts' weights and may build any layout the
    kernel wants; ``forward`` runs on what ``dispatch`` produced and must not call into the plugin
    manager, loop over tokens in Python, or synchronise with the host if the backend claims speed.
    """

    def __init__(self, *, setup: ExpertsSetup) -> None:
        self.setup = setup

    def prepare(self, weights: ExpertWeights) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def forward(self, dispatched: Dispatched) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError


@attrs.frozen
class CommSetup:
    """Everything a communication backend is constructed with (keyword ``setup=``).

    :param group: the ``torch.distributed`` process group of expert parallelism, or ``None``.
    :param max_tokens_per_rank: the batch bound the plan was made for (low-latency buffers).
    """

    problem: LayerProblem
    payload: str
    layout: str
    ep_rank: int = 0
    ep_size: int = 1
    device: str = "cpu"
    max_tokens_per_rank: int = 4096
    group: Any = attrs.field(default=None, eq=False, hash=False)


class CommBackend:
    """Base class of communication backends. The factory is called as ``Cls(setup=...)``.

    ``dispatch(hidden, topk_ids, topk_weights, *, scales)`` takes the rank's tokens with *global*
    expert ids and returns ``(Dispatched, handle)``; ``combine(expert_out, handle)`` returns the
    ``[N, H]`` output in the rank's original token order. ``scales`` carries the layer's activation
    scales (``a13_scale``) for quantized payloads. The handle holds all that combine needs.
    """

    def __init__(self, *, setup: CommSetup) -> None:
        self.setup = setup

    def dispatch(  # pragma: no cover - interface
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
        input_scale: torch.Tensor | None = None,
    ) -> tuple[Dispatched, Any]:
        raise NotImplementedError

    def combine(self, expert_out: torch.Tensor, handle: Any) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError
