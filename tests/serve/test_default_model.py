"""The embedded default model: made deterministically, quickly, offline, cached atomically."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from moe_runtime.serve import default_model


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    out = tmp_path_factory.mktemp("default-a")
    start = time.monotonic()
    default_model.make_default_model(out)
    return out, time.monotonic() - start


def test_it_is_made_in_seconds(made):
    _, seconds = made
    assert seconds < 30


def test_it_is_made_deterministically(made, tmp_path):
    first, _ = made
    default_model.make_default_model(tmp_path)
    assert _digest(tmp_path) == _digest(first)


def test_it_is_a_moe_checkpoint_with_a_chat_tokenizer(made):
    out, _ = made
    config = AutoConfig.from_pretrained(out)
    assert config.num_experts > 1 and config.num_experts_per_tok > 1
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) <= config.vocab_size
    text = "Hello, wörld ☃"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                         add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token_id == json.loads(
        (out / "generation_config.json").read_text())["eos_token_id"]


def test_it_is_a_modelopt_mixed_precision_export(made):
    out, _ = made
    quant = json.loads((out / "hf_quant_config.json").read_text())
    assert quant["producer"]["name"] == "modelopt"
    assert quant["quantization"]["quant_algo"] == "MIXED_PRECISION"
    layers = quant["quantization"]["quantized_layers"]
    algos = {name: entry["quant_algo"] for name, entry in layers.items()}
    assert {a for n, a in algos.items() if n.endswith(".mlp.experts")} == {"NVFP4"}
    assert {a for n, a in algos.items() if ".self_attn." in n} == {"FP8"}
    config = AutoConfig.from_pretrained(out)
    attention = {f"model.layers.{i}.self_attn.{p}_proj" for i in range(config.num_hidden_layers)
                 for p in "qkvo"}
    assert len(attention - set(algos)) == 1  # one module left unquantized


def test_the_cache_is_made_once_under_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = default_model.ensure_default_model(progress=False)
    assert first == tmp_path / "moe-runtime" / "default-model" / default_model.RECIPE
    stamp = (first / "config.json").stat().st_mtime_ns
    assert default_model.ensure_default_model(progress=False) == first
    assert (first / "config.json").stat().st_mtime_ns == stamp
    # nothing half-written is left beside it
    assert [p.name for p in first.parent.iterdir()] == [first.name]
