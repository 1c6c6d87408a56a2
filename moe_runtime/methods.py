"""Per-layer quantization methods: what a MoE layer's weights look like and how they are loaded.

A method is identified by the formats it holds, never by the checkpoint's quantization name: the
NVFP4 MoE layers of a ``modelopt_fp4`` and of a ``modelopt_mixed`` checkpoint are both
:class:`ModelOptNvFp4FusedMoEMethod` layers. A method owns the tensor names, shapes, dtypes,
loading and validation; the experts backend owns any kernel layout prepared from the result.
"""

from __future__ import annotations

from typing import Sequence

import torch

from moe_runtime import formats as F
from moe_runtime.backend_api import ExpertWeights
from moe_runtime.checkpoint.tensors import CheckpointTensors, WeightError

FP8 = torch.float8_e4m3fn
F32 = torch.float32


class FusedMoEMethod:
    """Loads one MoE layer's local experts into :class:`ExpertWeights`."""

    formats: frozenset[str] = frozenset()

    def load(self, tensors: CheckpointTensors, layer, experts: Sequence[int], *,
             dtype: torch.dtype = torch.bfloat16) -> ExpertWeights:
        raise NotImplementedError

    # helpers -----------------------------------------------------------------------------
    @staticmethod
    def _names(layer, e: int) -> tuple[str, str, str]:
        gate, up, down = layer.expert_names
        return (f"{layer.name}.{e}.{gate}", f"{layer.name}.{e}.{up}", f"{layer.name}.{e}.{down}")

    @staticmethod
    def _shared_scalar(tensors, names: list[str], layer: str, what: str) -> torch.Tensor:
        """A scalar that must be the same in every named tensor (checked, not assumed)."""
        values = [tensors.get(n, layer=layer, expect_dtype=F32, what=what).reshape(()) for n in names]
        first = values[0]
        for n, v in zip(names, values):
            if not torch.equal(v, first):
                raise WeightError(
                    f"layer {layer}: {what} must be shared, but {names[0]!r} = {first.item():.6g} "
                    f"and {n!r} = {v.item():.6g}"
                )
        return first.clone()


class UnquantizedFusedMoEMethod(FusedMoEMethod):
    formats = frozenset({F.BF16, F.FP16})

    def load(self, tensors, layer, experts, *, dtype=torch.bfloat16):
        h, i = layer.hidden_size, layer.intermediate_size
        e_n = len(experts)
        w13 = torch.empty((e_n, 2 * i, h), dtype=dtype)
        w2 = torch.empty((e_n, h, i), dtype=dtype)
        ok = (torch.bfloat16, torch.float16, torch.float32)
        for j, e in enumerate(experts):
            g, u, d = self._names(layer, e)
            w13[j, :i] = tensors.get(f"{g}.weight", layer=layer.name, expect_dtype=ok,
                                     expect_shape=(i, h), what="gate projection weight")
            w13[j, i:] = tensors.get(f"{u}.weight", layer=layer.name, expect_dtype=ok,
                                     expect_shape=(i, h), what="up projection weight")
            w2[j] = tensors.get(f"{d}.weight", layer=layer.name, expect_dtype=ok,
                                expect_shape=(h, i), what="down projection weight")
        return ExpertWeights(layer.quant.format, layer.activation, w13, w2)


class ModelOptFp8FusedMoEMethod(FusedMoEMethod):
    """FP8 e4m3 weights with per-tensor ``weight_scale``; ``input_scale`` shared by the layer."""

    formats = frozenset({F.FP8_W8A8})

    def load(self, tensors, layer, experts, *, dtype=torch.bfloat16):
        h, i = layer.hidden_size, layer.intermediate_size
        e_n = len(experts)
        w13 = torch.empty((e_n, 2 * i, h), dtype=FP8)
        w2 = torch.empty((e_n, h, i), dtype=FP8)
        s13 = torch.empty((e_n, 2 * i), dtype=F32)
        s2 = torch.empty((e_n, h), dtype=F32)
        in13, in2 = [], []
        for j, e in enumerate(experts):
            g, u, d = self._names(layer, e)
            for name, rows, shape, w_out, s_out in (
                (g, slice(0, i), (i, h), w13, s13),
                (u, slice(i, 2 * i), (i, h), w13, s13),
                (d, slice(0, h), (h, i), w2, s2),
            ):
                w_out[j, rows] = tensors.get(f"{name}.weight", layer=layer.name, expect_dtype=FP8,
                                             expect_shape=shape, what="FP8 e4m3 weight")
                s_out[j, rows] = tensors.get(f"{name}.weight_scale", layer=layer.name,
                                             expect_dtype=F32, what="per-tensor weight scale"
                                             ).reshape(())
            in13 += [f"{g}.input_scale", f"{u}.input_scale"]
            in2.append(f"{d}.input_scale")
        a13 = self._shared_scalar(tensors, in13, layer.name, "the gate/up input_scale")
        a2 = self._shared_scalar(tensors, in2, layer.name, "the down input_scale")
        return ExpertWeights(F.FP8_W8A8, layer.activation, w13, w2, w13_scale=s13, w2_scale=s2,
                             a13_scale=a13, a2_scale=a2)


class ModelOptNvFp4FusedMoEMethod(FusedMoEMethod):
    """NVFP4: packed E2M1 ``weight``, e4m3 16-block ``weight_scale``, ``weight_scale_2`` (shared by
    gate and up), ``input_scale`` (W4A4 only, shared by the layer's experts)."""

    formats = frozenset({F.NVFP4_W4A4, F.NVFP4_W4A16})

    def load(self, tensors, layer, experts, *, dtype=torch.bfloat16):
        h, i = layer.hidden_size, layer.intermediate_size
        group = layer.quant.group_size or 16
        if group != 16:
            raise WeightError(f"layer {layer.name}: NVFP4 group size {group}; only 16 is defined")
        if h % 16 or i % 16:
            raise WeightError(
                f"layer {layer.name}: NVFP4 needs hidden ({h}) and intermediate ({i}) sizes "
                "that are multiples of 16")
        e_n = len(experts)
        w13 = torch.empty((e_n, 2 * i, h // 2), dtype=torch.uint8)
        w2 = torch.empty((e_n, h, i // 2), dtype=torch.uint8)
        s13 = torch.empty((e_n, 2 * i, h // 16), dtype=FP8)
        s2 = torch.empty((e_n, h, i // 16), dtype=FP8)
        g13 = torch.empty((e_n,), dtype=F32)
        g2 = torch.empty((e_n,), dtype=F32)
        in13, in2 = [], []
        w4a4 = layer.quant.format == F.NVFP4_W4A4
        for j, e in enumerate(experts):
            g, u, d = self._names(layer, e)
            for name, rows, (o, k), w_out, s_out in (
                (g, slice(0, i), (i, h), w13, s13),
                (u, slice(i, 2 * i), (i, h), w13, s13),
                (d, slice(0, h), (h, i), w2, s2),
            ):
                w_out[j, rows] = tensors.get(
                    f"{name}.weight", layer=layer.name, expect_dtype=torch.uint8,
                    expect_shape=(o, k // 2), what="packed E2M1 weight [out, in/2]")
                s_out[j, rows] = tensors.get(
                    f"{name}.weight_scale", layer=layer.name, expect_dtype=FP8,
                    expect_shape=(o, k // 16), what="e4m3 block scale [out, in/16]")
            g13[j] = self._shared_scalar(
                tensors, [f"{g}.weight_scale_2", f"{u}.weight_scale_2"], layer.name,
                f"weight_scale_2 of expert {e}'s gate and up projections")
            g2[j] = tensors.get(f"{d}.weight_scale_2", layer=layer.name, expect_dtype=F32,
                                what="global weight scale").reshape(())
            in13 += [f"{g}.input_scale", f"{u}.input_scale"]
            in2.append(f"{d}.input_scale")
        a13 = a2 = None
        if w4a4:
            a13 = self._shared_scalar(tensors, in13, layer.name, "the gate/up input_scale")
            a2 = self._shared_scalar(tensors, in2, layer.name, "the down input_scale")
        return ExpertWeights(layer.quant.format, layer.activation, w13, w2, w13_scale=s13,
                             w2_scale=s2, w13_scale_2=g13, w2_scale_2=g2, a13_scale=a13,
                             a2_scale=a2)


METHODS: tuple[FusedMoEMethod, ...] = (
    UnquantizedFusedMoEMethod(),
    ModelOptFp8FusedMoEMethod(),
    ModelOptNvFp4FusedMoEMethod(),
)


def method_for_format(fmt: str) -> FusedMoEMethod:
    for m in METHODS:
        if fmt in m.formats:
            return m
    known = sorted(f for m in METHODS for f in m.formats)
    raise WeightError(f"no quantization method loads format {fmt!r}; methods exist for {known}")


def load_expert_weights(tensors: CheckpointTensors, layer, *, experts: Sequence[int] | None = None,
                        dtype: torch.dtype = torch.bfloat16) -> ExpertWeights:
    """Read one MoE layer's experts (``experts``: global ids of the local ones; default all)."""
    if experts is None:
        experts = range(layer.num_experts)
    return method_for_format(layer.quant.format).load(tensors, layer, list(experts), dtype=dtype)
