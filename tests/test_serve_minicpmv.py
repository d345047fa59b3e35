"""The OpenAI-compatible endpoint serving the MiniCPM-V preset (sliced image, hybrid language model),
driven by the official `openai` client; transformers' own generate() is the reference."""

from __future__ import annotations

import openai
import pytest

from raypipe.models.prompt import build_prompt
from raypipe.models.registry import language_adapter, vision_adapter
from tests import minicpmv_reference as ref
from tests.conftest import random_images
from tests.test_serve_api import free_port, image_url, user

KEY = "test-key"
MAX_NEW = 12


@pytest.fixture(scope="module")
def server(ray_local, minicpmv_ckpt):
    from ray import serve

    from raypipe.serve.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"model": str(minicpmv_ckpt), "served_model_name": "tiny-minicpmv", "api_key": KEY,
                         "engine": {"max_model_len": 1024, "max_num_seqs": 4}}), name="raypipe-minicpmv", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def test_streams_the_same_text_as_transformers(server, minicpmv_ckpt):
    from PIL import Image
    from transformers import MiniCPMV4_6ForConditionalGeneration

    messages = user("Describe:", image_url(300, 500, seed=3), "briefly.")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)
    stream = client.chat.completions.create(model="tiny-minicpmv", messages=messages, max_tokens=MAX_NEW,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    # The reference: the same prompt (the processor's, see test_minicpmv_encode) through transformers.
    lang = language_adapter(minicpmv_ckpt)
    image = random_images([(300, 500)], seed=3)[0]
    parts = [{"type": "text", "text": "Describe:"}, {"type": "image", "image": Image.fromarray(image)},
             {"type": "text", "text": "briefly."}]
    prompt = build_prompt([{"role": "user", "content": parts}], lang.tokenizer, vision_adapter(minicpmv_ckpt))
    hf = MiniCPMV4_6ForConditionalGeneration.from_pretrained(minicpmv_ckpt).eval()
    want = ref.hf_generate(hf, prompt.prompt_token_ids, ref.image_embeddings(hf, minicpmv_ckpt, [image]), MAX_NEW)
    eos = lang.eos_token_ids[0]
    want = want[: want.index(eos) + 1] if eos in want else want
    assert text == lang.tokenizer.decode(want, skip_special_tokens=True)
    usage = chunks[-1].usage
    assert usage.prompt_tokens == len(prompt.prompt_token_ids) and usage.completion_tokens == len(want)
