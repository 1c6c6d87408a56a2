"""Weight preparation, step by step, against plain statements of the layouts the kernels read.

The weights are real ModelOpt NVFP4 exports (``NVFP4QTensor``). Each target layout is written
here independently of the implementation: as an index formula, element by element.
"""

from __future__ import annotations

import pytest
import torch

from moe_runtime import formats as F
from moe_runtime_flashinfer_cutedsl import weights as W

from cutedsl_helpers import dequantize, make_nvfp4_weights, make_setup


def unswizzle(storage: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Read ``[E, rows, cols]`` back out of 128x4 storage with the index formula alone."""
    e = storage.shape[0]
    flat = storage.reshape(e, -1)
    kp = -(-cols // 4) * 4
    m = torch.arange(rows).view(-1, 1)
    k = torch.arange(cols).view(1, -1)
    # FlashInfer's 128x4 layout: tile of 128 rows x 4 columns = 512 bytes, tiles row-major over
    # (row tile, column tile); inside a tile, row m sits at (m % 32) * 16 + ((m % 128) // 32) * 4.
    offset = ((m // 128) * (128 * kp) + (k // 4) * 512
              + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4)
    return flat[:, offset]


# ------------------------------------------------------------------------------ 128x4 swizzle


def test_swizzle_places_every_scale_where_the_128x4_layout_says(nvfp4_weights):
    sf = nvfp4_weights.w13_scale  # [E, 2I, H/16], e4m3, from ModelOpt
    out = W.swizzle_block_scales(sf)
    e, rows, cols = sf.shape
    assert out.dtype == torch.uint8
    assert tuple(out.shape) == (e, rows // 128, cols // 4, 32, 4, 4)
    for ei in range(e):
        for m in range(rows):
            for k in range(cols):
                assert out[ei, m // 128, k // 4, m % 32, (m % 128) // 32, k % 4] == \
                    sf[ei, m, k].view(torch.uint8)


def test_swizzle_matches_the_flat_offset_formula_and_pads_with_zeros():
    g = torch.Generator().manual_seed(3)
    sf = torch.randint(1, 255, (3, 200, 10), generator=g, dtype=torch.uint8)  # pads to 256 x 12
    out = W.swizzle_block_scales(sf)
    assert tuple(out.shape) == (3, 2, 3, 32, 4, 4)
    assert torch.equal(unswizzle(out, 200, 10), sf)
    # every byte that is not a real scale is zero padding
    assert int((out != 0).sum()) == int((sf != 0).sum())


def test_swizzle_is_the_documented_reshape_and_permute(nvfp4_weights):
    sf = nvfp4_weights.w2_scale.view(torch.uint8)
    e, m, k = sf.shape
    expected = sf.reshape(e, m // 128, 4, 32, k // 4, 4).permute(0, 1, 4, 3, 2, 5)
    assert torch.equal(W.swizzle_block_scales(sf), expected.contiguous())


def test_mma_view_is_the_kernels_6d_layout_over_the_same_storage(nvfp4_weights):
    sf = nvfp4_weights.w13_scale
    storage = W.swizzle_block_scales(sf)
    view = W.mma_scale_view(storage)
    e, rows, cols = sf.shape
    # grouped_gemm_nt_masked / convert_sf_to_mma_layout: logical (32, 4, rm, 4, rk, l)
    assert tuple(view.shape) == (32, 4, rows // 128, 4, cols // 4, e)
    assert view.data_ptr() == storage.data_ptr() and storage.is_contiguous()
    m = torch.arange(rows).view(-1, 1)
    k = torch.arange(cols).view(1, -1)
    for ei in range(e):
        got = view[m % 32, (m % 128) // 32, m // 128, k % 4, k // 4, ei]
        assert torch.equal(got, sf[ei].view(torch.uint8))


# ---------------------------------------------------------------------- gate/up and interleave


def test_interleave_puts_up_then_gate_in_alternating_64_row_chunks(nvfp4_weights):
    w13 = nvfp4_weights.w13  # rows [gate; up]
    e, two_i, _ = w13.shape
    i = two_i // 2
    out = W.up_gate_interleaved(w13)
    for r in range(two_i):
        chunk, within = divmod(r, 128)
        src = (i if within < 64 else 0) + chunk * 64 + within % 64  # up rows start at I
        assert torch.equal(out[:, r], w13[:, src]), r


def test_interleaved_gemm1_gives_silu_gate_times_up_where_the_kernel_reads_it(nvfp4_weights):
    """CuteDslMoEWrapper's GEMM 1 epilogue: per 128 output columns, 64 of up then 64 of gate."""
    w = nvfp4_weights
    setup = make_setup(w, layout=F.TOKEN_MAJOR)
    prepared = W.prepare_experts(w, setup)
    i = w.intermediate_size
    x = torch.randn(5, w.hidden_size, generator=torch.Generator().manual_seed(1))
    for e in range(w.num_experts):
        original = dequantize(w.w13[e], w.w13_scale[e], w.w13_scale_2[e])
        gate, up = original[:i], original[i:]
        expected = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)

        scales = W.up_gate_interleaved(w.w13_scale.view(torch.uint8))[e]
        kernel_w = dequantize(prepared.w13[e], unswizzle(prepared.w13_scale[e:e + 1], 2 * i,
                                                         w.hidden_size // 16)[0],
                              w.w13_scale_2[e])
        assert torch.equal(unswizzle(prepared.w13_scale[e:e + 1], 2 * i, w.hidden_size // 16)[0],
                           scales)
        acc = (x @ kernel_w.T).view(5, i // 64, 2, 64)
        got = torch.nn.functional.silu(acc[:, :, 1]) * acc[:, :, 0]
        torch.testing.assert_close(got.reshape(5, i), expected, rtol=1e-5, atol=1e-5)


def test_masked_path_keeps_the_checkpoint_gate_then_up_order(nvfp4_weights):
    """silu_and_mul_scaled_nvfp4_experts_quantize applies SiLU to the first half of each row."""
    w = nvfp4_weights
    prepared = W.prepare_experts(w, make_setup(w, layout=F.MASKED))
    assert prepared.gate_up_order == W.GATE_UP
    assert torch.equal(prepared.w13, w.w13)
    assert torch.equal(prepared.w13_scale, W.swizzle_block_scales(w.w13_scale))
    assert torch.equal(prepared.w2, w.w2)
    assert torch.equal(prepared.w2_scale, W.swizzle_block_scales(w.w2_scale))


def test_interleave_refuses_an_intermediate_size_off_the_64_row_chunk():
    with pytest.raises(ValueError, match="multiple of 64"):
        W.up_gate_interleaved(torch.zeros(1, 2 * 96, 8, dtype=torch.uint8))


# ---------------------------------------------------------------------------- alphas and scales


def test_alphas_are_input_scale_times_weight_scale_2_per_expert(nvfp4_weights):
    w = nvfp4_weights
    p = W.prepare_experts(w, make_setup(w))
    for e in range(w.num_experts):
        assert p.w13_alpha[e].item() == pytest.approx(
            float(w.a13_scale) * float(w.w13_scale_2[e]), rel=1e-6)
        assert p.w2_alpha[e].item() == pytest.approx(
            float(w.a2_scale) * float(w.w2_scale_2[e]), rel=1e-6)
    assert p.w13_alpha.dtype == torch.float32 and tuple(p.w13_alpha.shape) == (w.num_experts,)


def test_activation_global_scales_are_the_inverse_input_scales(nvfp4_weights):
    w = nvfp4_weights
    p = W.prepare_experts(w, make_setup(w))
    assert tuple(p.a13_gscale.shape) == (1,) and p.a13_gscale.dtype == torch.float32
    assert p.a13_gscale.item() == pytest.approx(1.0 / float(w.a13_scale), rel=1e-6)
    assert p.a2_gscale.item() == pytest.approx(1.0 / float(w.a2_scale), rel=1e-6)


def test_alpha_times_dequantized_gemm_is_the_real_product(nvfp4_weights):
    """What the kernel computes, alpha * (x_q / a_gs ... ) - stated with the scales it is given:
    x quantized with global scale 1/input_scale has values x / input_scale; the weight without its
    weight_scale_2 has values W / weight_scale_2; alpha restores both."""
    w = nvfp4_weights
    p = W.prepare_experts(w, make_setup(w, layout=F.MASKED))
    x = torch.randn(3, w.hidden_size, generator=torch.Generator().manual_seed(2))
    for e in range(w.num_experts):
        w_true = dequantize(w.w13[e], w.w13_scale[e], w.w13_scale_2[e])
        w_no_s2 = dequantize(w.w13[e], w.w13_scale[e], 1.0)
        kernel = p.w13_alpha[e] * ((x * p.a13_gscale) @ w_no_s2.T)
        torch.testing.assert_close(kernel, x @ w_true.T, rtol=1e-5, atol=1e-6)


def test_w4a16_alphas_are_weight_scale_2_alone_and_no_activation_scales():
    w = make_nvfp4_weights(fmt=F.NVFP4_W4A16, seed=4)
    p = W.prepare_experts(w, make_setup(w, fmt=F.NVFP4_W4A16))
    assert torch.equal(p.w13_alpha, w.w13_scale_2.float())
    assert torch.equal(p.w2_alpha, w.w2_scale_2.float())
    assert p.a13_gscale is None and p.a2_gscale is None
    assert p.gate_up_order == W.UP_GATE_INTERLEAVED


def test_w4a4_without_input_scales_is_refused_naming_them():
    w = make_nvfp4_weights(fmt=F.NVFP4_W4A16, seed=5)
    with pytest.raises(ValueError, match="a13_scale, a2_scale"):
        W.prepare_experts(w, make_setup(w, fmt=F.NVFP4_W4A4))


def test_non_nvfp4_weights_are_refused():
    w = make_nvfp4_weights(seed=6)
    import attrs

    fp8 = attrs.evolve(w, format=F.FP8_W8A8)
    with pytest.raises(ValueError, match="NVFP4"):
        W.prepare_experts(fp8, make_setup(w))


# ------------------------------------------------------------------------- expert parallelism


@pytest.mark.parametrize("layout", [F.TOKEN_MAJOR, F.MASKED])
def test_each_rank_prepares_exactly_its_own_slice_of_experts(layout):
    n, ep = 7, 3  # 3, 2, 2 experts
    full = make_nvfp4_weights(num_experts=n, seed=7)
    counts = [n // ep + (1 if r < n % ep else 0) for r in range(ep)]
    whole = W.prepare_experts(full, make_setup(full, layout=layout))
    for rank in range(ep):
        first = sum(counts[:rank])
        sl = slice(first, first + counts[rank])
        p = W.prepare_experts(full, make_setup(full, layout=layout, ep_rank=rank, ep_size=ep))
        assert p.num_experts == counts[rank]
        for name in ("w13", "w13_scale", "w2", "w2_scale", "w13_alpha", "w2_alpha"):
            assert torch.equal(getattr(p, name), getattr(whole, name)[sl]), (rank, name)
        assert torch.equal(p.w13_alpha, full.a13_scale * full.w13_scale_2[sl])


def test_a_rank_given_only_its_local_experts_prepares_the_same():
    n, ep, rank = 6, 2, 1
    full = make_nvfp4_weights(num_experts=n, seed=8)
    setup = make_setup(full, ep_rank=rank, ep_size=ep)
    local = W.local_experts(full, setup)
    assert local.num_experts == 3 and torch.equal(local.w13, full.w13[3:])
    a = W.prepare_experts(full, setup)
    b = W.prepare_experts(local, setup)
    for name in ("w13", "w13_scale", "w2", "w2_scale", "w13_alpha", "w2_alpha", "a13_gscale"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_a_wrong_number_of_experts_is_refused():
    full = make_nvfp4_weights(num_experts=4, seed=9)
    setup = make_setup(8, ep_rank=0, ep_size=3)  # expects 8 or 3 experts
    with pytest.raises(ValueError, match="expected the layer's 8 experts or this rank's 3"):
        W.prepare_experts(full, setup)


# ------------------------------------------------------------------------------- on the device


def _synthetic_nvfp4(e=3, h=256, i=128, seed=10):
    """Random bytes in the NVFP4 layout (no quantizer needed): the preparation only moves bytes
    and multiplies scalars."""
    from moe_runtime.backend_api import ExpertWeights

    g = torch.Generator().manual_seed(seed)

    def u8(*shape):
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)

    def e4m3(*shape):  # finite, positive e4m3 bytes
        return torch.randint(0x08, 0x7E, shape, generator=g, dtype=torch.uint8).view(
            torch.float8_e4m3fn)

    return ExpertWeights(
        format=F.NVFP4_W4A4, activation=F.SILU, w13=u8(e, 2 * i, h // 2), w2=u8(e, h, i // 2),
        w13_scale=e4m3(e, 2 * i, h // 16), w2_scale=e4m3(e, h, i // 16),
        w13_scale_2=torch.rand(e, generator=g) + 0.1, w2_scale_2=torch.rand(e, generator=g) + 0.1,
        a13_scale=torch.tensor(0.03), a2_scale=torch.tensor(0.02),
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
@pytest.mark.parametrize("layout", [F.TOKEN_MAJOR, F.MASKED])
def test_preparing_on_the_gpu_gives_the_cpu_bytes(layout):
    w = _synthetic_nvfp4()
    setup = make_setup(w, layout=layout, ep_rank=1, ep_size=2)
    cpu = W.prepare_experts(w, setup)
    gpu = W.prepare_experts(w.to("cuda"), setup)
    for name in ("w13", "w13_scale", "w2", "w2_scale", "w13_alpha", "w2_alpha", "a13_gscale",
                 "a2_gscale"):
        a, b = getattr(cpu, name), getattr(gpu, name)
        assert b.is_cuda and torch.equal(a, b.cpu()), name
    assert torch.equal(cpu.w13_scale_mma, gpu.w13_scale_mma.cpu())


# ------------------------------------------------------- a checkpoint exported by ModelOpt itself


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One MoE layer of a tiny Qwen3-MoE checkpoint quantized and exported by nvidia-modelopt's
    own exporter, read back through moe-runtime's NVFP4 method."""
    tiny = pytest.importorskip("moe_runtime.checkpoint.tiny", reason="moe_runtime.checkpoint.tiny "
                               "(tiny ModelOpt checkpoints) is not in this checkout")
    from moe_runtime.checkpoint import read_checkpoint
    from moe_runtime.checkpoint.tensors import CheckpointTensors
    from moe_runtime.methods import load_expert_weights

    folder = tiny.make_tiny_checkpoint(tmp_path_factory.mktemp("export") / "nvfp4",
                                       arch="qwen3_moe", quant="nvfp4", hidden_size=128,
                                       intermediate_size=64, num_experts=6)
    layer = read_checkpoint(folder).moe_layers[0]
    tensors = CheckpointTensors(folder)
    try:
        return load_expert_weights(tensors, layer)
    finally:
        tensors.close()


def test_exported_weights_prepare_to_the_same_layouts(exported):
    w = exported
    assert w.format == F.NVFP4_W4A4 and w.a13_scale is not None
    p = W.prepare_experts(w, make_setup(w, hidden=128, intermediate=64))
    i, h = w.intermediate_size, w.hidden_size
    assert torch.equal(p.w13, W.up_gate_interleaved(w.w13))
    assert torch.equal(unswizzle(p.w13_scale, 2 * i, h // 16),
                       W.up_gate_interleaved(w.w13_scale.view(torch.uint8)))
    assert torch.equal(unswizzle(p.w2_scale, h, i // 16), w.w2_scale.view(torch.uint8))
    assert torch.equal(p.w13_alpha, (w.a13_scale * w.w13_scale_2).float())
    assert torch.equal(p.w2_alpha, (w.a2_scale * w.w2_scale_2).float())
    x = torch.randn(4, h, generator=torch.Generator().manual_seed(3))
    for e in range(w.num_experts):
        full = dequantize(w.w13[e], w.w13_scale[e], w.w13_scale_2[e])
        expected = torch.nn.functional.silu(x @ full[:i].T) * (x @ full[i:].T)
        kernel_w = dequantize(p.w13[e], unswizzle(p.w13_scale[e:e + 1], 2 * i, h // 16)[0],
                              w.w13_scale_2[e])
        acc = (x @ kernel_w.T).view(4, i // 64, 2, 64)
        got = (torch.nn.functional.silu(acc[:, :, 1]) * acc[:, :, 0]).reshape(4, i)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_exported_weights_split_across_ranks(exported):
    w = exported
    whole = W.prepare_experts(w, make_setup(w, hidden=128, intermediate=64, layout=F.MASKED))
    for rank, sl in ((0, slice(0, 2)), (1, slice(2, 4)), (2, slice(4, 6))):
        p = W.prepare_experts(w, make_setup(w, hidden=128, intermediate=64, layout=F.MASKED,
                                            ep_rank=rank, ep_size=3))
        for name in ("w13", "w13_scale", "w2", "w2_scale", "w13_alpha", "w2_alpha"):
            assert torch.equal(getattr(p, name), getattr(whole, name)[sl]), (rank, name)
