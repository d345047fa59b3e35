"""The OpenAI endpoint serving the Qwen3.5 preset to the official `openai` client: the answer to images
sent as data: URLs is transformers' own greedy answer, split into `reasoning_content` and `content` as
vLLM's `qwen3` parser rule splits the same tokens, whole and streamed as deltas; with
`chat_template_kwargs: {"enable_thinking": false}` the prompt closes the thinking block and the whole
answer is content; an output constraint (schema, choice, forced tool call) applies to the answer after the
thinking block, or with thinking off to the whole answer."""

from __future__ import annotations

import json

import openai
import pytest

from raypipe.models.registry import preset_checkpoint
from tests import qwen3_vl_reference as ref
from tests.conftest import random_images
from tests.test_reasoning_parser import vllm_qwen3
from tests.test_serve_api import data_url, png_bytes

MODEL = "tiny-qwen3.5"
MAX_TOKENS = 12
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(serve_app):
    from raypipe.serve.app import build_app

    preset_checkpoint(MODEL)  # written once here, not by each replica
    url = serve_app(build_app({"model": MODEL, "num_encoders": 1, "batch_window_s": 0.02,
                                "engine": {"max_model_len": 1024, "max_num_seqs": 4}}), "raypipe-qwen3-5-test")
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


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
