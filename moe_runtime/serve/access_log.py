"""The one access-log line per request and the ``x-request-id`` it carries.

Written by the app (``app._Guard``) when a response ends, and by the HTTP protocol
(``http_protocol``) for what it answers itself, before any app sees a request: a 400
``malformed_http_request`` and a 408 ``request_timeout``. Both write the same fields, so that
every response sent has a line and a request id.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from urllib.parse import quote

access_log = logging.getLogger("moe_runtime.serve.access")

_REQUEST_ID_CHARS = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
                              b"-_.:/+=@")
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
          "/v1/moe/plan")


def request_id(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The client's ``x-request-id`` (printable, at most 128 characters), else a new one;
    ``headers`` as ASGI and h11 give them, names lower-cased."""
    for name, value in headers:
        if name == b"x-request-id":
            if 0 < len(value) <= 128 and set(value) <= _REQUEST_ID_CHARS:
                return value.decode()
            break
    return uuid.uuid4().hex


def route_label(path: str) -> str:
    """The ``route`` label of ``moe_runtime_requests_total``: a served route, else ``other``
    (a client's paths never become label values)."""
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return path if path in ROUTES else "other"


def logged_path(path: str, limit: int = 200) -> str:
    """``path`` (decoded by uvicorn, so any character) percent-encoded again for a log line:
    a ``%0A`` in a request line must not start a forged line of its own, nor a space add fields."""
    return quote(path[:limit], safe="!#$&'()*+,/:;=?@[]~")


def log_request(client, method: str, path: str, status: int, seconds: float, extra: str,
                request_id: str) -> None:
    """``client method path status milliseconds [extra] request_id=...``."""
    host, port = client[:2] if client else ("-", 0)
    access_log.info("%s:%s %s %s %d %.1fms%s request_id=%s", host, port, method,
                    logged_path(path), status, seconds * 1000, extra, request_id)
