"""The parts under the server: stop strings and the command's early errors (sampling: test_sampling.py)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from moe_runtime.serve import add_serve_arguments
from moe_runtime.serve.detokenize import IncrementalDetokenizer
from moe_runtime.serve.tiny_tokenizer import save_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(out, model_max_length=64)
    return AutoTokenizer.from_pretrained(out)


def _stream(detok, ids):
    parts = [detok.step(ids[: i + 1]) for i in range(len(ids))]
    return parts + [detok.finish()]


def test_detokenized_deltas_add_up_to_the_text(tokenizer):
    text = "Hello, wörld! ☃ and more"
    assert "".join(_stream(IncrementalDetokenizer(tokenizer),
                           tokenizer(text)["input_ids"])) == text


def test_a_stop_string_is_never_shown_even_in_part(tokenizer):
    ids = tokenizer("The quick brown fox jumps")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, ("brown",))
    parts = _stream(detok, ids)
    assert detok.stopped
    assert "".join(parts) == "The quick "
    assert not any("b" in p for p in parts)


def test_text_that_only_looks_like_a_stop_string_is_released(tokenizer):
    ids = tokenizer("The quick brow")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, ("brown",))
    assert "".join(_stream(detok, ids)) == "The quick brow"
    assert not detok.stopped


def test_serve_options_have_safe_defaults():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args([])
    assert args.host == "127.0.0.1"
    assert args.model is None
    assert args.max_batch_size >= 1


def _serve(*argv, timeout=60):
    return subprocess.run([sys.executable, "-m", "moe_runtime.serve", "--port", "0", *argv],
                          capture_output=True, text=True, timeout=timeout)


def test_a_missing_model_folder_exits_non_zero(tmp_path):
    r = _serve("--model", str(tmp_path / "nope"))
    assert r.returncode == 1
    assert "no config.json" in r.stderr


def test_a_backend_that_cannot_run_a_layer_is_refused_before_any_weight_is_read(tmp_path):
    import time

    from moe_runtime.checkpoint.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "m", arch="qwen3_moe", quant="mixed")
    start = time.monotonic()
    r = _serve("--model", str(ckpt), "--moe-runner-backend", "flashinfer_cutedsl")
    elapsed = time.monotonic() - start
    assert r.returncode == 1
    # one line for both layers, as `moe-runtime plan` groups it
    assert "layers 0-1 of model.layers.N.mlp.experts (format nvfp4_w4a4" in r.stderr
    assert "flashinfer_cutedsl" in r.stderr and "would run this layer: " in r.stderr
    assert "reference" in r.stderr.split("would run this layer: ")[1]
    assert "Loading" not in r.stderr  # refused before the weights' progress bar started
    assert elapsed < 60


def test_an_unknown_backend_pin_lists_the_registered_ones(tmp_path):
    from moe_runtime.checkpoint.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "m", arch="qwen3_moe", quant="bf16")
    r = _serve("--model", str(ckpt), "--moe-runner-backend", "nope")
    assert r.returncode == 1
    assert "'nope' is not a registered experts backend" in r.stderr and "reference" in r.stderr
