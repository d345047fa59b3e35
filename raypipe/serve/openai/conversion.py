"""An accepted request's `SamplingParams`: OpenAI's (and vLLM's) sampling fields in the engine's terms.

Nothing is refused here: `refusals` already turned away what the engine cannot honour, so every
field left maps onto a `SamplingParams` field. Only what the request set is passed; the rest keeps
the engine's default, except where OpenAI's default differs (temperature and top_p are 1).
`SamplingParams` still validates the values (a negative `logit_bias` token id, `min_tokens` above
`max_tokens`) and names the field when it fails. `bad_words` need the tokenizer: the caller passes
them tokenized (`openai.bad_words`).
"""

from __future__ import annotations

import json

from raypipe.inputs.sampling import SamplingParams
from raypipe.inputs.structured import StructuredOutput
from raypipe.serve.openai.schemas import ChatCompletionRequest, Common, CompletionRequest
from raypipe.serve.openai.tools import tool_call_grammar

# Request fields that `SamplingParams` takes unchanged, under the same name.
_SAME = ("ignore_eos", "stop_token_ids", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
         "min_tokens", "allowed_token_ids", "skip_special_tokens", "include_stop_str_in_output", "prompt_logprobs")


def sampling_params(request: Common, max_tokens: int, bad_words_token_ids: list[list[int]] | None = None
                    ) -> SamplingParams:
    kwargs = {name: getattr(request, name) for name in _SAME if getattr(request, name) is not None}
    if request.top_k is not None:
        kwargs["top_k"] = max(request.top_k, 0)  # vLLM: -1 (or 0) means off
    if request.logit_bias:
        kwargs["logit_bias"] = {int(token): bias for token, bias in request.logit_bias.items()}
    if isinstance(request, ChatCompletionRequest) and request.logprobs:
        kwargs["logprobs"] = request.top_logprobs or 0  # 0: the sampled token's own log-probability only
    if isinstance(request, CompletionRequest) and request.logprobs is not None:
        kwargs["logprobs"] = request.logprobs  # the legacy integer: that many top candidates
    if bad_words_token_ids:
        kwargs["bad_words_token_ids"] = bad_words_token_ids
    structured = structured_output(request)
    if structured is not None:
        kwargs["structured"] = structured
    return SamplingParams(max_tokens=max_tokens, seed=request.seed, stop=request.stop_list(),
                          temperature=1.0 if request.temperature is None else request.temperature,
                          top_p=1.0 if request.top_p is None else request.top_p, **kwargs)


def structured_output(request: Common) -> StructuredOutput | None:
    """The request's one output constraint (`refusals` turned away requests naming several)."""
    forced = request.forced_tools() if isinstance(request, ChatCompletionRequest) else None
    if forced:  # OpenAI's default allows parallel calls
        # Each tool's arguments schema read as a constraint of its own: normalized like any schema, and
        # named `tools[i].function.parameters` if it is the reason the call grammar is refused.
        index = {tool.function.name: i for i, tool in enumerate(request.tools)}
        parts = tuple(StructuredOutput(json=schema, source=f"tools[{index[name]}].function.parameters")
                      for name, schema in forced.items())
        schemas = {name: json.loads(part.json) for name, part in zip(forced, parts)}
        return StructuredOutput(grammar=tool_call_grammar(schemas, parallel=request.parallel_tool_calls is not False
                                                                 and not request.legacy_functions),
                                source="tools", parts=parts)
    if isinstance(request, ChatCompletionRequest) and request.response_format is not None:
        form = request.response_format
        if form.type == "json_object":
            return StructuredOutput(json_object=True, source="response_format")
        if form.type == "json_schema":
            return StructuredOutput(json=form.json_schema.schema_, source="response_format.json_schema.schema")
    if request.structured_outputs is not None:
        fields = request.structured_outputs.model_dump(exclude_none=True, by_alias=True)
        fields = {key: value for key, value in fields.items() if key != "json_object" or value}
        source = f"structured_outputs.{next(iter(fields))}" if len(fields) == 1 else "structured_outputs"
        return StructuredOutput(**fields, source=source)
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(request, f"guided_{kind}")
        if value is not None:
            return StructuredOutput(**{kind: value}, source=f"guided_{kind}")
    return None
