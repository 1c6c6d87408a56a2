"""A plain-torch reference and weight quantizers for the Triton plugin's tests.

Written independently of the kernels: per (token, expert) pair, float32 math on weights
dequantized by the textbook formulas of each format.
"""

from __future__ import annotations

import torch

from moe_runtime.runtime import ExpertWeights

E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def quantize_fp8_rows(w: torch.Tensor):
    """Per output row (ModelOpt's per-tensor scale broadcast to rows is a special case)."""
    amax = w.abs().amax(dim=-1).clamp_min(1e-8).float()
    scale = amax / 448.0
    q = (w.float() / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale


def quantize_fp8_expert(w: torch.Tensor, rows_per_group: int):
    """One scale per group of rows (gate and up each one scale, as ModelOpt stores them)."""
    e, r, k = w.shape
    g = w.float().reshape(e, r // rows_per_group, rows_per_group * k)
    amax = g.abs().amax(dim=-1).clamp_min(1e-8)
    scale = amax / 448.0
    q = (g / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(e, r, k)
    return q, scale.repeat_interleave(rows_per_group, dim=1)


def quantize_nvfp4(w: torch.Tensor):
    """``w [E, R, K]`` -> (packed uint8 [E, R, K/2], e4m3 [E, R, K/16], scale_2 float32 [E])."""
    e, r, k = w.shape
    w = w.float()
    amax = w.abs().reshape(e, -1).amax(dim=1).clamp_min(1e-8)
    scale_2 = amax / (448.0 * 6.0)
    blocks = w.reshape(e, r, k // 16, 16)
    bamax = blocks.abs().amax(dim=-1)
    bs = (bamax / 6.0 / scale_2[:, None, None]).clamp(min=2 ** -9, max=448)
    bs = bs.to(torch.float8_e4m3fn)
    denom = bs.float() * scale_2[:, None, None]
    vals = blocks / denom[..., None]
    mags = E2M1[:8]
    idx = (vals.abs()[..., None] - mags).abs().argmin(dim=-1)
    codes = (idx + 8 * (vals < 0).long()).to(torch.uint8).reshape(e, r, k)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), bs.contiguous(), scale_2.float()


def dequant_nvfp4(packed, bs, scale_2):
    e, r, kh = packed.shape
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(e, r, kh * 2).long()
    vals = E2M1.to(packed.device)[codes]
    return vals * bs.float().repeat_interleave(16, dim=-1) * scale_2[:, None, None]


def fake_fp8(x: torch.Tensor, scale: torch.Tensor):
    return (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def make_weights(fmt: str, E: int, H: int, I: int, activation="silu", device="cpu", seed=0,
                 dtype=torch.bfloat16):
    """Random expert weights in ``fmt`` and their float32 dequantized copies."""
    g = torch.Generator().manual_seed(seed)
    w13f = torch.randn(E, 2 * I, H, generator=g) * (1.0 / H ** 0.5)
    w2f = torch.randn(E, H, I, generator=g) * (1.0 / I ** 0.5)
    if fmt in ("bf16", "fp16"):
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[fmt]
        if dtype == torch.float32:
            dt = torch.float32
        w = ExpertWeights(format=fmt, activation=activation, w13=w13f.to(dt), w2=w2f.to(dt))
        deq = (w13f.to(dt).float(), w2f.to(dt).float())
    elif fmt == "fp8_w8a8":
        q13, s13 = quantize_fp8_expert(w13f, I)
        q2, s2 = quantize_fp8_expert(w2f, H)
        w = ExpertWeights(format=fmt, activation=activation, w13=q13, w2=q2,
                          w13_scale=s13, w2_scale=s2,
                          a13_scale=torch.tensor(4.0 / 448), a2_scale=torch.tensor(1.0 / 448))
        deq = (q13.float() * s13[..., None], q2.float() * s2[..., None])
    else:
        p13, b13, t13 = quantize_nvfp4(w13f)
        p2, b2, t2 = quantize_nvfp4(w2f)
        extra = {}
        if fmt == "nvfp4_w4a4":
            extra = dict(a13_scale=torch.tensor(4.0 / 448 / 6), a2_scale=torch.tensor(1.0 / 448 / 6))
        w = ExpertWeights(format=fmt, activation=activation, w13=p13, w2=p2, w13_scale=b13,
                          w2_scale=b2, w13_scale_2=t13, w2_scale_2=t2, **extra)
        deq = (dequant_nvfp4(p13, b13, t13), dequant_nvfp4(p2, b2, t2))
    return w.to(device), (deq[0].to(device), deq[1].to(device))


def reference(hidden, topk_ids, topk_weights, deq, activation="silu", fp8_scales=None):
    """float32 ``[N, H]``; ``fp8_scales=(a13, a2)`` emulates W8A8 activation quantization."""
    w13, w2 = deq
    E, two_i, H = w13.shape
    I = two_i // 2
    N, K = topk_ids.shape
    out = torch.zeros(N, H, dtype=torch.float32, device=hidden.device)
    x = hidden.float()
    if fp8_scales is not None:
        x = fake_fp8(x, fp8_scales[0].float())
    for t in range(N):
        for k in range(K):
            e = int(topk_ids[t, k])
            if e < 0 or e >= E:
                continue
            gu = w13[e].float() @ x[t]
            gate, up = gu[:I], gu[I:]
            if activation == "silu":
                h = torch.nn.functional.silu(gate) * up
            else:
                h = torch.nn.functional.gelu(gate) * up
            if fp8_scales is not None:
                h = fake_fp8(h, fp8_scales[1].float())
            out[t] += float(topk_weights[t, k]) * (w2[e].float() @ h)
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    if torch.isnan(a).any():
        return float("inf")
    den = b.norm().item()
    return (a - b).norm().item() / (den if den > 0 else 1.0)
