"""MiniCPM-V 4.6 videos: the frame plan, canvases, processed tensors and prompt equal transformers'
`MiniCPMV4_6VideoProcessor` / `MiniCPMV4_6Processor` on the same source frames, and a video's frame
pieces sharded over Ray workers (alone or next to images) encode to transformers' `get_video_features`."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from raypipe.errors import InvalidInput
from raypipe.inputs.media import DecodedVisual, pixel_hash
from raypipe.inputs.video import VideoLimits, VideoMetadata, VideoSampling, load_video
from raypipe.models.minicpmv4_6 import video as mvideo
from raypipe.models.prompt import VideoOptions, build_prompt
from raypipe.models.registry import language_adapter, vision_adapter
from tests import minicpmv_reference as ref
from tests import minicpmv_video_reference as vref
from tests.conftest import over_first_workers, random_images

PRESET = None  # the checkpoint's own video processor config (tiny preset: stack_frames=3, max_num_frames=8)
# (source frames, fps, height, width, video processor config over the preset's, request max_frames)
CASES = [
    (5, 10.0, 96, 64, PRESET, None),  # 0.5 s: one main frame and a canvas of the frames at 1/3 and 2/3 s
    (25, 10.0, 240, 320, PRESET, None),  # 2.5 s, sliced frames; the last second's canvas holds one frame
    (32, 4.0, 48, 64, PRESET, None),  # exactly the 8 s main-frame cap
    (90, 5.0, 40, 56, PRESET, None),  # 18 s, above the cap: 8 main frames spread over the video
    (100, 29.97, 180, 320, PRESET, 3),  # request max_frames=3 (above it), odd rate
    (61, 12.0, 64, 400, dict(stack_frames=4), None),  # canvases of 3 frames (1x3 or 3x1), wide strip
    (45, 9.0, 200, 60, dict(stack_frames=5, max_num_frames=4), None),  # canvases of 4 (2x2), tall strip, 5 s
    (30, 10.0, 320, 240, dict(stack_frames=1), None),  # no canvases
    (24, 8.0, 300, 300, dict(slice_mode=False), None),  # no slices
]


def _case_id(case) -> str:
    frames, fps, height, width, config, max_frames = case
    knobs = ",".join(f"{k}={v}" for k, v in (config or {}).items()) + (f"max_frames={max_frames}" if max_frames else "")
    return f"{frames / fps:.2f}s-{height}x{width}" + (f"-{knobs}" if knobs else "")


@pytest.fixture(scope="module")
def tower(minicpmv_ckpt):
    return vision_adapter(minicpmv_ckpt).load_tower(torch.device("cpu"), torch.float32)


def _source(frames: int, height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


def _adapters(ckpt, config):
    """raypipe's adapter and transformers' processor, both with `config` over the checkpoint's video processor."""
    adapter = vision_adapter(ckpt)
    reference = vref.processor(ckpt)
    if config:
        adapter = copy.copy(adapter)
        adapter.video_processor = mvideo.load_processor(ckpt)
        adapter._canvas_sizes = {}
        for name, value in config.items():
            setattr(adapter.video_processor, name, value)
            setattr(reference, name, value)
    return adapter, reference


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_plan_canvases_and_tensors_equal_transformers(minicpmv_video_reference, minicpmv_ckpt, tower, case):
    from transformers.video_utils import VideoMetadata as HFVideoMetadata

    frames, fps, height, width, config, max_frames = case
    adapter, reference = _adapters(minicpmv_ckpt, config)
    source = _source(frames, height, width, seed=frames)
    sampling = VideoSampling(max_frames=max_frames)
    cap = {"max_num_frames": max_frames} if max_frames else {}

    plan = adapter.plan_frames(sampling)(VideoMetadata(frames, fps, frames / fps, width, height))
    want_indices = reference.sample_frames(HFVideoMetadata(total_num_frames=frames, fps=fps, duration=frames / fps),
                                           **cap)
    assert list(plan.indices) == [int(i) for i in want_indices]

    visual = load_video(list(source), VideoLimits(), adapter.plan_frames(sampling), frames_fps=fps)
    item = adapter.make_item(visual)
    want = vref.preprocess(reference, source, fps, **cap)
    # canvas layout: which units are main frames and canvases, and each unit's slice grid
    grids = adapter.image_grids(item.grid)
    assert want["num_frames_per_video"] == [len(grids)]
    assert want["grids_videos"].tolist() == [list(g[:2]) for g in grids]
    assert want["num_patches_per_frame"].tolist() == [g[0] * g[1] + 1 for g in grids]
    # processed tensors: every piece's pixels in the tower's packed layout, and its size in patches
    units = adapter.units(item)
    packed = tower.pack(units)
    assert torch.equal(packed.target_sizes, want["target_sizes_videos"])
    assert torch.equal(packed.pixel_values, want["pixel_values_videos"])
    assert item.num_tokens == sum(u.num_tokens for u in units) == int(
        (want["target_sizes_videos"].prod(-1) // 16).sum())


@pytest.mark.parametrize("with_image", [False, True], ids=["video", "image-video"])
def test_prompt_equals_processor(minicpmv_video_reference, minicpmv_ckpt, with_image):
    """The video's `<image_id>`, and each unit's `<image>` / `<slice>` runs of `<|video_pad|>`, as the processor
    puts them (an image and a video in one prompt each count from 0)."""
    lang, vision = language_adapter(minicpmv_ckpt), vision_adapter(minicpmv_ckpt)
    processor = ref.processor(minicpmv_ckpt)
    source = _source(25, 240, 320, seed=1)
    images = random_images([(300, 500)], seed=2) if with_image else []
    parts = [{"type": "image", "image": im} for im in images] + [
        {"type": "video", "video": list(source)}, {"type": "text", "text": "What happens?"}]
    messages = [{"role": "user", "content": parts}]
    prompt = build_prompt(messages, lang.tokenizer, vision, video=VideoOptions())
    text = lang.tokenizer.apply_chat_template([{"role": "user", "content": [{"type": p["type"]} if p["type"] != "text"
                                                                           else p for p in parts]}],
                                              add_generation_prompt=True, tokenize=False)
    meta = vref.metadata(source, fps=2.0)  # a frames list is a video at 2 frames per second (`frames_fps`)
    want = processor(text=[text], images=images or None, videos=[source], video_metadata=[meta], return_tensors="pt")
    assert prompt.prompt_token_ids == want["input_ids"][0].tolist()
    lang_runs = [n for layout in prompt.visual_layouts for n in lang.prompt_runs(layout)]
    assert sum(lang_runs) == prompt.num_image_tokens


def test_refusals(minicpmv_ckpt, monkeypatch):
    lang, vision = language_adapter(minicpmv_ckpt), vision_adapter(minicpmv_ckpt)
    source = list(_source(6, 48, 64, seed=0))
    messages = [{"role": "user", "content": [{"type": "video", "video": source}]}]
    with pytest.raises(InvalidInput) as err:  # EVS is Qwen's; MiniCPM-V refuses it clearly
        build_prompt(messages, lang.tokenizer, vision, video=VideoOptions(pruning_rate=0.5))
    assert err.value.code == "invalid_video_pruning_rate"
    with pytest.raises(InvalidInput) as err:  # it keeps one frame per second: fps is not its knob
        build_prompt(messages, lang.tokenizer, vision, video=VideoOptions(sampling=VideoSampling(fps=4.0)))
    assert err.value.code == "invalid_video_sampling"
    with pytest.raises(InvalidInput) as err:  # refused from the header's plan, before any frame is decoded
        build_prompt(messages, lang.tokenizer, vision, max_video_tokens=20)
    assert err.value.code == "context_length_exceeded"
    monkeypatch.setattr(mvideo, "MAX_KEPT_BYTES", 500 * 1024**2)  # the tiny preset keeps at most 24 frames
    with pytest.raises(InvalidInput) as err:  # 24 frames of 4K (0.6 GB) would stay in memory at source size
        vision.plan_frames(VideoSampling())(VideoMetadata(300, 30.0, 10.0, 3840, 2160))
    assert err.value.code == "video_too_large"


def test_visual_units_need_the_duration(minicpmv_ckpt):
    vision = vision_adapter(minicpmv_ckpt)
    pixels = _source(6, 48, 64, seed=0)
    with pytest.raises(InvalidInput):
        vision.make_item(DecodedVisual(pixels, pixel_hash(pixels), "video", 2.0))
    # 3 s at the preset's stack of 3: main, canvas, main, canvas, main, canvas
    decoded = DecodedVisual(np.concatenate([pixels, pixels[:3]]), "", "video", 3.0, 3.0)
    assert mvideo.visual_units(decoded.num_frames, decoded.duration_s, vision.video_processor) == [0, 2, 0, 2, 0, 2]


# --- sharded over Ray workers == transformers' get_video_features ---------------------------------------------

@pytest.fixture(scope="module")
def hf_minicpmv(minicpmv_ckpt):
    from transformers import MiniCPMV4_6ForConditionalGeneration

    return MiniCPMV4_6ForConditionalGeneration.from_pretrained(minicpmv_ckpt).eval()


@pytest.fixture(scope="module")
def three_workers(three_worker_pipelines, minicpmv_ckpt):
    return three_worker_pipelines.get(minicpmv_ckpt)


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"{n}workers")
def pipe(request, three_workers):
    return over_first_workers(three_workers, request.param)


def _video(source: np.ndarray, fps: float, adapter) -> DecodedVisual:
    return load_video(list(source), VideoLimits(), adapter.plan_frames(VideoSampling()), frames_fps=fps)


def _video_features(hf_model, processed) -> torch.Tensor:
    """transformers' `get_video_features` on the whole video, called as its forward calls it."""
    with torch.no_grad():
        units = hf_model.model.get_video_features(processed["pixel_values_videos"][:1],
                                                  processed["target_sizes_videos"]).pooler_output
    return torch.cat(units)


def test_sharded_video_equals_get_video_features(minicpmv_video_reference, pipe, hf_minicpmv, minicpmv_ckpt):
    adapter = pipe.coordinator.adapter
    source = _source(15, 240, 320, seed=7)  # 1.5 s of sliced frames: 14 pieces
    (got,) = pipe.coordinator.encode([_video(source, 10.0, adapter)])
    want = _video_features(hf_minicpmv, vref.preprocess(vref.processor(minicpmv_ckpt), source, 10.0))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    if len(pipe.coordinator.workers) > 1:  # the video's frame pieces went to more than one worker
        assert sum(1 for shard in pipe.coordinator.last_report.assignment if 0 in shard) > 1


def test_videos_mixed_with_images(minicpmv_video_reference, pipe, hf_minicpmv, minicpmv_ckpt):
    adapter = pipe.coordinator.adapter
    reference = vref.processor(minicpmv_ckpt)
    images = random_images([(300, 500), (60, 50)], seed=4)
    sources = [(_source(20, 64, 96, seed=5), 8.0), (_source(9, 48, 40, seed=6), 1.0)]  # 2.5 s; 9 s, above the cap
    videos = [_video(source, fps, adapter) for source, fps in sources]
    visuals = [DecodedVisual(images[0], pixel_hash(images[0])), videos[0],
               DecodedVisual(images[1], pixel_hash(images[1])), videos[1]]
    got = pipe.coordinator.encode(visuals)
    image_rows = ref.image_embeddings(hf_minicpmv, minicpmv_ckpt, images)
    video_rows = [_video_features(hf_minicpmv, vref.preprocess(reference, s, fps)) for s, fps in sources]
    for ours, theirs in zip(got, [image_rows[0], video_rows[0], image_rows[1], video_rows[1]]):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    if len(pipe.coordinator.workers) > 1:  # each video's pieces went to more than one worker
        for index in (1, 3):
            assert sum(1 for shard in pipe.coordinator.last_report.assignment if index in shard) > 1
