"""The OpenAI endpoint serving the Step3 preset: the official `openai` client gets transformers'
own greedy answer (images sent as data: URLs). One encoder worker: views sharded over several are
`test_step3_encode`'s (1, 2 and 3 workers); each extra worker adds seconds to the app's start-up."""

from __future__ import annotations

import openai
import pytest

from raypipe.inputs.images import load_image
from raypipe.models.prompt import build_prompt
from raypipe.models.registry import vision_adapter
from tests import step3_reference as ref
from tests.conftest import random_images
from tests.test_serve_api import data_url, png_bytes

# The Serve path is every family's; Step3's own outputs are test_step3_*'s, in `make test`
pytestmark = pytest.mark.extended

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(serve_app, step3_ckpt):
    from raypipe.serve.app import build_app

    return serve_app(build_app({"model": "tiny-step3", "num_encoders": 1, "batch_window_s": 0.02,
                                "engine": {"max_model_len": 1024, "max_num_seqs": 4}}), "raypipe-step3-test")


def test_openai_client_gets_transformers_greedy_answer(server, step3_ckpt, step3_hf_model):
    images = random_images([(300, 200), (60, 500)], seed=7)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Compare"}]
                 + [{"type": "image_url", "image_url": {"url": data_url(png_bytes(image))}} for image in images]
                 + [{"type": "text", "text": "briefly."}]}]
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)
    reply = client.chat.completions.create(model="tiny-step3", messages=messages, max_tokens=MAX_TOKENS,
                                           temperature=0)

    tokenizer = ref.processor(step3_ckpt).tokenizer
    prompt = build_prompt(messages, tokenizer, vision_adapter(step3_ckpt))
    decoded = [load_image(image).pixels for image in prompt.visuals]
    want = ref.generate(step3_hf_model, prompt.prompt_token_ids,
                        ref.image_features(step3_hf_model, step3_ckpt, decoded), MAX_TOKENS)
    eos = step3_hf_model.generation_config.eos_token_id
    want = want[: want.index(eos) + 1] if eos in want else want
    assert reply.usage.prompt_tokens == len(prompt.prompt_token_ids)
    assert reply.usage.completion_tokens == len(want)
    assert reply.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)
