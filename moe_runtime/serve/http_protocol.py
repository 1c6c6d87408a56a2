"""uvicorn's h11 protocol with a deadline for receiving each request (headers and body).

uvicorn bounds only the idle time between requests (its keep-alive timeout), and cancels even
that on any byte received: a client that sends half a request line, or one header byte a second,
or a body slower than it declared, holds its connection (and a file descriptor) for ever, and a few
thousand such clients starve the server of descriptors (slowloris). Here every request must
arrive whole within ``--request-read-timeout`` seconds of the connection opening or of the
previous response ending. A request whose headers are late is answered 408 (OpenAI's error
shape) and the connection closed; an idle connection that received nothing is closed silently;
one whose body is late is cut off (the handler sees the client disconnect, as for a client that
left). A response being sent is never cut: the deadline stops once the request has arrived.
A request that is not HTTP/1.1 (a bad request line, a header without a colon, a head over h11's
limit) is answered 400 in OpenAI's error shape naming what h11 refused, where uvicorn answers a
plain-text "Invalid HTTP request received." that no OpenAI client can parse. So is a request
that declares its body's length twice, with both ``Content-Length`` and ``Transfer-Encoding``
(RFC 9112 section 6.1: a proxy in front may frame it by the other header, so the bytes after the
body this server reads would be smuggled in as a request of their own): h11 reads it as chunked and
keeps the connection; here it is refused and the connection closed, as the RFC asks.

A request target in absolute form (``GET http://host/health HTTP/1.1``, what a client
configured to use this server as its proxy sends) is served as its path: RFC 9112 section 3.2.2
says a server must accept it, and uvicorn would take the whole URL for the path (a 404 for
``/http://host/health``).

What the protocol answers itself (the 400 and the 408) carries ``x-request-id`` (the client's,
when its headers were read) and has its access-log line and its count in
``moe_runtime_requests_total``, as every response of the app has. A 400 for a body that breaks
HTTP (a bad chunk) comes while the app handles the request: the app writes that line, with the
status sent.
"""

from __future__ import annotations

import json
import logging
import re

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from moe_runtime.serve.access_log import log_request, request_id, route_label

log = logging.getLogger("moe_runtime.serve")


def _timeout_response(seconds: float, rid: str) -> bytes:
    body = json.dumps({"error": {
        "message": f"the request did not arrive whole within {seconds:g} s (the server's "
                   "--request-read-timeout); send the request line, headers and body at once",
        "type": "invalid_request_error", "param": None, "code": "request_timeout"}}).encode()
    head = ("HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nx-request-id: {rid}\r\n"
            "connection: close\r\n\r\n").encode()
    return head + body


_BYTEARRAY = re.compile(r"bytearray\((b'(?:[^'\\]|\\.)*'|b\"(?:[^\"\\]|\\.)*\")\)")


def _malformed_body(detail: str, advice: str = "") -> bytes:
    from moe_runtime.serve.protocol import clip

    advice = advice or ("send HTTP/1.1: a request line 'METHOD /path HTTP/1.1', 'Name: value' "
                        "header lines, a blank line, then a body of the Content-Length declared")
    # h11 quotes the line it refused as "bytearray(b'GET  /x HTTP/1.1')": the bytes alone
    detail = _BYTEARRAY.sub(r"\1", detail)
    return json.dumps({"error": {
        "message": f"malformed HTTP request: {clip(detail or 'unreadable', 200)}; {advice}",
        "type": "invalid_request_error", "param": None, "code": "malformed_http_request"}}).encode()


FRAMING_CONFLICT = ("the request has both a Content-Length and a Transfer-Encoding header, which "
                    "frame its body in two ways (RFC 9112 section 6.1)")
FRAMING_ADVICE = "send one of them: Content-Length for a body of known length, else chunked"


_ABSOLUTE = re.compile(rb"(?i)https?://[^/?#]*(?P<rest>.*)", re.S)


def _origin_form(event: h11.Request) -> h11.Request:
    """``event`` with an absolute-form target (``http://host/path?q``) as its path and query."""
    m = _ABSOLUTE.match(event.target)
    if m is None:
        return event  # '*', or not an http(s) URL: routed (or refused) as it is
    rest = m.group("rest")
    target = rest if rest.startswith(b"/") else b"/" + rest  # 'http://a?q' is '/?q'
    return h11.Request(method=event.method, headers=event.headers, target=target,
                       http_version=event.http_version)


def _framing_conflict(event: h11.Request) -> bool:
    names = {name for name, _ in event.headers}  # h11 gives them lower-cased
    return b"content-length" in names and b"transfer-encoding" in names


def protocol_with_read_deadline(seconds: float, metrics=None) -> type[H11Protocol]:
    """An :class:`H11Protocol` subclass (uvicorn's ``http=``) giving each request ``seconds``;
    what it answers itself is counted in ``metrics`` (a :class:`~.metrics.ServerMetrics`)."""

    class ReadDeadlineProtocol(H11Protocol):
        read_timeout = seconds

        def connection_made(self, transport) -> None:  # type: ignore[override]
            self._read_deadline = None
            self._protocol_error = ""
            self._protocol_advice = ""
            self._refused_head = None  # (method, path, headers) of a request refused on its head
            self._request_began = 0.0
            super().connection_made(transport)
            self._arm_read_deadline()
            # keep what h11 refused (uvicorn's handler drops it) for the 400's message
            events = self.conn.next_event

            def next_event():
                try:
                    event = events()
                except h11.RemoteProtocolError as exc:
                    self._protocol_error = str(exc)
                    raise
                if isinstance(event, h11.Request) and _framing_conflict(event):
                    # refused before the app sees it; uvicorn answers send_400_response
                    self._protocol_error, self._protocol_advice = FRAMING_CONFLICT, FRAMING_ADVICE
                    self._refused_head = (event.method.decode("ascii", "replace"),
                                          event.target.decode("ascii", "replace").partition("?")[0],
                                          event.headers)
                    raise h11.RemoteProtocolError(FRAMING_CONFLICT, 400)
                if isinstance(event, h11.Request) and not event.target.startswith(b"/"):
                    event = _origin_form(event)
                return event

            self.conn.next_event = next_event

        def send_400_response(self, msg: str) -> None:  # type: ignore[override]
            """uvicorn's 400 for what h11 cannot parse, as a JSON error naming the problem."""
            body = _malformed_body(self._protocol_error, self._protocol_advice)
            self._protocol_error = self._protocol_advice = ""
            method, path, heads = self._refused_head or ("-", "-", ())
            self._refused_head = None
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                # the app has this request (its body broke HTTP): it logs it, as a 400
                state = cycle.scope.setdefault("state", {})
                state["refused_by_protocol"] = 400
                rid = state.setdefault("request_id", request_id(cycle.scope.get("headers", ())))
            else:
                rid = request_id(heads)
                self._log_own(method, path, 400, " malformed_http_request", rid)
            headers = [(b"content-type", b"application/json"),
                       (b"content-length", str(len(body)).encode()),
                       (b"x-request-id", rid.encode()), (b"connection", b"close")]
            try:
                self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers,
                                                                 reason=b"Bad Request")))
                self.transport.write(self.conn.send(h11.Data(data=body)))
                self.transport.write(self.conn.send(h11.EndOfMessage()))
            except h11.LocalProtocolError:  # a response had begun: nothing more can be said
                pass
            self.transport.close()

        def _log_own(self, method: str, path: str, status: int, extra: str, rid: str) -> None:
            """The access line and count of a response this protocol sent itself."""
            seconds = max(0.0, self.loop.time() - self._request_began)
            if metrics is not None:
                metrics.finished_http(route_label(path), status, seconds)
            log_request(self.client, method, path, status, seconds, extra, rid)

        def _arm_read_deadline(self) -> None:
            self._cancel_read_deadline()
            self._request_began = self.loop.time()
            self._read_deadline = self.loop.call_later(self.read_timeout, self._read_too_slow)

        def _cancel_read_deadline(self) -> None:
            if self._read_deadline is not None:
                self._read_deadline.cancel()
                self._read_deadline = None

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
                self._cancel_read_deadline()  # the request is in (or the connection is ending)

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may start a pipelined request's cycle
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm_read_deadline()

        def connection_lost(self, exc) -> None:
            self._cancel_read_deadline()
            super().connection_lost(exc)

        def _read_too_slow(self) -> None:
            self._read_deadline = None
            if self.transport.is_closing():
                return
            prefix = "%s:%d " % tuple(self.client[:2]) if self.client else ""
            if self.cycle is None or self.cycle.response_complete:
                if not self.conn.trailing_data[0]:
                    # idle, nothing of a request received: close without a word (a 408 here
                    # could be read by a pooled client as the answer to its next request)
                    self.transport.close()
                    return
                log.info("%sclosed: no whole request headers within %g s (--request-read-timeout)",
                         prefix, self.read_timeout)
                rid = request_id(())
                self._log_own("-", "-", 408, " request_timeout", rid)
                self.transport.write(_timeout_response(self.read_timeout, rid))
            else:
                log.info("%sclosed: the request body did not arrive within %g s "
                         "(--request-read-timeout)", prefix, self.read_timeout)
            self.transport.close()

    return ReadDeadlineProtocol
