"""OpenAI request bodies as pydantic models, in strict mode, with the few reads the ingress needs.

Strict mode makes `"max_tokens": "5"` a 400 rather than a silent coercion, and `extra="forbid"`
makes an unknown or misspelled field a 400 naming it. Explicit `null` means "not set", as in
OpenAI's API. vLLM's extra sampling fields (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`,
`ignore_eos`, `stop_token_ids`, `bad_words`), which benchmark tools send, are accepted under vLLM's names,
and so are its prompt fields (`add_special_tokens`, `truncate_prompt_tokens`, chat `echo`), video parts (`video_url`), per-request video sampling (`mm_processor_kwargs`) and the chat
template's switches (`chat_template_kwargs`: Qwen3.5's `enable_thinking`). Structured
outputs come as OpenAI's `response_format` (chat), vLLM's `structured_outputs` object (vLLM >= 0.12)
or vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields.

The models describe what a client may write; what this server refuses of it lives in `refusals`,
and what it asks of the engine in `conversion`.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, model_validator

from raypipe.inputs.sampling import MAX_BAD_WORDS
from raypipe.models.prompt import TemplateOptions


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class CacheBreakpoint(_Strict):
    """OpenAI's explicit prompt-cache breakpoint on a part: no effect (this server caches every full block)."""

    mode: Literal["explicit"]
    ttl: Literal["30m", "12h"] | None = None


class ImageURL(_Strict):
    url: str
    # "low": OpenAI's low-resolution view (`LOW_DETAIL_PIXELS`); the others: the model's own resolution
    detail: Literal["auto", "low", "high", "original"] | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: CacheBreakpoint | None = None


class _URLPart(_Strict):
    """A visual part whose field, named after its type, is `{"url": ...}` or the bare URL string."""

    @property
    def url(self) -> str:
        value = getattr(self, self.type)
        return value if isinstance(value, str) else value.url


class ImageURLPart(_URLPart):
    type: Literal["image_url"]
    image_url: ImageURL | str
    prompt_cache_breakpoint: CacheBreakpoint | None = None

    @property
    def low_detail(self) -> bool:
        return isinstance(self.image_url, ImageURL) and self.image_url.detail == "low"


class VideoURL(_Strict):
    url: str


class VideoURLPart(_URLPart):
    type: Literal["video_url"]
    video_url: VideoURL | str


class RefusalPart(_Strict):
    """An assistant turn's refusal, as OpenAI's client sends it back: rendered as the turn's text."""

    type: Literal["refusal"]
    refusal: str


class InputAudio(_Strict):
    data: str
    format: str


class InputAudioPart(_Strict):
    type: Literal["input_audio"]
    input_audio: InputAudio
    prompt_cache_breakpoint: CacheBreakpoint | None = None


class FileData(_Strict):
    file_data: str | None = None
    file_id: str | None = None
    filename: str | None = None


class FilePart(_Strict):
    type: Literal["file"]
    file: FileData
    prompt_cache_breakpoint: CacheBreakpoint | None = None


ContentPart = Annotated[TextPart | ImageURLPart | VideoURLPart | RefusalPart | InputAudioPart | FilePart,
                        Field(discriminator="type")]
# Parts this server cannot read (`refusals` turns them away by name).
UNREADABLE_PARTS = (InputAudioPart, FilePart)


class MMProcessorKwargs(_Strict):
    """vLLM's per-request processor overrides that apply to this server's models: video sampling
    (`raypipe.inputs.video.VideoSampling`) and the EVS pruning rate (`raypipe.models.evs`); and
    LLaVA-OneVision's `tile_every_image` (`VisionAdapter.prompt_visuals`)."""

    fps: float | None = Field(default=None, gt=0.0)
    num_frames: int | None = Field(default=None, ge=1)
    min_frames: int | None = Field(default=None, ge=1)
    max_frames: int | None = Field(default=None, ge=1)
    min_pixels: int | None = Field(default=None, ge=1)
    max_pixels: int | None = Field(default=None, ge=1)
    total_pixels: int | None = Field(default=None, ge=1)
    video_pruning_rate: float | None = Field(default=None, ge=0.0, lt=1.0)
    tile_every_image: StrictBool | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class CustomCall(_Strict):
    name: str
    input: str


class CustomToolCall(_Strict):
    """A call of a custom (free-text) tool, which this server has none of (`refusals`)."""

    id: str
    type: Literal["custom"]
    custom: CustomCall


class AudioReference(_Strict):
    id: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # function: legacy tool turn
    content: str | list[ContentPart] | None = None  # null only for assistant turns
    name: str | None = None
    # What OpenAI's own client echoes back in an assistant turn.
    refusal: str | None = None
    tool_calls: list[Annotated[ToolCall | CustomToolCall, Field(discriminator="type")]] | None = None
    tool_call_id: str | None = None  # in a tool turn: the call it answers
    function_call: FunctionCall | None = None  # legacy form of one tool call
    audio: AudioReference | None = None  # a previous audio answer (`refusals` turns it away)
    annotations: list[dict] | None = None  # url citations of web search answers: nothing to render
    # A thinking model's reasoning, as this server (and vLLM) sent it: SDK loops append the message back.
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM >= 0.10's name for it

    @property
    def past_reasoning(self) -> str | None:
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object; none: no arguments
    strict: bool | None = None  # forced calls follow the schema either way

    @property
    def arguments_schema(self) -> dict:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class CustomDefinition(_Strict):
    name: str
    description: str | None = None
    format: dict | None = None


class CustomTool(_Strict):
    """OpenAI's custom tool (free text or a grammar as its input): refused by `refusals`."""

    type: Literal["custom"]
    custom: CustomDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class NamedCustomChoice(_Strict):
    type: Literal["custom"]
    custom: NamedFunction


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # no effect: OpenAI's padding against length side channels
    continuous_usage_stats: bool | None = None  # vLLM: with include_usage, every chunk's usage holds the counts so far


class AllowedTools(_Strict):
    mode: Literal["auto", "required"]
    tools: list[Annotated[NamedToolChoice | NamedCustomChoice, Field(discriminator="type")]] = Field(min_length=1)


class AllowedToolsChoice(_Strict):
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class LegacyFunctionChoice(_Strict):
    name: str


class Prediction(_Strict):
    type: Literal["content"]
    content: str | list[TextPart]


class Moderation(_Strict):
    model: str
    policy: dict | None = None


class PromptCacheOptions(_Strict):
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


class AudioOutput(_Strict):
    format: str
    voice: str | dict


class WebSearchOptions(_Strict):
    search_context_size: Literal["low", "medium", "high"] | None = None
    user_location: dict | None = None


class JSONSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output follows the schema either way


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` request object (the fields this server's grammar engine takes)."""

    json_: dict | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class Common(_Strict):
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
    n: int | None = Field(default=None, ge=1, le=128)  # OpenAI's limit; choices are independent sequences
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    # vLLM's: each prompt token's log-probability (and its top candidates) in the response; not with stream
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    stop_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1)  # sample only among these ids
    skip_special_tokens: bool | None = None  # false: special tokens' text stays in the output
    spaces_between_special_tokens: bool | None = None  # no effect: fast tokenizers add no spaces there either way
    include_stop_str_in_output: bool | None = None  # true: the text ends after the stop string that ended it
    priority: int | None = None  # 0 only: requests are served first come, first served (no priority scheduling)
    request_id: str | None = Field(default=None, min_length=1, max_length=256)  # the response's id, after its prefix
    return_tokens_as_token_ids: bool | None = None  # logprob tokens written "token_id:<id>"
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)  # prefix-cache hits only within a salt
    bad_words: list[str] | None = Field(default=None, max_length=MAX_BAD_WORDS)  # banned words (`openai.bad_words`)
    # vLLM's prompt fields (`openai.prompt_tokens`): keep the last N prompt tokens (-1: the context length); the
    # tokenizer's special tokens around the prompt text (default: `special_tokens`)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    add_special_tokens: bool | None = None
    echo: bool | None = None  # the reply begins with the prompt (completions) or the message it continues (chat)

    @property
    def requested_max_tokens(self) -> int | None:
        """None leaves the choice to the server's limits."""
        return self.max_tokens

    @property
    def special_tokens(self) -> bool:
        """vLLM's default for chat: none (the chat template writes what the model needs)."""
        return bool(self.add_special_tokens)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def stop_list(self) -> list[str] | None:
        if self.stop is None:
            return None
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the newer name of max_tokens; wins when both are set
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Annotated[Tool | CustomTool, Field(discriminator="type")]] | None = None
    # tools given: "auto"
    tool_choice: Literal["none", "auto", "required"] | Annotated[
        NamedToolChoice | NamedCustomChoice | AllowedToolsChoice, Field(discriminator="type")] | None = None
    parallel_tool_calls: bool | None = None
    # The legacy names of tools and tool_choice, read as them (`_legacy_functions_as_tools`).
    functions: list[FunctionDefinition] | None = None
    function_call: Literal["none", "auto"] | LegacyFunctionChoice | None = None
    # "none"/"minimal" switch a model's thinking off (`template_kwargs`); other values leave it on.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # Output audio, which this server cannot make (`refusals`): modalities ["text"] is what it does anyway.
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioOutput | None = None
    moderation: Moderation | None = None  # no moderation model here (`refusals`)
    # OpenAI's fields with no effect here (docs/serving-fields.md says why each).
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None
    safety_identifier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prediction: Prediction | None = None
    web_search_options: WebSearchOptions | None = None
    mm_processor_kwargs: MMProcessorKwargs | None = None
    # vLLM's switches for the chat template (`enable_thinking`); `models.prompt.check_template_kwargs` says which
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool | None = None  # true (the default): the template opens the assistant's turn
    continue_final_message: bool | None = None  # true: the last (assistant) message is left open and continued
    chat_template: str | None = None  # this request's template instead of the model's (same sandbox)

    _legacy_functions: bool = PrivateAttr(default=False)  # tools came as `functions`

    @model_validator(mode="after")
    def _legacy_functions_as_tools(self):
        """`functions` are tools and `function_call` a tool_choice (OpenAI's own mapping); with `tools` set as
        well nothing is mapped, and `refusals` names the conflict."""
        if self.functions is not None and self.tools is None:
            self._legacy_functions = True
            self.tools = [Tool(type="function", function=function) for function in self.functions]
            if self.function_call is not None and self.tool_choice is None:
                call = self.function_call
                self.tool_choice = call if isinstance(call, str) else NamedToolChoice(
                    type="function", function=NamedFunction(name=call.name))
        return self

    @property
    def legacy_functions(self) -> bool:
        return self._legacy_functions

    def template_options(self) -> TemplateOptions:
        continuing = bool(self.continue_final_message)
        opens_turn = not continuing if self.add_generation_prompt is None else self.add_generation_prompt
        return TemplateOptions(opens_turn, continuing, self.chat_template)

    def template_kwargs(self, has_thinking_switch: bool) -> dict | None:
        """`chat_template_kwargs`, plus `enable_thinking: false` when `reasoning_effort` is "none" or "minimal" and
        the model has a thinking switch (an explicit `enable_thinking` wins; elsewhere the effort has no effect)."""
        kwargs = self.chat_template_kwargs
        if has_thinking_switch and self.reasoning_effort in ("none", "minimal") \
                and "enable_thinking" not in (kwargs or {}):
            return {**(kwargs or {}), "enable_thinking": False}
        return kwargs

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def echoed_text(self) -> str:
        """With `echo`, what the reply's content begins with (vLLM's rule): the last message's text when the
        reply continues it, i.e. when it is the assistant's (the reply's role); else nothing."""
        last = self.messages[-1]
        if not self.echo or last.role != "assistant" or last.content is None:
            return ""
        if isinstance(last.content, str):
            return last.content
        return "\n".join(part.text if isinstance(part, TextPart) else part.refusal for part in last.content
                         if isinstance(part, (TextPart, RefusalPart)))

    def tile_every_image(self) -> bool:
        return bool(self.mm_processor_kwargs and self.mm_processor_kwargs.tile_every_image)

    def tool_names(self) -> set[str] | None:
        """The functions whose calls the output is parsed for; None: the output is all content."""
        if not self.tools or self.tool_choice == "none":
            return None
        return {tool.function.name for tool in self.tools if self._allowed(tool.function.name)}

    def _allowed(self, name: str) -> bool:
        """Whether `tool_choice` (`allowed_tools`) leaves the function `name` to call."""
        choice = self.tool_choice
        return not isinstance(choice, AllowedToolsChoice) or name in {
            allowed.function.name for allowed in choice.allowed_tools.tools}

    def forced_tools(self) -> dict[str, dict] | None:
        """Name -> arguments schema of the functions generation is constrained to call (`required`, named, or
        `allowed_tools` in mode required)."""
        choice = self.tool_choice
        if not self.tools or choice in (None, "none", "auto") or (
                isinstance(choice, AllowedToolsChoice) and choice.allowed_tools.mode == "auto"):
            return None
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        return {tool.function.name: tool.function.arguments_schema for tool in self.tools
                if named in (None, tool.function.name) and self._allowed(tool.function.name)}

    def template_tools(self) -> list[dict] | None:
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    def image_urls(self) -> list[str]:
        return self._urls(ImageURLPart)

    def video_urls(self) -> list[str]:
        return self._urls(VideoURLPart)

    def _urls(self, part_type) -> list[str]:
        return [part.url for message in self.messages if isinstance(message.content, list)
                for part in message.content if isinstance(part, part_type)]

    def messages_for_template(self) -> list[dict]:
        """Plain dicts in the shape `raypipe.models.prompt.build_prompt` and chat templates expect.

        `developer` is OpenAI's newer name for `system` and `function` its older name for `tool` (chat
        templates know only `system` and `tool`), a legacy `function_call` is a tool call, and an
        assistant turn with `content: null` is an empty one; its past reasoning (`reasoning_content`
        or `reasoning`) goes to the template as `reasoning_content`, which renders it or not. Tool calls
        carry their arguments as an object, as chat templates expect (`refusals` checked that they parse).
        """
        out = []
        for message in self.messages:
            extra = {}
            calls = [call.function for call in message.tool_calls or ()] + (
                [message.function_call] if message.function_call else [])
            if calls:
                extra["tool_calls"] = [{"type": "function", "function": {
                    "name": call.name, "arguments": json.loads(call.arguments)}} for call in calls]
            if message.tool_call_id is not None:
                extra["tool_call_id"] = message.tool_call_id
            if message.role == "assistant" and message.past_reasoning is not None:
                extra["reasoning_content"] = message.past_reasoning  # the name Qwen3 / Qwen3.5 templates read
            content = message.content
            if content is None:
                content = ""
            elif isinstance(content, list):
                content = [{"type": "text", "text": part.text} if isinstance(part, TextPart)
                           else {"type": "text", "text": part.refusal} if isinstance(part, RefusalPart)
                           else {"type": part.type, part.type: {"url": part.url, **(
                               {"detail": "low"} if isinstance(part, ImageURLPart) and part.low_detail else {})}}
                           for part in content]
            out.append({"role": _TEMPLATE_ROLES.get(message.role, message.role), "content": content, **extra})
        return out


_TEMPLATE_ROLES = {"developer": "system", "function": "tool"}


class CompletionRequest(Common):
    """`POST /v1/completions`: text prompts (plain text, see `raypipe.models.prompt`) or token ids; no images.
    Several prompts are answered as one request each, their choices in prompt order."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)  # OpenAI's limit: top candidates per output token
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    @property
    def requested_max_tokens(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens  # OpenAI's default for completions

    @property
    def special_tokens(self) -> bool:
        """vLLM's default for a completion prompt: the tokenizer's special tokens (a BOS) around its text."""
        return self.add_special_tokens is not False

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one text or token-id list, or each of a list of them."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)


class TokenizeChatRequest(ChatCompletionRequest):
    """vLLM's `POST /tokenize` with chat messages: the prompt's token ids as a chat request with these messages
    (images and videos expanded to their placeholder runs) would send them to the model."""

    model: str | None = None  # optional here, as in vLLM
    return_token_strs: bool | None = None  # also each token's text


class TokenizeCompletionRequest(_Strict):
    """vLLM's `POST /tokenize` with a text prompt, tokenized as `/v1/completions` tokenizes it."""

    model: str | None = None
    prompt: str
    return_token_strs: bool | None = None
    add_special_tokens: bool | None = None  # as in `CompletionRequest`

    @property
    def special_tokens(self) -> bool:
        return self.add_special_tokens is not False


class DetokenizeRequest(_Strict):
    """vLLM's `POST /detokenize`: token ids back to text."""

    model: str | None = None
    tokens: list[int] = Field(min_length=1)


class LoadLoraAdapterRequest(_Strict):
    """vLLM's `POST /v1/load_lora_adapter`: serve the PEFT LoRA save at `lora_path` (a folder every Decoder replica
    can read, or `s3://`) as model `lora_name`."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(_Strict):
    """vLLM's `POST /v1/unload_lora_adapter` (by name; vLLM's `lora_int_id` has no meaning here)."""

    lora_name: str = Field(min_length=1)
