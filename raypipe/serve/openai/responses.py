"""OpenAI's Responses API request (`POST /v1/responses`), and the chat request it becomes.

A response is a chat completion with another vocabulary: `input` items are chat messages (a
`function_call` item is an assistant turn's tool call, a `function_call_output` a tool turn, a
`reasoning` item the thinking of the assistant turn after it), `instructions` the system message,
`text.format` the response format, `max_output_tokens` the token budget. `chat_request` writes the
chat request and validates it as `/v1/chat/completions` would (its limits and refusals apply), so
both endpoints answer alike. `previous_response_id` prepends the stored conversation of that
response (`serve/response_store.py`): its input and output, not its instructions (OpenAI's rule).

Accepted with no effect, as on chat: `store` (it only decides whether this response can be
continued), `metadata`, `user`, `safety_identifier`, `prompt_cache_key`, `prompt_cache_retention`,
`service_tier`, `max_tool_calls` (no hosted tools run here), `text.verbosity`, `reasoning.summary`,
`include` values other than `message.output_text.logprobs`, `stream_options`. Refused with a 400:
hosted tools (web search, file search, computer use, MCP, code interpreter, image generation, custom),
`background`, `conversation`, stored `prompt` templates, `truncation: "auto"`, file inputs, audio,
image `file_id`s and `item_reference` items (this server keeps conversations, not items).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from raypipe.errors import InvalidInput
from raypipe.serve.openai.parsing import validate_chat
from raypipe.serve.openai.schemas import ChatCompletionRequest, _Strict

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class InputImage(_Strict):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["low", "high", "auto", "original"] | None = None


class InputFile(_Strict):
    type: Literal["input_file"]
    file_id: str | None = None
    file_data: str | None = None
    file_url: str | None = None
    filename: str | None = None


class InputAudio(_Strict):
    type: Literal["input_audio"]
    input_audio: dict


class OutputText(_Strict):
    """An earlier answer's text, as the SDK sends `response.output` back."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict] | None = None
    logprobs: list[dict] | None = None


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputText | InputImage | InputFile | InputAudio | OutputText | Refusal,
                        Field(discriminator="type")]


class MessageItem(_Strict):
    type: Literal["message"] = "message"  # optional in OpenAI's "easy" input message
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class SummaryText(_Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    id: str | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @property
    def text(self) -> str:
        return "".join(part.text for part in (self.content or self.summary))


class ItemReference(_Strict):
    type: Literal["item_reference"]
    id: str


def _item_type(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return kind if kind in _ITEM_TYPES else "unknown"


class UnknownItem(_Strict):
    """Any other item type (hosted tools' calls and outputs): refused naming its type."""

    model_config = {**_Strict.model_config, "extra": "allow"}
    type: str


_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning", "item_reference")
InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[ItemReference, Tag("item_reference")] | Annotated[UnknownItem, Tag("unknown")],
    Discriminator(_item_type)]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class HostedTool(_Strict):
    """A tool OpenAI runs itself (web search, file search, ...): refused naming its type."""

    model_config = {**_Strict.model_config, "extra": "allow"}
    type: str


def _tool_type(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "function" if kind == "function" else "hosted"


Tool = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[HostedTool, Tag("hosted")],
                 Discriminator(_tool_type)]


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class AllowedTools(_Strict):
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[FunctionChoice] = Field(min_length=1)


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningOptions(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponseStreamOptions(_Strict):
    include_obfuscation: bool | None = None


class ResponsesRequest(_Strict):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | AllowedTools | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    stream: bool | None = None
    stream_options: ResponseStreamOptions | None = None
    include: list[str] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    conversation: str | dict | None = None
    prompt: dict | None = None

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    @property
    def stored(self) -> bool:
        return self.store is not False


def chat_request(request: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    """The chat request `request` asks for, after the stored conversation `history` (chat messages)."""
    _refuse_unsupported(request)
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    body: dict = {"model": request.model, "messages": system + history + input_messages(request)}
    for name, value in (("max_completion_tokens", request.max_output_tokens), ("temperature", request.temperature),
                        ("top_p", request.top_p), ("parallel_tool_calls", request.parallel_tool_calls),
                        ("user", request.user), ("stream", request.stream)):
        if value is not None:
            body[name] = value
    if request.logprobs:
        body.update(logprobs=True, top_logprobs=request.top_logprobs or 0)
    if request.tools:
        body["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                         for tool in request.tools]
    if request.tool_choice is not None:
        body["tool_choice"] = _tool_choice(request.tool_choice)
    form = request.text.format if request.text else None
    if form is not None:
        body["response_format"] = {"type": form.type} if form.type != "json_schema" else {
            "type": "json_schema", "json_schema": {"name": form.name or "response", "schema": form.schema_,
                                                   **({"strict": form.strict} if form.strict is not None else {}),
                                                   **({"description": form.description} if form.description else {})}}
    if request.reasoning is not None and request.reasoning.effort is not None:
        body["reasoning_effort"] = request.reasoning.effort
    return validate_chat(body)


def input_messages(request: ResponsesRequest) -> list[dict]:
    """`input` as chat messages (the part of the conversation this request adds)."""
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    messages: list[dict] = []
    reasoning = None  # a reasoning item's text, for the assistant turn after it
    for i, item in enumerate(request.input):
        where = f"input[{i}]"
        if isinstance(item, MessageItem):
            message = {"role": item.role, "content": _content(item.content, where)}
            if item.role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)  # the same turn's text and calls: one message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call],
                                 **({"reasoning_content": reasoning} if reasoning is not None else {})})
                reasoning = None
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else "".join(part.text for part in item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        elif isinstance(item, ReasoningItem):
            reasoning = item.text
        elif isinstance(item, ItemReference):
            _unsupported(where, "item references are not supported: send the item itself, or continue a stored "
                                "response with previous_response_id")
        else:
            _unsupported(f"{where}.type", f"input items of type {item.type!r} are not supported here (message, "
                                          "function_call, function_call_output and reasoning items are)")
    return messages


def _content(content: str | list, where: str) -> str | list[dict]:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if isinstance(part, (InputText, OutputText)):
            parts.append({"type": "text", "text": part.text})
        elif isinstance(part, Refusal):
            parts.append({"type": "refusal", "refusal": part.refusal})
        elif isinstance(part, InputImage):
            if part.image_url is None:
                _unsupported(at, "images by file_id are not supported: send image_url (a data: URL or an "
                                 "allowed http(s) URL)")
            parts.append({"type": "image_url", "image_url": {"url": part.image_url,
                                                              **({"detail": part.detail} if part.detail else {})}})
        else:
            _unsupported(at, f"{part.type} parts are not supported: raypipe reads text and images")
    return parts


def _tool_choice(choice) -> str | dict:
    if isinstance(choice, str):
        return choice
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return {"type": "allowed_tools", "allowed_tools": {
        "mode": choice.mode, "tools": [{"type": "function", "function": {"name": t.name}} for t in choice.tools]}}


def _refuse_unsupported(request: ResponsesRequest) -> None:
    for i, tool in enumerate(request.tools or ()):
        if isinstance(tool, HostedTool):
            _unsupported(f"tools[{i}].type", f"{tool.type!r} tools run on OpenAI's side; this server runs none "
                                             "(function tools are supported)")
    for name, why in (("background", "background responses are not supported: send the request and wait, or "
                                     "stream it"),
                      ("conversation", "conversation objects are not supported: continue with previous_response_id"),
                      ("prompt", "stored prompt templates are not supported: send instructions and input")):
        if getattr(request, name) not in (None, False):
            _unsupported(name, why)
    if request.truncation == "auto":
        _unsupported("truncation", "truncation 'auto' (dropping conversation items to fit) is not supported: "
                                   "a conversation longer than the context is refused")


# Chat fields `chat_request` writes, and the Responses fields they come from (a chat message's index is not an
# input item's: instructions and the stored conversation come first).
_RESPONSES_FIELDS = (("messages", "input"), ("max_completion_tokens", "max_output_tokens"),
                     ("max_tokens", "max_output_tokens"), ("response_format.json_schema.schema", "text.format.schema"),
                     ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
                     ("reasoning_effort", "reasoning.effort"), ("tool_choice.function.name", "tool_choice.name"))


def as_responses_error(error: InvalidInput) -> InvalidInput:
    """`error` about the chat request `chat_request` wrote, naming the Responses field the client sent."""
    item = re.sub(r"^tools\[(\d+)\]\.function\.", r"tools[\1].", error.item or "")
    reason = error.reason
    for chat, ours in _RESPONSES_FIELDS:
        if item == chat or item.startswith((chat + ".", chat + "[")):
            item = ours if chat == "messages" else ours + item[len(chat):]
            reason = re.sub(rf"\b{re.escape(chat)}\b", ours, reason)
            break
    if not item or item == error.item:
        return error
    return InvalidInput(reason, item=item, code=error.code)


def _unsupported(param: str, message: str) -> None:
    raise InvalidInput(message, item=param, code="unsupported_parameter")
