"""The OpenAI-compatible request bodies and error responses.

Bodies are validated strictly (a string where a number belongs is an error, not a conversion);
fields this server does not know are ignored, since clients send many. Errors use OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

MAX_STOP_SEQUENCES = 4
MAX_N = 16  # choices per request (each is one more sequence in the batch)
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs bound; vLLM's default too)
# apply_chat_template's own arguments: a request's chat_template_kwargs may not replace them
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize", "return_dict",
                                      "return_tensors", "padding", "truncation", "max_length",
                                      "chat_template", "tools", "documents"})
MAX_JSON_DEPTH = 32  # OpenAI bodies nest a few levels (messages -> content parts -> fields)


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


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
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


def decode_body(body: bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON value of a request body; too deep, invalid or non-standard JSON: a 400."""
    # No body with fewer brackets than the limit can nest deeper: most skip the scan.
    depth = 0 if body.count(b"[") + body.count(b"{") <= max_depth else json_depth(body)
    if depth > max_depth:
        raise invalid(f"the request body nests arrays and objects {depth} levels deep; at most "
                      f"{max_depth} are accepted", code="json_too_deep")
    try:
        value = json.loads(body, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        # ValueError also covers integers of more digits than Python converts (4300)
        raise invalid(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if b"\\u" in body or b"\xed" in body:  # where a lone UTF-16 surrogate can come from
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = exc.object[exc.start:exc.end].encode("unicode_escape").decode()
            raise invalid(f"the request body holds {bad}, a lone UTF-16 surrogate, which is no "
                          "Unicode character; send text as valid UTF-8 (or paired \\u escapes)",
                          code="invalid_json") from None
    return value


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # an extension (vLLM's): -1 or 0 turn it off
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    return_token_ids: bool = False  # an extension: each choice also carries its token ids
    # extensions (vLLM's and SGLang's names and ranges; transformers' definitions)
    min_p: float | None = None
    repetition_penalty: float | None = None

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
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        return v

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def check_supported(self) -> None:
        """Refuse what this server accepts in the schema but does not implement."""
        if self.logit_bias:
            raise invalid("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed with stream=true", "stream_options")


class CompletionRequest(_Request):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, 1, self.n):
            raise invalid("best_of is not supported (only best_of equal to n)", "best_of")
        if self.suffix:
            raise invalid("suffix is not supported", "suffix")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, each a string or token ids (a list of them: a batch)."""
        p = self.prompt
        batch = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        if len(batch) > MAX_PROMPTS:
            raise invalid(f"at most {MAX_PROMPTS} prompts per request are accepted, got "
                          f"{len(batch)}", "prompt")
        for one in batch:
            if len(one) == 0:
                raise invalid("the prompt is empty", "prompt")
        return batch

    @property
    def top_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # an extension (vLLM's)
    # OpenAI's field is top_logprobs; the completions field of the same meaning is logprobs
    top_logprobs_: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS, alias="top_logprobs")

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise invalid("messages must not be empty", "messages")
        if self.tools:
            raise invalid("tools are not supported", "tools")
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise invalid(f"response_format type {kind!r} is not supported: this server has no "
                          "constrained decoding, so it cannot promise JSON output; accepted: "
                          "'text' (ask for JSON in the messages instead)", "response_format",
                          "unsupported_response_format")
        if self.top_logprobs_ is not None and not self.logprobs:
            raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
        for key in sorted(self.chat_template_kwargs or {}):
            if key in RESERVED_TEMPLATE_KWARGS:
                raise invalid(f"chat_template_kwargs may not set {key!r}: it is an argument of "
                              "the template call itself", "chat_template_kwargs")
        if all(not m.text() for m in self.messages):
            raise invalid("the messages have no content", "messages")

    @property
    def top_logprobs(self) -> int | None:
        """Alternatives per token to return; None: no logprobs at all."""
        return (self.top_logprobs_ or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else (
            self.max_tokens)

    def chat_messages(self) -> list[dict]:
        # the "developer" role is OpenAI's newer name for "system"
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate ``body`` into ``model``; a schema error becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(x) for x in err["loc"] if not _is_union_branch(x)]
        param = ".".join(loc) or None
        if err["type"] == "missing":
            message = f"missing required parameter: {param!r}"
        else:
            given = err.get("input")
            shown = repr(given)[:80]
            message = f"invalid value for {param!r}: {err['msg']} (got {shown})"
        raise invalid(message, param, "invalid_type" if err["type"].endswith("_type") else
                      "invalid_value") from None


def _is_union_branch(loc_item) -> bool:
    # pydantic names union members in error locations ("str", "list[int]"): not a field
    return isinstance(loc_item, str) and (loc_item in {"str", "int", "float", "bool"}
                                          or "[" in loc_item or loc_item.startswith("function"))
