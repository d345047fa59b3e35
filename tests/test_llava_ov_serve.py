"""The OpenAI endpoint serving the LLaVA-OneVision preset: the official `openai` client gets transformers'
own greedy answer (images sent as data: URLs). One encoder worker: sharding over several is
`test_llava_ov_encode`'s; each extra worker adds seconds to the Serve start-up."""

from __future__ import annotations

import openai
import pytest

from raypipe.models.prompt import build_prompt
from raypipe.models.registry import language_adapter, vision_adapter
from tests import llava_ov_reference as ref
from tests.conftest import random_images
from tests.test_serve_api import data_url, png_bytes

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(serve_app, llava_ckpt):
    from raypipe.serve.app import build_app

    return serve_app(build_app({"model": "tiny-llava-ov", "num_encoders": 1, "batch_window_s": 0.02,
                                "engine": {"max_model_len": 1024, "max_num_seqs": 4}}), "raypipe-llava-ov-test")


def test_openai_client_gets_transformers_greedy_answer(server, llava_ckpt, llava_hf_model):
    images = random_images([(100, 60), (40, 170)], seed=7)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Compare"}]
                 + [{"type": "image_url", "image_url": {"url": data_url(png_bytes(image))}} for image in images]
                 + [{"type": "text", "text": "briefly."}]}]
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)
    reply = client.chat.completions.create(model="tiny-llava-ov", messages=messages, max_tokens=MAX_TOKENS,
                                           temperature=0)

    tokenizer = language_adapter(llava_ckpt).tokenizer
    prompt = build_prompt(messages, tokenizer, vision_adapter(llava_ckpt))
    # PNG is lossless: the images as sent; two in one prompt, so base views only (the model's chat rule).
    want = ref.generate(llava_hf_model, prompt.prompt_token_ids,
                        ref.image_features(llava_hf_model, llava_ckpt, images), MAX_TOKENS)
    eos = llava_hf_model.generation_config.eos_token_id
    want = want[: want.index(eos) + 1] if eos in want else want
    assert reply.usage.prompt_tokens == len(prompt.prompt_token_ids)
    assert reply.usage.completion_tokens == len(want)
    assert reply.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)


def test_tile_every_image_on_request(server, llava_ckpt):
    """`mm_processor_kwargs.tile_every_image` gives both images their tiles (the processor's flat image list);
    anything but a boolean is a 400."""
    images = random_images([(100, 60), (40, 170)], seed=8)
    parts = [{"type": "image_url", "image_url": {"url": data_url(png_bytes(image))}} for image in images]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "Compare."}]}]
    text = language_adapter(llava_ckpt).tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare."}]}],
        tokenize=False, add_generation_prompt=True)
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)
    for tile in (False, True):
        reply = client.chat.completions.create(model="tiny-llava-ov", messages=messages, max_tokens=1,
                                               extra_body={"mm_processor_kwargs": {"tile_every_image": tile}})
        assert reply.usage.prompt_tokens == len(ref.prompt_ids(llava_ckpt, text, images, tile_every_image=tile))
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-llava-ov", messages=messages, max_tokens=1,
                                       extra_body={"mm_processor_kwargs": {"tile_every_image": "yes"}})
    assert err.value.status_code == 400
