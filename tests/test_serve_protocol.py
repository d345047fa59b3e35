"""The HTTP layer's pure parts, without Ray: request parsing, limits, error bodies, SSE chunks."""

from __future__ import annotations

import json

import pytest

from raypipe.errors import InvalidInput
from raypipe.serve.errors import ApiError
from raypipe.serve.limits import ServeLimits
from raypipe.serve.openai.bodies import chunk_body
from raypipe.serve.openai.conversion import sampling_params
from raypipe.serve.openai.parsing import parse_request
from raypipe.serve.openai.schemas import CompletionRequest


def body(**fields) -> bytes:
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def test_parses_text_and_image_parts():
    request = parse_request(json.dumps({"model": "m", "max_completion_tokens": 7, "max_tokens": 3, "stop": "x",
                                        "stream": True, "stream_options": {"include_usage": True},
                                        "messages": [{"role": "user", "content": [
                                            {"type": "text", "text": "a"},
                                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                                        ]}]}).encode())
    assert request.requested_max_tokens == 7  # the newer field wins
    assert request.stop_list() == ["x"] and request.include_usage
    assert request.image_urls() == ["data:image/png;base64,AA=="]
    assert request.messages_for_template()[0]["content"][1]["image_url"]["url"].startswith("data:")


def _tool(name="add", **function) -> dict:
    return {"type": "function", "function": {"name": name, **function}}


BAD_TOOLS = [  # (tools, other fields, the param the 400 names)
    ([_tool("add two")], {}, "tools[0].function.name"),  # OpenAI's name rule
    ([{"type": "retrieval", "function": {"name": "add"}}], {}, "tools[0].type"),
    ([_tool(parameters={"type": 5})], {}, "tools[0].function.parameters"),  # not a JSON schema
    ([_tool(parameters={"type": "array"})], {}, "tools[0].function.parameters"),  # arguments are an object
    ([_tool(), _tool()], {}, "tools[1].function.name"),  # duplicate
    ([_tool()], {"tool_choice": {"type": "function", "function": {"name": "sub"}}}, "tool_choice.function.name"),
    (None, {"tool_choice": "required"}, "tool_choice"),  # nothing to call
    ([_tool()], {"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
]


@pytest.mark.parametrize("raw, code, param", [
    (b"{not json", "invalid_json", None),
    (body(max_tokens="5"), "invalid_type", "max_tokens"),  # strict: no silent coercion
    (body(messages=[{"role": "user", "content": [{"type": "audio"}]}]), "invalid_value", "messages[0].content[0].type"),
    (body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), "missing_field",
     "messages[0].content[0].image_url.url"),
    (json.dumps({"messages": []}).encode(), "missing_field", "model"),
    (body(n=129), "invalid_value", "n"),
    *((body(tools=tools, **extra), "invalid_value", param) for tools, extra, param in BAD_TOOLS),
    (body(messages=[{"role": "tool", "content": "3"}]), "missing_field", "messages[0].tool_call_id"),
    (body(messages=[{"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "add", "arguments": "[1, 2]"}}]}]), "invalid_value", "messages[0].tool_calls[0].function.arguments"),
    (body(stop=["a", "b", "c", "d", "e"]), "invalid_value", "stop"),
])
def test_bad_requests_name_the_field(raw, code, param):
    with pytest.raises(InvalidInput) as info:
        parse_request(raw)
    assert info.value.code == code and info.value.item == (param if param is not None else None)



def test_sampling_params_carry_what_the_request_set():
    params = sampling_params(parse_request(body(top_k=-1, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.5,
                                                frequency_penalty=0.5, min_tokens=2, ignore_eos=True,
                                                stop_token_ids=[3], logit_bias={"5": 10}, logprobs=True,
                                                top_logprobs=2, stop="x", seed=7)), max_tokens=9)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (9, 1.0, 1.0, 0)  # OpenAI's defaults
    assert (params.min_p, params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == \
        (0.1, 1.2, 0.5, 0.5)
    assert (params.min_tokens, params.ignore_eos, params.stop_token_ids, params.logit_bias) == (2, True, [3], {5: 10.0})
    assert (params.logprobs, params.stop, params.seed) == (2, ["x"], 7)
    assert sampling_params(parse_request(body(logprobs=True)), max_tokens=1).logprobs == 0  # the sampled token only


def test_tool_choice_decides_parsing_and_constraint():
    def parsed(**fields):
        request = parse_request(body(tools=[_tool(), _tool("sub")], **fields))
        return request.tool_names(), sampling_params(request, max_tokens=9).structured

    assert parsed(tool_choice="none") == (None, None)  # tools listed in the prompt, output left alone
    assert parsed() == parsed(tool_choice="auto") == ({"add", "sub"}, None)  # parsed, not constrained
    _, required = parsed(tool_choice="required")
    _, named = parsed(tool_choice={"type": "function", "function": {"name": "sub"}}, parallel_tool_calls=False)
    assert '"add"' in required.grammar and '"sub"' in required.grammar and '("\\n" call)*' in required.grammar
    assert '"add"' not in named.grammar and '"sub"' in named.grammar and "call)*" not in named.grammar


@pytest.mark.parametrize("prompt", ["", [], [""], [[]], ["a", ""], [[1], []]])
def test_empty_prompts_are_refused(prompt):
    raw = json.dumps({"model": "tiny", "prompt": prompt}).encode()
    with pytest.raises(InvalidInput) as info:
        parse_request(raw, CompletionRequest)
    assert info.value.code == "invalid_value" and info.value.item == "prompt"


def completion(**fields) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "hi", **fields}).encode()


@pytest.mark.parametrize("fields, code, param", [
    ({"echo": True, "logprobs": 0}, "unsupported_parameter", "logprobs"),  # the prompt in the legacy object
    ({"best_of": 2}, "unsupported_parameter", "best_of"),
    ({"suffix": "x"}, "unsupported_parameter", "suffix"),
    ({"logprobs": 6}, "invalid_value", "logprobs"),
    ({"truncate_prompt_tokens": -2}, "invalid_value", "truncate_prompt_tokens"),
    ({"bad_words": ["a"] * 101}, "invalid_value", "bad_words"),
    ({"bad_words": [3]}, "invalid_type", "bad_words[0]"),
    ({"add_special_tokens": "yes"}, "invalid_type", "add_special_tokens"),
    ({"prompt_logprobs": 21}, "invalid_value", "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "invalid_value", "prompt_logprobs"),  # vLLM's rule
    ({"documents": []}, "unrecognized_argument", "documents"),
])
def test_completion_fields_refused_with_the_reason(fields, code, param):
    with pytest.raises(InvalidInput) as info:
        parse_request(completion(**fields), CompletionRequest)
    assert (info.value.code, info.value.item) == (code, param)
    if param == "logprobs" and code == "unsupported_parameter":
        assert "echo" in str(info.value) and "prompt" in str(info.value)


def test_prompt_lists_defaults_and_chat_echo_text():
    assert parse_request(completion(prompt=["a", "b"]), CompletionRequest).prompts() == ["a", "b"]
    assert parse_request(completion(prompt=[[1, 2], [3]]), CompletionRequest).prompts() == [[1, 2], [3]]
    assert parse_request(completion(prompt=[1, 2]), CompletionRequest).prompts() == [[1, 2]]
    # vLLM's defaults: completions add the tokenizer's special tokens, chat does not (its template does)
    assert parse_request(completion(), CompletionRequest).special_tokens and not parse_request(body()).special_tokens
    assert sampling_params(parse_request(completion(logprobs=3), CompletionRequest), 4).logprobs == 3
    turns = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert parse_request(body(messages=turns, echo=True)).echoed_text() == "a\nb"  # text parts, as vLLM joins them
    assert parse_request(body(messages=turns)).echoed_text() == ""
    assert parse_request(body(messages=turns[:1], echo=True)).echoed_text() == ""  # the reply continues no message


def test_prompt_limits_and_truncation():
    from raypipe.serve.openai.prompt_tokens import truncate, truncation_length

    with pytest.raises(InvalidInput) as info:
        ServeLimits(max_prompts_per_request=2).check_prompt_count(3)
    assert (info.value.code, info.value.item) == ("too_many_prompts", "prompt")
    assert truncation_length(None, 100) is None and truncation_length(-1, 100) == 100
    for bad in (0, 101):
        with pytest.raises(InvalidInput) as info:
            truncation_length(bad, 100)
        assert info.value.item == "truncate_prompt_tokens"
    ids = [1, 2, 3, 9, 9, 9, 4, 5]  # 9: a placeholder run at 3..5, opened by the marker 3
    assert truncate(ids, 6, {9}) == ids[2:] and truncate(ids, 8, {9}) == ids == truncate(ids, 20, {9})
    assert truncate(ids, 3) == [9, 4, 5]  # no visual items: any cut
    for keep in (2, 4, 5):  # into the run, or right at its start (its opening marker would go)
        with pytest.raises(InvalidInput) as info:
            truncate(ids, keep, {9})
        assert info.value.item == "truncate_prompt_tokens" and "image or video" in str(info.value)
        assert "keep at least 6" in str(info.value)


def test_special_tokens_around_the_text_are_the_tokenizers_own(tiny_ckpt):
    """A tokenizer that adds a BOS and an EOS (Qwen's add none): what `add_special_tokens` puts around a prompt's
    text ids is what the tokenizer's own `encode(..., add_special_tokens=True)` gives."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from raypipe.models.prompt import plain_text_ids
    from raypipe.serve.openai.prompt_tokens import special_tokens_around

    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt)
    assert special_tokens_around(tokenizer) == ([], [])
    bos, eos = "<|im_start|>", "<|endoftext|>"
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in (bos, eos)}
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=list(ids.items()))
    before, after = special_tokens_around(tokenizer)
    for text in ("Once upon a time", " spaced", "x"):
        assert before + plain_text_ids(tokenizer, text) + after == tokenizer.encode(text, add_special_tokens=True)
    assert (before, after) == ([ids[bos]], [ids[eos]])


def test_bad_words_are_tokenized_as_vllm_does(tiny_ckpt):
    """Each word as it starts a text and, when that gives another first token and as many tokens, after a space.
    The preset tokenizers are byte-level (a space is a token of its own); "hello" and " hello" are made one
    token each here, as a BPE vocabulary has them."""
    from transformers import AutoTokenizer

    from raypipe.models.prompt import max_chars_per_token
    from raypipe.serve.openai.bad_words import bad_words_token_ids

    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt)
    tokenizer.add_tokens(["hello", " hello"])
    per_token = max_chars_per_token(tokenizer)

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    assert len(encode("hello")) == len(encode(" hello")) == 1 and len(encode(" world")) == len(encode("world")) + 1
    assert bad_words_token_ids(tokenizer, ["  hello", "world"], per_token) == [
        encode("hello"), encode(" hello"), encode("world")]  # " world" has one more token: not banned as well
    assert bad_words_token_ids(tokenizer, None, per_token) is None
    assert bad_words_token_ids(tokenizer, ["<|im_end|>"], per_token)[0] != [tokenizer.convert_tokens_to_ids(
        "<|im_end|>")]  # plain text, as prompts are
    for words, param in ((["ok", ""], "bad_words[1]"), (["   "], "bad_words[0]"), (["ab " * 40], "bad_words[0]"),
                         (["a" * 10**6], "bad_words[0]")):
        with pytest.raises(InvalidInput) as info:
            bad_words_token_ids(tokenizer, words, per_token)
        assert (info.value.code, info.value.item) == ("invalid_value", param)

def test_max_tokens_against_context():
    limits = ServeLimits(default_max_tokens=100)
    assert limits.max_tokens_for(None, prompt_tokens=950, max_model_len=1000) == 50
    assert limits.max_tokens_for(None, prompt_tokens=10, max_model_len=1000) == 100
    for requested, prompt, code in ((0, 10, "invalid_value"), (991, 10, "context_length_exceeded"),
                                    (None, 1000, "context_length_exceeded")):
        with pytest.raises(InvalidInput) as info:
            limits.max_tokens_for(requested, prompt_tokens=prompt, max_model_len=1000)
        assert info.value.code == code


@pytest.mark.parametrize("exc, status", [
    (InvalidInput("no", item="sampling_params.seed", code="invalid_sampling_params"), 400),
    (InvalidInput("no", code="invalid_api_key"), 401),
    (InvalidInput("no", item="model", code="model_not_found"), 404),
    (InvalidInput("no", code="request_too_large"), 413),
    (RuntimeError("secret internals"), 500),
])
def test_error_bodies(exc, status):
    error = ApiError.from_exception(exc)
    body = error.body()["error"]
    assert error.status == status and set(body) == {"message", "type", "param", "code"}
    assert "secret" not in body["message"]
    if status == 400:
        assert body["param"] == "seed"  # the HTTP field name, not the internal one


def test_usage_chunk_has_no_choices():
    for kind in ("chat", "text"):
        chunk = chunk_body(kind, "id", "m", "fp_x", 0, None, with_usage_field=True, usage_value={"total_tokens": 3})
        assert chunk["choices"] == [] and chunk["usage"] == {"total_tokens": 3}
        assert "usage" not in chunk_body(kind, "id", "m", "fp_x", 0, {"content": "x", "text": "x"})


def test_dead_replica_is_a_retryable_503():
    from ray.exceptions import ActorDiedError

    error = ApiError.from_exception(ActorDiedError())
    assert error.status == 503 and error.body()["error"]["code"] == "replica_unavailable"


# --- issue 43: every field OpenAI's chat API defines -------------------------------------------------

def _openai_fields(typed_dict) -> set[str]:
    """The keys of one of the openai package's request TypedDicts (and its bases)."""
    return {key for cls in typed_dict.__mro__ for key in getattr(cls, "__annotations__", {})}


def test_every_field_of_the_openai_clients_chat_request_is_known():
    """The installed `openai` package's own request types: every parameter, every message and content-part field."""
    from openai.types.chat import completion_create_params as params
    from openai.types.chat import (chat_completion_assistant_message_param as assistant,
                                   chat_completion_content_part_image_param as image,
                                   chat_completion_content_part_text_param as text)

    from raypipe.serve.openai.schemas import ChatCompletionRequest, ImageURL, ImageURLPart, Message, TextPart

    for typed_dict, model in ((params.CompletionCreateParamsBase, ChatCompletionRequest),
                              (assistant.ChatCompletionAssistantMessageParam, Message),
                              (image.ChatCompletionContentPartImageParam, ImageURLPart),
                              (image.ImageURL, ImageURL), (text.ChatCompletionContentPartTextParam, TextPart)):
        assert _openai_fields(typed_dict) <= set(model.model_fields), (model, _openai_fields(typed_dict) - set(
            model.model_fields))


NO_EFFECT = {"metadata": {"team": "a"}, "store": True, "service_tier": "flex", "user": "u1", "safety_identifier": "s",
             "prompt_cache_key": "k", "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "implicit"},
             "modalities": ["text"], "verbosity": "low", "prediction": {"type": "content", "content": "hi"},
             "web_search_options": {"search_context_size": "low"}, "parallel_tool_calls": True,
             "stream_options": {"include_obfuscation": False}}


def test_fields_with_no_effect_change_nothing():
    plain, loaded = parse_request(body()), parse_request(body(**NO_EFFECT))
    assert sampling_params(loaded, 9) == sampling_params(plain, 9)
    assert loaded.messages_for_template() == plain.messages_for_template()
    assert loaded.template_kwargs(True) == plain.template_kwargs(True) is None
    assert (loaded.tool_names(), loaded.forced_tools()) == (plain.tool_names(), plain.forced_tools()) == (None, None)


def test_reasoning_effort_switches_thinking_where_the_model_has_a_switch():
    for effort, off in (("none", True), ("minimal", True), ("low", False), ("high", False), ("max", False)):
        request = parse_request(body(reasoning_effort=effort))
        assert request.template_kwargs(True) == ({"enable_thinking": False} if off else None), effort
        assert request.template_kwargs(False) is None  # no switch: no effect
    explicit = parse_request(body(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}))
    assert explicit.template_kwargs(True) == {"enable_thinking": True}  # the explicit switch wins


def test_legacy_functions_are_tools():
    function = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    modern = parse_request(body(tools=[{"type": "function", "function": function}],
                                tool_choice={"type": "function", "function": {"name": "add"}}))
    legacy = parse_request(body(functions=[function], function_call={"name": "add"}))
    assert legacy.legacy_functions and not modern.legacy_functions
    assert legacy.template_tools() == modern.template_tools()
    assert legacy.forced_tools() == modern.forced_tools() and legacy.tool_names() == {"add"}
    assert parse_request(body(functions=[function], function_call="none")).tool_names() is None
    # A legacy call in history (and a `function` turn answering it) renders as a tool call and a tool turn.
    history = parse_request(body(messages=[
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": None, "function_call": {"name": "add", "arguments": '{"a": 1}'}},
        {"role": "function", "name": "add", "content": "3"}]))
    turns = history.messages_for_template()
    assert turns[1]["tool_calls"] == [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]
    assert turns[2]["role"] == "tool"


def test_an_assistant_turn_the_sdk_sends_back_is_accepted():
    """`resp.choices[0].message` appended as is: `reasoning_content` (this server's and vLLM's name) or `reasoning`
    (vLLM >= 0.10), `refusal`, `annotations`; the reasoning reaches the template as `reasoning_content`."""
    for name in ("reasoning_content", "reasoning"):
        request = parse_request(body(messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", name: "greet back", "refusal": None, "annotations": []},
            {"role": "user", "content": "again"}]))
        assert request.messages_for_template()[1] == {"role": "assistant", "content": "hello",
                                                      "reasoning_content": "greet back"}


@pytest.mark.parametrize("fields, param", [
    ({"temprature": 0.5}, "temprature"),  # in neither API
    ({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}]},
     "messages[0].content[0]"),
    ({"audio": {"format": "wav", "voice": "alloy"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"messages": [{"role": "assistant", "content": None, "audio": {"id": "a1"}}]}, "messages[0].audio"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ({"tools": [{"type": "custom", "custom": {"name": "sql"}}]}, "tools[0]"),
    ({"tools": [_tool()], "functions": [{"name": "sub"}]}, "functions"),
    ({"tools": [_tool()], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "sub"}}]}}},
     "tool_choice.allowed_tools.tools[0].function.name"),
])
def test_what_cannot_be_honoured_is_refused_by_name(fields, param):
    with pytest.raises(InvalidInput) as info:
        parse_request(body(**fields))
    assert info.value.item == param and info.value.code in ("unsupported_parameter", "unrecognized_argument",
                                                            "invalid_value")
    assert param.split(".")[-1].split("[")[0] in str(info.value) or info.value.code == "unsupported_parameter"


def test_allowed_tools_narrow_the_tools():
    tools = [_tool("add"), _tool("sub")]
    choice = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "sub"}}]}}
    request = parse_request(body(tools=tools, tool_choice=choice))
    assert request.tool_names() == {"sub"} and set(request.forced_tools()) == {"sub"}
    choice["allowed_tools"]["mode"] = "auto"
    request = parse_request(body(tools=tools, tool_choice=choice))
    assert request.tool_names() == {"sub"} and request.forced_tools() is None


def test_low_detail_images_are_read_at_the_low_detail_size(tiny_ckpt):
    """`detail: "low"` shrinks the image (aspect kept) to `ImageLimits.low_detail_pixels` before the model's own
    processor: the same tokens as the image shrunk by PIL beforehand and sent at "auto"; other details unchanged."""
    import base64
    import io

    import numpy as np
    from PIL import Image
    from transformers import AutoTokenizer

    from raypipe.inputs.images import ImageLimits
    from raypipe.models.prompt import build_prompt
    from raypipe.models.registry import vision_adapter

    def url(image: Image.Image) -> str:
        out = io.BytesIO()
        image.save(out, "PNG")
        return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()

    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (224, 448, 3), dtype=np.uint8))
    limits = ImageLimits(low_detail_pixels=112 * 56)  # below the tiny preset's own pixel budget, so it shows
    tokenizer, vision = AutoTokenizer.from_pretrained(tiny_ckpt), vision_adapter(tiny_ckpt)

    def prompt(source: Image.Image, detail: str):
        request = parse_request(body(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url(source), "detail": detail}}]}]))
        return build_prompt(request.messages_for_template(), tokenizer, vision, limits)

    low, auto, high = (prompt(image, detail) for detail in ("low", "auto", "high"))
    shrunk = prompt(image.resize((112, 56), Image.Resampling.BICUBIC), "auto")
    assert low.prompt_token_ids == shrunk.prompt_token_ids and low.visual_grids == shrunk.visual_grids
    assert len(low.prompt_token_ids) < len(auto.prompt_token_ids) == len(high.prompt_token_ids)
    assert low.visuals[0].content_hash == shrunk.visuals[0].content_hash != auto.visuals[0].content_hash


class _Deltas:
    """A decoder stream stand-in: the given texts, one token each, the last cut by `max_tokens`."""

    def __init__(self, texts: list[str], finish: str):
        from raypipe.decode.sequence import RequestDelta

        self.items = [RequestDelta("r", [k], text, finish if k == len(texts) - 1 else None)
                      for k, text in enumerate(texts)]

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    def cancel(self):
        self.items = []


def test_calls_cut_by_max_tokens_keep_the_finished_ones_only():
    """tool_choice "required" with parallel calls, cut inside the last call: the finished calls come back as calls,
    whole and streamed; the unfinished one is not returned as `<tool_call>` text in content."""
    import asyncio

    from raypipe.serve.metrics import ServeMetrics
    from raypipe.serve.streaming import CompletionStream

    call = '<tool_call>\n{"name": "add", "arguments": {"a": %d}}\n</tool_call>'
    texts = [call % 1, "\n", call % 2, "\n", '<tool_call>\n{"name": "add", "argu']

    async def run(streaming: bool):
        stream = CompletionStream("chat", "id", "m", "fp", [_Deltas(texts, "length")], [3], 0.0, False,
                                  tool_names={"add"})
        await stream.start()
        if not streaming:
            return (await stream.collect())["choices"][0]
        return [json.loads(line[6:]) for line in [chunk async for chunk in stream.sse(ServeMetrics(), "chat")]
                if line.startswith("data: {")]

    whole = asyncio.run(run(False))
    assert whole["message"]["content"] is None and whole["finish_reason"] == "length"
    assert [json.loads(c["function"]["arguments"]) for c in whole["message"]["tool_calls"]] == [{"a": 1}, {"a": 2}]
    chunks = [chunk["choices"][0] for chunk in asyncio.run(run(True))]
    assert "".join(c["delta"].get("content") or "" for c in chunks) == ""
    arguments = ["".join(d["function"]["arguments"] for c in chunks for d in c["delta"].get("tool_calls", [])
                         if d["index"] == k) for k in range(2)]
    assert [json.loads(a) for a in arguments] == [{"a": 1}, {"a": 2}] and chunks[-1]["finish_reason"] == "length"
