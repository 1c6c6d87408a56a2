"""The embedded default model: a tiny MoE checkpoint made on first use and cached per user.

``moe-runtime serve`` without ``--model`` serves it, so the first command of the README runs on a
fresh CPU machine with no download. The checkpoint is made deterministically from a seed (random
weights: it shows the machinery, it does not write prose) in a second or two, into a temporary
folder that is renamed into place, so a half-written cache is never read; the folder name carries
:data:`DEFAULT_MODEL_VERSION`, so a new recipe never reads an old cache.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from moe_runtime.serve import tiny_tokenizer

# Bump when the recipe (shapes, seed, tokenizer, maker) changes: the cache is keyed by it.
_RECIPE = 1
CONTEXT_LENGTH = 1024
DEFAULT_MODEL_NAME = "moe-runtime-tiny"  # the model id served when no --model is given
SEED = 0


def _checkpoint_maker():
    """moe-runtime's ModelOpt tiny-checkpoint maker when this install has it, else None."""
    try:
        from moe_runtime.checkpoint.tiny import make_tiny_checkpoint
    except ImportError:
        return None
    return make_tiny_checkpoint


def default_model_version() -> str:
    """The cache key: the recipe number and which maker builds the weights."""
    maker = "modelopt-mixed" if _checkpoint_maker() is not None else "transformers-bf16"
    return f"tiny-qwen3-moe-r{_RECIPE}-{maker}"


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/moe-runtime`` or ``~/.cache/moe-runtime``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moe-runtime"


def default_model_dir() -> Path:
    return cache_root() / "default-model" / default_model_version()


def ensure_default_model(progress: bool = True) -> Path:
    """The default model's folder, made first if the cache lacks it."""
    final = default_model_dir()
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        if progress:
            print(f"moe-runtime: making the default model in {final} (first use only)", flush=True)
        make_default_model(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished first (rename onto a non-empty folder fails): use theirs.
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _tiny_config(vocab_size: int):
    from transformers import Qwen3MoeConfig

    ids = tiny_tokenizer.special_token_ids()
    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=CONTEXT_LENGTH,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=ids[tiny_tokenizer.BOS_TOKEN],
        eos_token_id=ids[tiny_tokenizer.EOS_TOKEN],
        pad_token_id=ids[tiny_tokenizer.BOS_TOKEN],
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    return config


def make_default_model(out_dir: str | Path) -> Path:
    """Write the default model (weights, config, tokenizer) into ``out_dir``, deterministically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = tiny_tokenizer.save_tokenizer(out, model_max_length=CONTEXT_LENGTH)
    maker = _checkpoint_maker()
    if maker is not None:
        ids = tiny_tokenizer.special_token_ids()
        maker(out, arch="qwen3_moe", quant="mixed", seed=SEED, vocab_size=vocab,
              max_position_embeddings=CONTEXT_LENGTH, initializer_range=0.1,
              bos_token_id=ids[tiny_tokenizer.BOS_TOKEN],
              eos_token_id=ids[tiny_tokenizer.EOS_TOKEN],
              pad_token_id=ids[tiny_tokenizer.BOS_TOKEN])
        _check_vocab(out, vocab)
    else:
        _make_with_transformers(out, vocab)
    _write_generation_config(out)
    return out


def _make_with_transformers(out: Path, vocab: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    config = _tiny_config(vocab)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)


def _check_vocab(out: Path, vocab: int) -> None:
    cfg = json.loads((out / "config.json").read_text())
    model_vocab = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")
    if model_vocab is not None and model_vocab < vocab:
        raise RuntimeError(f"the default model's vocabulary ({model_vocab}) is smaller than its "
                           f"tokenizer's ({vocab})")


def _write_generation_config(out: Path) -> None:
    """Greedy-neutral defaults: the server passes every sampling parameter per request."""
    ids = tiny_tokenizer.special_token_ids()
    gen = {
        "bos_token_id": ids[tiny_tokenizer.BOS_TOKEN],
        "eos_token_id": ids[tiny_tokenizer.EOS_TOKEN],
        "pad_token_id": ids[tiny_tokenizer.BOS_TOKEN],
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
