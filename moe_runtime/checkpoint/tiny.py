"""Tiny MoE checkpoints quantized and exported by NVIDIA ModelOpt itself, on CPU, in seconds.

:func:`make_tiny_checkpoint` builds a small model from a transformers config (random weights,
deterministic by seed), calibrates ModelOpt's quantizers on a few random token batches and writes
the folder with ModelOpt's own exporter (``modelopt.torch.export.export_hf_checkpoint``), so tests
read exactly what ModelOpt 0.47 produces. Same arguments, same bytes: the safetensors files are
byte-identical from run to run (one intra-op thread while making; the global torch RNG and thread
count are left as they were).

Calibration uses ModelOpt's ``max`` algorithm, which only collects amax statistics: quantizers are
switched to calibration mode during the forward loop, so the NVFP4 fake-quant forward (which asserts
CUDA in 0.47: "amax must be a CUDA tensor for dynamic block quantization") never runs; a forward
*after* ``mtq.quantize`` would hit it. The export path is ModelOpt's real one, unpatched.

What ModelOpt 0.47 writes (transformers 5.14; per expert tensors under
``model.layers.{i}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}``, Mixtral
``model.layers.{i}.block_sparse_moe.experts.{e}.{w1,w3,w2}``; transformers' fused in-memory
``gate_up_proj`` is split back to the hub names by ModelOpt's quant-aware reverse conversion):

- ``fp8``: ``weight`` float8_e4m3fn ``[out, in]``, ``weight_scale`` and ``input_scale`` float32
  0-dim. ``hf_quant_config.json``: ``{"producer": {"name": "modelopt", "version": "0.47.0"},
  "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": null, "exclude_modules":
  ["lm_head", "model.embed_tokens", "model.layers.{i}.mlp.gate", ...]}}`` (routers listed one by
  one). config.json gains ``quantization_config``: ``{"config_groups": {"group_0": {...8-bit
  float weights and input_activations, "targets": ["Linear"]}}, "ignore": [same list],
  "quant_algo": "FP8", "producer": {...}, "quant_method": "modelopt"}``.
- ``nvfp4``: ``weight`` uint8 ``[out, in/2]``, ``weight_scale`` float8_e4m3fn ``[out, in/16]``,
  ``weight_scale_2`` and ``input_scale`` float32 0-dim. hf_quant_config as FP8 with
  ``"quant_algo": "NVFP4", "group_size": 16``; config.json's group carries ``group_size: 16``.
- ``w4a16_nvfp4``: as NVFP4 without any ``input_scale``; ``"quant_algo": "W4A16_NVFP4"``,
  ``"group_size": 16``; config.json's group has ``weights`` only.
- ``mixed``: ``"quant_algo": "MIXED_PRECISION"`` and ``quantized_layers`` keyed by module, the
  experts by *container* (``{"model.layers.0.mlp.experts": {"quant_algo": "NVFP4",
  "group_size": 16}, "model.layers.0.self_attn.q_proj": {"quant_algo": "FP8"}, ...}``); **no
  exclude_modules** (routers, lm_head and excluded modules are simply absent from the map) and
  config.json's copy has ``"ignore": []``, one config group per distinct algorithm with the module
  names as ``targets``, and the full ``quantized_layers``.
- ``bf16``: transformers' own ``save_pretrained`` (ModelOpt is not involved), no quantization
  config.

Shared by all: gate and up of one expert share ``weight_scale_2`` (NVFP4; FP8: ``weight_scale``),
since transformers fuses them into one ``gate_up_proj`` quantized per expert; ``input_scale`` is
shared per projection by all experts of a layer; routers (``mlp.gate``), DeepSeek's
``e_score_correction_bias``, norms, embeddings and ``lm_head`` stay bf16. With ``kv_cache="fp8"``
``kv_cache_quant_algo`` is ``"FP8"``, config.json gets ``kv_cache_scheme`` and the attention's
``k_proj``/``v_proj`` get float32 ``k_scale``/``v_scale``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import warnings
from pathlib import Path
from typing import Any

ARCHS: dict[str, str] = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
QUANTS: tuple[str, ...] = ("bf16", "fp8", "nvfp4", "w4a16_nvfp4", "mixed")
KV_CACHE: tuple[str, ...] = ("fp8",)

_HEAD_DIM = 16
_CALIB_BATCHES, _CALIB_BATCH, _CALIB_SEQ = 4, 4, 16


def _config(arch: str, *, num_layers: int, hidden_size: int, intermediate_size: int,
            num_experts: int, top_k: int, vocab_size: int, overrides: dict[str, Any]):
    """The transformers config of the tiny model (``overrides`` win)."""
    import transformers

    heads = max(1, hidden_size // _HEAD_DIM)
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_experts_per_tok=top_k,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    if arch == "qwen3_moe":
        kwargs = dict(
            common, head_dim=_HEAD_DIM, num_key_value_heads=max(1, heads // 2),
            intermediate_size=2 * intermediate_size, moe_intermediate_size=intermediate_size,
            num_experts=num_experts, norm_topk_prob=True,
        )
        cls = transformers.Qwen3MoeConfig
    elif arch == "qwen2_moe":
        kwargs = dict(
            common, num_key_value_heads=max(1, heads // 2),
            intermediate_size=2 * intermediate_size, moe_intermediate_size=intermediate_size,
            shared_expert_intermediate_size=2 * intermediate_size, num_experts=num_experts,
            norm_topk_prob=True,
        )
        cls = transformers.Qwen2MoeConfig
    elif arch == "mixtral":
        kwargs = dict(
            common, head_dim=_HEAD_DIM, num_key_value_heads=max(1, heads // 2),
            intermediate_size=intermediate_size, num_local_experts=num_experts,
        )
        cls = transformers.MixtralConfig
    else:
        n_group = 2 if num_experts % 2 == 0 and num_experts >= 4 else 1
        per_group = num_experts // n_group
        kwargs = dict(
            common, num_key_value_heads=heads,
            intermediate_size=2 * intermediate_size, moe_intermediate_size=intermediate_size,
            n_routed_experts=num_experts, n_shared_experts=1,
            first_k_dense_replace=1 if num_layers > 1 else 0,
            n_group=n_group, topk_group=min(n_group, max(1, math.ceil(top_k / per_group))),
            routed_scaling_factor=2.5, norm_topk_prob=True,
            q_lora_rank=2 * _HEAD_DIM, kv_lora_rank=_HEAD_DIM,
            qk_rope_head_dim=_HEAD_DIM, qk_nope_head_dim=_HEAD_DIM, v_head_dim=_HEAD_DIM,
            num_nextn_predict_layers=0,
        )
        cls = transformers.DeepseekV3Config
    kwargs.update(overrides)
    config = cls(**kwargs)
    # ModelOpt's exporter and transformers' reload both need the model class in the config.
    config.architectures = [ARCHS[arch]]
    return config


def _moe_layer_indices(arch: str, config) -> list[int]:
    n = config.num_hidden_layers
    if arch == "deepseek_v3":
        return [i for i in range(n) if i >= config.first_k_dense_replace]
    if arch in ("qwen3_moe", "qwen2_moe"):
        dense = set(config.mlp_only_layers or [])
        step = config.decoder_sparse_step
        return [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    return list(range(n))


def _quant_config(quant: str, fp8_moe_layers: tuple[int, ...], kv_cache: str | None) -> dict:
    """A ModelOpt ``mtq.quantize`` config built from ModelOpt's own presets."""
    import modelopt.torch.quantization as mtq

    if quant == "fp8":
        cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    elif quant == "nvfp4":
        cfg = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
    elif quant == "w4a16_nvfp4":
        cfg = copy.deepcopy(mtq.W4A16_NVFP4_CFG)
    else:
        # MIXED_PRECISION: FP8 everywhere (attention, dense and shared-expert MLPs), NVFP4 routed
        # experts except ``fp8_moe_layers``, and layer 0's o_proj left bf16 (an excluded module).
        cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
        fp8 = _entry_cfg(mtq.FP8_DEFAULT_CFG, "*weight_quantizer")
        nvfp4 = _entry_cfg(mtq.NVFP4_DEFAULT_CFG, "*weight_quantizer")
        entries = cfg["quant_cfg"]
        # ".experts." is the routed experts container; DeepSeek's "shared_experts" does not match.
        for kind in ("weight_quantizer", "input_quantizer"):
            entries.append({"quantizer_name": f"*.experts.*{kind}", "cfg": nvfp4})
            for index in fp8_moe_layers:
                entries.append({"quantizer_name": f"*.layers.{index}.*.experts.*{kind}",
                                "cfg": fp8})
        entries.append({"quantizer_name": "*.layers.0.self_attn.o_proj.*", "enable": False})
    if kv_cache == "fp8":
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
    return cfg


def _entry_cfg(preset: dict, name: str) -> dict:
    for entry in preset["quant_cfg"]:
        if entry.get("quantizer_name") == name and "cfg" in entry:
            return copy.deepcopy(entry["cfg"])
    raise RuntimeError(f"ModelOpt preset has no {name!r} entry; the tiny maker needs updating")


@contextlib.contextmanager
def _one_thread(torch):
    """One intra-op thread: the same float results on every machine, and on a busy CPU tiny ops
    run many times faster than with spinning worker threads. Restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _quiet_transformers():
    """No progress bars or deprecation notices from transformers while saving; restored after."""
    from transformers.utils import logging

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def make_tiny_checkpoint(
    out_dir: str | Path,
    *,
    arch: str,
    quant: str,
    seed: int = 0,
    fp8_moe_layers: tuple[int, ...] = (),
    num_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 32,
    num_experts: int = 8,
    top_k: int = 2,
    vocab_size: int = 256,
    max_shard_size: int | str | None = None,
    kv_cache: str | None = None,
    **overrides: Any,
) -> Path:
    """Build, calibrate, quantize and export a tiny MoE model into ``out_dir``; return the folder.

    :param arch: ``"qwen3_moe"``, ``"qwen2_moe"`` (with a shared expert), ``"mixtral"`` or
        ``"deepseek_v3"`` (first layer dense).
    :param quant: ``"bf16"`` (no ModelOpt), ``"fp8"``, ``"nvfp4"``, ``"w4a16_nvfp4"`` or
        ``"mixed"`` (MIXED_PRECISION: NVFP4 routed experts, FP8 attention and dense MLPs, layer
        0's ``self_attn.o_proj`` left bf16, ``lm_head`` and routers bf16).
    :param fp8_moe_layers: with ``quant="mixed"``, MoE layers whose experts are FP8 instead.
    :param intermediate_size: one routed expert's intermediate size (dense MLPs get twice it).
    :param max_shard_size: write sharded safetensors with ``model.safetensors.index.json``.
    :param kv_cache: ``"fp8"`` adds ModelOpt's FP8 KV-cache quantization.
    :param overrides: further fields of the transformers config (``initializer_range``...).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r}: accepted {', '.join(map(repr, ARCHS))}")
    if quant not in QUANTS:
        raise ValueError(f"quant {quant!r}: accepted {', '.join(map(repr, QUANTS))}")
    if kv_cache is not None and (kv_cache not in KV_CACHE or quant == "bf16"):
        raise ValueError(f"kv_cache {kv_cache!r}: accepted None or 'fp8' with a quantized model")
    fp8_moe_layers = tuple(fp8_moe_layers)
    if fp8_moe_layers and quant != "mixed":
        raise ValueError("fp8_moe_layers applies to quant='mixed' only")
    for name, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
        if size % 16:
            raise ValueError(f"{name} {size}: NVFP4 blocks need a multiple of 16")

    if quant != "bf16":
        try:
            import modelopt.torch.export  # noqa: F401
        except ImportError as exc:
            raise ImportError(
                f"quant={quant!r}: the tiny checkpoints are exported by nvidia-modelopt, which is "
                "not installed: pip install 'moe-runtime[default-model]' (from a checkout: "
                "pip install '.[default-model]')"
            ) from exc
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _config(arch, num_layers=num_layers, hidden_size=hidden_size,
                     intermediate_size=intermediate_size, num_experts=num_experts, top_k=top_k,
                     vocab_size=vocab_size, overrides=overrides)
    moe_layers = _moe_layer_indices(arch, config)
    unknown = sorted(set(fp8_moe_layers) - set(moe_layers))
    if unknown:
        raise ValueError(f"fp8_moe_layers {unknown} are not MoE layers (MoE layers: {moe_layers})")
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}

    with torch.random.fork_rng(devices=[]), warnings.catch_warnings(), _quiet_transformers(), \
            _one_thread(torch):
        warnings.simplefilter("ignore")
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.eval()
        if arch == "deepseek_v3":
            # transformers starts the selection bias at zero; a random one exercises routers.
            for i in moe_layers:
                gate = model.model.layers[i].mlp.gate
                gate.e_score_correction_bias.copy_(
                    0.05 * torch.randn(gate.e_score_correction_bias.shape))
        if quant == "bf16":
            model.save_pretrained(out, **save_kwargs)
            return out

        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint

        generator = torch.Generator().manual_seed(seed + 1)
        batches = [torch.randint(0, vocab_size, (_CALIB_BATCH, _CALIB_SEQ), generator=generator)
                   for _ in range(_CALIB_BATCHES)]

        def calibrate(m):
            with torch.no_grad():
                for ids in batches:
                    m(input_ids=ids)

        # ModelOpt prints a summary of every quantizer; keep the caller's output clean.
        with contextlib.redirect_stdout(io.StringIO()):
            model = mtq.quantize(model, _quant_config(quant, fp8_moe_layers, kv_cache), calibrate)
            export_hf_checkpoint(model, export_dir=out, **save_kwargs)
    return out
