"""The OpenAI endpoint serving the LLaVA-OneVision preset: the official `openai` client gets transformers'
own greedy answer (images sent as data: URLs). One encoder worker: sharding over several is
`test_llava_ov_encode`'s; each extra worker adds seconds to the Serve start-up."""

from __future__ import annotations

import openai
import pytest

from raypipe.inputs.images import load_image
from raypipe.models.prompt import build_prompt
from raypipe.models.registry import language_adapter, vision_adapter
from tests import llava_ov_reference as ref
from tests.conftest import random_images
from tests.test_serve_api import data_url, free_port, png_bytes

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(ray_local, llava_ckpt):
    from ray import serve

    from raypipe.serve.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"model": "tiny-llava-ov", "num_encoders": 1, "batch_window_s": 0.02,
                         "engine": {"max_model_len": 1024, "max_num_seqs": 4}}),
              name="raypipe-llava-ov-test", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


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
    decoded = [load_image(image).pixels for image in prompt.visuals]
    want = ref.generate(llava_hf_model, prompt.prompt_token_ids,
                        ref.image_features(llava_hf_model, llava_ckpt, decoded), MAX_TOKENS)
    eos = llava_hf_model.generation_config.eos_token_id
    want = want[: want.index(eos) + 1] if eos in want else want
    assert reply.usage.prompt_tokens == len(prompt.prompt_token_ids)
    assert reply.usage.completion_tokens == len(want)
    assert reply.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)
