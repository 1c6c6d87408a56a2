"""Write a ModelOpt-format Qwen3-MoE checkpoint of any shape, quickly, without nvidia-modelopt.

The serving benchmark (``benchmarks/bench_serve.py``) needs a large MoE checkpoint on the GPU
machine, where nvidia-modelopt is not installed and from which nothing can be fetched, and a
checkpoint of gigabytes cannot be carried there either. This script makes one in place: random
weights (drawn on the GPU when there is one), quantized with moe-runtime's own ModelOpt-exact
quantizers (:func:`moe_runtime.reference_math.quantize_expert_weights` for the experts,
:mod:`moe_runtime.quant` for the attention projections), written one decoder layer per
safetensors shard so memory stays bounded by one layer.

**This writer mimics ModelOpt 0.47's export format; ModelOpt does not run here.** It reproduces
what :mod:`moe_runtime.checkpoint.tiny` records of ModelOpt's real exporter: the tensor names (per
expert ``model.layers.{i}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}``), the dtypes (NVFP4:
``weight`` uint8 ``[out, in/2]``, ``weight_scale`` float8_e4m3fn ``[out, in/16]``,
``weight_scale_2`` and ``input_scale`` float32 0-dim; FP8: ``weight`` float8_e4m3fn,
``weight_scale`` and ``input_scale`` float32 0-dim), the scale recipes (gate and up of one expert
share ``weight_scale_2``; ``input_scale`` is shared per projection by all experts of a layer;
routers, norms, embeddings and ``lm_head`` stay bf16), ``hf_quant_config.json`` and config.json's
``quantization_config`` (``quant_method: "modelopt"``). The quantized values themselves come from
moe-runtime's quantizer, which the tests show is bit-exact with ModelOpt's
(``tests/quant/test_nvfp4_quant.py``, ``tests/quant/test_fp8_quant.py``,
``tests/quant/test_reference_math.py``: codes, block scales and global scales compared with
ModelOpt 0.47's own on random and edge-case weights, CUDA bit-identical to CPU). What differs from a
real export: no calibration. Activation ``input_scale`` values come from fixed absolute maxima
(``--act-amax``, ``--act2-amax``) instead of a calibration pass; ``producer`` names this script.

Quantization (``--quant``):

- ``mixed`` (default): MIXED_PRECISION as ModelOpt writes it: NVFP4 routed experts, FP8
  attention projections, ``quantized_layers`` keyed by module (experts by container), no
  ``exclude_modules``, one config group per algorithm with the module names as targets.
- ``nvfp4``: NVFP4 for every linear except the routers and ``lm_head`` (``exclude_modules`` lists
  them and ``model.embed_tokens``), one config group targeting ``Linear``.

The tokenizer is the embedded default model's byte-level BPE
(:mod:`moe_runtime.serve.tiny_tokenizer`) and the vocabulary is its size (512) unless
``--vocab-size`` asks for more, so embeddings and the LM head stay small and the model's time goes
to attention and the MoE layers. A
``generation_config.json`` carries BOS/EOS/PAD.

Full depth (the default of ``--preset qwen3-30b-a3b``: 48 layers, 16.1 GiB of safetensors) took
36 s on an H200 (2026-12-04: weights drawn and quantized on the GPU, 1.7 GB of host memory at
most, one layer at a time). A real ModelOpt export of that size cannot be made there (ModelOpt is
not installed and nothing can be fetched) nor carried there (a call carries 64 MiB); the format
matches ModelOpt's as described above, and ``tests/quant`` holds the bit-exactness of the values.

Examples::

    python benchmarks/make_bench_checkpoint.py /tmp/q30b --preset qwen3-30b-a3b          # 48 layers
    python benchmarks/make_bench_checkpoint.py /tmp/q30b-4l --preset qwen3-30b-a3b --layers 4
    python benchmarks/make_bench_checkpoint.py /tmp/tiny-bench --preset tiny --verify
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

PRESETS: dict[str, dict] = {
    # Qwen/Qwen3-30B-A3B's config, full depth (fewer layers with --layers)
    "qwen3-30b-a3b": dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, top_k=8,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          rope_theta=1_000_000.0, layers=48),
    # the embedded default model's shapes (hidden 64, 8 experts, top-2)
    "tiny": dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, top_k=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10_000.0,
                 layers=2),
}
QUANTS = ("mixed", "nvfp4")
ARCHITECTURE = "Qwen3MoeForCausalLM"
PRODUCER = {"name": "moe-runtime benchmarks/make_bench_checkpoint.py",
            "version": "mimics modelopt 0.47.0 export"}
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_EXPERT_CHUNK = 16  # experts quantized at once: bounds the quantizer's float32 temporaries


def _nvfp4_group() -> dict:
    spec = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    return {"input_activations": dict(spec), "weights": dict(spec)}


def _fp8_group() -> dict:
    spec = {"dynamic": False, "num_bits": 8, "type": "float"}
    return {"input_activations": dict(spec), "weights": dict(spec)}


def quantization_configs(quant: str, num_layers: int) -> tuple[dict, dict]:
    """``(hf_quant_config.json, config.json's quantization_config)``, as ModelOpt 0.47 writes."""
    if quant == "nvfp4":
        exclude = ["lm_head", "model.embed_tokens"] + [
            f"model.layers.{i}.mlp.gate" for i in range(num_layers)]
        hf = {"producer": PRODUCER,
              "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None,
                               "group_size": 16, "exclude_modules": exclude}}
        qc = {"config_groups": {"group_0": {**_nvfp4_group(), "targets": ["Linear"]}},
              "ignore": exclude, "quant_algo": "NVFP4", "producer": PRODUCER,
              "quant_method": "modelopt"}
        return hf, qc
    if quant != "mixed":
        raise ValueError(f"quant {quant!r}: accepted {', '.join(QUANTS)}")
    layers: dict[str, dict] = {}
    for i in range(num_layers):
        for p in _ATTN:
            layers[f"model.layers.{i}.self_attn.{p}"] = {"quant_algo": "FP8"}
        layers[f"model.layers.{i}.mlp.experts"] = {"quant_algo": "NVFP4", "group_size": 16}
    fp8 = sorted(m for m, v in layers.items() if v["quant_algo"] == "FP8")
    nvfp4 = sorted(m for m, v in layers.items() if v["quant_algo"] == "NVFP4")
    hf = {"producer": PRODUCER,
          "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
                           "quantized_layers": layers}}
    qc = {"config_groups": {"group_0": {**_fp8_group(), "targets": fp8},
                            "group_1": {**_nvfp4_group(), "targets": nvfp4}},
          "quantized_layers": layers, "ignore": [], "quant_algo": "MIXED_PRECISION",
          "producer": PRODUCER, "quant_method": "modelopt"}
    return hf, qc


def _hf_config(shape: dict, *, num_layers: int, vocab_size: int, max_position_embeddings: int,
               special: dict, initializer_range: float):
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=shape["hidden_size"],
        intermediate_size=3 * shape["moe_intermediate_size"],  # unused: every layer is MoE
        moe_intermediate_size=shape["moe_intermediate_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"],
        num_experts=shape["num_experts"],
        num_experts_per_tok=shape["top_k"],
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_theta": shape["rope_theta"], "rope_type": "default"},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=initializer_range,
        **special,
    )
    config.architectures = [ARCHITECTURE]
    config.dtype = "bfloat16"
    return config


class _Writer:
    """Draws, quantizes and collects the tensors of one shard at a time."""

    def __init__(self, device, seed: int, std: float, act_amax: float, act2_amax: float):
        import torch

        self.torch = torch
        self.device = device
        self.seed = seed
        self.std = std
        self.act_amax = act_amax
        self.act2_amax = act2_amax

    def generator(self, stream: int):
        g = self.torch.Generator(device=self.device)
        g.manual_seed(self.seed * 1_000_003 + stream)
        return g

    def normal(self, shape, g):
        torch = self.torch
        x = torch.randn(shape, generator=g, device=self.device, dtype=torch.float32)
        return (x * self.std).to(torch.bfloat16)

    def ones(self, n):
        return self.torch.ones(n, dtype=self.torch.bfloat16, device=self.device)

    def linear(self, out: dict, name: str, w, fmt: str) -> None:
        """One linear ``name`` (``....q_proj``) as ``fmt``: ``bf16``, ``fp8`` or ``nvfp4``."""
        from moe_runtime.quant import (
            fp8_scale_from_amax,
            nvfp4_global_scale,
            quantize_fp8_per_tensor,
            quantize_nvfp4,
        )

        torch = self.torch
        if fmt == "bf16":
            out[f"{name}.weight"] = w
            return
        amax = w.abs().amax().to(torch.float32)
        if fmt == "fp8":
            scale = fp8_scale_from_amax(amax)
            out[f"{name}.weight"] = quantize_fp8_per_tensor(w, scale)
            out[f"{name}.weight_scale"] = scale
            out[f"{name}.input_scale"] = fp8_scale_from_amax(
                torch.tensor(self.act_amax, device=self.device))
            return
        gs = nvfp4_global_scale(amax)
        packed, block_scale = quantize_nvfp4(w, gs)
        out[f"{name}.weight"] = packed
        out[f"{name}.weight_scale"] = block_scale
        out[f"{name}.weight_scale_2"] = gs
        out[f"{name}.input_scale"] = nvfp4_global_scale(
            torch.tensor(self.act_amax, device=self.device))

    def experts(self, out: dict, prefix: str, g, *, num_experts: int, hidden: int,
                inter: int) -> None:
        """NVFP4 W4A4 experts ``{prefix}.{e}.{gate,up,down}_proj``, ModelOpt's per-expert layout."""
        from moe_runtime.reference_math import quantize_expert_weights

        for first in range(0, num_experts, _EXPERT_CHUNK):
            n = min(_EXPERT_CHUNK, num_experts - first)
            w13 = self.normal((n, 2 * inter, hidden), g)  # [gate; up], as transformers fuses them
            w2 = self.normal((n, hidden, inter), g)
            q = quantize_expert_weights(w13, w2, "nvfp4_w4a4", "silu",
                                        a13_amax=self.act_amax, a2_amax=self.act2_amax)
            for j in range(n):
                e = f"{prefix}.{first + j}"
                for proj, rows in (("gate_proj", slice(0, inter)),
                                   ("up_proj", slice(inter, 2 * inter))):
                    out[f"{e}.{proj}.weight"] = q.w13[j, rows]
                    out[f"{e}.{proj}.weight_scale"] = q.w13_scale[j, rows]
                    out[f"{e}.{proj}.weight_scale_2"] = q.w13_scale_2[j]
                    out[f"{e}.{proj}.input_scale"] = q.a13_scale
                out[f"{e}.down_proj.weight"] = q.w2[j]
                out[f"{e}.down_proj.weight_scale"] = q.w2_scale[j]
                out[f"{e}.down_proj.weight_scale_2"] = q.w2_scale_2[j]
                out[f"{e}.down_proj.input_scale"] = q.a2_scale
            del w13, w2, q


def _save_shard(tensors: dict, path: Path) -> int:
    from safetensors.torch import save_file

    # copy=True: experts are slices of one quantized chunk, and safetensors refuses shared storage
    cpu = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}
    save_file(cpu, str(path), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in cpu.values())


def make_bench_checkpoint(
    out_dir: str | Path,
    *,
    preset: str = "qwen3-30b-a3b",
    layers: int | None = None,
    quant: str = "mixed",
    device: str | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
    max_position_embeddings: int = 4096,
    std: float = 0.02,
    act_amax: float = 8.0,
    act2_amax: float = 8.0,
    progress: bool = True,
    **shape_overrides,
) -> Path:
    """Write the checkpoint into ``out_dir`` (replaced if it exists); return the folder.

    :param preset: a key of :data:`PRESETS`; ``shape_overrides`` (``hidden_size``,
        ``moe_intermediate_size``, ``num_experts``, ``top_k``, ``num_attention_heads``,
        ``num_key_value_heads``, ``head_dim``) win over it.
    :param device: where weights are drawn and quantized (default: CUDA when present, else CPU).
        The bytes depend on the device's random generator, not on the quantizer (CUDA is
        bit-identical to CPU there).
    :param act_amax: the absolute maximum the FP8/NVFP4 ``input_scale`` of attention projections
        and of the experts' gate/up is derived from (ModelOpt would calibrate it).
    :param act2_amax: likewise for the experts' down projection (the gated intermediate).
    """
    import torch
    from tqdm.auto import tqdm

    from moe_runtime.serve import tiny_tokenizer

    if preset not in PRESETS:
        raise ValueError(f"preset {preset!r}: accepted {', '.join(PRESETS)}")
    if quant not in QUANTS:
        raise ValueError(f"quant {quant!r}: accepted {', '.join(QUANTS)}")
    shape = {**PRESETS[preset], **{k: v for k, v in shape_overrides.items() if v is not None}}
    num_layers = int(layers or shape["layers"])
    hidden, inter = shape["hidden_size"], shape["moe_intermediate_size"]
    for what, size in (("hidden_size", hidden), ("moe_intermediate_size", inter)):
        if size % 16:
            raise ValueError(f"{what} {size}: NVFP4 blocks need a multiple of 16")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")

    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tok_vocab = tiny_tokenizer.save_tokenizer(out, model_max_length=max_position_embeddings)
    vocab = int(vocab_size or tok_vocab)
    if vocab < tok_vocab:
        raise ValueError(f"vocab_size {vocab} is smaller than the tokenizer's {tok_vocab}")
    ids = tiny_tokenizer.special_token_ids()
    special = {"bos_token_id": ids[tiny_tokenizer.BOS_TOKEN],
               "eos_token_id": ids[tiny_tokenizer.EOS_TOKEN],
               "pad_token_id": ids[tiny_tokenizer.BOS_TOKEN]}
    config = _hf_config(shape, num_layers=num_layers, vocab_size=vocab,
                        max_position_embeddings=max_position_embeddings, special=special,
                        initializer_range=std)
    hf_quant, qc = quantization_configs(quant, num_layers)

    writer = _Writer(device, seed, std, act_amax, act2_amax)
    heads, kv_heads, head_dim = (shape["num_attention_heads"], shape["num_key_value_heads"],
                                 shape["head_dim"])
    attn_fmt = "fp8" if quant == "mixed" else "nvfp4"
    shards = num_layers + 1
    weight_map: dict[str, str] = {}
    total = 0
    bar = tqdm(total=shards, desc=f"writing {out.name}", unit="shard", disable=not progress)
    with torch.no_grad():
        for i in range(shards):
            tensors: dict = {}
            g = writer.generator(i)
            if i < num_layers:
                p = f"model.layers.{i}"
                tensors[f"{p}.input_layernorm.weight"] = writer.ones(hidden)
                tensors[f"{p}.post_attention_layernorm.weight"] = writer.ones(hidden)
                tensors[f"{p}.self_attn.q_norm.weight"] = writer.ones(head_dim)
                tensors[f"{p}.self_attn.k_norm.weight"] = writer.ones(head_dim)
                for proj, rows, cols in (("q_proj", heads * head_dim, hidden),
                                         ("k_proj", kv_heads * head_dim, hidden),
                                         ("v_proj", kv_heads * head_dim, hidden),
                                         ("o_proj", hidden, heads * head_dim)):
                    writer.linear(tensors, f"{p}.self_attn.{proj}",
                                  writer.normal((rows, cols), g), attn_fmt)
                tensors[f"{p}.mlp.gate.weight"] = writer.normal((shape["num_experts"], hidden), g)
                writer.experts(tensors, f"{p}.mlp.experts", g, num_experts=shape["num_experts"],
                               hidden=hidden, inter=inter)
            else:
                tensors["model.embed_tokens.weight"] = writer.normal((vocab, hidden), g)
                tensors["model.norm.weight"] = writer.ones(hidden)
                tensors["lm_head.weight"] = writer.normal((vocab, hidden), g)
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            total += _save_shard(tensors, out / fname)
            weight_map.update(dict.fromkeys(tensors, fname))
            del tensors
            bar.update(1)
    bar.close()

    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        indent=2) + "\n")
    config.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg, indent=4) + "\n")
    (out / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=4) + "\n")
    (out / "generation_config.json").write_text(json.dumps(special, indent=2) + "\n")
    return out


def _describe(path: Path) -> str:
    from moe_runtime.checkpoint import read_checkpoint

    info = read_checkpoint(path)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    formats = sorted({layer.quant.format for layer in info.moe_layers})
    first = info.moe_layers[0]
    return (f"{path}: {info.architecture}, {info.method}, {len(info.moe_layers)} MoE layers "
            f"({first.num_experts} experts, top-{first.top_k}, hidden {first.hidden_size}, "
            f"intermediate {first.intermediate_size}), experts {', '.join(formats)}, "
            f"{size / 2**30:.2f} GiB of safetensors")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="output folder (replaced if it exists)")
    parser.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers, every one MoE (default: the preset's)")
    parser.add_argument("--quant", default="mixed", choices=QUANTS)
    parser.add_argument("--device", default=None,
                        help="where weights are drawn and quantized (default: cuda if present)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="default: the tokenizer's (512)")
    parser.add_argument("--max-position-embeddings", type=int, default=4096)
    parser.add_argument("--act-amax", type=float, default=8.0)
    parser.add_argument("--act2-amax", type=float, default=8.0)
    for name in ("hidden-size", "moe-intermediate-size", "num-experts", "top-k",
                 "num-attention-heads", "num-key-value-heads", "head-dim"):
        parser.add_argument(f"--{name}", type=int, default=None, help="override the preset")
    parser.add_argument("--verify", action="store_true",
                        help="read the result back with moe_runtime.checkpoint.read_checkpoint")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    out = make_bench_checkpoint(
        args.out, preset=args.preset, layers=args.layers, quant=args.quant, device=args.device,
        seed=args.seed, vocab_size=args.vocab_size,
        max_position_embeddings=args.max_position_embeddings, act_amax=args.act_amax,
        act2_amax=args.act2_amax, progress=not args.no_progress,
        hidden_size=args.hidden_size, moe_intermediate_size=args.moe_intermediate_size,
        num_experts=args.num_experts, top_k=args.top_k,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads, head_dim=args.head_dim)
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s", flush=True)
    if args.verify:
        print(_describe(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.fspath(Path(__file__).resolve().parent.parent))
    sys.exit(main())
