"""Start-up and shutdown of a real ``moe-runtime serve``: a missing model fails at once, a model
without a tokenizer is refused before its weights load, /health answers 503 while the model loads,
and Ctrl+C (SIGINT) stops the server with status 130 and no traceback, loading or serving."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.serve.conftest import ServerProcess


def _serve(*argv, timeout=120):
    return subprocess.run([sys.executable, "-m", "moe_runtime.serve", "--port", "0", *argv],
                          capture_output=True, text=True, timeout=timeout)


def test_a_missing_model_fails_in_under_a_second_naming_it():
    start = time.monotonic()
    r = _serve("--model", "/nonexistent", timeout=30)
    elapsed = time.monotonic() - start
    assert r.returncode == 1
    assert "error: model /nonexistent: no such folder" in r.stderr
    assert elapsed < 1.0, elapsed  # before torch, transformers or the web stack are imported


def test_a_checkpoint_without_tokenizer_files_is_refused_before_its_weights_load(tmp_path):
    from moe_runtime.checkpoint.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "no-tokenizer", arch="qwen3_moe", quant="bf16")
    r = _serve(str(ckpt))
    assert r.returncode == 1
    assert f"error: {ckpt} has no tokenizer files" in r.stderr
    assert "--tokenizer" in r.stderr
    assert "Loading" not in r.stderr and "Traceback" not in r.stderr


def test_a_tokenizer_that_encodes_nothing_is_refused(tmp_path):
    from moe_runtime.checkpoint.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "empty-vocab", arch="qwen3_moe", quant="bf16")
    # a config naming a tokenizer class but no vocabulary: it loads, and encodes text to nothing
    (ckpt / "tokenizer_config.json").write_text('{"tokenizer_class": "Qwen2Tokenizer"}')
    r = _serve(str(ckpt))
    assert r.returncode == 1
    assert "encodes text to no tokens" in r.stderr and "Traceback" not in r.stderr


def _start(cache_home, *argv) -> ServerProcess:
    env = dict(os.environ, XDG_CACHE_HOME=str(cache_home), PYTHONUNBUFFERED="1",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return ServerProcess(["--port", "0", "--dtype", "float32", *argv], env)


def _listening_url(proc: ServerProcess, timeout=60.0) -> str:
    [line] = proc.lines_with("listening at http://", timeout=timeout)[:1]
    return line.split("listening at ")[1].split()[0]


def test_health_answers_503_while_the_model_loads_then_200(model_dir, cache_home):
    proc = _start(cache_home, str(model_dir))
    try:
        root = _listening_url(proc)
        start = time.monotonic()
        first = httpx.get(root + "/health", timeout=5)
        assert time.monotonic() - start < 2  # answered, not held until the model is loaded
        assert first.status_code == 503 and first.json() == {"status": "loading"}
        loading = httpx.post(root + "/v1/completions", json={"prompt": "hi"}, timeout=5)
        if loading.status_code == 503:  # unless the model was loaded in between
            assert loading.json()["error"]["code"] in ("model_loading", "engine_unavailable")
        proc.wait_ready()
        assert httpx.get(root + "/health").json() == {"status": "ok"}
    finally:
        proc.stop()


@pytest.mark.parametrize("when", ["loading", "serving"])
def test_ctrl_c_exits_130_without_a_traceback(model_dir, cache_home, when):
    proc = _start(cache_home, str(model_dir))
    try:
        _listening_url(proc)
        if when == "serving":
            proc.wait_ready()
        proc.proc.send_signal(signal.SIGINT)
        assert proc.proc.wait(30) == 130
        time.sleep(0.2)  # the reader thread takes the last lines
        text = "\n".join(proc.lines)
        assert "Traceback" not in text and "KeyboardInterrupt" not in text
    finally:
        proc.stop()
