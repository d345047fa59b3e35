"""MiniCPM-V 4.6 with videos in the engine (hybrid gated-delta-net / attention LM, its per-layer cache kinds):
greedy == transformers' `generate()` token for token, K=1 and K=8, alone and with staggered joins.

transformers' side is its own processor (prompt ids, pixel values of images and videos; torchvision's two
kernels stood in for, see minicpmv_video_reference) and its own model end to end; raypipe's side is its
prompt builder, its frame pieces through its vision tower, and the engine.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from raypipe import SamplingParams
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.models.prompt import VideoOptions, build_prompt
from raypipe.models.registry import vision_adapter
from tests import minicpmv_reference as ref
from tests import minicpmv_video_reference as vref
from tests.conftest import random_images

MAX_NEW = 16
FRAMES_FPS = 2.0  # a frames list is a video at this rate (`load_video`'s default)
# Each request: its visual items in prompt order, ("video", frames, height, width) or ("image", h, w).
REQUESTS = [
    [("video", 5, 64, 96)],  # 2.5 s: main frames and canvases
    [("image", 300, 500), ("video", 1, 96, 64)],  # 0.5 s
    [("video", 6, 48, 64), ("image", 60, 50), ("video", 19, 40, 40)],  # the second video is above the 8 s cap
    [("video", 3, 240, 320)],  # sliced frames and canvases
]


@pytest.fixture(scope="module")
def engines(minicpmv_ckpt):
    made = {}

    def get(k: int) -> LLMEngine:
        if k not in made:
            made[k] = LLMEngine(minicpmv_ckpt, EngineConfig(max_num_seqs=8, max_model_len=1024, num_scheduler_steps=k))
        return made[k]

    yield get
    for engine in made.values():
        engine.shutdown()


def _parts(spec, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    parts = []
    for kind, *shape in spec:
        if kind == "image":
            parts.append({"type": "image", "image": random_images([tuple(shape)], seed=seed + len(parts))[0]})
        else:
            frames = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
            parts.append({"type": "video", "video": list(frames)})
    return parts + [{"type": "text", "text": "What happens here?"}]


def _hf_inputs(processor, parts) -> dict:
    """transformers' processor on the same chat, images and source frames: ids and pixel values."""
    template = [{"type": p["type"]} if p["type"] != "text" else p for p in parts]
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": template}],
                                                   add_generation_prompt=True, tokenize=False)
    images = [p["image"] for p in parts if p["type"] == "image"]
    videos = [np.stack(p["video"]) for p in parts if p["type"] == "video"]
    return processor(text=[text], images=images or None, videos=videos,
                     video_metadata=[vref.metadata(v, FRAMES_FPS) for v in videos], return_tensors="pt")


def _hf_generate(hf_model, inputs, eos: int) -> list[int]:
    names = ("pixel_values", "target_sizes", "pixel_values_videos", "target_sizes_videos")
    with torch.no_grad():
        out = hf_model.generate(inputs["input_ids"], attention_mask=inputs["attention_mask"], max_new_tokens=MAX_NEW,
                                do_sample=False, **{n: inputs[n] for n in names if n in inputs})
    tokens = out[0, inputs["input_ids"].shape[1]:].tolist()
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.fixture(scope="module")
def cases(minicpmv_video_reference, minicpmv_ckpt, engines):
    from transformers import MiniCPMV4_6ForConditionalGeneration

    hf_model = MiniCPMV4_6ForConditionalGeneration.from_pretrained(minicpmv_ckpt).eval()
    engine = engines(1)
    vision = vision_adapter(minicpmv_ckpt)
    tower = vision.load_tower(torch.device("cpu"), torch.float32)
    processor = ref.processor(minicpmv_ckpt)
    out = []
    for i, spec in enumerate(REQUESTS):
        parts = _parts(spec, seed=i)
        prompt = build_prompt([{"role": "user", "content": parts}], engine.tokenizer, vision, video=VideoOptions())
        inputs = _hf_inputs(processor, parts)
        assert prompt.prompt_token_ids == inputs["input_ids"][0].tolist()
        embeds = [torch.cat(tower.encode(vision.units(vision.make_item(v)))) for v in prompt.visuals]
        out.append((prompt, embeds, _hf_generate(hf_model, inputs, engine.adapter.eos_token_ids[0])))
    assert len({tuple(want) for _, _, want in out}) == len(out)  # the oracle tells the requests apart
    return out


@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize("case", range(len(REQUESTS)), ids=["video", "image-short-video", "two-videos-image",
                                                             "sliced-video"])
def test_video_request_matches_generate(engines, cases, k, case):
    prompt, embeds, want = cases[case]
    out = asyncio.run(engines(k).generate_output(f"mvideo-{k}-{case}", prompt, embeds,
                                                 SamplingParams(max_tokens=MAX_NEW)))
    assert out.token_ids == want
    assert out.num_image_tokens == prompt.num_image_tokens


@pytest.mark.parametrize("k", [1, 8])
def test_staggered_video_requests_join_a_running_batch(engines, cases, k):
    engine = engines(k)
    max_tokens = [MAX_NEW, 5, 11, MAX_NEW]

    async def one(i):
        await asyncio.sleep(0.01 * i)
        prompt, embeds, _ = cases[i]
        return await engine.generate_output(f"mstagger-{k}-{i}", prompt, embeds,
                                            SamplingParams(max_tokens=max_tokens[i]))

    async def main():
        return await asyncio.gather(*(one(i) for i in range(len(cases))))

    for (_, _, want), limit, out in zip(cases, max_tokens, asyncio.run(main())):
        assert out.token_ids == want[:limit]
