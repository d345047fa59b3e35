"""What a well-formed request may still not ask: OpenAI's limits the schema cannot express, and
fields whose behaviour this server lacks.

What a client sends is either honoured or refused, never silently ignored (OpenAI's API and
vLLM's server ignore some): a known OpenAI field the engine cannot honour (`n`, tools, image
`detail` low/high, completions' `logprobs`/`echo`/`best_of`/`suffix`) is a 400 naming it
(`unsupported_parameter`), unless it carries the value that means "not used". A request may carry
one output constraint (`response_format` json modes, `structured_outputs` or one `guided_*` field).

The rules run inside `parsing.parse_request`, in one fixed order (the first fault is the one
named), before anything else looks at the request; they live apart from `conversion` so that
turning an accepted request into `SamplingParams` is a plain mapping with nothing left to refuse.
Every other sampling control the schema accepts is a `SamplingParams` field, so it is honoured.
"""

from __future__ import annotations

from raypipe.errors import InvalidInput
from raypipe.serve.openai.schemas import ChatCompletionRequest, Common, CompletionRequest, ImageURL, ImageURLPart

MAX_STOP = 4  # OpenAI's limit, tighter than the engine's


def check_supported(request: Common) -> None:
    """Raise `InvalidInput` naming the first field of `request` that this server refuses."""
    _check_common(request)
    if isinstance(request, ChatCompletionRequest):
        _check_chat(request)
    else:
        _check_completion(request)


def _check_common(request: Common) -> None:
    if request.n not in (None, 1):  # one choice per request
        _unsupported("n")
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
          for kind in ("json", "regex", "choice", "grammar"))) if used]
    if len(named) > 1:
        raise InvalidInput(f"at most one output constraint per request, got {', '.join(named)}", item=named[1],
                           code="invalid_value")


def _check_chat(request: ChatCompletionRequest) -> None:
    for m, message in enumerate(request.messages):
        if message.content is None and message.role != "assistant":
            raise InvalidInput(f"content is required for role {message.role!r}", item=f"messages[{m}].content",
                               code="missing_field")
        if message.tool_calls:
            raise InvalidInput("tool calls are not supported by this server", item=f"messages[{m}].tool_calls",
                               code="unsupported_parameter")
        for p, part in enumerate(message.content if isinstance(message.content, list) else []):
            if isinstance(part, ImageURLPart) and isinstance(part.image_url, ImageURL) \
                    and part.image_url.detail not in (None, "auto"):
                raise InvalidInput("image detail 'low'/'high' is not supported by this server (use 'auto')",
                                   item=f"messages[{m}].content[{p}].image_url.detail", code="unsupported_parameter")
    if request.top_logprobs and not request.logprobs:
        raise InvalidInput("top_logprobs needs logprobs=true", item="top_logprobs", code="invalid_value")
    _refuse_used({"tools": bool(request.tools), "tool_choice": request.tool_choice not in (None, "none"),
                  "parallel_tool_calls": request.parallel_tool_calls is not None})


def _check_completion(request: CompletionRequest) -> None:
    if isinstance(request.prompt, list) and request.prompt and not isinstance(request.prompt[0], int) \
            and len(request.prompt) != 1:
        raise InvalidInput("one prompt per request is supported", item="prompt", code="unsupported_parameter")
    if len(request.prompt) == 0:  # [""] and [[]] pass here; `single_prompt` refuses them
        raise InvalidInput("prompt must not be empty", item="prompt", code="invalid_value")
    _refuse_used({"logprobs": request.logprobs is not None, "echo": bool(request.echo),
                  "best_of": request.best_of not in (None, 1), "suffix": bool(request.suffix)})


def _refuse_used(used: dict[str, bool]) -> None:
    for field, is_used in used.items():
        if is_used:
            _unsupported(field)


def _unsupported(field: str) -> None:
    raise InvalidInput(f"'{field}' is not supported by this server", item=field, code="unsupported_parameter")
