"""The OpenAI endpoint serving the Qwen3.5 preset to the official `openai` client: the answer to images
sent as data: URLs is transformers' own greedy answer, split into `reasoning_content` and `content` as
vLLM's `qwen3` parser rule splits the same tokens, whole and streamed as deltas; with
`chat_template_kwargs: {"enable_thinking": false}` the prompt closes the thinking block and the whole
answer is content; an output constraint (schema, choice, forced tool call) applies to the answer after the
thinking block, or with thinking off to the whole answer. The `model` field may name a LoRA adapter
(`engine.lora_modules`): its answer is PEFT's greedy answer, `/v1/models` lists it under its base model, and
an unknown name is a 404 naming it. Adapters are loaded and unloaded while the app runs through vLLM's
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (behind the API key), while another request streams."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from raypipe.models.registry import preset_checkpoint
from tests import qwen3_vl_reference as ref
from tests.conftest import random_images
from raypipe.testing.lora_adapters import write_adapters
from tests.test_lora import ADAPTERS
from tests.test_reasoning_parser import vllm_qwen3
from tests.test_serve_api import data_url, png_bytes

MODEL = "tiny-qwen3.5"
MAX_TOKENS = 12
OFF = {"chat_template_kwargs": {"enable_thinking": False}}
KEY = "qwen3.5-test-key"


ADAPTER = "blue"  # tests.test_lora's adapter on every linear of the language model


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """The adapter's folder, written by PEFT."""
    return write_adapters(preset_checkpoint(MODEL), tmp_path_factory.mktemp("lora"), {ADAPTER: ADAPTERS[ADAPTER]})[ADAPTER]


@pytest.fixture(scope="module")
def server(serve_app, adapter):
    from raypipe.serve.app import build_app

    preset_checkpoint(MODEL)  # written once here, not by each replica
    url = serve_app(build_app({"model": MODEL, "num_encoders": 1, "batch_window_s": 0.02, "api_key": KEY,
                                "engine": {"max_model_len": 1024, "max_num_seqs": 4,
                                           "lora_modules": {ADAPTER: str(adapter)}}}), "raypipe-qwen3-5-test")
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def expected():
    """The request's messages and, with thinking on and off, transformers' greedy text for them."""
    from transformers import AutoModelForImageTextToText

    ckpt = preset_checkpoint(MODEL)
    hf = AutoModelForImageTextToText.from_pretrained(ckpt).eval()
    processor = ref.hf_processor(ckpt)
    # PNG is lossless: the images as sent. The greedy answer writes `</think>` twice (the first one ends reasoning).
    images = random_images([(100, 60), (40, 170)], seed=1)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Describe"}]
                 + [{"type": "image_url", "image_url": {"url": data_url(png_bytes(image))}} for image in images]
                 + [{"type": "text", "text": "it."}]}]
    theirs = [{"role": "user", "content": [{"type": "text", "text": "Describe"}, {"type": "image"}, {"type": "image"},
                                           {"type": "text", "text": "it."}]}]
    texts = {}
    for on in (True, False):
        text = processor.apply_chat_template(theirs, add_generation_prompt=True, tokenize=False, enable_thinking=on)
        inputs = dict(processor(text=[text], images=images, return_tensors="pt"))
        ids = ref.hf_generate(hf, inputs, MAX_TOKENS, hf.generation_config.eos_token_id)
        texts[on] = processor.tokenizer.decode(ids, skip_special_tokens=True)
    return messages, texts


def test_reasoning_and_content_split_as_the_qwen3_parser_rule(server, expected):
    messages, texts = expected
    reasoning, content = vllm_qwen3(texts[True], True)
    assert reasoning and "</think>" in content  # the greedy answer thinks, closes the block, answers (see above)
    message = server.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                             temperature=0).choices[0].message
    assert (message.model_extra.get("reasoning_content"), message.content) == (reasoning, content)


def test_streamed_deltas_split_the_same(server, expected):
    messages, texts = expected
    stream = server.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    reasoning = "".join(delta.model_extra.get("reasoning_content") or "" for delta in deltas)
    content = "".join(delta.content or "" for delta in deltas)
    assert (reasoning or None, content or None) == vllm_qwen3(texts[True], True)


def test_thinking_switched_off_answers_in_content(server, expected):
    messages, texts = expected
    assert texts[False] != texts[True]
    message = server.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                             extra_body=OFF).choices[0].message
    assert message.content == texts[False] and message.model_extra.get("reasoning_content") is None


SCHEMA = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 8}}, "required": ["color"],
          "additionalProperties": False}
FORM = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}


def test_structured_output_applies_to_the_answer_after_thinking(server, expected):
    """Greedy: the reasoning is the model's own up to its `</think>` (the grammar leaves the block free), the content
    after it follows the schema; streamed the same; with thinking off the whole answer is the JSON."""
    messages, texts = expected
    reply = server.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0,
                                           response_format=FORM).choices[0]
    reasoning = reply.message.model_extra.get("reasoning_content")
    assert reasoning == vllm_qwen3(texts[True], True)[0] and reply.finish_reason == "stop"
    assert set(json.loads(reply.message.content)) == {"color"} and len(json.loads(reply.message.content)["color"]) <= 8
    stream = server.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0,
                                            response_format=FORM, stream=True)
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == reply.message.content
    off = server.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0,
                                         response_format=FORM, extra_body=OFF).choices[0].message
    assert set(json.loads(off.content)) == {"color"} and off.model_extra.get("reasoning_content") is None


def test_choice_and_forced_tool_call_after_thinking(server, expected):
    messages, texts = expected
    reasoning = vllm_qwen3(texts[True], True)[0]
    choice = server.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0,
                                            extra_body={"guided_choice": ["red", "blue"]}).choices[0].message
    assert choice.content in ("red", "blue") and choice.model_extra.get("reasoning_content") == reasoning
    tool = {"type": "function", "function": {"name": "paint", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}}}
    called = server.chat.completions.create(model=MODEL, messages=messages, max_tokens=96, temperature=0, tools=[tool],
                                            tool_choice={"type": "function", "function": {"name": "paint"}}).choices[0]
    assert called.finish_reason == "tool_calls" and called.message.model_extra.get("reasoning_content") == reasoning
    assert [c.function.name for c in called.message.tool_calls] == ["paint"]
    assert set(json.loads(called.message.tool_calls[0].function.arguments)) == {"n"}


def test_max_tokens_inside_the_thinking_block_leaves_no_content(server, expected):
    """Cut before `</think>`: all reasoning, finish_reason "length", no content (as vLLM)."""
    reply = server.chat.completions.create(model=MODEL, messages=expected[0], max_tokens=2, temperature=0,
                                           response_format=FORM).choices[0]
    assert reply.finish_reason == "length" and reply.message.content is None
    assert reply.message.model_extra.get("reasoning_content")


# --- issue 43: what the SDK sends back, OpenAI's other fields -------------------------------------------

def _chat_loop(server, stream: bool) -> list[tuple]:
    """The SDK's multi-turn loop: each reply's message appended as it came (streamed: the deltas gathered into
    one, as clients do), then the next question. (reasoning, content, prompt tokens) per turn."""
    messages, turns = [{"role": "user", "content": "Describe a cat."}], []
    for turn in range(3):
        kwargs = dict(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        if stream:
            chunks = list(server.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
            deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
            reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
            message = {"role": "assistant", "content": "".join(d.content or "" for d in deltas) or None,
                       "reasoning_content": reasoning or None}
            usage = chunks[-1].usage
        else:
            reply = server.chat.completions.create(**kwargs)
            message, usage = reply.choices[0].message, reply.usage
        turns.append((_field(message, "reasoning_content"), _field(message, "content"), usage.prompt_tokens))
        messages = [*messages, message, {"role": "user", "content": f"Turn {turn + 2}: and then?"}]
    return turns


def _field(message, name):
    return message.get(name) if isinstance(message, dict) else getattr(message, name, None) or (
        message.model_extra or {}).get(name)


def test_the_sdk_loop_appends_replies_with_their_reasoning(server):
    """Appending `resp.choices[0].message` (it carries `reasoning_content`) was a 400 naming it; the loop now runs,
    whole and streamed alike, and each turn's prompt holds the previous one."""
    whole, streamed = _chat_loop(server, False), _chat_loop(server, True)
    assert whole == streamed
    assert all(reasoning for reasoning, _, _ in whole)  # the turns sent back carried reasoning
    assert whole[0][2] < whole[1][2] < whole[2][2]


def test_past_reasoning_renders_where_the_template_renders_it(server):
    """After the last user turn (a tool-call loop) the template writes the assistant's reasoning as a thinking block:
    the prompt is the one transformers renders from the same messages, and differs from the one without it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(preset_checkpoint(MODEL))
    call = {"id": "call_1", "type": "function", "function": {"name": "paint", "arguments": '{"n": 3}'}}
    tool = {"type": "function", "function": {"name": "paint", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}}}}}
    counts = {}
    for reasoning in ("I should paint three.", None):
        messages = [{"role": "user", "content": "Paint."},
                    {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": reasoning},
                    {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
        reply = server.chat.completions.create(model=MODEL, messages=messages, tools=[tool], max_tokens=1,
                                               temperature=0)
        theirs = [{**m, "content": m["content"] or "", "tool_calls": [{"type": "function", "function": {
            "name": "paint", "arguments": {"n": 3}}}]} if m["role"] == "assistant" else m for m in messages]
        text = tokenizer.apply_chat_template(theirs, tools=[tool], add_generation_prompt=True, tokenize=False)
        assert (reasoning is not None) == ("I should paint three." in text)
        assert reply.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
        counts[reasoning] = reply.usage.prompt_tokens
    assert counts["I should paint three."] > counts[None]


NO_EFFECT = dict(metadata={"team": "a"}, store=True, service_tier="flex", user="u1", safety_identifier="s",
                 prompt_cache_key="k", prompt_cache_retention="24h", modalities=["text"], verbosity="low",
                 prediction={"type": "content", "content": "hi"}, web_search_options={"search_context_size": "low"},
                 reasoning_effort="high")


def test_openai_fields_with_no_effect_are_accepted_and_change_nothing(server, expected):
    messages, texts = expected
    message = server.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                             extra_body={"prompt_cache_options": {"mode": "implicit"}},
                                             **NO_EFFECT).choices[0].message
    assert (message.model_extra.get("reasoning_content"), message.content) == vllm_qwen3(texts[True], True)


def test_reasoning_effort_none_switches_thinking_off(server, expected):
    messages, texts = expected
    for effort in ("none", "minimal"):
        message = server.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                                 reasoning_effort=effort).choices[0].message
        assert message.content == texts[False] and message.model_extra.get("reasoning_content") is None


def test_misspelt_field_and_audio_are_refused_by_name(server):
    cases = [({"extra_body": {"temprature": 0.5}}, "temprature"),
             ({"messages": [{"role": "user", "content": [
                 {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]}]},
              "messages[0].content[0]"),
             ({"modalities": ["text", "audio"], "audio": {"format": "wav", "voice": "alloy"}}, "audio")]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            server.chat.completions.create(**{"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 2, **fields})
        assert refused.value.body["param"] == param, refused.value.body


def test_legacy_functions_call_a_function(server, expected):
    """`functions` + `function_call` are tools + tool_choice, answered in the legacy shape (`function_call`)."""
    messages, texts = expected
    function = {"name": "paint", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}}
    reply = server.chat.completions.create(model=MODEL, messages=messages, max_tokens=96, temperature=0,
                                           functions=[function], function_call={"name": "paint"}).choices[0]
    assert reply.finish_reason == "function_call" and reply.message.function_call.name == "paint"
    assert set(json.loads(reply.message.function_call.arguments)) == {"n"} and not reply.message.tool_calls
    stream = server.chat.completions.create(model=MODEL, messages=messages, max_tokens=96, temperature=0,
                                            functions=[function], function_call={"name": "paint"}, stream=True)
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    calls = [c.delta.function_call for c in chunks if c.delta.function_call]
    assert calls[0].name == "paint"
    assert "".join(c.arguments or "" for c in calls) == reply.message.function_call.arguments
    assert chunks[-1].finish_reason == "function_call"


DOG = [{"role": "user", "content": "Describe a dog."}]


def _greedy_texts(*adapters) -> list[str]:
    """transformers' greedy answer to DOG with thinking off: the base model's, then PEFT's with each adapter folder."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    ckpt = preset_checkpoint(MODEL)
    processor = ref.hf_processor(ckpt)
    text = processor.apply_chat_template(DOG, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    inputs = dict(processor(text=[text], return_tensors="pt"))
    eos = AutoModelForImageTextToText.from_pretrained(ckpt).generation_config.eos_token_id
    models = [AutoModelForImageTextToText.from_pretrained(ckpt).eval()]
    models += [PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(ckpt), a).eval() for a in adapters]
    return [processor.tokenizer.decode(ref.hf_generate(m, inputs, MAX_TOKENS, eos), skip_special_tokens=True)
            for m in models]


def test_model_field_names_a_lora_adapter(server, adapter):
    """vLLM's convention: `model` names the adapter; the answer is PEFT's greedy one, not the base model's."""
    messages = DOG
    base, theirs = _greedy_texts(adapter)
    assert theirs != base
    for model, want in ((ADAPTER, theirs), (MODEL, base)):
        reply = server.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                               extra_body=OFF)
        assert (reply.model, reply.choices[0].message.content) == (model, want)
    cards = {m.id: m.model_extra.get("parent") for m in server.models.list().data}
    assert cards == {MODEL: None, ADAPTER: MODEL} and server.models.retrieve(ADAPTER).model_extra["parent"] == MODEL
    with pytest.raises(openai.NotFoundError, match="'red'"):
        server.chat.completions.create(model="red", messages=messages, max_tokens=1)


def _admin(server, route: str, **body) -> str:
    """POST vLLM's adapter route through the openai client's own transport (it raises its status errors)."""
    return server.post(f"/{route}", body=body, cast_to=httpx.Response).text


@pytest.fixture(scope="module")
def red(tmp_path_factory):
    """tests.test_lora's "red" adapter, written by PEFT, its malformed copy (DoRA), and PEFT's answer to DOG."""
    folder = tmp_path_factory.mktemp("runtime-lora")
    red = write_adapters(preset_checkpoint(MODEL), folder, {"red": ADAPTERS["red"]})["red"]
    dora = folder / "dora"
    dora.mkdir()
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        (dora / name).write_bytes((red / name).read_bytes())
    (dora / "adapter_config.json").write_text(json.dumps({**json.loads((red / "adapter_config.json").read_text()),
                                                          "use_dora": True}))
    base, theirs = _greedy_texts(red)
    assert theirs != base
    return red, dora, theirs


def test_adapters_load_and_unload_while_the_app_runs(server, red):
    """vLLM's routes: a load while another request streams (that stream ends as it would have), `model=<adapter>`
    then answers as PEFT with it, /v1/models lists it; a name loaded twice, a malformed adapter (naming the field)
    and a path without one are refused; an unload while a request of the adapter streams lets it end as it would
    have, and after it the name is a 404 naming it; the key guards both routes."""
    red, dora, theirs = red
    long = dict(messages=DOG, max_tokens=48, temperature=0, extra_body={**OFF, "ignore_eos": True})

    def streamed_around(model: str, action) -> bool:
        """Whether a stream of `model`, with `action` run once it started, equals the same request answered whole."""
        whole = server.chat.completions.create(model=model, **long).choices[0].message.content
        stream = server.chat.completions.create(model=model, **long, stream=True)
        chunks = [next(stream)]  # streaming: its first delta is out
        action()
        chunks += list(stream)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole

    def load():
        assert _admin(server, "load_lora_adapter", lora_name="red", lora_path=str(red)) == \
            "Success: LoRA adapter 'red' added successfully."

    assert streamed_around(ADAPTER, load)
    reply = server.chat.completions.create(model="red", messages=DOG, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body=OFF)
    assert (reply.model, reply.choices[0].message.content) == ("red", theirs)
    assert {m.id: m.model_extra.get("parent") for m in server.models.list().data}["red"] == MODEL
    for name, path, error, where in (("red", red, openai.BadRequestError, "'red'"),  # loaded already
                                     (ADAPTER, red, openai.BadRequestError, f"'{ADAPTER}'"),  # configured at start
                                     ("dora", dora, openai.BadRequestError, "use_dora"),
                                     ("nowhere", red.parent / "nowhere", openai.NotFoundError, "nowhere")):
        with pytest.raises(error, match=where):
            _admin(server, "load_lora_adapter", lora_name=name, lora_path=str(path))
    with pytest.raises(openai.BadRequestError) as refused:
        _admin(server, "load_lora_adapter", lora_name="dora", lora_path=str(dora))
    assert refused.value.body["param"] == "lora_path.use_dora"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).post(
            "/unload_lora_adapter", body={"lora_name": "red"}, cast_to=httpx.Response)

    def unload():
        assert _admin(server, "unload_lora_adapter", lora_name="red") == \
            "Success: LoRA adapter 'red' removed successfully."

    assert streamed_around("red", unload)
    with pytest.raises(openai.NotFoundError, match="'red'"):
        server.chat.completions.create(model="red", messages=DOG, max_tokens=1)
    with pytest.raises(openai.NotFoundError, match="'red'"):
        _admin(server, "unload_lora_adapter", lora_name="red")
    assert "red" not in {m.id for m in server.models.list().data}


# --- issue 43 item 4: OpenAI's Responses API (`client.responses`) ------------------------------------------------

def _responses_input(messages: list[dict]) -> list[dict]:
    """The chat messages of `expected` as Responses input items (input_text / input_image parts)."""
    return [{"role": m["role"], "content": [
        {"type": "input_text", "text": p["text"]} if p["type"] == "text"
        else {"type": "input_image", "image_url": p["image_url"]["url"]} for p in m["content"]]} for m in messages]


def _split(response) -> tuple[str | None, str | None]:
    reasoning = [i.content[0].text for i in response.output if i.type == "reasoning"]
    return (reasoning[0] if reasoning else None), (response.output_text or None)


def test_a_response_holds_transformers_answer_as_reasoning_and_message_items(server, expected):
    """Text and images in, greedy: the reasoning item and the output text are transformers' answer split by the qwen3
    rule; streamed, the events rebuild the same items and end with the same response."""
    messages, texts = expected
    fields = dict(model=MODEL, input=_responses_input(messages), max_output_tokens=MAX_TOKENS, temperature=0)
    response = server.responses.create(**fields)
    assert _split(response) == vllm_qwen3(texts[True], True)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    chat = server.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert response.usage.output_tokens == MAX_TOKENS and response.usage.input_tokens == chat.usage.prompt_tokens
    events = list(server.responses.create(**fields, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert _split(final) == _split(response)
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == _split(response)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.model_dump(exclude={"id"}) for i in done] == [i.model_dump(exclude={"id"}) for i in response.output]


def test_previous_response_id_continues_the_stored_conversation(server):
    """Turn 2 by `previous_response_id` is the chat request with turn 1's messages and answer (its reasoning
    included): same output; `store: false` leaves nothing to continue, and an unknown id is a 404 naming it."""
    first = server.responses.create(model=MODEL, input="Name a color.", instructions="Be brief.", max_output_tokens=8,
                                    temperature=0)
    second = server.responses.create(model=MODEL, input="And another?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    reasoning, content = _split(first)
    chat = server.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "Name a color."},  # instructions are not carried over (OpenAI's rule)
        {"role": "assistant", "content": content, "reasoning_content": reasoning},
        {"role": "user", "content": "And another?"}])
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert _split(second) == (chat.choices[0].message.model_extra.get("reasoning_content"),
                              chat.choices[0].message.content)
    assert second.previous_response_id == first.id
    unstored = server.responses.create(model=MODEL, input="Hi.", max_output_tokens=2, store=False)
    for missing in (unstored.id, "resp_does_not_exist"):
        with pytest.raises(openai.NotFoundError) as refused:
            server.responses.create(model=MODEL, input="Again.", previous_response_id=missing, max_output_tokens=2)
        assert refused.value.body["param"] == "previous_response_id" and missing in refused.value.body["message"]


def test_a_function_call_round_trip(server):
    """A forced call comes back as a function_call item; its output sent as a function_call_output item continues
    the conversation exactly as the chat request with the tool turn does."""
    tool = {"type": "function", "name": "paint", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}}
    called = server.responses.create(model=MODEL, input="Paint.", tools=[tool], max_output_tokens=96, temperature=0,
                                     tool_choice={"type": "function", "name": "paint"})
    [call] = [item for item in called.output if item.type == "function_call"]
    assert call.name == "paint" and set(json.loads(call.arguments)) == {"n"} and called.status == "completed"
    answered = server.responses.create(model=MODEL, previous_response_id=called.id, tools=[tool], max_output_tokens=8,
                                       temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                              "output": "painted"}])
    chat_tool = {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
    reasoning, _ = _split(called)
    chat = server.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, tools=[chat_tool], messages=[
        {"role": "user", "content": "Paint."},
        {"role": "assistant", "content": None, "reasoning_content": reasoning, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "paint", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "painted"}])
    assert answered.usage.input_tokens == chat.usage.prompt_tokens
    assert _split(answered) == (chat.choices[0].message.model_extra.get("reasoning_content"),
                                chat.choices[0].message.content)
    # The SDK's other loop: the output items sent back as input instead of previous_response_id.
    resent = server.responses.create(model=MODEL, tools=[tool], max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": "Paint."}, *[item.model_dump(exclude_none=True) for item in called.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "painted"}])
    assert _split(resent) == _split(answered)


def test_a_json_schema_text_format_applies_to_the_answer(server, expected):
    messages, texts = expected
    response = server.responses.create(model=MODEL, input=_responses_input(messages), max_output_tokens=64,
                                       temperature=0, text={"format": {"type": "json_schema", "name": "answer",
                                                                       "schema": SCHEMA}})
    reasoning, content = _split(response)
    assert reasoning == vllm_qwen3(texts[True], True)[0] and set(json.loads(content)) == {"color"}


def test_what_responses_cannot_honour_is_refused_by_name(server):
    cases = [({"tools": [{"type": "web_search"}]}, "tools[0].type"), ({"background": True}, "background"),
             ({"truncation": "auto"}, "truncation"), ({"temprature": 0.5}, "temprature"),
             ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
             ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
             ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input[0].content[0]"),
             ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0].type"),
             # faults of the chat request written for it name the Responses field the client sent
             ({"max_output_tokens": 10**9}, "max_output_tokens"), ({"input": [{"content": "hi"}]}, "input[0].role"),
             ({"tools": [{"type": "function", "name": "f"}] * 2}, "tools[1].name"),
             ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
             ({"input": "x" * 10**5}, "input")]
    for fields, param in cases:
        body = {"input": "hi", "max_output_tokens": 2, **fields}
        with pytest.raises(openai.BadRequestError) as refused:
            server.responses.create(model=MODEL, extra_body=body)
        assert refused.value.body["param"] == param, refused.value.body


def test_a_decoder_replica_started_later_serves_an_adapter_loaded_before_it(server, red):
    """The registry, not the replica that checked the load, holds runtime adapters: the Decoder replica is killed
    after a load, and its replacement (which read only the adapters configured at start) answers `model=red` as
    PEFT does, reading the adapter when the first request names it. Last in this module: it restarts the Decoder."""
    import os
    import signal
    import time

    from ray import serve

    folder, _, theirs = red
    _admin(server, "load_lora_adapter", lora_name="red", lora_path=str(folder))  # unloaded above: loaded again
    decoder = serve.get_deployment_handle("Decoder", "raypipe-qwen3-5-test")
    old = decoder.pid.remote().result()
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 240
    while True:
        try:
            if decoder.pid.remote().result(timeout_s=30) != old:
                break
        except Exception:  # noqa: BLE001 - the replica is dead or not started yet
            pass
        assert time.monotonic() < deadline, "no new Decoder replica"
        time.sleep(0.5)
    reply = server.chat.completions.create(model="red", messages=DOG, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body=OFF)
    assert reply.choices[0].message.content == theirs
