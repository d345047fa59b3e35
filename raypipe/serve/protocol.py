"""The OpenAI chat-completions and completions wire formats: request validation and response bodies.

Requests are parsed in pydantic's strict mode, so `"max_tokens": "5"` is a 400 rather than a
silent coercion. What a client sends is either honoured or refused, never silently ignored (as
OpenAI's API and vLLM's server do):
- an unknown or misspelled field is a 400 naming it (`unrecognized_argument`);
- a known OpenAI field whose behaviour the engine lacks (tools, `response_format` json modes,
  image `detail` low/high, a sampling control `SamplingParams` has no field for) is a 400 naming it
  (`unsupported_parameter`), unless it carries the value that means "not used";
- explicit `null` means "not set", as in OpenAI's API.
vLLM's extra sampling fields (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`,
`stop_token_ids`), which benchmark tools send, are accepted under vLLM's names.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from raypipe.errors import InvalidInput
from raypipe.inputs.sampling import SamplingParams

# SamplingParams fields, so a control is accepted exactly when the engine has it.
ENGINE_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURLPart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL | str  # a bare string is the URL itself


ContentPart = Annotated[TextPart | ImageURLPart, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None  # null only for assistant turns
    name: str | None = None
    # What OpenAI's own client echoes back in an assistant turn; accepted while empty.
    refusal: str | None = None
    tool_calls: list[Any] | None = None


class StreamOptions(_Strict):
    include_usage: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None


class _Common(_Strict):
    """Fields chat and text completions share: the model, sampling controls and streaming."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = Field(default=None, ge=1)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None

    def _unsupported(self) -> dict[str, bool]:
        """field -> whether this request uses it though the server cannot honour it."""
        engine = {name: getattr(self, name) is not None and getattr(self, name) != off for name, off in (
            ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("logit_bias", {}), ("min_p", 0.0),
            ("repetition_penalty", 1.0), ("min_tokens", 0), ("n", 1)) if name not in ENGINE_SAMPLING_FIELDS}
        return engine

    def check_supported(self) -> None:
        for field, used in self._unsupported().items():
            if used:
                raise InvalidInput(f"'{field}' is not supported by this server", item=field,
                                   code="unsupported_parameter")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise InvalidInput("at most 4 stop sequences are allowed", item="stop", code="invalid_value")
        if self.logit_bias:
            for key in self.logit_bias:
                if not key.lstrip("-").isdigit():
                    raise InvalidInput(f"logit_bias keys are token ids, got {key!r}", item="logit_bias",
                                       code="invalid_value")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def stop_list(self) -> list[str] | None:
        if self.stop is None:
            return None
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling_kwargs(self) -> dict:
        """`SamplingParams` keyword arguments (besides max_tokens) for what this request set."""
        kwargs = {"temperature": 1.0 if self.temperature is None else self.temperature,
                  "top_p": 1.0 if self.top_p is None else self.top_p, "seed": self.seed, "stop": self.stop_list()}
        if self.top_k is not None:
            kwargs["top_k"] = max(self.top_k, 0)  # vLLM: -1 (or 0) means off
        for name in ("ignore_eos", "stop_token_ids", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "min_tokens", "n"):
            if getattr(self, name) is not None and name in ENGINE_SAMPLING_FIELDS:
                kwargs[name] = getattr(self, name)
        if self.logit_bias and "logit_bias" in ENGINE_SAMPLING_FIELDS:
            kwargs["logit_bias"] = {int(token): bias for token, bias in self.logit_bias.items()}
        return kwargs


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the newer name of max_tokens; wins when both are set
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for m, message in enumerate(self.messages):
            if message.content is None and message.role != "assistant":
                raise InvalidInput(f"content is required for role {message.role!r}",
                                   item=f"messages[{m}].content", code="missing_field")
            if message.tool_calls:
                raise InvalidInput("tool calls are not supported by this server",
                                   item=f"messages[{m}].tool_calls", code="unsupported_parameter")
            for p, part in enumerate(message.content if isinstance(message.content, list) else []):
                if isinstance(part, ImageURLPart) and isinstance(part.image_url, ImageURL) \
                        and part.image_url.detail not in (None, "auto"):
                    raise InvalidInput("image detail 'low'/'high' is not supported by this server (use 'auto')",
                                       item=f"messages[{m}].content[{p}].image_url.detail",
                                       code="unsupported_parameter")
        if self.top_logprobs is not None and not self.logprobs and self.top_logprobs > 0:
            raise InvalidInput("top_logprobs needs logprobs=true", item="top_logprobs", code="invalid_value")
        refused = {"logprobs": bool(self.logprobs) and "logprobs" not in ENGINE_SAMPLING_FIELDS,
                   "response_format": self.response_format is not None and self.response_format.type != "text",
                   "tools": bool(self.tools), "tool_choice": self.tool_choice not in (None, "none"),
                   "parallel_tool_calls": self.parallel_tool_calls is not None}
        for field, used in refused.items():
            if used:
                raise InvalidInput(f"'{field}' is not supported by this server", item=field,
                                   code="unsupported_parameter")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_kwargs(self) -> dict:
        kwargs = super().sampling_kwargs()
        if self.logprobs and "logprobs" in ENGINE_SAMPLING_FIELDS:
            kwargs["logprobs"] = self.top_logprobs or 0
        return kwargs

    def image_urls(self) -> list[str]:
        return [_url(part) for message in self.messages if isinstance(message.content, list)
                for part in message.content if isinstance(part, ImageURLPart)]

    def messages_for_template(self) -> list[dict]:
        """Plain dicts in the shape `raypipe.models.prompt.build_prompt` and chat templates expect.

        `developer` is OpenAI's newer name for `system` (chat templates know only `system`); an
        assistant turn with `content: null` is an empty one.
        """
        out = []
        for message in self.messages:
            content = message.content
            if content is None:
                content = ""
            elif isinstance(content, list):
                content = [{"type": "image_url", "image_url": {"url": _url(part)}} if isinstance(part, ImageURLPart)
                           else {"type": "text", "text": part.text} for part in content]
            out.append({"role": "system" if message.role == "developer" else message.role, "content": content})
        return out


class CompletionRequest(_Common):
    """`POST /v1/completions`: a text prompt (plain text, see `raypipe.models.prompt`) or token ids; no images."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = None
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int) \
                and len(self.prompt) != 1:
            raise InvalidInput("one prompt per request is supported", item="prompt", code="unsupported_parameter")
        if isinstance(self.prompt, (str, list)) and len(self.prompt) == 0:
            raise InvalidInput("prompt must not be empty", item="prompt", code="invalid_value")
        refused = {"logprobs": self.logprobs is not None, "echo": bool(self.echo),
                   "best_of": self.best_of not in (None, 1), "suffix": bool(self.suffix)}
        for field, used in refused.items():
            if used:
                raise InvalidInput(f"'{field}' is not supported by this server", item=field,
                                   code="unsupported_parameter")

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, (str, list)) and len(prompt) == 0:
            raise InvalidInput("prompt must not be empty", item="prompt", code="invalid_value")
        return prompt


def _url(part: ImageURLPart) -> str:
    return part.image_url if isinstance(part.image_url, str) else part.image_url.url


_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "too_short", "too_long",
                 "literal_error", "finite_number"}


def parse_request(body: bytes, model: type[_Common] = ChatCompletionRequest) -> _Common:
    """Parse a request body, turning any JSON or schema error into an `InvalidInput` naming the field."""
    try:
        request = model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if errors[0]["type"] == "json_invalid":
            raise InvalidInput(f"request body is not valid JSON ({errors[0]['msg']})", code="invalid_json") from None
        extra = [error for error in errors if error["type"] == "extra_forbidden"]
        if extra:  # OpenAI's wording for an argument it does not know
            where = _field_path(extra[0]["loc"])
            raise InvalidInput(f"Unrecognized request argument supplied: {where}", item=where,
                               code="unrecognized_argument") from None
        first = max(errors, key=lambda error: len(error["loc"]))  # the deepest is the most specific
        where = _field_path(first["loc"])
        message = first["msg"]
        if first["type"] == "finite_number":
            message = f"must be a finite number, got {first.get('input')!r} (NaN and Infinity are not numbers here)"
        code = ("missing_field" if first["type"] == "missing" else
                "invalid_value" if first["type"] in _RANGE_ERRORS else "invalid_type")
        raise InvalidInput(message + (f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""),
                           item=where or "body", code=code) from None
    request.check_supported()
    return request


def _field_path(loc: tuple) -> str:
    """`('messages', 0, 'content', 'list[...]', 1, 'image_url', 'url')` -> `messages[0].content[1].image_url.url`.

    Pydantic puts union branches in locations: type names (`str`, `list[...]`, `ImageURL`) and,
    right after a list index, the content-part tag (`text`, `image_url`). Those are not fields, so
    they are dropped.
    """
    path, previous = "", None
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in ("str", "int", "float", "bool", "ImageURL") and not (
                isinstance(previous, int) and part in ("text", "image_url")):
            path += f".{part}" if path else part
        previous = part
    return path


def completion_id(prefix: str = "chatcmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def models_body(models: list[dict]) -> dict:
    return {"object": "list", "data": models}


def model_card(model: str, max_model_len: int, created: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "raypipe", "max_model_len": max_model_len}


# --- response bodies --------------------------------------------------------------------------
# `kind` is "chat" (chat.completion) or "text" (text_completion); the two differ only in how a
# choice carries its text.

_OBJECT = {"chat": ("chat.completion", "chat.completion.chunk"), "text": ("text_completion", "text_completion")}


def completion_body(kind: str, request_id: str, model: str, fingerprint: str, created: int, text: str,
                    finish_reason: str, prompt_tokens: int, completion_tokens: int,
                    logprobs: dict | None = None) -> dict:
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if kind == "chat"
              else {"index": 0, "text": text})
    return {"id": request_id, "object": _OBJECT[kind][0], "created": created, "model": model,
            "system_fingerprint": fingerprint,
            "choices": [{**choice, "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": usage(prompt_tokens, completion_tokens)}


def chunk_body(kind: str, request_id: str, model: str, fingerprint: str, created: int, delta: dict | None,
               finish_reason: str | None = None, *, logprobs: dict | None = None, with_usage_field: bool = False,
               usage_value: dict | None = None) -> dict:
    """One stream chunk. `delta=None` makes the usage-only chunk (no choices); for "text", `delta` is `{"text": ...}`."""
    body = {"id": request_id, "object": _OBJECT[kind][1], "created": created, "model": model,
            "system_fingerprint": fingerprint}
    if delta is None:
        body["choices"] = []
    elif kind == "chat":
        body["choices"] = [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    else:
        body["choices"] = [{"index": 0, "text": delta.get("text", ""), "logprobs": logprobs,
                            "finish_reason": finish_reason}]
    if with_usage_field:  # with include_usage, every chunk carries `usage` (null until the last)
        body["usage"] = usage_value
    return body
