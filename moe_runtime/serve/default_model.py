"""The embedded default model: a tiny MoE checkpoint made on first use and cached per user.

``moe-runtime serve`` without ``--model`` serves it, so the first command of the README runs on a
fresh CPU machine with no download. It is a 2-layer Qwen3-MoE (8 experts, top-2, hidden 64) with
random weights drawn from a fixed seed (it shows the machinery; it does not write prose), exported
by nvidia-modelopt as MIXED_PRECISION (NVFP4 experts, FP8 attention, one attention projection left
unquantized) through :func:`moe_runtime.checkpoint.tiny.make_tiny_checkpoint`, with the byte-level
tokenizer of :mod:`moe_runtime.serve.tiny_tokenizer`. Same recipe, same bytes; a few seconds on a
CPU. It is written into a temporary folder renamed into place, so a half-written cache is never
read, and the folder is named after the recipe, so a changed recipe never reads an old cache.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from moe_runtime.serve import tiny_tokenizer

RECIPE = "tiny-qwen3-moe-mixed-r1"  # change it whenever the recipe below changes
DEFAULT_MODEL_NAME = "moe-runtime-default"  # the model id served when no --model is given
CONTEXT_LENGTH = 1024
SEED = 0


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/moe-runtime``, or ``~/.cache/moe-runtime``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moe-runtime"


def default_model_dir() -> Path:
    return cache_root() / "default-model" / RECIPE


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
            # another process got there first (renaming onto a non-empty folder fails): use theirs
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def make_default_model(out_dir: str | Path, *, quant: str = "mixed", arch: str = "qwen3_moe",
                       **overrides) -> Path:
    """Write the default model (weights, config, tokenizer) into ``out_dir``, deterministically.

    ``quant`` picks another export of the same recipe (``"w4a16_nvfp4"``, ``"bf16"``...), for tests
    that need weight-only numerics; ``arch`` another architecture of
    :data:`moe_runtime.checkpoint.tiny.ARCHS` with the same tokenizer (tests of each served
    family), ``overrides`` further :func:`~moe_runtime.checkpoint.tiny.make_tiny_checkpoint`
    arguments.
    """
    from moe_runtime.checkpoint.tiny import make_tiny_checkpoint

    if quant != "bf16":
        try:
            import modelopt.torch.export  # noqa: F401
        except ImportError as exc:
            raise ImportError(
                "the default model is exported by nvidia-modelopt, which is not installed: "
                "pip install 'moe-runtime[default-model]' (from a checkout: "
                "pip install '.[default-model]'), or serve a checkpoint of yours with --model DIR"
            ) from exc
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = tiny_tokenizer.save_tokenizer(out, model_max_length=CONTEXT_LENGTH)
    ids = tiny_tokenizer.special_token_ids()
    special = {
        "bos_token_id": ids[tiny_tokenizer.BOS_TOKEN],
        "eos_token_id": ids[tiny_tokenizer.EOS_TOKEN],
        "pad_token_id": ids[tiny_tokenizer.BOS_TOKEN],
    }
    options = dict(seed=SEED, vocab_size=vocab, max_position_embeddings=CONTEXT_LENGTH,
                   initializer_range=0.1, **special)
    make_tiny_checkpoint(out, arch=arch, quant=quant, **{**options, **overrides})
    # the exporter writes no generation config; the server reads EOS from it
    (out / "generation_config.json").write_text(json.dumps(special, indent=2) + "\n")
    return out
