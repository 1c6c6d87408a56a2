"""A real ``moe-runtime serve`` process on a loopback port, shared by the tests of this folder.

It serves the embedded default model (made on first use into a temporary cache dir, as on a fresh
machine) in float32: on a CPU, bf16 matmuls round differently with the batch's shape, so only a
float32 model gives a request the same tokens alone and batched (see ``test_concurrency.py``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

API_KEY = "sk-test-moe-runtime"
READY = re.compile(r"serving '(?P<name>[^']+)' .* at (?P<url>http://\S+/v1)")


class ServerProcess:
    """A server subprocess and every line it wrote (stdout and stderr together)."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moe_runtime.serve", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.base_url = ""
        self.model = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            m = READY.search(line)
            if m and not self._ready.is_set():
                self.base_url, self.model = m.group("url"), m.group("name")
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        if not self._ready.wait(timeout) or not self.base_url:
            raise RuntimeError("server did not start:\n" + "\n".join(self.lines[-40:]))
        root = self.base_url.removesuffix("/v1")
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{root}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError("server never became healthy:\n" + "\n".join(self.lines[-40:]))

    def lines_with(self, text: str, timeout: float = 5.0) -> list[str]:
        """The output lines containing ``text``, waiting a little for the first to arrive."""
        deadline = time.monotonic() + timeout
        while True:
            found = [line for line in list(self.lines) if text in line]
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.05)

    @property
    def root(self) -> str:
        return self.base_url.removesuffix("/v1")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture(scope="session")
def cache_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("xdg-cache")


@pytest.fixture(scope="session")
def server_factory(cache_home):
    """Start more servers (extra CLI arguments); each is stopped at the end of the session."""
    started = []

    def start(extra: list[str]) -> ServerProcess:
        env = dict(os.environ, XDG_CACHE_HOME=str(cache_home), PYTHONUNBUFFERED="1",
                   HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        proc = ServerProcess(["--port", "0", "--dtype", "float32", "--api-key", API_KEY,
                              "--max-batch-size", "8", *extra], env)
        started.append(proc)
        proc.wait_ready()
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture(scope="session")
def server(server_factory):
    return server_factory([])


@pytest.fixture(scope="session")
def model_dir(server, cache_home) -> Path:
    """The checkpoint folder the server made and serves."""
    found = sorted((cache_home / "moe-runtime" / "default-model").glob("*/config.json"))
    assert len(found) == 1, found
    return found[0].parent


@pytest.fixture(scope="session")
def api_key() -> str:
    return API_KEY


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.root, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c
