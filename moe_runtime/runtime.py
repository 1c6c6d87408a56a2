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
