"""The HTTP application: OpenAI-compatible routes over an :class:`~moe_runtime.serve.engine.Engine`.

Routes: ``/v1/completions`` and ``/v1/chat/completions`` (whole or streamed as server-sent events),
``/v1/models``, ``/health``, ``/metrics`` (Prometheus) and ``/v1/moe/plan``. Every route but
``/health`` checks ``api_key`` when one is set. One log line per request, written when its response
ends (for a stream: when the stream ends).

Client errors are answered in OpenAI's error shape and logged as that one line: bodies larger than
``max_request_bytes`` (413), nested deeper than ``protocol.MAX_JSON_DEPTH``, or not standard JSON
(400); a client that leaves mid-request is logged as status 499, with no traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from moe_runtime.serve.engine import Delta, Engine, EngineError, EngineUnavailable
from moe_runtime.serve.metrics import ServerMetrics
from moe_runtime.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    decode_body,
    invalid,
    parse,
)
from moe_runtime.serve.sampling import SamplingParams

access_log = logging.getLogger("moe_runtime.serve.access")
log = logging.getLogger("moe_runtime.serve")
CLIENT_GONE = 499  # the status logged (never sent) for a client that left before its response

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
           "/v1/moe/plan")


def _error_response(err: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


class _Server:
    def __init__(self, engine: Engine, *, served_model_name: str | None, api_key: str | None,
                 max_request_bytes: int) -> None:
        self.engine = engine
        self.model_name = served_model_name or engine.loaded.name
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.created = int(time.time())
        self.metrics = ServerMetrics(model_name=self.model_name, plan=engine.loaded.plan)
        engine.sampler.on_step = self.metrics.batch_sequences.observe

    # -------------------------------------------------------------------------- plain routes

    async def health(self, request: Request) -> Response:
        if self.engine.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    async def metrics_route(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "moe-runtime", "max_model_len": self.engine.context_length}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self._check_model(request.path_params["model_id"])
        return JSONResponse(self._model_card())

    async def plan(self, request: Request) -> Response:
        return JSONResponse(self.engine.loaded.plan)

    # -------------------------------------------------------------------------- generation

    async def _body(self, request: Request):
        limit = self.max_request_bytes
        too_large = APIError(413, f"the request body is larger than {limit} bytes",
                             code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return decode_body(b"".join(chunks))

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{self.model_name!r}", param="model", code="model_not_found")

    def _budget(self, prompt_ids: list[int], requested: int | None, default: int | None) -> int:
        ctx = self.engine.context_length
        n = len(prompt_ids)
        if n >= ctx:
            raise invalid(f"this model's maximum context length is {ctx} tokens, and the prompt "
                          f"has {n}", "prompt", "context_length_exceeded")
        room = ctx - n
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise invalid(f"this model's maximum context length is {ctx} tokens; you requested "
                          f"{n + requested} ({n} in the prompt, {requested} for the completion)",
                          "max_tokens", "context_length_exceeded")
        return requested

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.engine.encode_prompt(prompt)
        else:
            vocab = self.engine.loaded.model.config.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise invalid(f"token ids must lie in [0, {vocab}); got {bad[:3]}", "prompt")
            ids = list(prompt)
        if not ids:
            raise invalid("the prompt is empty", "prompt")
        return ids

    @staticmethod
    def _sampling(req) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k in (None, -1) else req.top_k,
            seed=req.seed,
        )

    async def completions(self, request: Request) -> Response:
        req = parse(CompletionRequest, await self._body(request))
        req.check_supported()
        self._check_model(req.model)
        prompt_ids = self._prompt_ids(req.single_prompt())
        max_tokens = self._budget(prompt_ids, req.max_tokens, DEFAULT_COMPLETION_TOKENS)
        return await self._respond(request, "/v1/completions", req, prompt_ids, max_tokens,
                                   chat=False)

    async def chat_completions(self, request: Request) -> Response:
        req = parse(ChatCompletionRequest, await self._body(request))
        req.check_supported()
        self._check_model(req.model)
        try:
            prompt_ids = self.engine.encode_chat(req.chat_messages())
        except ValueError as exc:
            raise invalid(str(exc), "messages") from None
        max_tokens = self._budget(prompt_ids, req.requested_max_tokens, None)
        return await self._respond(request, "/v1/chat/completions", req, prompt_ids, max_tokens,
                                   chat=True)

    async def _respond(self, request: Request, route: str, req, prompt_ids: list[int],
                       max_tokens: int, *, chat: bool) -> Response:
        if not self.engine.healthy:
            raise APIError(503, "the generation engine is not running", type="server_error",
                           code="engine_unavailable")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        request.state.moe_request = {"id": rid, "prompt_tokens": len(prompt_ids)}
        stream = self.engine.generate(prompt_ids, max_tokens=max_tokens,
                                      sampling=self._sampling(req), stop=req.stop_sequences,
                                      request_id=rid)
        if req.stream:
            events = self._events(request, route, req, stream, rid, created, len(prompt_ids),
                                  chat=chat)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        self.metrics.in_progress.inc()
        try:
            text, last = [], None
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    text.append(delta.text)
                    last = delta
        except EngineUnavailable as exc:
            raise APIError(503, str(exc), type="server_error", code="engine_unavailable") from None
        except EngineError as exc:
            raise APIError(500, f"generation failed: {exc}", type="server_error") from None
        finally:
            self.metrics.in_progress.dec()
        self._account(route, request, len(prompt_ids), last)
        choice = {"index": 0, "finish_reason": last.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice["text"] = "".join(text)
        if req.return_token_ids:
            choice["token_ids"] = list(last.token_ids)
        return JSONResponse({
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": [choice],
            "usage": _usage(len(prompt_ids), last),
            "system_fingerprint": None,
        })

    def _account(self, route: str, request: Request, prompt_tokens: int,
                 last: Delta | None, reason: str | None = None) -> None:
        completion = len(last.token_ids) if last else 0
        m = self.metrics
        m.prompt_tokens.inc(prompt_tokens)
        m.generation_tokens.inc(completion)
        m.prompt_length.observe(prompt_tokens)
        m.generation_length.observe(completion)
        reason = reason or (last.finish_reason if last else None) or "abort"
        m.finished.labels(reason=reason).inc()
        if last is not None and last.first_token_s is not None:
            m.first_token_latency.labels(route=route).observe(last.first_token_s)
        request.state.moe_request.update(completion_tokens=completion, finish_reason=reason)

    async def _events(self, request: Request, route: str, req, stream: AsyncIterator[Delta],
                      rid: str, created: int, prompt_tokens: int, *, chat: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list, usage: dict | None = None) -> str:
            body = {"id": rid, "object": obj, "created": created, "model": self.model_name,
                    "choices": choices, "system_fingerprint": None}
            if req.include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        def choice(text: str | None, finish: str | None, first: bool = False,
                   token_ids=None) -> dict:
            c = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                delta = {"role": "assistant", "content": ""} if first else {}
                if text:
                    delta["content"] = text
                c["delta"] = delta
            else:
                c["text"] = text or ""
            if token_ids is not None:
                c["token_ids"] = token_ids
            return c

        last: Delta | None = None
        reason = None
        self.metrics.in_progress.inc()
        try:
            async with contextlib.aclosing(stream):
                if chat:
                    yield chunk([choice(None, None, first=True)])
                sent = 0
                async for delta in stream:
                    new_ids = None
                    if req.return_token_ids:
                        new_ids = list(delta.token_ids[sent:])
                        sent = len(delta.token_ids)
                    last = delta
                    yield chunk([choice(delta.text, delta.finish_reason, token_ids=new_ids)])
                    if await request.is_disconnected():
                        reason = "abort"
                        return
            if req.include_usage:
                yield chunk([], _usage(prompt_tokens, last))
            yield "data: [DONE]\n\n"
        except (EngineUnavailable, EngineError) as exc:
            reason = "error"
            status = 503 if isinstance(exc, EngineUnavailable) else 500
            err = APIError(status, str(exc), type="server_error")
            yield f"data: {json.dumps(err.body())}\n\n"
        except asyncio.CancelledError:
            reason = "abort"  # the client went away; the engine request is cancelled already
            raise
        finally:
            self.metrics.in_progress.dec()
            self._account(route, request, prompt_tokens, last, reason)


def _usage(prompt_tokens: int, last: Delta | None) -> dict:
    completion = len(last.token_ids) if last else 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


class _Guard:
    """ASGI middleware: API key, request metrics and the one log line per request."""

    def __init__(self, app, server: _Server) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        path = scope["path"]
        status_holder = {"status": 500}
        scope.setdefault("state", {})

        async def send_wrapper(message) -> None:
            if message["type"] == "http.response.start":
                status_holder["status"] = message["status"]
            await send(message)

        try:
            err = self._auth_error(scope)
            if err is not None:
                await _error_response(err)(scope, receive, send_wrapper)
            else:
                await self.app(scope, receive, send_wrapper)
        except ClientDisconnect:
            # The client left mid-request or mid-response: its fault, nobody to answer, no
            # traceback. The access line says so.
            if status_holder["status"] == 500:
                status_holder["status"] = CLIENT_GONE
            scope["state"].setdefault("moe_request", {})["client_gone"] = True
        finally:
            self._finish(scope, path, status_holder["status"], time.perf_counter() - start)

    def _auth_error(self, scope) -> APIError | None:
        key = self.server.api_key
        if not key or scope["path"] == "/health":
            return None
        header = ""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(),
                                                                 key.encode()):
            return None
        what = "no API key was provided" if not header else "the API key is not valid"
        return APIError(401, f"{what}; send it as 'Authorization: Bearer <key>'",
                        code="invalid_api_key")

    def _finish(self, scope, path: str, status: int, seconds: float) -> None:
        route = path if path in _ROUTES or path.startswith("/v1/models/") else "other"
        if route.startswith("/v1/models/"):
            route = "/v1/models/{model}"
        m = self.server.metrics
        m.requests.labels(route=route, status=str(status)).inc()
        m.request_latency.labels(route=route).observe(seconds)
        state = scope.get("state", {}).get("moe_request", {})
        extra = ""
        if "prompt_tokens" in state:
            extra = (f" id={state.get('id')} prompt_tokens={state['prompt_tokens']} "
                     f"completion_tokens={state.get('completion_tokens', 0)} "
                     f"finish={state.get('finish_reason')}")
        if state.get("client_gone"):
            extra += " client_disconnected"
        client = scope.get("client") or ("-", 0)
        access_log.info("%s:%s %s %s %d %.1fms%s", client[0], client[1], scope.get("method"),
                        path[:200], status, seconds * 1000, extra)


def create_app(engine: Engine, *, served_model_name: str | None = None,
               api_key: str | None = None, max_request_bytes: int = 1 << 20,
               manage_engine: bool = True) -> Starlette:
    """The ASGI app serving ``engine``.

    With ``manage_engine`` the app starts the engine on start-up and stops it on shutdown.
    """
    server = _Server(engine, served_model_name=served_model_name, api_key=api_key,
                     max_request_bytes=max_request_bytes)

    def wrap(handler):
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as err:
                return _error_response(err)
        return endpoint

    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = (f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405)
                   else str(exc.detail))
        return _error_response(APIError(exc.status_code, message, code=code))

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return _error_response(APIError(500, f"internal error: {exc}", type="server_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            if manage_engine:
                engine.shutdown()

    routes = [
        Route("/health", wrap(server.health), methods=["GET"]),
        Route("/metrics", wrap(server.metrics_route), methods=["GET"]),
        Route("/v1/models", wrap(server.models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", wrap(server.model), methods=["GET"]),
        Route("/v1/moe/plan", wrap(server.plan), methods=["GET"]),
        Route("/v1/completions", wrap(server.completions), methods=["POST"]),
        Route("/v1/chat/completions", wrap(server.chat_completions), methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error, Exception: server_error})
    app.add_middleware(_Guard, server=server)
    app.state.server = server
    return app
