"""The OpenAI endpoint serving the Qwen3.5 preset to the official `openai` client: the answer to images
sent as data: URLs is transformers' own greedy answer, split into `reasoning_content` and `content` as
vLLM's `qwen3` parser rule splits the same tokens, whole and streamed as deltas; with
`chat_template_kwargs: {"enable_thinking": false}` the prompt closes the thinking block and the whole
answer is content; an output constraint is refused while thinking and honoured without."""

from __future__ import annotations

import json

import openai
import pytest

from raypipe.models.registry import preset_checkpoint
from tests import qwen3_vl_reference as ref
from tests.conftest import random_images
from tests.test_reasoning_parser import vllm_qwen3
from tests.test_serve_api import data_url, free_port, png_bytes

MODEL = "tiny-qwen3.5"
MAX_TOKENS = 12
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(ray_local):
    from ray import serve

    from raypipe.serve.app import build_app

    preset_checkpoint(MODEL)  # written once here, not by each replica
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"model": MODEL, "num_encoders": 1, "batch_window_s": 0.02,
                         "engine": {"max_model_len": 1024, "max_num_seqs": 4}}),
              name="raypipe-qwen3-5-test", route_prefix="/")
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
    serve.shutdown()


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


def test_structured_output_needs_thinking_off(server, expected):
    messages = expected[0]
    schema = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 8}}, "required": ["color"],
              "additionalProperties": False}
    form = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as refused:
        server.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, response_format=form)
    assert refused.value.body["code"] == "constraint_with_thinking"
    reply = server.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0,
                                           response_format=form, extra_body=OFF)
    assert set(json.loads(reply.choices[0].message.content)) == {"color"}
