"""A stop (SIGINT or SIGTERM) while requests run answers them before the graceful-shutdown
deadline: a stream ends with an error event, a whole-answer request gets a 503, each has its
access line, and the log has no traceback. A real server process, real HTTP clients.

Before, uvicorn cancelled them at the deadline: "Exception in ASGI application" with a
CancelledError traceback, a stream cut without an error event, an empty reply for the other.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from tests.serve.conftest import ServerProcess

TIMEOUT = 2.0  # --shutdown-timeout


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_running_requests_are_answered_when_the_server_stops(cache_home, sig, code):
    env = dict(os.environ, XDG_CACHE_HOME=str(cache_home), PYTHONUNBUFFERED="1",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = ServerProcess(["--port", "0", "--dtype", "float32", "--shutdown-timeout",
                          str(TIMEOUT)], env)
    try:
        proc.wait_ready()
        long = {"model": proc.model, "prompt": "go on", "max_tokens": 1000,
                "ignore_eos": True, "temperature": 0}
        whole: list = []

        def whole_answer():
            try:
                whole.append(httpx.post(f"{proc.root}/v1/completions", json=long, timeout=60))
            except httpx.HTTPError as exc:
                whole.append(exc)

        other = threading.Thread(target=whole_answer)
        other.start()
        events = []
        with httpx.stream("POST", f"{proc.root}/v1/completions", json={**long, "stream": True},
                          timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            proc.proc.send_signal(sig)  # both run: the stream has its first token
            events = [line for line in lines if line.startswith("data: ")]
        other.join(60)
        # 128 + the signal; a SIGTERM's status is the signal itself re-raised (-15 here,
        # 143 in a shell)
        assert proc.proc.wait(60) in (code, -sig)
        assert events and '"error"' in events[-1], events[-3:]
        err = json.loads(events[-1][6:])["error"]
        assert err["code"] == "engine_unavailable" and "shutting down" in err["message"]
        (answer,) = whole
        assert isinstance(answer, httpx.Response), answer
        assert answer.status_code == 503 and "shutting down" in answer.json()["error"]["message"]
        log = "\n".join(proc.lines)
        assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
        assert len([line for line in proc.lines if "POST /v1/completions" in line]) == 2, (
            log[-3000:])
    finally:
        proc.stop()
