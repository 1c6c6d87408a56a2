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


def test_a_tokenizer_config_without_its_vocabulary_is_refused_naming_the_missing_file(tmp_path):
    """A tokenizer_config.json left without tokenizer.json: transformers either loads a
    tokenizer that encodes text to nothing, or says to install sentencepiece or tiktoken (an
    audit of 2026-12-07); the refusal names the file that is missing instead."""
    from moe_runtime.checkpoint.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "empty-vocab", arch="qwen3_moe", quant="bf16")
    (ckpt / "tokenizer_config.json").write_text('{"tokenizer_class": "Qwen2Tokenizer"}')
    r = _serve(str(ckpt))
    assert r.returncode == 1
    assert "has tokenizer_config.json but no vocabulary for it" in r.stderr
    assert "tokenizer.json" in r.stderr and "--tokenizer" in r.stderr
    assert "sentencepiece" not in r.stderr and "Traceback" not in r.stderr


def _start(cache_home, *argv) -> ServerProcess:
    env = dict(os.environ, XDG_CACHE_HOME=str(cache_home), PYTHONUNBUFFERED="1",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONFAULTHANDLER="1")
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
        try:
            code = proc.proc.wait(30)
        except subprocess.TimeoutExpired:
            # seen twice in whole-suite runs on a 2-core machine (2026-12-07), never alone: the
            # server's threads' stacks (faulthandler, on by PYTHONFAULTHANDLER, dumps them on
            # SIGABRT) say where it hangs
            proc.proc.send_signal(signal.SIGABRT)
            try:
                proc.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            time.sleep(0.5)
            pytest.fail("no exit 30 s after SIGINT (" + when + "); the server's last lines:\n"
                        + "\n".join(proc.lines[-80:]))
        assert code == 130
        time.sleep(0.2)  # the reader thread takes the last lines
        text = "\n".join(proc.lines)
        assert "Traceback" not in text and "KeyboardInterrupt" not in text
    finally:
        proc.stop()


# Ctrl+C at the instant the first token is being generated, made deterministic: the server
# process with its probe wrapped to send itself SIGINT and go on only once the main thread has
# shut the engine down under it, and the main thread's shutdown held until the probe ended. This
# is the race that made the [loading] case above flaky: the probe failed, and a server stopped
# by Ctrl+C exited 1 saying the model "cannot serve".
_CTRL_C_AT_PROBE = """
import os, signal, sys, threading, time
from moe_runtime.serve import engine
probe, shutdown, probed = engine.Engine.probe, engine.Engine.shutdown, threading.Event()
def interrupted_probe(self, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    deadline = time.monotonic() + 20
    while self._manager is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        return probe(self, *args, **kwargs)
    finally:
        print("probe ended after the engine was " +
              ("shut down" if self._manager is None else "left running"), flush=True)
        probed.set()
def held_shutdown(self):
    shutdown(self)
    if threading.current_thread() is threading.main_thread():
        probed.wait(20)
engine.Engine.probe, engine.Engine.shutdown = interrupted_probe, held_shutdown
from moe_runtime.serve.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_while_the_first_token_is_generated_exits_130(model_dir, cache_home):
    env = dict(os.environ, XDG_CACHE_HOME=str(cache_home), PYTHONUNBUFFERED="1",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([sys.executable, "-c", _CTRL_C_AT_PROBE, "--port", "0", "--dtype",
                        "float32", str(model_dir)], capture_output=True, text=True, timeout=120,
                       env=env)
    text = r.stdout + r.stderr
    assert "probe ended after the engine was shut down" in text, text[-3000:]  # the instant was the one meant
    assert r.returncode == 130, text[-3000:]
    assert "cannot serve" not in text
    assert not [line for line in text.splitlines() if line.startswith("error:")]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
