"""The OpenAI-compatible request bodies and error responses.

Bodies are validated strictly (a string where a number belongs is an error, not a conversion).
Every field is implemented, accepted where it changes nothing here (``user``, ``metadata``...),
refused unless at its "off" value where this server does not implement it (:data:`UNSUPPORTED`:
tools, beam search, constrained decoding...), or unknown: a 400 naming it, as OpenAI answers (vLLM
logs and drops them; a dropped field is a client's intent lost without a word). Errors use OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``. An error message echoes client input (a
field's value or name, a model name, a path, a header) only through :func:`clip`: at most
:data:`ECHO_LIMIT` characters of it and its length, however much was sent.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import sys
import threading
from typing import Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

# stop strings per request: OpenAI allows 4, vLLM any number; lm-eval's local-completions sends
# its task's stops and the EOS text untrimmed (often 5 or more)
MAX_STOP_SEQUENCES = 16
MAX_N = 16  # choices per request (each is one more sequence in the batch)
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_STOP_TOKEN_IDS = 64  # vLLM's stop_token_ids per request (sampling.MAX_STOP_TOKEN_IDS)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a request's seed: int64, as OpenAI and vLLM take
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs bound; vLLM's default too)
# apply_chat_template's own arguments: a request's chat_template_kwargs may not replace them
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize", "return_dict",
                                      "return_tensors", "padding", "truncation", "max_length",
                                      "chat_template", "tools", "documents", "tokenizer_kwargs",
                                      "return_assistant_tokens_mask"})

MAX_JSON_DEPTH = 32  # OpenAI bodies nest a few levels (messages -> content parts -> fields)
ECHO_LIMIT = 200  # characters of one piece of client input that an error message echoes


def clip(value: Any, limit: int = ECHO_LIMIT, *, quoted: bool = False) -> str:
    """``value`` (client input) as an error message may echo it: whole when it has at most
    ``limit`` characters, else its first ``limit`` and how many it had, as
    ``abc... (100000 characters)``. ``quoted``: a string in ``repr``'s quotes; a value that is not
    a string is shown by its ``repr``. A client sending 100 KB gets a message of ~200 characters.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 3 * limit:
        # repr of an int over 4300 digits raises, and a long one says nothing: its size instead
        digits = int(value.bit_length() * 0.30103) + 1
        return f"{'-' if value < 0 else ''}an integer of about {digits} digits"
    if not isinstance(value, str):
        value, quoted = repr(value), False
    head = repr(value[:limit]) if quoted else value[:limit]
    return head if len(value) <= limit else f"{head}... ({len(value)} characters)"


class APIError(Exception):
    """An error response: HTTP ``status`` and an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    """A 400: a client's request that this server refuses; ``code`` is never null (clients
    branch on it), ``invalid_value`` unless a more specific one applies."""
    return APIError(400, message, param=param, code=code)


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(body: bytes) -> int:
    """How deeply ``body`` nests arrays and objects, found without parsing it (linear time)."""
    import numpy as np

    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


class _Duplicated(dict):
    """A JSON object that held ``key`` more than once (``json.loads`` keeps the last)."""

    __slots__ = ("duplicated",)


def _object_pairs(pairs: list) -> dict:
    """``json.loads``' object_pairs_hook: a dict, marked when a key came twice."""
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    seen: set = set()
    for key, _ in pairs:
        if key in seen:
            break
        seen.add(key)
    marked = _Duplicated(obj)
    marked.duplicated = key
    _duplicates_seen.flag = True
    return marked


_duplicates_seen = threading.local()  # set by _object_pairs: the body must be walked for it


def _first_duplicate(value: Any, path: tuple = ()) -> tuple[tuple, str] | None:
    """The path to the first object (in document order) that held a key twice, and the key."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _first_duplicate(item, (*path, i))
            if found:
                return found
    elif isinstance(value, dict):
        dup = getattr(value, "duplicated", None)
        for key, item in value.items():
            if key == dup:  # met before anything nested after it
                return path, key
            found = _first_duplicate(item, (*path, key))
            if found:
                return found
    return None


def _shown_path(path: tuple) -> str:
    """``messages[0].role`` (each key bounded: it is client input)."""
    out = ""
    for step in path:
        out += f"[{step}]" if isinstance(step, int) else (
            f".{clip(step, 80)}" if out else clip(step, 80))
    return out


def _duplicate_key_error(value: Any) -> APIError:
    path, key = _first_duplicate(value)
    where = (f"in {clip(_shown_path(path), 200)} (at {clip(_shown_path((*path, key)), 200)})"
             if path else "in the request body")
    param = ".".join(clip(str(step), 80) for step in (*path, key))
    return invalid(f"duplicate key {clip(key, 80, quoted=True)} {where}: a JSON object may hold "
                   "each key once; this server refuses a repeated key rather than keep one of its "
                   "values (send the key once, with the value meant)", clip(param, 200),
                   "duplicate_key")


def decode_body(body: bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON value of a request body; too deep, invalid or non-standard JSON, or an object
    holding a key twice (``{"model": "a", "model": "b"}``, anywhere in the body): a 400. A
    repeated key is refused (code ``duplicate_key``, the message naming the key and its path as
    ``messages[0].role``, ``param`` as pydantic's ``messages.0.role``) rather than read as
    ``json.loads`` reads it, the last value winning: which one a client meant is unknown, and
    a proxy that kept the first would have checked another request than the one served."""
    # No body with fewer brackets than the limit can nest deeper: most skip the scan.
    depth = 0 if body.count(b"[") + body.count(b"{") <= max_depth else json_depth(body)
    if depth > max_depth:
        raise invalid(f"the request body nests arrays and objects {depth} levels deep; at most "
                      f"{max_depth} are accepted", code="json_too_deep")
    try:
        # UTF-8 only (RFC 8259 8.1; a leading BOM, which it lets a reader ignore, is): json.loads
        # of bytes would also read UTF-16 and UTF-32, which a proxy reading UTF-8 sees as garbage
        text = body.removeprefix(b"\xef\xbb\xbf").decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(f"the request body is not UTF-8: byte {body[exc.start]:#04x} at offset "
                      f"{exc.start} ({exc.reason}); send JSON as UTF-8 text, whatever the "
                      "charset says (RFC 8259 section 8.1)", code="invalid_json") from None
    nul = body.find(b"\x00")
    if nul >= 0:  # never in JSON text (escaped in strings); UTF-16 and UTF-32 are full of them
        raise invalid(f"the request body holds a NUL byte (at offset {nul}), which JSON text never "
                      "does (a body in UTF-16 or UTF-32 is full of them); send JSON as UTF-8 "
                      "text (RFC 8259 section 8.1)", code="invalid_json")
    try:
        _duplicates_seen.flag = False
        value = json.loads(text, parse_constant=_no_constant, object_pairs_hook=_object_pairs)
    except (ValueError, RecursionError) as exc:
        # ValueError also covers integers of more digits than Python converts (4300), whose
        # message advises sys.set_int_max_str_digits(): the server's business, not the client's
        if "integer string conversion" in str(exc):
            limit = sys.get_int_max_str_digits()
            raise invalid(f"the request body holds an integer of more than {limit} digits; "
                          f"accepted: numbers of at most {limit} digits (no field takes a larger "
                          "one)", code="invalid_json") from None
        raise invalid(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if b"\\u" in body or b"\xed" in body:  # where a lone UTF-16 surrogate can come from
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = exc.object[exc.start:exc.end].encode("unicode_escape").decode()
            raise invalid(f"the request body holds {bad}, a lone UTF-16 surrogate, which is no "
                          "Unicode character; send text as valid UTF-8 (or paired \\u escapes)",
                          code="invalid_json") from None
    if _duplicates_seen.flag:
        raise _duplicate_key_error(value)
    return value


class StreamOptions(BaseModel):
    """``stream_options``: OpenAI's keys and vLLM's ``continuous_usage_stats``; any other is a 400."""

    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage in every chunk
    include_obfuscation: bool | None = None  # OpenAI's; this server never pads its chunks


# Fields of OpenAI's, vLLM's and SGLang's APIs that this server does not implement: accepted
# only at values that change nothing (null, or the value meaning "off"), else a 400 that names the
# field, the value, what is accepted, and what to do instead. Every other field a route does not
# declare is unknown: a 400 too (as OpenAI answers), never silently dropped.
_OFF = (None,)
_EMPTY = (None, [], {})
UNSUPPORTED: dict[str, tuple[tuple, str, str]] = {
    # field: (values that change nothing, those values in words, why / what to do instead)
    "logit_bias": (_EMPTY, "null or {}", "this server does not bias logits"),
    "tools": (_EMPTY, "null or []", "this server has no tool calling"),
    "functions": (_EMPTY, "null or []", "this server has no tool calling"),
    "tool_choice": ((None, "none", "auto"), "null, 'none' or 'auto' (no tools)",
                    "this server has no tool calling"),
    "function_call": ((None, "none", "auto"), "null, 'none' or 'auto'",
                      "this server has no tool calling"),
    "use_beam_search": ((None, False), "false", "beam search is not implemented; sample several "
                        "choices with n instead"),
    "length_penalty": ((None, 1, 1.0), "1", "it weighs beam search, which is not implemented"),
    "early_stopping": ((None, False), "false", "it ends beam search, which is not implemented"),
    "prompt_logprobs": (_OFF, "null", "/v1/completions with echo and logprobs scores the "
                        "prompt (on a server started with --batching dynamic)"),
    "truncate_prompt_tokens": (_OFF, "null", "prompts are never truncated; send one that fits "
                               "the context"),
    "allowed_token_ids": (_EMPTY, "null or []", "this server has no constrained decoding"),
    "bad_words": (_EMPTY, "null or []", "this server has no constrained decoding"),
    "logits_processors": (_EMPTY, "null or []", "this server runs no custom logits processors"),
    "custom_logit_processor": (_OFF, "null", "this server runs no custom logits processors"),
    "guided_json": (_OFF, "null", "this server has no constrained decoding"),
    "guided_regex": (_OFF, "null", "this server has no constrained decoding"),
    "guided_choice": (_EMPTY, "null", "this server has no constrained decoding"),
    "guided_grammar": (_OFF, "null", "this server has no constrained decoding"),
    "guided_decoding_backend": (_OFF, "null", "this server has no constrained decoding"),
    "guided_whitespace_pattern": (_OFF, "null", "this server has no constrained decoding"),
    "structured_outputs": (_OFF, "null", "this server has no constrained decoding"),
    "regex": (_OFF, "null", "this server has no constrained decoding"),
    "json_schema": (_OFF, "null", "this server has no constrained decoding"),
    "ebnf": (_OFF, "null", "this server has no constrained decoding"),
    "return_tokens_as_token_ids": ((None, False), "false", "send return_token_ids: true for each "
                                   "choice's token ids"),
    "spaces_between_special_tokens": ((None, True), "true", "special tokens are decoded as the "
                                      "tokenizer joins them"),
    "priority": ((None, 0), "0", "requests are served first come, first served"),
    "lora_request": (_OFF, "null", "this server loads no LoRA adapters"),
    "lora_path": (_OFF, "null", "this server loads no LoRA adapters"),
    "return_hidden_states": ((None, False), "false", "this server returns no hidden states"),
    "kv_transfer_params": (_OFF, "null", "this server transfers no KV cache"),
    "vllm_xargs": (_EMPTY, "null", "this server takes no vLLM plugin arguments"),
    "mm_processor_kwargs": (_EMPTY, "null", "this server serves text only"),
    "audio": (_OFF, "null", "this server serves text only"),
    "modalities": ((None, ["text"]), "null or ['text']", "this server serves text only"),
    "web_search_options": (_OFF, "null", "this server has no web search"),
    "reasoning_effort": (_OFF, "null", "send the chat template's own variable in "
                         "chat_template_kwargs instead (Qwen3: {'enable_thinking': false})"),
    # OpenAI's default verbosity: what a client that names it without choosing sends
    "verbosity": ((None, "medium"), "null or 'medium'", "no model here reads it"),
    "moderation": (_OFF, "null", "this server runs no moderation model over requests or "
                   "answers"),
    "store": ((None, False), "false", "this server stores no completions"),
    "prompt_embeds": (_OFF, "null", "send the prompt as text or token ids"),
    "thinking_token_budget": (_OFF, "null", "bound the whole completion with max_tokens"),
    "session_params": (_OFF, "null", "this server keeps no sessions"),
}
_CHAT_ONLY = {"tools", "functions", "tool_choice", "function_call", "audio", "modalities",
              "web_search_options", "reasoning_effort", "verbosity", "mm_processor_kwargs",
              "moderation"}
_CHAT_UNSUPPORTED = {
    "echo": ((None, False), "false", "vLLM's chat echo is not implemented; /v1/completions "
             "echoes a prompt"),
    "chat_template": (_OFF, "null", "start the server with --chat-template"),
    "documents": (_EMPTY, "null", "this server has no retrieval templates"),
}


class _Request(BaseModel):
    # unknown fields are refused by parse() before validation (with a suggestion)
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # an extension (vLLM's): -1 or 0 turn it off
    stop: str | list[str] | None = None
    seed: int | None = None  # a signed 64-bit integer (_seed_range)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    return_token_ids: bool | None = False  # an extension: each choice also carries its token ids
    # extensions (vLLM's and SGLang's names and ranges; transformers' definitions)
    min_p: float | None = None
    repetition_penalty: float | None = None
    # vLLM's (and SGLang's) stopping and decoding controls
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    min_tokens: int | None = Field(default=0, ge=0)
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    no_stop_trim: bool | None = False  # SGLang's name for include_stop_str_in_output
    # accepted, and change nothing here: who is asking, caching and routing hints
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None  # OpenAI's cache breakpoints and lifetime
    safety_identifier: str | None = None
    cache_salt: str | None = None  # vLLM's: keys its prefix cache, which this server lacks
    parallel_tool_calls: bool | None = None  # no tools here, so nothing to call in parallel
    prediction: dict[str, Any] | None = None  # predicted outputs only speed a response up
    # vLLM's: the response's id (it reaches the access log: the x-request-id header's characters)
    request_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.:/+=@-]{1,128}$")
    prompt_cache_retention: str | None = None
    # no reasoning parser here: the reasoning stays in the content, whatever these say
    include_reasoning: bool | None = None  # vLLM's
    separate_reasoning: bool | None = None  # SGLang's
    stream_reasoning: bool | None = None  # SGLang's

    @field_validator("seed")
    @classmethod
    def _seed_range(cls, v):
        # OpenAI's and vLLM's range (int64). Seeds of [2**63, 2**64) were taken once, and drew
        # as the negative seed 2**64 below them: two seeds a client told apart, one answer
        if v is not None and not SEED_MIN <= v <= SEED_MAX:
            raise PydanticCustomError("out_of_range", "must be a signed 64-bit integer, in "
                                      f"[{SEED_MIN}, {SEED_MAX}] (OpenAI's and vLLM's range)")
        return v

    @field_validator("min_p")
    @classmethod
    def _min_p_range(cls, v):
        if v is not None and not 0.0 <= v <= 1.0:
            raise PydanticCustomError("out_of_range", "must lie in [0, 1] (0: off)")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty_range(cls, v):
        if v is not None and not (math.isfinite(v) and v > 0.0):
            raise PydanticCustomError("out_of_range", "must be a finite number above 0 (1: "
                                      "off; above 1 discourages repeats, below 1 favours them)")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP_SEQUENCES:
            raise PydanticCustomError(  # not ValueError: pydantic prefixes 'Value error, '
                "too_many_stops", f"at most {MAX_STOP_SEQUENCES} stop sequences are accepted; "
                "this list has {count}", {"count": len(v)})
        if v == "" or (isinstance(v, list) and "" in v):
            # an empty string matches everywhere or nowhere: never a stop a client meant
            raise PydanticCustomError("empty_stop", "a stop sequence must not be the empty "
                                      "string; accepted: non-empty strings (or null for none)")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v):
        if v is not None and any(t < 0 for t in v):
            raise PydanticCustomError("out_of_range", "token ids must be 0 or more")
        return v

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def choices(self) -> int:
        return self.n if self.n is not None else 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's: with include_usage, every chunk carries the usage so far."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    unsupported_fields: ClassVar[dict[str, tuple[tuple, str, str]]] = UNSUPPORTED

    def check_supported(self) -> None:
        """Refuse what this server accepts in the schema but does not implement."""
        extra = self.model_extra or {}
        for name in sorted(extra):
            accepted, words, why = self.unsupported_fields[name]
            value = extra[name]
            if not any(value == a and type(value) is type(a) or value is a for a in accepted):
                raise invalid(f"{name}={_shown(value)} is not supported: {why}; accepted: "
                              f"{words}", name, "unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed with stream=true", "stream_options")
        given = getattr(self, "max_completion_tokens", None)
        if self.max_tokens is not None and given is not None and self.max_tokens != given:
            raise invalid(f"max_tokens ({clip(self.max_tokens)}) and max_completion_tokens "
                          f"({clip(given)}) "
                          "disagree; send one of them (max_completion_tokens is the newer name "
                          "of max_tokens)", "max_completion_tokens")
        if self.min_tokens and self.requested_max_tokens is not None and (
                self.min_tokens > self.requested_max_tokens):
            raise invalid(f"min_tokens ({clip(self.min_tokens)}) must not exceed max_tokens "
                          f"({clip(self.requested_max_tokens)})", "min_tokens", "invalid_value")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        """The field the token bound came in (an error about it names that one)."""
        if self.max_tokens is None and getattr(self, "max_completion_tokens", None) is not None:
            return "max_completion_tokens"
        return "max_tokens"


def _shown(value: Any) -> str:
    return clip(json.dumps(value) if _jsonable(value) else repr(value), 80)


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


class CompletionRequest(_Request):
    route: ClassVar[str] = "/v1/completions"
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        # one message for every wrong shape, rather than the first union member's complaint
        ok = isinstance(v, str) or (isinstance(v, list) and (
            all(isinstance(x, int) and not isinstance(x, bool) for x in v)
            or all(isinstance(x, str) for x in v)
            or all(isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                               for t in x) for x in v)))
        if not ok:
            raise PydanticCustomError(
                "prompt_type", "a prompt is a string, a list of token ids, a list of strings or "
                "a list of token-id lists (one kind per request)")
        return v

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_count(cls, v):
        if isinstance(v, bool):
            raise PydanticCustomError(
                "logprobs_type", "on /v1/completions logprobs is the number of alternatives per "
                f"token, 0 to {MAX_LOGPROBS} (true/false is chat's logprobs, with top_logprobs)")
        return v

    # not OpenAI's completions field, but chat's newer name for max_tokens; benchmark clients
    # send it to both routes
    max_completion_tokens: int | None = Field(default=None, ge=1)
    add_special_tokens: bool | None = True  # vLLM's: the tokenizer's BOS (and kin) on a text prompt
    response_format: dict[str, Any] | None = None  # vLLM's on completions: only 'text' here

    unsupported_fields: ClassVar[dict[str, tuple[tuple, str, str]]] = {
        k: v for k, v in UNSUPPORTED.items() if k not in _CHAT_ONLY}

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, 1, self.choices):
            raise invalid(f"best_of={clip(self.best_of)} is not supported: this server returns "
                          f"every choice it generates; accepted: null, 1 or n ({self.choices})",
                          "best_of", "unsupported_parameter")
        if self.suffix:
            raise invalid(f"suffix={_shown(self.suffix)} is not supported: this server does not "
                          "fill in the middle; accepted: null or ''", "suffix",
                          "unsupported_parameter")
        _check_response_format(self.response_format)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, each a string or token ids (a list of them: a batch)."""
        p = self.prompt
        batch = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        if len(batch) > MAX_PROMPTS:
            raise invalid(f"at most {MAX_PROMPTS} prompts per request are accepted, got "
                          f"{len(batch)}", "prompt", "invalid_value")
        for one in batch:
            if len(one) == 0:
                raise invalid("the prompt is empty", "prompt", "invalid_value")
        return batch

    @property
    def top_logprobs(self) -> int | None:
        return self.logprobs


def _check_response_format(response_format: dict | None) -> None:
    if response_format is not None and "type" not in response_format:
        raise invalid("response_format needs a 'type' (OpenAI's schema requires it); accepted: "
                      "{'type': 'text'} or null", "response_format.type", "missing_required")
    kind = (response_format or {}).get("type", "text")
    if kind != "text":
        raise invalid(f"response_format type {clip(kind, 80, quoted=True)} is not supported: "
                      "this server has no constrained decoding, so it cannot promise JSON "
                      "output; accepted: 'text' (ask for JSON in the prompt instead)",
                      "response_format",
                      "unsupported_response_format")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: str


class RefusalPart(BaseModel):
    """An assistant's refusal sent back from an earlier answer: its text is the content."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["refusal"]
    refusal: str

    @property
    def text(self) -> str:
        return self.refusal


_PART_TEXT = {"text": "text", "refusal": "refusal"}  # content part type -> its string's key


class ChatMessage(BaseModel):
    # an unknown key is a 400 naming it (as an unknown top-level field is), not dropped
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart | RefusalPart] | None = None
    name: str | None = None
    # what clients send back of an earlier answer: null or empty here (no tools, text only)
    tool_calls: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    refusal: str | None = None
    reasoning_content: str | None = None  # vLLM's and SGLang's; Qwen3's template reads it
    # a tool message's (the answer to a tool call): accepted only as null on these roles
    tool_call_id: str | None = None
    annotations: list[Any] | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _served_role(cls, v):
        if v in ("tool", "function"):  # else pydantic's list of the accepted roles, unexplained
            raise PydanticCustomError(
                "unsupported_role", "role '{role}' is not served: this server has no tool "
                "calling, so no tool's answer can be sent back; accepted: 'system', "
                "'developer', 'user' or 'assistant'", {"role": v})
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v, info):
        # checked here so that a bad part is named, not reported as "not a valid string"
        if not isinstance(v, list):
            return v
        role = info.data.get("role")
        for i, part in enumerate(v):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in _PART_TEXT or (kind == "refusal" and role != "assistant"):
                raise PydanticCustomError(
                    "unsupported_content", "content part {i} is {kind}: this server serves "
                    "text only; accepted: parts of type 'text' (and 'refusal' in an "
                    "assistant's message), or content as a string",
                    {"i": i, "kind": f"of type {clip(kind, 80, quoted=True)}" if kind else
                     "not a typed object"})
            if not isinstance(part.get(_PART_TEXT[kind]), str):
                raise PydanticCustomError(
                    "invalid_content", "content part {i} of type '{kind}' needs a string "
                    "'{key}'", {"i": i, "kind": kind, "key": _PART_TEXT[kind]})
        return v

    @field_validator("tool_calls", "function_call", "audio")
    @classmethod
    def _nothing_to_carry(cls, v, info):
        if v not in (None, []):
            what = "tool calling" if info.field_name != "audio" else "audio"
            raise PydanticCustomError(
                "unsupported", "this server has no {what}; accepted: null or []", {"what": what})
        return v

    @field_validator("tool_call_id")
    @classmethod
    def _no_tool_answer(cls, v, info):
        # OpenAI refuses a field its role does not have; kept, it would be dropped unread
        if v is not None:
            raise PydanticCustomError(
                "misplaced_field", "tool_call_id belongs to a message of role 'tool' (the "
                "answer to a tool call), and this server has no tool calling; on a '{role}' "
                "message it is accepted only as null or omitted", {"role": info.data.get("role")})
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Request):
    route: ClassVar[str] = "/v1/chat/completions"
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None  # an extension (vLLM's)
    # OpenAI's field is top_logprobs; the completions field of the same meaning is logprobs
    top_logprobs_: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS, alias="top_logprobs")
    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_flag(cls, v):
        if isinstance(v, int) and not isinstance(v, bool):
            raise PydanticCustomError(
                "logprobs_type", "on /v1/chat/completions logprobs is true or false; the "
                f"alternatives per token are top_logprobs, 0 to {MAX_LOGPROBS}")
        return v

    # vLLM's chat template controls
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    add_special_tokens: bool | None = False

    unsupported_fields: ClassVar[dict[str, tuple[tuple, str, str]]] = {
        **UNSUPPORTED, **_CHAT_UNSUPPORTED}

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise invalid("messages must not be empty", "messages", "empty_array")
        _check_response_format(self.response_format)
        if self.top_logprobs_ and not self.logprobs:  # 0 asks for nothing: served (as vLLM)
            raise invalid(f"top_logprobs={self.top_logprobs_} needs logprobs set to true; "
                          "accepted without it: null or 0", "top_logprobs")
        for key in sorted(self.chat_template_kwargs or {}):
            if key in RESERVED_TEMPLATE_KWARGS:
                raise invalid(f"chat_template_kwargs may not set {key!r}: it is an argument of "
                              "the template call itself; accepted: the template's own "
                              "variables (enable_thinking...)", "chat_template_kwargs")
        # chat_template_kwargs win over the request's two fields, as in vLLM: the checks read
        # what the template will be called with
        merged = self.template_kwargs()
        continues = bool(merged.get("continue_final_message"))
        if merged.get("add_generation_prompt") and continues:
            raise invalid("continue_final_message=true continues the last message, so it needs "
                          "add_generation_prompt=false (chat_template_kwargs' values count, as "
                          "in vLLM)", "continue_final_message")
        if continues and self.messages and self.messages[-1].role != "assistant":
            raise invalid("continue_final_message=true continues the last message, which must "
                          f"be the assistant's; it is the {self.messages[-1].role}'s",
                          "continue_final_message")
        if self.add_special_tokens:
            raise invalid("add_special_tokens=true is not supported on chat: the chat template "
                          "writes the special tokens; accepted: false", "add_special_tokens",
                          "unsupported_parameter")
        if all(not m.text() for m in self.messages):
            raise invalid(f"the messages have no content (none of the {len(self.messages)} "
                          "holds text); accepted: at least one message with non-empty content",
                          "messages.0.content", "invalid_value")

    @property
    def top_logprobs(self) -> int | None:
        """Alternatives per token to return; None: no logprobs at all."""
        return (self.top_logprobs_ or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else (
            self.max_tokens)

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's variables: chat_template_kwargs, and the two controls."""
        kwargs = {"add_generation_prompt": self.add_generation_prompt is not False}
        if self.continue_final_message:
            kwargs["continue_final_message"] = True
        return {**kwargs, **(self.chat_template_kwargs or {})}

    def chat_messages(self) -> list[dict]:
        # the "developer" role is OpenAI's newer name for "system"
        out = []
        for m in self.messages:
            message = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.name is not None:
                message["name"] = m.name
            if m.reasoning_content is not None:
                message["reasoning_content"] = m.reasoning_content
            out.append(message)
        return out


_NESTED = {"stream_options": StreamOptions}


def known_fields(model: type[BaseModel]) -> set[str]:
    """The top-level fields a request model knows: its own (by their JSON names) and the
    unsupported ones it accepts at their "off" values; parse() refuses any other."""
    names = set()
    for name, field in model.model_fields.items():
        names.add(field.alias or name)
    return names | set(model.unsupported_fields)


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate ``body`` into ``model``; a schema error becomes a 400 naming the field."""
    if not isinstance(body, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", int: "a number",
                float: "a number", type(None): "null"}.get(type(body), type(body).__name__)
        raise invalid(f"the request body must be a JSON object of the request's fields; got "
                      f"{kind}", code="invalid_type")
    known = known_fields(model)
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        elsewhere = [m.route for m in (CompletionRequest, ChatCompletionRequest)
                     if m is not model and name in known_fields(m)]
        if elsewhere and not close:
            hint = f" (a field of {elsewhere[0]}, not of {model.route})"
        others = f" (and {len(unknown) - 1} more unknown)" if len(unknown) > 1 else ""
        raise invalid(f"unknown field {clip(name, 80, quoted=True)}{hint}{others}: this server "
                      "refuses the fields it does not know rather than ignore them; the fields it "
                      "accepts are listed in docs/serve.md (Request fields)", name[:80],
                      "unknown_field")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        # a location can hold a client's key (an unknown key of stream_options): bounded
        loc = [str(x)[:80] for x in err["loc"] if not _is_union_branch(x)]
        param = ".".join(loc) or None
        if err["type"] == "missing":
            message = f"missing required parameter: {param!r}"
        elif err["type"] == "extra_forbidden" and loc[0] == "messages" and len(loc) == 3:
            accepted = ", ".join(ChatMessage.model_fields)
            raise invalid(f"unknown key {clip(loc[2], 80, quoted=True)} in {loc[0]}[{loc[1]}]; "
                          f"a message accepts: {accepted}", param, "unknown_field") from None
        elif err["type"] == "extra_forbidden" and loc[0] in _NESTED:
            accepted = ", ".join(_NESTED[loc[0]].model_fields)
            # the code of an unknown top-level field and of a message's unknown key
            raise invalid(f"unknown field {param!r}; {loc[0]} accepts: {accepted}", param,
                          "unknown_field") from None
        else:
            shown = clip(err.get("input"), 80, quoted=True)
            message = f"invalid value for {param!r}: {clip(err['msg'], 500)} (got {shown})"
            branches = _union_branches(exc.errors(), err["loc"])
            if len(branches) > 1:  # "a valid string" alone hid that a list is accepted too
                message += f"; accepted: {' or '.join(branches)}"
        raise invalid(message, param, "invalid_type" if err["type"].endswith("_type") else
                      "invalid_value") from None


def _union_branches(errors, loc) -> list[str]:
    """The union members pydantic tried for the field of ``loc`` (its first error), in order:
    ``["str", "list[str]"]`` for ``stop``; empty where the field is no union."""
    cut = next((i for i, x in enumerate(loc) if _is_union_branch(x)), None)
    if cut is None:
        return []
    head = tuple(loc[:cut])
    found = [e["loc"][cut] for e in errors
             if tuple(e["loc"][:cut]) == head and len(e["loc"]) > cut
             and _is_union_branch(e["loc"][cut])]
    return [str(b)[:60] for b in dict.fromkeys(found)]


def _is_union_branch(loc_item) -> bool:
    # pydantic names union members in error locations ("str", "list[int]"): not a field
    return isinstance(loc_item, str) and (loc_item in {"str", "int", "float", "bool"}
                                          or "[" in loc_item or loc_item.startswith("function"))
