"""The OpenAI chat-completions wire format: request validation and response bodies.

Requests are parsed in pydantic's strict mode, so `"max_tokens": "5"` is a 400 rather than a
silent coercion. Fields of the OpenAI API that raypipe does not implement (n > 1, logprobs, tools,
penalties) are refused with a 400 naming the field instead of being ignored: a client asking for
them would otherwise get an answer that quietly differs from what it asked for.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from raypipe.errors import InvalidInput


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURLPart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImageURLPart, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatCompletionRequest(_Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # the newer name of max_tokens; wins when both are set
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Accepted only at the value that means "not used" (see the module docstring).
    n: int = 1
    logprobs: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    tools: list[Any] | None = None

    def check_supported(self) -> None:
        unsupported = {"n": self.n != 1, "logprobs": self.logprobs, "presence_penalty": self.presence_penalty != 0,
                       "frequency_penalty": self.frequency_penalty != 0, "tools": bool(self.tools)}
        for field, used in unsupported.items():
            if used:
                raise InvalidInput(f"'{field}' is not supported by this server", item=field, code="unsupported_parameter")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise InvalidInput("at most 4 stop sequences are allowed", item="stop", code="invalid_value")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def stop_list(self) -> list[str] | None:
        if self.stop is None:
            return None
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def image_urls(self) -> list[str]:
        return [part.image_url.url for message in self.messages if isinstance(message.content, list)
                for part in message.content if isinstance(part, ImageURLPart)]

    def messages_for_template(self) -> list[dict]:
        """Plain dicts in the shape `raypipe.prompt.build_prompt` and chat templates expect."""
        return [message.model_dump(exclude_none=True) for message in self.messages]


def parse_request(body: bytes) -> ChatCompletionRequest:
    """Parse a request body, turning any JSON or schema error into an `InvalidInput` naming the field."""
    try:
        request = ChatCompletionRequest.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if errors[0]["type"] == "json_invalid":
            raise InvalidInput(f"request body is not valid JSON ({errors[0]['msg']})", code="invalid_json") from None
        first = max(errors, key=lambda error: len(error["loc"]))  # the deepest is the most specific
        where = _field_path(first["loc"])
        raise InvalidInput(f"{first['msg']}" + (f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""),
                           item=where or "body", code="missing_field" if first["type"] == "missing" else "invalid_type"
                           ) from None
    request.check_supported()
    return request


def _field_path(loc: tuple) -> str:
    """`('messages', 0, 'content', 'list[...]', 1, 'image_url', 'url')` -> `messages[0].content[1].image_url.url`.

    Pydantic puts union branches in locations: type names (`str`, `list[...]`) and, right after a
    list index, the content-part tag (`text`, `image_url`). Those are not fields, so they are dropped.
    """
    path, previous = "", None
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in ("str", "int", "float", "bool") and not (
                isinstance(previous, int) and part in ("text", "image_url")):
            path += f".{part}" if path else part
        previous = part
    return path


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(request_id: str, model: str, text: str, finish_reason: str, prompt_tokens: int,
                    completion_tokens: int) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": usage(prompt_tokens, completion_tokens)}


def chunk_body(request_id: str, model: str, created: int, delta: dict | None, finish_reason: str | None = None,
               *, with_usage_field: bool = False, usage_value: dict | None = None) -> dict:
    """One `chat.completion.chunk`. `delta=None` makes the usage-only chunk (no choices)."""
    body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                                  "finish_reason": finish_reason}]}
    if with_usage_field:  # with include_usage, every chunk carries `usage` (null until the last)
        body["usage"] = usage_value
    return body


def models_body(model: str, max_model_len: int, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "raypipe",
                                        "max_model_len": max_model_len}]}
