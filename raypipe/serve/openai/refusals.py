"""What a well-formed request may still not ask: OpenAI's limits the schema cannot express, and
fields whose behaviour this server lacks.

Every field OpenAI's API defines is accepted (the schema), and refused here with a 400 naming it
(`unsupported_parameter`) only where this server cannot honour it: audio in or out, file parts,
moderation, custom tools, completions' `best_of`/`suffix` unless it carries the value that means "not
used", and completions' `echo` with `logprobs` (that needs the prompt's log-probabilities). Fields with no effect here are accepted (docs/serving-fields.md lists
them with the reason); a name in neither OpenAI's nor vLLM's API is a 400 in `parsing`. A request may carry
one output constraint (`response_format` json modes, `structured_outputs`, one `guided_*` field, or
a `tool_choice` that forces calls). Tools are checked here as far as the request alone tells: a
parameters schema that is no JSON schema, a duplicate or unknown function name, call arguments that
are no JSON object; whether a schema compiles is the grammar engine's to say.

The rules run inside `parsing.parse_request`, in one fixed order (the first fault is the one
named), before anything else looks at the request; they live apart from `conversion` so that
turning an accepted request into `SamplingParams` is a plain mapping with nothing left to refuse.
Every other sampling control the schema accepts is a `SamplingParams` field, so it is honoured.
"""

from __future__ import annotations

import json

import jsonschema

from raypipe.errors import InvalidInput
from raypipe.serve.openai.schemas import (
    UNREADABLE_PARTS,
    AllowedToolsChoice,
    ChatCompletionRequest,
    Common,
    CompletionRequest,
    CustomTool,
    CustomToolCall,
    NamedCustomChoice,
    NamedToolChoice,
)

MAX_STOP = 4  # OpenAI's limit, tighter than the engine's
_CUSTOM_TOOLS = "custom tools are not supported by this server (function tools are)"


def check_supported(request: Common) -> None:
    """Raise `InvalidInput` naming the first field of `request` that this server refuses."""
    if isinstance(request, ChatCompletionRequest):
        _check_cannot_honour(request)
    _check_common(request)
    if isinstance(request, ChatCompletionRequest):
        _check_chat(request)
    else:
        _check_completion(request)


def _check_common(request: Common) -> None:
    if request.prompt_logprobs is not None and request.stream:
        raise InvalidInput("prompt_logprobs are not available with stream=true (as in vLLM)", item="prompt_logprobs",
                           code="invalid_value")
    if request.priority not in (None, 0):
        _unsupported("priority", "priority scheduling is not enabled: requests are served first come, first "
                                 "served, so priority must be 0")
    if isinstance(request.stop, list) and len(request.stop) > MAX_STOP:
        raise InvalidInput(f"at most {MAX_STOP} stop sequences are allowed", item="stop", code="invalid_value")
    for key in request.logit_bias or ():
        if not key.lstrip("-").isdigit():
            raise InvalidInput(f"logit_bias keys are token ids, got {key!r}", item="logit_bias", code="invalid_value")
    _check_constraints(request)


def _check_constraints(request: Common) -> None:
    form = getattr(request, "response_format", None)
    if form is not None and form.type == "json_schema" and (form.json_schema is None or form.json_schema.schema_ is None):
        raise InvalidInput("response_format json_schema needs json_schema.schema", item="response_format.json_schema",
                           code="missing_field")
    named = [name for name, used in (
        ("response_format", form is not None and form.type != "text"),
        ("structured_outputs", request.structured_outputs is not None),
        *((f"guided_{kind}", getattr(request, f"guided_{kind}") is not None)
          for kind in ("json", "regex", "choice", "grammar")),
        ("tool_choice", getattr(request, "tool_choice", None) not in (None, "none", "auto"))) if used]
    if len(named) > 1:
        raise InvalidInput(f"at most one output constraint per request, got {', '.join(named)}", item=named[1],
                           code="invalid_value")


def _check_chat(request: ChatCompletionRequest) -> None:
    for m, message in enumerate(request.messages):
        if message.content is None and message.role != "assistant":
            raise InvalidInput(f"content is required for role {message.role!r}", item=f"messages[{m}].content",
                               code="missing_field")
        if message.role == "tool" and not message.tool_call_id:
            raise InvalidInput("a tool message needs the tool_call_id it answers", item=f"messages[{m}].tool_call_id",
                               code="missing_field")
        calls = [(f"messages[{m}].tool_calls[{c}].function", call.function)
                 for c, call in enumerate(message.tool_calls or ())]
        for where, function in calls + ([(f"messages[{m}].function_call", message.function_call)]
                                        if message.function_call else []):
            if not isinstance(_json_or_none(function.arguments), dict):
                raise InvalidInput("tool call arguments must be a JSON object", item=f"{where}.arguments",
                                   code="invalid_value")
        for p, part in enumerate(message.content if isinstance(message.content, list) else []):
            if isinstance(part, UNREADABLE_PARTS):
                raise InvalidInput(f"content[{p}] is an '{part.type}' part, which this server cannot read (it reads "
                                   "text, images and videos)", item=f"messages[{m}].content[{p}]",
                                   code="unsupported_parameter")
    if request.top_logprobs and not request.logprobs:
        raise InvalidInput("top_logprobs needs logprobs=true", item="top_logprobs", code="invalid_value")
    _check_tools(request)


def _check_cannot_honour(request: ChatCompletionRequest) -> None:
    """OpenAI's fields this server has no means for: audio out (and an earlier audio answer to continue),
    moderation, custom (free-text) tools."""
    if request.moderation is not None:
        _unsupported("moderation", "moderation is not supported by this server (it runs no moderation model)")
    for t, tool in enumerate(request.tools or ()):
        if isinstance(tool, CustomTool):
            _unsupported(f"tools[{t}]", _CUSTOM_TOOLS)
    choice = request.tool_choice
    if isinstance(choice, NamedCustomChoice):
        _unsupported("tool_choice", _CUSTOM_TOOLS)
    for t, allowed in enumerate(choice.allowed_tools.tools if isinstance(choice, AllowedToolsChoice) else ()):
        if isinstance(allowed, NamedCustomChoice):
            _unsupported(f"tool_choice.allowed_tools.tools[{t}]", _CUSTOM_TOOLS)
    for m, message in enumerate(request.messages):
        for c, call in enumerate(message.tool_calls or ()):
            if isinstance(call, CustomToolCall):
                _unsupported(f"messages[{m}].tool_calls[{c}]", _CUSTOM_TOOLS)
    if request.audio is not None:
        _unsupported("audio", "audio output is not supported by this server")
    if request.modalities and "audio" in request.modalities:
        _unsupported("modalities", "audio output is not supported by this server (modalities: ['text'])")
    for m, message in enumerate(request.messages):
        if message.audio is not None:
            _unsupported(f"messages[{m}].audio", "audio answers are not supported by this server")


def _check_tools(request: ChatCompletionRequest) -> None:
    if request.functions is not None and not request.legacy_functions:
        raise InvalidInput("give tools or the legacy functions, not both", item="functions", code="invalid_value")
    names = set()
    for t, tool in enumerate(request.tools or ()):
        function = tool.function
        if function.name in names:
            raise InvalidInput(f"duplicate function name {function.name!r}", item=f"tools[{t}].function.name",
                               code="invalid_value")
        names.add(function.name)
        schema = function.arguments_schema
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise InvalidInput(f"parameters is not a valid JSON schema: {exc.message}",
                               item=f"tools[{t}].function.parameters", code="invalid_value") from None
        if schema.get("type", "object") != "object":
            raise InvalidInput("parameters must describe a JSON object (type 'object')",
                               item=f"tools[{t}].function.parameters", code="invalid_value")
    choice = request.tool_choice
    if choice not in (None, "none", "auto") and not request.tools:
        raise InvalidInput("tool_choice needs tools", item="tool_choice", code="invalid_value")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise InvalidInput(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                           item="tool_choice.function.name", code="invalid_value")
    for t, allowed in enumerate(choice.allowed_tools.tools if isinstance(choice, AllowedToolsChoice) else ()):
        if allowed.function.name not in names:
            raise InvalidInput(f"allowed_tools names {allowed.function.name!r}, which is not among the tools",
                               item=f"tool_choice.allowed_tools.tools[{t}].function.name", code="invalid_value")


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _check_completion(request: CompletionRequest) -> None:
    if len(request.prompt) == 0:
        raise InvalidInput("prompt must not be empty", item="prompt", code="invalid_value")
    for i, prompt in enumerate(request.prompts()):
        if len(prompt) == 0:
            raise InvalidInput(f"prompt[{i}] is empty; every prompt needs at least one token", item="prompt",
                               code="invalid_value")
    _refuse_used({"best_of": request.best_of not in (None, 1), "suffix": bool(request.suffix)})
    if request.echo and request.logprobs is not None:
        _unsupported("logprobs", "logprobs with echo (the prompt tokens in the legacy logprobs object) is not "
                                 "supported; send echo or logprobs, not both (prompt_logprobs gives the prompt's)")


def _refuse_used(used: dict[str, bool]) -> None:
    for field, is_used in used.items():
        if is_used:
            _unsupported(field)


def _unsupported(field: str, message: str | None = None) -> None:
    raise InvalidInput(message or f"'{field}' is not supported by this server", item=field,
                       code="unsupported_parameter")
