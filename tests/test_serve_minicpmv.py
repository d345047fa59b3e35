"""MiniCPM-V 4.6 through the OpenAI endpoint (official `openai` client, streamed) for a sliced image and for a
video (`video_url`); its batch job over video files is tests/test_batch.py's MiniCPM-V job. One app for the
image and the video requests; each answer against transformers' own processor and generate() (the video on
every frame of the same encoded file)."""

from __future__ import annotations

import io

import av
import numpy as np
import openai
import pytest
import torch

from raypipe.models.prompt import build_prompt
from raypipe.models.registry import language_adapter, vision_adapter
from raypipe.testing.sample_videos import make_video
from tests import minicpmv_reference as ref
from tests import minicpmv_video_reference as vref
from tests.conftest import random_images
from tests.test_serve_api import data_url, image_url, user

KEY = "test-key"
MAX_NEW = 12


def _encoded(seconds: float, fps: int, height: int, width: int, seed: int, container: str = "mp4") -> bytes:
    frames = np.random.default_rng(seed).integers(0, 256, (round(seconds * fps), height, width, 3), dtype=np.uint8)
    codec = {"mp4": "libx264", "webm": "libvpx-vp9"}[container]
    return make_video(list(frames), fps=fps, codec=codec, container=container)


def _all_frames(data: bytes) -> tuple[np.ndarray, float]:
    """Every frame, decoded by the same decoder, and the stream's rate: what transformers' pyav reader gives."""
    with av.open(io.BytesIO(data)) as container:
        fps = float(container.streams.video[0].average_rate)
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]), fps


@pytest.fixture(scope="module")
def hf_minicpmv(minicpmv_ckpt):
    from transformers import MiniCPMV4_6ForConditionalGeneration

    return MiniCPMV4_6ForConditionalGeneration.from_pretrained(minicpmv_ckpt).eval()


@pytest.fixture(scope="module")
def server(serve_app, minicpmv_ckpt):
    from raypipe.serve.app import build_app

    return serve_app(build_app({"model": str(minicpmv_ckpt), "served_model_name": "tiny-minicpmv", "api_key": KEY,
                                "num_encoders": 1, "engine": {"max_model_len": 1024, "max_num_seqs": 4}}),
                     "raypipe-minicpmv")


def test_streams_the_same_text_as_transformers(server, minicpmv_ckpt, hf_minicpmv):
    from PIL import Image

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
    want = ref.hf_generate(hf_minicpmv, prompt.prompt_token_ids, ref.image_embeddings(hf_minicpmv, minicpmv_ckpt, [image]),
                           MAX_NEW)
    eos = lang.eos_token_ids[0]
    want = want[: want.index(eos) + 1] if eos in want else want
    assert text == lang.tokenizer.decode(want, skip_special_tokens=True)
    usage = chunks[-1].usage
    assert usage.prompt_tokens == len(prompt.prompt_token_ids) and usage.completion_tokens == len(want)


def test_video_url_streams_the_same_text_as_transformers(minicpmv_video_reference, server, minicpmv_ckpt, hf_minicpmv):
    data = _encoded(2.5, 10, 96, 128, seed=3)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Describe:"},
                                             {"type": "video_url", "video_url": {"url": data_url(data, "video/mp4")}}]}]
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)
    stream = client.chat.completions.create(model="tiny-minicpmv", messages=messages, max_tokens=MAX_NEW,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    processor = ref.processor(minicpmv_ckpt)
    frames, fps = _all_frames(data)
    chat = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "Describe:"}, {"type": "video"}]}],
        add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[chat], videos=[frames], video_metadata=[vref.metadata(frames, fps)], return_tensors="pt")
    with torch.no_grad():
        out = hf_minicpmv.generate(inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                   pixel_values_videos=inputs["pixel_values_videos"],
                                   target_sizes_videos=inputs["target_sizes_videos"], max_new_tokens=MAX_NEW,
                                   do_sample=False)
    want = out[0, inputs["input_ids"].shape[1]:].tolist()
    eos = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    want = want[: want.index(eos) + 1] if eos in want else want
    assert text == processor.tokenizer.decode(want, skip_special_tokens=True)
    usage = chunks[-1].usage
    assert usage.prompt_tokens == inputs["input_ids"].shape[1] and usage.completion_tokens == len(want)
