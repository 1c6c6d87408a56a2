"""The parts under the server: stop strings, per-request sampling, the command's early errors."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer

from moe_runtime.serve import add_serve_arguments
from moe_runtime.serve.detokenize import IncrementalDetokenizer
from moe_runtime.serve.sampling import GREEDY, PerRequestSampler, SamplingParams
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


def _sample_rows(sampler, keys, logits):
    scores = logits.clone()
    sampler(scores, torch.tensor(keys, dtype=torch.int32))
    return scores.argmax(-1).tolist()


def test_each_request_samples_from_its_own_generator():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    alone = []
    for seed in (1, 2, 3):
        s = PerRequestSampler()
        k = s.open(SamplingParams(temperature=1.0, seed=seed))
        alone.append([_sample_rows(s, [k], logits[i : i + 1])[0] for i in range(4)])
    s = PerRequestSampler()
    keys = [s.open(SamplingParams(temperature=1.0, seed=seed)) for seed in (1, 2, 3)]
    together = [[], [], []]
    for i in range(4):
        # a greedy request shares the batch; the order of rows changes every step
        order = [(i + j) % 3 for j in range(3)]
        rows = torch.stack([logits[i]] * 4)
        picked = _sample_rows(s, [keys[j] for j in order] + [GREEDY], rows)
        for j, tok in zip(order, picked[:3], strict=True):
            together[j].append(tok)
        assert picked[3] == int(logits[i].argmax())
    assert together == alone


def test_top_p_and_top_k_keep_only_the_likeliest_tokens():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0, -2.0]])
    for params in (SamplingParams(temperature=1.0, top_p=0.5, seed=0),
                   SamplingParams(temperature=1.0, top_k=1, seed=0)):
        s = PerRequestSampler()
        key = s.open(params)
        got = {_sample_rows(s, [key], logits)[0] for _ in range(50)}
        assert got == {0}
    s = PerRequestSampler()
    key = s.open(SamplingParams(temperature=1.0, top_k=2, seed=0))
    assert {_sample_rows(s, [key], logits)[0] for _ in range(200)} <= {0, 1}


def test_greedy_requests_take_no_slot():
    s = PerRequestSampler()
    assert s.open(SamplingParams(temperature=0.0, seed=5)) == GREEDY
    assert s.open_slots == 0


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
