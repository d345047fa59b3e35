"""A request body's bytes to an accepted request, or to an `InvalidInput` that names the field.

Pydantic's errors are turned into OpenAI's shapes: an unknown argument is `unrecognized_argument`
(OpenAI's wording), a missing one `missing_field`, an out-of-range one `invalid_value`, anything
else `invalid_type`; the field is written as a client writes it (`messages[0].content[1]`).
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ValidationError

from raypipe.errors import InvalidInput
from raypipe.serve.openai.refusals import check_supported
from raypipe.serve.openai.schemas import ChatCompletionRequest, Common

_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "too_short", "too_long",
                 "literal_error", "finite_number", "string_pattern_mismatch", "union_tag_invalid"}


def parse_request(body: bytes, model: type[BaseModel] = ChatCompletionRequest) -> BaseModel:
    """Parse a request body and apply `refusals`: what comes back is a request this server honours in full."""
    try:
        request = model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if errors[0]["type"] != "json_invalid" or "recursion limit" not in errors[0]["msg"]:
            raise _invalid_input(errors) from None
        request = _validate_deep(body, model)
    if isinstance(request, Common):  # the tokenizer endpoints' bodies ask for no generation
        check_supported(request)
    return request


def validate_chat(data: dict) -> ChatCompletionRequest:
    """A chat request the server wrote from another API's request (`responses`), validated and checked as if it
    had been sent to /v1/chat/completions."""
    try:
        request = ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        raise _invalid_input(exc.errors(include_url=False)) from None
    check_supported(request)
    return request


def _validate_deep(body: bytes, model: type[Common]) -> Common:
    """A body nested deeper than pydantic's JSON reader goes (~200 levels, e.g. a deep JSON schema), read
    by the standard library's instead (to Python's recursion limit); deeper still is refused with its own code."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise InvalidInput("request body nests too deep to read", code="json_too_deep") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _invalid_input(exc.errors(include_url=False)) from None


def _invalid_input(errors: list[dict]) -> InvalidInput:
    if errors[0]["type"] == "json_invalid":
        return InvalidInput(f"request body is not valid JSON ({errors[0]['msg']})", code="invalid_json")
    extra = [error for error in errors if error["type"] == "extra_forbidden"]
    if extra:
        where = _field_path(extra[0]["loc"])
        return InvalidInput(f"Unrecognized request argument supplied: {where}", item=where,
                            code="unrecognized_argument")
    first = max(errors, key=lambda error: len(error["loc"]))  # the deepest is the most specific
    message = first["msg"]
    if first["type"] == "finite_number":
        message = f"must be a finite number, got {first.get('input')!r} (NaN and Infinity are not numbers here)"
    code = ("missing_field" if first["type"] == "missing" else
            "invalid_value" if first["type"] in _RANGE_ERRORS else "invalid_type")
    where = _field_path(first["loc"]) + (".type" if first["type"] == "union_tag_invalid" else "")  # the tag's field
    return InvalidInput(message + (f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""),
                        item=where or "body", code=code)


def _field_path(loc: tuple) -> str:
    """`('messages', 0, 'content', 'list[...]', 1, 'image_url', 'url')` -> `messages[0].content[1].image_url.url`.

    Pydantic puts union branches in locations: type names (`str`, `list[...]`, `ImageURL`,
    `tagged-union[...]`) and, right after a list index or a tagged union, the branch's tag (`text`,
    `image_url`, `function`). Those are not fields, so they are dropped.
    """
    path, previous = "", None
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in ("str", "int", "float", "bool", "ImageURL", "VideoURL") and not (
                (isinstance(previous, int) or str(previous).startswith("tagged-union")) and part in _TAGS):
            path += f".{part}" if path else part
        previous = part
    return path


# The `type` values of the schemas' tagged unions (content parts, tools, tool calls, tool choices).
_TAGS = {"text", "image_url", "video_url", "refusal", "input_audio", "file", "function", "custom", "allowed_tools",
         # the Responses API's items, parts and tools (`responses`)
         "message", "function_call", "function_call_output", "reasoning", "item_reference", "unknown", "hosted",
         "input_text", "input_image", "input_file", "output_text"}
