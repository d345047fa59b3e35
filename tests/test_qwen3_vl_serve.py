"""The OpenAI endpoint serving the Qwen3-VL MoE preset: the official `openai` client gets transformers' own
greedy answer for images and a video (sent as data: URLs), whole and streamed, and a structured output
that parses; EVS and tool calls through the same endpoint."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from raypipe.models.registry import preset_checkpoint
from raypipe.testing.sample_videos import make_video
from tests import qwen3_vl_reference as ref
from tests.conftest import random_images
from tests.test_serve_api import data_url, png_bytes

MODEL = "tiny-qwen3-vl-moe"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(serve_app):
    from raypipe.serve.app import build_app

    preset_checkpoint(MODEL)  # written once here, not by each replica
    url = serve_app(build_app({"model": MODEL, "num_encoders": 1, "batch_window_s": 0.02,
                                "engine": {"max_model_len": 2048, "max_num_seqs": 4}}), "raypipe-qwen3-vl-test")
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def expected():
    """The request's messages and transformers' greedy ids and text for them."""
    from transformers import AutoModelForImageTextToText

    ckpt = preset_checkpoint(MODEL)
    hf = AutoModelForImageTextToText.from_pretrained(ckpt).eval()
    processor = ref.hf_processor(ckpt)
    images = random_images([(100, 60), (40, 170)], seed=7)  # PNG is lossless: the images as sent
    messages = [{"role": "user", "content": [{"type": "text", "text": "Compare"}]
                 + [{"type": "image_url", "image_url": {"url": data_url(png_bytes(image))}} for image in images]
                 + [{"type": "text", "text": "briefly."}]}]
    theirs = [{"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "image"},
                                           {"type": "text", "text": "briefly."}]}]
    inputs = ref.hf_inputs(processor, theirs, images)
    ids = ref.hf_generate(hf, inputs, MAX_TOKENS, hf.generation_config.eos_token_id)
    return messages, len(inputs["input_ids"][0]), ids, processor.tokenizer.decode(ids, skip_special_tokens=True)


def test_openai_client_gets_transformers_greedy_answer(server, expected):
    messages, prompt_tokens, ids, text = expected
    reply = server.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert reply.usage.prompt_tokens == prompt_tokens
    assert reply.usage.completion_tokens == len(ids)
    assert reply.choices[0].message.content == text


def test_streamed_answer_is_the_same(server, expected):
    messages, _, _, text = expected
    stream = server.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == text


def test_structured_output_parses(server, expected):
    messages = expected[0]
    schema = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 8}}, "required": ["color"],
              "additionalProperties": False}
    reply = server.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert set(json.loads(reply.choices[0].message.content)) == {"color"}


def test_video_answer_is_transformers_greedy(server):
    """A video as a data: URL: sampled, timestamped and encoded by the endpoint; transformers generates from the
    same decoded frames (decoded here by raypipe's reader, which `test_qwen3_vl_video` checks) and prompt."""
    from transformers import AutoModelForImageTextToText

    from raypipe.models.prompt import build_prompt
    from raypipe.models.qwen2_5_vl.video import process_video
    from raypipe.models.registry import vision_adapter

    video = make_video(random_images([(64, 96)] * 12, seed=3), fps=4)
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": data_url(video, "video/mp4")}},
                                             {"type": "text", "text": "What happens?"}]}]
    reply = server.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)

    ckpt = preset_checkpoint(MODEL)
    hf = AutoModelForImageTextToText.from_pretrained(ckpt).eval()
    tokenizer = ref.hf_processor(ckpt).tokenizer
    vision = vision_adapter(ckpt)
    prompt = build_prompt(messages, tokenizer, vision)
    rows, grid = process_video(prompt.visuals[0].pixels, vision.video_config)
    ids = torch.tensor([prompt.prompt_token_ids])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values_videos": rows,
              "video_grid_thw": torch.tensor([grid]), "mm_token_type_ids": 2 * (ids == hf.config.video_token_id).int()}
    want = ref.hf_generate(hf, inputs, MAX_TOKENS, hf.generation_config.eos_token_id)
    assert reply.usage.prompt_tokens == ids.shape[1]
    assert reply.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)


def test_video_pruning_rate_shrinks_the_prompt_by_the_planned_count(server):
    """`mm_processor_kwargs.video_pruning_rate`: the prompt loses exactly the video tokens vLLM's rule drops
    (`max(per_group, int(total * (1 - rate)))` kept; timestamps and vision start/end stay)."""
    from raypipe.models.prompt import build_prompt
    from raypipe.models.registry import vision_adapter

    video = make_video(random_images([(64, 96)] * 16, seed=4), fps=4)
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": data_url(video, "video/mp4")}},
                                             {"type": "text", "text": "What happens?"}]}]
    plain = server.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    pruned = server.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                            extra_body={"mm_processor_kwargs": {"video_pruning_rate": 0.6}})
    ckpt = preset_checkpoint(MODEL)
    vision = vision_adapter(ckpt)
    grid = vision.make_item(build_prompt(messages, ref.hf_processor(ckpt).tokenizer, vision).visuals[0]).grid
    total = grid[0] * grid[1] * grid[2] // vision.merge**2
    saved = total - max(total // grid[0], int(total * (1 - 0.6)))
    assert grid[0] > 1 and saved > 0
    assert pruned.usage.prompt_tokens == plain.usage.prompt_tokens - saved
    assert pruned.usage.completion_tokens >= 1


def test_forced_tool_calls_follow_the_schemas_whole_and_streamed(server):
    """Tools through the Qwen3-VL endpoint (an image in the request), as `test_serve_api` checks them for Qwen2.5-VL."""
    from tests.test_serve_api import ADD, WEATHER, check_forced_tool_calls

    image = random_images([(64, 64)], seed=9)[0]
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png_bytes(image))}},
                                             {"type": "text", "text": "Weather in Paris?"}]}]
    check_forced_tool_calls(server, "get_weather", model=MODEL, messages=messages, tools=[WEATHER, ADD],
                            max_tokens=120, temperature=0, parallel_tool_calls=False)
