"""LLaVA-OneVision videos: frames sampled and processed as `LlavaOnevisionVideoProcessor.preprocess` does, the
prompt as the processor expands `<video>`, frames sharded over two Ray workers (next to an image's tiles)
equal `get_video_features` (tower, projector, 2x2 pooling, one newline row), and greedy decoding with a
video equals transformers' `generate()` for K=1 and K=8."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from raypipe import SamplingParams
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.encode.coordinator import Coordinator
from raypipe.encode.pool import EncoderPool
from raypipe.errors import InvalidInput
from raypipe.inputs.video import VideoLimits, VideoMetadata, VideoSampling, load_video
from raypipe.models.prompt import VideoOptions, build_prompt
from raypipe.models.registry import language_adapter, vision_adapter
from tests import llava_ov_reference as ref
from tests import minicpmv_video_reference as vref
from tests.conftest import random_images

FPS = 2.0  # a frames list is a video at 2 frames per second (`frames_fps`)
MAX_NEW = 12
# (source frames, height, width, request sampling, the same as `preprocess` kwargs)
CASES = [
    (7, 40, 90, VideoSampling(), {}),  # fewer than 32 frames: every frame, as transformers keeps them
    (20, 120, 70, VideoSampling(num_frames=6), {"num_frames": 6}),
    (15, 56, 56, VideoSampling(fps=0.5), {"fps": 0.5}),  # the tower's size already: no resize
]


@pytest.fixture(scope="module")
def patched():
    with pytest.MonkeyPatch.context() as monkeypatch:
        vref.install(monkeypatch)
        yield


def _source(frames: int, height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-{c[4] or 'default'}")
def test_frames_and_tensors_equal_preprocess(patched, llava_ckpt, case):
    frames, height, width, sampling, kwargs = case
    adapter = vision_adapter(llava_ckpt)
    source = _source(frames, height, width, seed=frames)
    visual = load_video(list(source), VideoLimits(), adapter.plan_frames(sampling), frames_fps=FPS)
    want = ref.preprocess_video(llava_ckpt, source, FPS, **kwargs)["pixel_values_videos"][0]
    item = adapter.make_item(visual)
    units = adapter.units(item)
    assert item.grid == (len(want),) and len(units) == len(want)
    tower = adapter.load_tower(torch.device("cpu"), torch.float32)
    torch.testing.assert_close(tower.pixel_values(units), want, atol=1e-6, rtol=0)
    assert item.num_tokens == sum(u.num_tokens for u in units)


def test_prompt_equals_processor(patched, llava_ckpt):
    lang, vision = language_adapter(llava_ckpt), vision_adapter(llava_ckpt)
    source = _source(9, 64, 48, seed=3)
    images = random_images([(100, 60)], seed=2)
    parts = [{"type": "image", "image": images[0]}, {"type": "video", "video": list(source)},
             {"type": "text", "text": "What happens?"}]
    prompt = build_prompt([{"role": "user", "content": parts}], lang.tokenizer, vision, video=VideoOptions())
    text = lang.tokenizer.apply_chat_template([{"role": "user", "content": [
        {"type": p["type"]} if p["type"] != "text" else p for p in parts]}], add_generation_prompt=True, tokenize=False)
    want = ref.prompt_ids(llava_ckpt, text, images, [ref.preprocess_video(llava_ckpt, source, FPS)])
    assert prompt.prompt_token_ids == want
    assert sum(n for layout in prompt.visual_layouts for n in lang.prompt_runs(layout)) == prompt.num_image_tokens


def test_refusals(llava_ckpt):
    lang, vision = language_adapter(llava_ckpt), vision_adapter(llava_ckpt)
    messages = [{"role": "user", "content": [{"type": "video", "video": list(_source(6, 32, 32, seed=0))}]}]
    with pytest.raises(InvalidInput) as err:  # EVS is Qwen's; this family refuses it clearly
        build_prompt(messages, lang.tokenizer, vision, video=VideoOptions(pruning_rate=0.5))
    assert err.value.code == "invalid_video_pruning_rate"
    for sampling in (VideoSampling(max_pixels=10_000), VideoSampling(num_frames=7), VideoSampling(fps=1, num_frames=2)):
        with pytest.raises(InvalidInput) as err:  # a pixel knob; more frames than the video has; both counts
            vision.plan_frames(sampling)(VideoMetadata(6, FPS, 3.0, 32, 32))
        assert err.value.code == "invalid_video_sampling"


# --- sharded over two Ray workers, then decoded --------------------------------------------------------------


@pytest.fixture(scope="module")
def coordinator(llava_workers, llava_ckpt):
    return Coordinator(vision_adapter(llava_ckpt), EncoderPool(llava_workers[:2]), cache_bytes=0)


@pytest.fixture(scope="module")
def request_with_video(patched, coordinator, llava_ckpt, llava_hf_model):
    """A prompt with an image and a video, raypipe's sharded embeddings and transformers' features of both."""
    lang, vision = language_adapter(llava_ckpt), vision_adapter(llava_ckpt)
    source = _source(11, 80, 64, seed=5)
    images = random_images([(160, 100)], seed=6)
    parts = [{"type": "image", "image": images[0]}, {"type": "video", "video": list(source)},
             {"type": "text", "text": "Describe the clip."}]
    prompt = build_prompt([{"role": "user", "content": parts}], lang.tokenizer, vision, video=VideoOptions())
    got = coordinator.encode(prompt.visuals)
    want = [*ref.image_features(llava_hf_model, llava_ckpt, images),
            ref.video_features(llava_hf_model, ref.preprocess_video(llava_ckpt, source, FPS))]
    return prompt, got, want


def test_sharded_video_equals_get_video_features(coordinator, request_with_video):
    _, got, want = request_with_video
    for ours, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    assert all(coordinator.last_report.assignment)  # the frames and tiles went to both workers


@pytest.mark.parametrize("k", [1, 8])
def test_greedy_with_video_equals_generate(llava_ckpt, llava_hf_model, request_with_video, k):
    prompt, got, want = request_with_video
    expected = ref.generate(llava_hf_model, prompt.prompt_token_ids, want[:1], MAX_NEW, video=want[1])
    engine = LLMEngine(llava_ckpt, EngineConfig(max_num_seqs=2, max_model_len=1024, num_scheduler_steps=k))
    try:
        out = asyncio.run(engine.generate_output(f"video-{k}", prompt, got, SamplingParams(max_tokens=MAX_NEW)))
    finally:
        engine.shutdown()
    eos = engine.adapter.eos_token_ids[0]
    assert len(expected) > 1 and expected[0] != eos  # the video leads somewhere: not an empty answer
    assert out.token_ids == (expected[: expected.index(eos) + 1] if eos in expected else expected)
