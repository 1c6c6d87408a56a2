"""The HTTP application: OpenAI-compatible routes over an :class:`~moe_runtime.serve.engine.Engine`.

Routes: ``/v1/completions`` and ``/v1/chat/completions`` (whole or streamed as server-sent events),
``/v1/models``, ``/health``, ``/metrics`` (Prometheus) and ``/v1/moe/plan``. Every route but
``/health`` and ``/metrics`` checks ``api_key`` when one is set (as vLLM guards only ``/v1``). One
log line per request, written when its response ends (for a stream: when the stream ends); every
response carries an ``x-request-id`` header, the client's own when it sent one.

The app may be made before its engine (``create_app(None, served_model_name=...)``, then
``app.state.server.attach(engine)``): until then ``/health`` answers 503 ``loading`` and the
generation routes 503 ``model_loading``, so a server answers while its model loads.

Client errors are answered in OpenAI's error shape and logged as that one line: bodies larger than
``max_request_bytes`` (413), sent with a ``Content-Encoding`` other than ``identity`` (415: none is
decoded here) or with a ``Content-Type`` that is not JSON (415: ``application/json`` and
``application/*+json`` are read, with any parameters, and a body with no ``Content-Type`` is read
as JSON, as ``vllm serve`` reads it, unless a web page sent it; ``text/plain`` or the form type
that ``curl -d`` sends is refused), nested deeper than ``protocol.MAX_JSON_DEPTH``, not standard JSON,
or holding an object with a key twice (400, ``duplicate_key``: never "the last one wins"); a client
that leaves mid-request is logged as status 499, with no traceback; one that leaves while its
whole (not streamed) answer is generated has its generation cancelled, as a stream's is, and is
logged 499 ``finish=abort``; a stream whose client leaves keeps the 200 it was sent and is logged
``finish=abort client_disconnected`` too. What an error echoes of the
request (a path, a model name, a header) is bounded by ``protocol.clip``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator

import attrs
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from moe_runtime.serve.access_log import log_request, logged_path, request_id, route_label
from moe_runtime.serve.engine import Delta, Engine, EngineError, EngineUnavailable, PromptRejected
from moe_runtime.serve.metrics import ServerMetrics
from moe_runtime.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    clip,
    decode_body,
    invalid,
    parse,
)
from moe_runtime.serve.sampling import SamplingParams

log = logging.getLogger("moe_runtime.serve")
CLIENT_GONE = 499  # the status logged (never sent) for a client that left before its response

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
UNGUARDED = ("/health", "/metrics")  # answered without the API key
IDENTITY = "identity"  # the one Content-Encoding accepted (as no header): bodies are never decoded
JSON_TYPE = "application/json"  # the Content-Type of a request body (or no header, or */*+json)
FORM = "application/x-www-form-urlencoded"  # what curl -d (and urllib) send by default


def _check_content_encoding(request: Request) -> None:
    """A body sent compressed (``Content-Encoding: gzip``, ``br``...) is a 415, never read as
    JSON; no header, an empty one or ``identity`` is accepted."""
    values = request.headers.getlist("content-encoding")
    codings = [c.strip().lower() for v in values for c in v.split(",")]
    if all(c in ("", IDENTITY) for c in codings):
        return
    received = ", ".join(values)
    raise APIError(415, f"the request body has Content-Encoding {clip(received, 80, quoted=True)}, "
                        "which this server does not decode; accepted: 'identity' or no "
                        "Content-Encoding header (send the JSON body uncompressed)",
                   param="Content-Encoding", code="unsupported_content_encoding")


def _is_json_media_type(value: str) -> bool:
    """``application/json`` or ``application/*+json``, in any case, with any parameters."""
    kind, _, subtype = value.split(";", 1)[0].strip().lower().partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def _check_content_type(request: Request) -> None:
    """A body sent as anything but JSON is a 415, never read as JSON.

    Accepted: ``application/json`` and ``application/*+json`` (any case, any parameters:
    ``Application/JSON; charset=utf-8``), and no ``Content-Type`` header (or an empty one): such a
    body is read as JSON and must be JSON, as ``vllm serve`` reads it (and FastAPI before 0.132).
    Any other type (``text/plain``; ``application/x-www-form-urlencoded``, which ``curl -d`` sends
    unless told otherwise; ``multipart/form-data``) is refused naming the type received. So is a
    missing one on a request that carries ``Origin``: a browser's. A web page may POST a body with
    no type, or a ``text/plain`` one, to this server (on localhost, often without an API key)
    with no CORS preflight; FastAPI 0.132 refuses a missing type for that reason. Scripts send
    no ``Origin``, and browsers' JSON requests name their type."""
    values = [v for v in request.headers.getlist("content-type") if v.strip()]
    if values and all(_is_json_media_type(v) for v in values):
        return
    if not values:
        if "origin" not in request.headers:
            return
        raise APIError(415, "the request body has no Content-Type and the request comes from a "
                            "web page (it has an Origin header), which may not send one here "
                            f"unasked; accepted: '{JSON_TYPE}' (or application/*+json)",
                       param="Content-Type", code="unsupported_content_type")
    received = ", ".join(values)
    hint = ""
    if any(v.split(";", 1)[0].strip().lower() == FORM for v in values):
        hint = " (curl -d sends that type: add -H 'Content-Type: application/json')"
    raise APIError(415, f"the request body has Content-Type {clip(received, 80, quoted=True)}, "
                        f"which this server does not read{hint}; accepted: '{JSON_TYPE}' (or "
                        "application/*+json, with any parameters such as '; charset=utf-8'), or "
                        "no Content-Type header", param="Content-Type",
                   code="unsupported_content_type")


class NonFiniteOutput(EngineError):
    """A request's log-probabilities are NaN or +inf: the model's outputs are not finite."""


LOGPROB_FLOOR = -9999.0  # what vLLM answers for a log-probability of -inf (JSON has no inf)


def _json_logprob(value: float | None, token: int) -> float | None:
    """A log-probability as JSON can carry it: -inf (a token the model gives no probability) as
    :data:`LOGPROB_FLOOR`; NaN or +inf (the model's outputs are not finite) an
    :class:`EngineError`, which the request answers as a server error (it was a 500 "Out of
    range float values are not JSON compliant" with a traceback in the log)."""
    if value is None or math.isfinite(value):
        return value
    if value == -math.inf:
        return LOGPROB_FLOOR
    raise NonFiniteOutput(f"the model's log-probability of token {token} is {value}: its outputs "
                      "are not finite for this request (its weights or scales overflow or hold "
                      "NaN), so the tokens mean nothing")


def _error_response(err: APIError, headers: dict | None = None) -> JSONResponse:
    if err.status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


@attrs.frozen
class _Job:
    """One choice to generate: its index in the response, prompt, sampling and echoed prefix."""

    index: int
    prompt_ids: list
    max_tokens: int
    sampling: SamplingParams
    echo: str = ""
    # echo with logprobs: the prompt's (token, logprob, top) entries, the first logprob None
    echo_logprobs: tuple = ()


class _Server:
    def __init__(self, engine: Engine | None, *, served_model_name: str | None,
                 api_key: str | None, max_request_bytes: int,
                 generation_defaults: dict | None = None) -> None:
        if engine is None and not served_model_name:
            raise ValueError("an app made before its engine needs served_model_name")
        self.engine: Engine | None = None
        self.model_name = served_model_name or engine.loaded.name
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.created = int(time.time())
        self.defaults = dict(generation_defaults or {})
        self.metrics = ServerMetrics(model_name=self.model_name)
        self._token_text: dict[int, str] = {}
        if engine is not None:
            self.attach(engine)

    def attach(self, engine: Engine) -> None:
        """Serve ``engine`` (loaded after the app started answering, or at once)."""
        engine.sampler.on_step = self.metrics.batch_sequences.observe
        engine.on_tokens = self.metrics.tokens_generated
        self.metrics.describe_engine(engine)
        self.engine = engine

    def _ready_engine(self) -> Engine:
        engine = self.engine
        if engine is None:
            raise APIError(503, "the model is still loading; retry when /health answers 200",
                           type="server_error", code="model_loading")
        return engine

    # -------------------------------------------------------------------------- plain routes

    async def health(self, request: Request) -> Response:
        if self.engine is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        if self.engine.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    async def metrics_route(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    def _model_card(self) -> dict:
        context = self.engine.context_length if self.engine is not None else None
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "moe-runtime", "max_model_len": context}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self._check_model(request.path_params["model_id"])
        return JSONResponse(self._model_card())

    async def plan(self, request: Request) -> Response:
        return JSONResponse(self._ready_engine().loaded.plan_json())

    # -------------------------------------------------------------------------- generation

    async def _body(self, request: Request):
        _check_content_encoding(request)
        _check_content_type(request)
        limit = self.max_request_bytes
        too_large = APIError(413, f"the request body is larger than {limit} bytes (the "
                                  "server's --max-request-bytes)", code="request_too_large")
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
            raise APIError(404, f"the model {clip(name, quoted=True)} does not exist; this server serves "
                                f"{self.model_name!r}", param="model", code="model_not_found")

    def _budget(self, prompt_ids: list[int], requested: int | None, default: int | None,
                min_tokens: int | None = 0, field: str = "max_tokens") -> int:
        """Tokens the completion may have: ``requested``, else the default (at least
        ``min_tokens``), within the context."""
        ctx = self.engine.context_length
        n = len(prompt_ids)
        if n >= ctx:
            raise invalid(f"this model's maximum context length is {ctx} tokens, and the prompt "
                          f"has {n}", "prompt", "context_length_exceeded")
        room = ctx - n
        min_tokens = min_tokens or 0
        if min_tokens > room:
            raise invalid(f"this model's maximum context length is {ctx} tokens; min_tokens asks "
                          f"for {clip(n + min_tokens)} ({n} in the prompt, {clip(min_tokens)} for "
                          "the completion)", "min_tokens", "context_length_exceeded")
        if requested is None:
            default = self.defaults.get("max_tokens", default)
            return room if default is None else min(max(default, min_tokens), room)
        if requested > room:
            raise invalid(f"this model's maximum context length is {ctx} tokens; you requested "
                          f"{clip(n + requested)} ({n} in the prompt, {clip(requested)} for the "
                          "completion)",
                          field, "context_length_exceeded")
        return requested

    async def _prompt_ids(self, prompt, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            # refused before tokenizing where its length alone says it cannot fit; tokenized on
            # a worker thread (the tokenizer releases the GIL), so that a megabyte of prompt
            # does not hold /health and every other request for the half second it takes
            floor, longest = self.engine.token_floor(prompt)
            ctx = self.engine.context_length
            if floor > ctx:
                raise invalid(f"this model's maximum context length is {ctx} tokens; the prompt "
                              f"has {clip(len(prompt))} characters, so at least {floor} tokens "
                              f"(no token of this tokenizer covers more than {longest}); it was "
                              "not tokenized", "prompt", "context_length_exceeded")
            ids = await asyncio.to_thread(self.engine.encode_prompt, prompt,
                                          add_special_tokens=add_special_tokens)
        else:
            vocab = self.engine.loaded.model.config.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise invalid(f"token ids must lie in [0, {vocab}); got {clip(bad[:3])}",
                              "prompt", "invalid_value")
            ids = list(prompt)
        if not ids:
            raise invalid("the prompt is empty", "prompt", "invalid_value")
        return ids

    def _sampling(self, req, choice: int = 0) -> SamplingParams:
        """A request's sampling; fields it omits come from the model's generation config."""
        d = self.defaults

        def pick(name, fallback):
            value = getattr(req, name)
            return value if value is not None else d.get(name, fallback)

        top_k = pick("top_k", 0)
        seed = req.seed if req.seed is None else req.seed + choice  # n > 1: one seed a choice
        return SamplingParams(
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=0 if top_k in (None, -1) else top_k,
            seed=seed,
            logprobs=req.top_logprobs,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            min_p=pick("min_p", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            min_tokens=req.min_tokens or 0,
        )

    def _check_stop_token_ids(self, req) -> None:
        vocab = self.engine.loaded.model.config.vocab_size
        bad = [t for t in req.stop_token_ids or () if t >= vocab]
        if bad:
            raise invalid(f"stop_token_ids must lie in [0, {vocab}) (the vocabulary); got "
                          f"{clip(bad[:3])}", "stop_token_ids", "invalid_value")

    async def completions(self, request: Request) -> Response:
        req = parse(CompletionRequest, await self._body(request))
        req.check_supported()
        self._check_model(req.model)
        self._ready_engine()
        scored = req.echo and req.logprobs is not None
        if scored and not self.engine.scores_prompts:
            raise invalid("echo together with logprobs (the prompt tokens' log-probabilities) "
                          "needs a server started with --batching dynamic: transformers' paged "
                          "continuous batching cannot score a prompt; send echo or logprobs "
                          "alone", "echo", "unsupported_echo_logprobs")
        jobs = []
        for p, prompt in enumerate(req.prompts()):
            ids = await self._prompt_ids(prompt, req.add_special_tokens is not False)
            max_tokens = self._budget(ids, req.requested_max_tokens, DEFAULT_COMPLETION_TOKENS,
                                      req.min_tokens, req.max_tokens_field)
            echo, echo_logprobs = "", ()
            if req.echo:
                echo = prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(
                    ids, skip_special_tokens=False)
            if scored:
                echo_logprobs = await self._prompt_logprobs(ids, req.logprobs)
            jobs += [_Job(p * req.choices + j, ids, max_tokens, self._sampling(req, j), echo,
                          echo_logprobs) for j in range(req.choices)]
        return await self._respond(request, "/v1/completions", req, jobs, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        req = parse(ChatCompletionRequest, await self._body(request))
        req.check_supported()
        self._check_model(req.model)
        engine = self._ready_engine()
        try:
            prompt_ids = await asyncio.to_thread(engine.encode_chat, req.chat_messages(),
                                                 req.template_kwargs())
        except ValueError as exc:
            raise invalid(clip(str(exc), 1000), "messages") from None
        max_tokens = self._budget(prompt_ids, req.requested_max_tokens, None, req.min_tokens,
                                  req.max_tokens_field)
        jobs = [_Job(j, prompt_ids, max_tokens, self._sampling(req, j))
                for j in range(req.choices)]
        return await self._respond(request, "/v1/chat/completions", req, jobs, chat=True)

    async def _respond(self, request: Request, route: str, req, jobs: list[_Job], *,
                       chat: bool) -> Response:
        self._check_stop_token_ids(req)
        if not self.engine.healthy:
            raise APIError(503, "the generation engine is not running", type="server_error",
                           code="engine_unavailable")
        prefix = "chatcmpl" if chat else "cmpl"
        engine_id = f"{prefix}-{uuid.uuid4().hex}"  # unique, whatever the client sends
        rid = f"{prefix}-{req.request_id}" if req.request_id else engine_id
        created = int(time.time())
        prompt_tokens = _prompt_tokens(jobs)
        request.state.moe_request = {"id": rid, "prompt_tokens": prompt_tokens}
        stops = dict(stop=req.stop_sequences, stop_token_ids=tuple(req.stop_token_ids or ()),
                     ignore_eos=bool(req.ignore_eos),
                     include_stop_str=bool(req.include_stop_str_in_output or req.no_stop_trim),
                     skip_special_tokens=req.skip_special_tokens is not False)
        streams = [self.engine.generate(job.prompt_ids, max_tokens=job.max_tokens,
                                        sampling=job.sampling,
                                        request_id=engine_id if len(jobs) == 1 else
                                        f"{engine_id}-{job.index}",
                                        group=engine_id if len(jobs) > 1 else None, **stops)
                   for job in jobs]
        if req.stream:
            events = self._events(request, route, req, jobs, streams, rid, created, chat=chat)
            return _EventStream(events, media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache"})
        self.metrics.in_progress.inc()
        started = time.perf_counter()
        lasts: dict[int, Delta] = {}  # each choice's latest delta, kept for a client that leaves
        try:
            results = await _unless_client_leaves(request, _all(
                _collect(stream, lasts, job.index) for job, stream in zip(jobs, streams,
                                                                          strict=True)))
        except EngineUnavailable as exc:
            raise APIError(503, str(exc), type="server_error", code="engine_unavailable") from None
        except PromptRejected as exc:
            raise invalid(str(exc), "messages" if chat else "prompt", "invalid_prompt") from None
        except EngineError as exc:
            raise APIError(500, f"generation failed: {exc}", type="server_error",
                           code="generation_failed") from None
        except ClientDisconnect:
            # the client left before its answer: its engine requests are cancelled already;
            # counted as a stream whose client left is, and logged 499 by _Guard
            for job in jobs:
                last = lasts.get(job.index)
                self._account(route, request, job, last,
                              None if last is not None and last.finish_reason else "abort",
                              started=started)
            request.state.moe_request.update(
                completion_tokens=sum(len(d.token_ids) for d in lasts.values()),
                finish_reason="abort")
            raise
        finally:
            self.metrics.in_progress.dec()
        choices = []
        for job, (text, last) in zip(jobs, results, strict=True):
            self._account(route, request, job, last, started=started)
            choice = {"index": job.index, "finish_reason": last.finish_reason, "logprobs": None,
                      "stop_reason": last.stop_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = job.echo + text
            if job.sampling.logprobs is not None:
                try:
                    choice["logprobs"] = self._logprobs(last.logprobs, chat=chat,
                                                        offset=len(job.echo),
                                                        prefix=job.echo_logprobs)
                except EngineError as exc:
                    raise APIError(500, f"generation failed: {exc}", type="server_error",
                                   code="non_finite_output") from None
            if req.return_token_ids:
                choice["token_ids"] = list(last.token_ids)
            choices.append(choice)
        request.state.moe_request.update(
            completion_tokens=sum(len(last.token_ids) for _, last in results),
            finish_reason=",".join(sorted({last.finish_reason or "abort" for _, last in results})))
        return JSONResponse({
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(prompt_tokens, [last for _, last in results]),
            "system_fingerprint": None,
        })

    # -------------------------------------------------------------------------- logprobs

    async def _prompt_logprobs(self, ids: list[int], top: int) -> tuple:
        try:
            records = await self.engine.prompt_logprobs(ids, top)
        except EngineUnavailable as exc:
            raise APIError(503, str(exc), type="server_error", code="engine_unavailable") from None
        except EngineError as exc:
            raise APIError(500, f"scoring the prompt failed: {exc}", type="server_error") from None
        first = [(ids[0], None, None)]
        return tuple(first + [(r.token, r.logprob, r.top) for r in records[1:]])

    def _text_of(self, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = self.engine.tokenizer.decode([token], skip_special_tokens=False,
                                                clean_up_tokenization_spaces=False)
            if len(self._token_text) < 1 << 20:
                self._token_text[token] = text
        return text

    def _logprobs(self, records, *, chat: bool, offset: int = 0, prefix: tuple = ()) -> dict:
        """``records`` in OpenAI's shape: chat's ``content`` list, or completions' four lists
        (after ``prefix``: echoed prompt entries, whose offsets start at 0)."""
        if chat:
            def entry(token: int, logprob: float) -> dict:
                text = self._text_of(token)
                return {"token": text, "logprob": _json_logprob(logprob, token),
                        "bytes": list(text.encode())}

            return {"content": [{**entry(r.token, r.logprob),
                                 "top_logprobs": [entry(t, lp) for t, lp in r.top]}
                                for r in records], "refusal": None}
        entries = [*prefix, *((r.token, r.logprob, r.top) for r in records)]
        tokens, offsets, at = [], [], 0
        for i, (token, _, _) in enumerate(entries):
            if i == len(prefix):
                at = offset  # the generated text starts after the echoed prompt
            offsets.append(at)
            tokens.append(self._text_of(token))
            at += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [_json_logprob(lp, t) for t, lp, _ in entries],
                "top_logprobs": [None if top is None else {self._text_of(t): _json_logprob(v, t)
                                                           for t, v in top}
                                 for _, _, top in entries],
                "text_offset": offsets}

    def _account(self, route: str, request: Request, job: _Job, last: Delta | None,
                 reason: str | None = None, *, started: float) -> None:
        completion = len(last.token_ids) if last else 0
        reason = reason or (last.finish_reason if last else None) or "abort"
        self.metrics.finished_request(
            route=route, prompt_tokens=len(job.prompt_ids), completion_tokens=completion,
            reason=reason, first_token_s=last.first_token_s if last is not None else None,
            seconds=time.perf_counter() - started)

    async def _events(self, request: Request, route: str, req, jobs: list[_Job],
                      streams: list[AsyncIterator[Delta]], rid: str, created: int, *,
                      chat: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list, usage: dict | None = None) -> str:
            body = {"id": rid, "object": obj, "created": created, "model": self.model_name,
                    "choices": choices, "system_fingerprint": None}
            if req.include_usage:
                # vLLM's continuous_usage_stats: every chunk has the usage so far
                if usage is None and req.continuous_usage:
                    usage = _usage(_prompt_tokens(jobs), list(lasts.values()))
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        def choice(job: _Job, text: str | None, finish: str | None, first: bool = False,
                   token_ids=None, logprobs=None, stop_reason=None) -> dict:
            c = {"index": job.index, "finish_reason": finish, "logprobs": logprobs,
                 "stop_reason": stop_reason}
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

        lasts: dict[int, Delta] = {}
        sent = {job.index: 0 for job in jobs}
        text_at = {job.index: len(job.echo) for job in jobs}
        by_index = {job.index: job for job in jobs}
        done: set[int] = set()
        reason = None
        ended = False  # the stream reached its end ([DONE], or an error event)
        started = time.perf_counter()
        self.metrics.in_progress.inc()
        merged = _merge(streams, [job.index for job in jobs])
        try:
            async with contextlib.aclosing(merged):
                for job in jobs:
                    if chat:
                        yield chunk([choice(job, None, None, first=True)])
                    elif job.echo:
                        logprobs = (self._logprobs((), chat=False, prefix=job.echo_logprobs)
                                    if job.echo_logprobs else None)
                        yield chunk([choice(job, job.echo, None, logprobs=logprobs)])
                async for index, delta in merged:
                    job = by_index[index]
                    start, end = sent[index], len(delta.token_ids)
                    new_ids = list(delta.token_ids[start:]) if req.return_token_ids else None
                    logprobs = None
                    if job.sampling.logprobs is not None:
                        logprobs = self._logprobs(delta.logprobs[start:end], chat=chat,
                                                  offset=text_at[index])
                        if not chat:
                            text_at[index] += sum(len(t) for t in logprobs["tokens"])
                    sent[index] = end
                    lasts[index] = delta
                    if delta.finish_reason is not None:
                        done.add(index)
                    yield chunk([choice(job, delta.text, delta.finish_reason, token_ids=new_ids,
                                        logprobs=logprobs, stop_reason=delta.stop_reason)])
                    if await request.is_disconnected():
                        return
            if req.include_usage:
                yield chunk([], _usage(_prompt_tokens(jobs), list(lasts.values())))
            ended = True
            yield "data: [DONE]\n\n"
        except (EngineUnavailable, EngineError) as exc:
            reason, ended = "error", True
            if isinstance(exc, PromptRejected):
                err = invalid(str(exc), "messages" if chat else "prompt", "invalid_prompt")
            else:
                err = APIError(503 if isinstance(exc, EngineUnavailable) else 500, str(exc),
                               type="server_error",
                               code=("engine_unavailable" if isinstance(exc, EngineUnavailable)
                                     else "non_finite_output"
                                     if isinstance(exc, NonFiniteOutput)
                                     else "generation_failed"))
            yield f"data: {json.dumps(err.body())}\n\n"
        finally:
            if not ended:
                # the client went away (seen after a chunk, or as the cancellation or closing
                # of this generator): the engine requests are cancelled by closing the merge.
                # The 200 was sent; the access line says the client left, as a whole
                # answer's 499 does.
                reason = "abort"
                request.state.moe_request["client_gone"] = True
            self.metrics.in_progress.dec()
            for job in jobs:
                self._account(route, request, job, lasts.get(job.index),
                              None if job.index in done else (reason or "abort"),
                              started=started)
            request.state.moe_request.update(
                completion_tokens=sum(len(d.token_ids) for d in lasts.values()),
                finish_reason=",".join(sorted({(d.finish_reason or reason or "abort")
                                               for d in lasts.values()})) or reason)


class _EventStream(StreamingResponse):
    """A server-sent event stream whose generator is closed before the response returns: a
    stream whose client left (its task cancelled while the generator waited at a ``yield``) has
    its accounting done, and its engine requests cancelled, before ``_Guard`` writes the access
    line, not whenever the event loop finalizes the generator."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _prompt_tokens(jobs: list[_Job]) -> int:
    # a prompt is counted once however many choices it has (as OpenAI's usage counts it)
    seen, total = set(), 0
    for job in jobs:
        key = id(job.prompt_ids)
        if key not in seen:
            seen.add(key)
            total += len(job.prompt_ids)
    return total


def _usage(prompt_tokens: int, lasts: list) -> dict:
    completion = sum(len(last.token_ids) for last in lasts if last is not None)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


async def _collect(stream: AsyncIterator[Delta], lasts: dict | None = None,
                   key: int = 0) -> tuple[str, Delta]:
    """A whole response: its text and its last delta (also kept in ``lasts[key]`` as it comes,
    for a response cut short)."""
    parts, last = [], None
    async with contextlib.aclosing(stream):
        async for delta in stream:
            parts.append(delta.text)
            last = delta
            if lasts is not None:
                lasts[key] = delta
    return "".join(parts), last


async def _client_left(request: Request) -> None:
    """Return once the client has gone (its body is read already: the next ASGI message is
    ``http.disconnect``, which uvicorn sends when the connection closes)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_client_leaves(request: Request, awaitable):
    """``awaitable``'s result; if the client leaves first, ``awaitable`` is cancelled (and
    awaited) and :class:`ClientDisconnect` raised. A watcher task waits for the disconnect and
    never outlives this call."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_client_left(request))
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
        if not work.done() and watcher.done() and watcher.exception() is None:
            work.cancel()
            await asyncio.wait((work,))  # its engine requests cancelled before this returns
            if work.cancelled():
                raise ClientDisconnect()
        return await work  # done (or the watcher failed: wait for the work alone)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
        await asyncio.gather(watcher, work, return_exceptions=True)


async def _all(coroutines) -> list:
    """Run ``coroutines`` together; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


async def _merge(streams: list[AsyncIterator[Delta]], indices: list[int]):
    """(index, delta) from every stream as they come; closing it closes them all."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]):
            async for delta in streams[0]:
                yield indices[0], delta
        return
    out: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(index: int, stream) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    await out.put((index, delta))
            await out.put((index, end))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the consumer, raised there
            await out.put((index, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in zip(indices, streams, strict=True)]
    running = len(tasks)
    try:
        while running:
            index, item = await out.get()
            if item is end:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _KeyCheck:
    """ASGI middleware: the API key. Inside the CORS middleware (a preflight needs no key) and
    inside :class:`_Guard`, so that a 401 is logged and counted like any response."""

    def __init__(self, app, server: _Server) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope, receive, send) -> None:
        err = self._auth_error(scope) if scope["type"] == "http" else None
        if err is not None:
            await _error_response(err)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _auth_error(self, scope) -> APIError | None:
        key = self.server.api_key
        if not key or scope["path"] in UNGUARDED:
            return None
        given = [value.decode("latin-1") for name, value in scope.get("headers", ())
                 if name == b"authorization"]
        if len(given) > 1:
            # one header field (RFC 9110 11.6.2): which one a proxy in front checked is unknown
            return APIError(401, f"the request has {len(given)} Authorization headers; send one, "
                                 "'Authorization: Bearer <key>'", code="invalid_api_key")
        header = given[0] if given else ""
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(),
                                                                 key.encode()):
            return None
        what = "no API key was provided" if not header else "the API key is not valid"
        return APIError(401, f"{what}; send it as 'Authorization: Bearer <key>'",
                        code="invalid_api_key")


class _Cors(CORSMiddleware):
    """Starlette's CORS, with a refused preflight answered in OpenAI's error shape (Starlette's
    is the plain text ``Disallowed CORS origin``)."""

    def preflight_response(self, request_headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        what = response.body.decode().removeprefix("Disallowed CORS ")
        err = APIError(400, f"the CORS preflight is refused: its {what} is not allowed (the "
                            "server's --allowed-origins, --allowed-methods and --allowed-headers "
                            "say what is)", code="cors_preflight_refused")
        headers = {k: v for k, v in response.headers.items()
                   if k not in ("content-length", "content-type")}
        return JSONResponse(err.body(), status_code=400, headers=headers)


class _Guard:
    """ASGI middleware, outermost: request ids, request metrics and the one log line per
    request (CORS preflights and 401s included)."""

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
        # the HTTP protocol may have named it first (a 400 it sent for this request's body)
        rid = scope["state"].setdefault("request_id", request_id(scope.get("headers", ())))

        async def send_wrapper(message) -> None:
            if message["type"] == "http.response.start":
                status_holder["status"] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except ClientDisconnect:
            # The client left mid-request or mid-response: its fault, nobody to answer, no
            # traceback. The access line says so.
            if status_holder["status"] == 500:
                status_holder["status"] = CLIENT_GONE
            scope["state"].setdefault("moe_request", {})["client_gone"] = True
        finally:
            self._finish(scope, path, status_holder["status"], time.perf_counter() - start, rid)

    def _finish(self, scope, path: str, status: int, seconds: float, rid: str) -> None:
        refused = scope["state"].get("refused_by_protocol")
        if refused is not None:  # its body broke HTTP: the protocol answered 400 (http_protocol)
            status = refused
        self.server.metrics.finished_http(route_label(path), status, seconds)
        state = scope["state"].get("moe_request", {})
        extra = ""
        if "prompt_tokens" in state:
            extra = (f" id={state.get('id')} prompt_tokens={state['prompt_tokens']} "
                     f"completion_tokens={state.get('completion_tokens', 0)} "
                     f"finish={state.get('finish_reason')}")
        if refused is not None:
            extra += " malformed_http_request"
        elif state.get("client_gone"):
            extra += " client_disconnected"
        log_request(scope.get("client"), scope.get("method"), path, status, seconds, extra, rid)


@attrs.frozen
class CorsOptions:
    """Cross-origin requests allowed (vLLM's ``--allowed-origins`` and its three kin)."""

    allowed_origins: tuple[str, ...] = attrs.field(converter=tuple)
    allowed_methods: tuple[str, ...] = attrs.field(default=("*",), converter=tuple)
    allowed_headers: tuple[str, ...] = attrs.field(default=("*",), converter=tuple)
    allow_credentials: bool = False


def create_app(engine: Engine | None, *, served_model_name: str | None = None,
               api_key: str | None = None, max_request_bytes: int = 1 << 20,
               manage_engine: bool = True, generation_defaults: dict | None = None,
               cors: CorsOptions | None = None) -> Starlette:
    """The ASGI app serving ``engine`` (``None``: one attached later, see the module).

    With ``manage_engine`` the app starts the engine on start-up and stops it on shutdown.
    ``generation_defaults`` (``temperature``, ``top_p``, ``top_k``, ``min_p``,
    ``repetition_penalty``, ``max_tokens``) fill what a request omits; ``cors`` adds CORS
    headers for the origins it names.
    """
    server = _Server(engine, served_model_name=served_model_name, api_key=api_key,
                     max_request_bytes=max_request_bytes, generation_defaults=generation_defaults)

    def wrap(handler):
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as err:
                return _error_response(err)
        return endpoint

    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        # the path (and method) as sent, bounded: a 100 KB path is not echoed whole
        path = request.url.path
        message = (f"no route {clip(request.method, 32)} {clip(path)}"
                   if exc.status_code in (404, 405) else clip(str(exc.detail)))
        allow = (exc.headers or {}).get("Allow")
        if allow:  # Starlette joins a set: in sorted order, the same on every run
            allow = ", ".join(sorted(m.strip() for m in allow.split(",")))
        if exc.status_code == 405 and allow:
            message += f"; the route takes {allow}"
        # a 405 names the methods the route takes (RFC 9110 15.5.6), as Starlette's own does
        return _error_response(APIError(exc.status_code, message, code=code),
                               headers={"Allow": allow} if allow else None)

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", logged_path(request.url.path))
        return _error_response(APIError(500, f"internal error: {clip(str(exc), 1000)}",
                                        type="server_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if manage_engine and engine is not None:
            engine.start()
        try:
            yield
        finally:
            if manage_engine and engine is not None:
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
    # Starlette answers a path with a trailing slash by a 307 to a Location built from the
    # client's Host header (an open redirect): such a path is unknown, a 404 like any other
    app.router.redirect_slashes = False
    # the last added is the outermost: _Guard, then CORS (a preflight needs no API key), then
    # the key check
    app.add_middleware(_KeyCheck, server=server)
    if cors is not None:
        app.add_middleware(_Cors, allow_origins=list(cors.allowed_origins),
                           allow_methods=list(cors.allowed_methods),
                           allow_headers=list(cors.allowed_headers),
                           allow_credentials=cors.allow_credentials,
                           expose_headers=["x-request-id"])
    app.add_middleware(_Guard, server=server)
    app.state.server = server
    return app
