"""Qwen2.5-VL videos: frame plans and pixels equal transformers' own code, positions follow the model's
original rule (transformers' `get_rope_index` where that agrees with it), and a video sharded over Ray
workers in chunks of temporal groups encodes to the rows of transformers' tower on the whole video."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from raypipe.errors import InvalidInput
from raypipe.inputs.media import DecodedVisual, pixel_hash
from raypipe.inputs.video import VideoMetadata, VideoSampling
from raypipe.models.base import VisualLayout
from raypipe.models.qwen2_5_vl.video import QwenVideoConfig, frame_planner, patchify, process_video, resize_frames
from raypipe.models.registry import language_adapter, vision_adapter
from tests import qwen_video_reference as ref
from tests.conftest import over_first_workers, random_images, reference_embeddings
from tests.mrope_reference import rule_positions

DEFAULTS = QwenVideoConfig()
SMALL_BUDGET = QwenVideoConfig(max_video_tokens=2000)  # the total-pixel cap bites on long videos

# (frames, source fps, height, width, model config, request knobs)
SAMPLING_CASES = [
    (300, 30.0, 480, 640, DEFAULTS, VideoSampling()),
    (97, 24.0, 360, 640, DEFAULTS, VideoSampling()),  # odd count
    (151, 29.97, 1280, 720, DEFAULTS, VideoSampling()),  # portrait
    (60, 30.0, 100, 400, DEFAULTS, VideoSampling()),  # 4:1 strip
    (400, 30.0, 40, 2000, DEFAULTS, VideoSampling()),  # 50:1 strip
    (3, 30.0, 100, 100, DEFAULTS, VideoSampling()),  # fewer frames than min_frames
    (10, 30.0, 64, 64, DEFAULTS, VideoSampling(min_frames=2)),  # upscaled to min_pixels
    (500, 25.0, 1080, 1920, DEFAULTS, VideoSampling(fps=0.5)),
    (300, 30.0, 480, 640, DEFAULTS, VideoSampling(num_frames=16)),
    (300, 30.0, 480, 640, DEFAULTS, VideoSampling(num_frames=7)),  # rounded to a temporal patch
    (3000, 30.0, 720, 1280, DEFAULTS, VideoSampling(max_frames=32)),
    (3000, 30.0, 720, 1280, DEFAULTS, VideoSampling()),  # 200 frames: the default total budget caps each
    (3000, 30.0, 720, 1280, SMALL_BUDGET, VideoSampling()),  # floor at 1.05 * min_pixels
    (3000, 30.0, 720, 1280, DEFAULTS, VideoSampling(total_pixels=SMALL_BUDGET.total_pixels, min_pixels=4 * 784)),
    (900, 30.0, 480, 854, DEFAULTS, VideoSampling(fps=4.0, max_pixels=64 * 784, min_pixels=8 * 784)),
]


@pytest.fixture(scope="module")
def hf_video():
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield ref.load_processor(monkeypatch)


def _case_id(case) -> str:
    knobs = ",".join(f"{k}={v}" for k, v in dataclasses.asdict(case[5]).items() if v is not None)
    return f"{case[0]}f-{case[2]}x{case[3]}-{case[4].max_video_tokens}tok" + (f"-{knobs}" if knobs else "")


@pytest.mark.parametrize("case", SAMPLING_CASES, ids=_case_id)
def test_frame_plan_equals_transformers(hf_video, case):
    from transformers.video_utils import VideoMetadata as HFVideoMetadata

    total, fps, height, width, config, sampling = case
    processor, tvf = hf_video
    plan = frame_planner(config, sampling)(VideoMetadata(total, fps, total / fps, width, height))
    pick = {name: getattr(sampling, name) for name in ("min_frames", "max_frames", "min_pixels", "max_pixels")}
    pick = {name: getattr(config, name) if value is None else value for name, value in pick.items()}
    mode = {"num_frames": sampling.num_frames} if sampling.num_frames else {"fps": sampling.fps or config.fps}
    want = processor.sample_frames(HFVideoMetadata(total_num_frames=total, fps=fps), temporal_patch_size=2,
                                   min_frames=pick["min_frames"], max_frames=pick["max_frames"], **mode)
    assert plan.indices == tuple(want.tolist())
    budget_tokens = config.max_video_tokens if sampling.total_pixels is None else SMALL_BUDGET.max_video_tokens
    assert (plan.height, plan.width) == ref.reference_frame_size(
        processor, tvf, len(want), height, width, min_pixels=pick["min_pixels"], max_pixels=pick["max_pixels"],
        max_video_tokens=budget_tokens)


def test_frame_plan_edges():
    """Where transformers' formula gives 0 frames (it then divides by zero), one frame is kept: index 0."""
    assert frame_planner(DEFAULTS)(VideoMetadata(1, 30.0, 1 / 30, 640, 480)).indices == (0,)
    assert frame_planner(DEFAULTS, VideoSampling(num_frames=1))(VideoMetadata(90, 30.0, 3.0, 64, 64)).indices == (0,)
    bad = [VideoSampling(fps=0), VideoSampling(fps=2, num_frames=8), VideoSampling(num_frames=0),
           VideoSampling(min_frames=9, max_frames=8), VideoSampling(min_pixels=10),
           VideoSampling(min_pixels=2000 * 784, max_pixels=1000 * 784), VideoSampling(total_pixels=-1)]
    for sampling in bad:
        with pytest.raises(InvalidInput) as err:
            frame_planner(DEFAULTS, sampling)
        assert err.value.code == "invalid_video_sampling"
    with pytest.raises(InvalidInput):  # more frames than the video has (transformers raises too)
        frame_planner(DEFAULTS, VideoSampling(num_frames=16))(VideoMetadata(8, 30.0, 0.3, 64, 64))


@pytest.mark.parametrize("size", [(240, 320, 112, 140), (50, 100, 224, 448), (37, 91, 28, 56), (56, 56, 56, 56)])
def test_resize_is_torchvision_bicubic_uint8(size):
    """torchvision's `resize_image` on a CPU uint8 tensor with BICUBIC: `_do_native_uint8_resize_on_cpu` is true
    for bicubic, so it calls `interpolate(mode="bicubic", align_corners=False, antialias=True)` on the uint8
    NCHW tensor itself, with no float round trip (that clamped/rounded path is its non-CPU one), and returns
    the input unchanged when the size already matches."""
    height, width, new_h, new_w = size
    frames = np.random.default_rng(height).integers(0, 256, (3, height, width, 3), dtype=np.uint8)
    nchw = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
    want = torch.nn.functional.interpolate(nchw, size=(new_h, new_w), mode="bicubic", align_corners=False,
                                           antialias=True).permute(0, 2, 3, 1).numpy()
    got = resize_frames(frames, (new_h, new_w))
    assert got.dtype == np.uint8 and got.flags.c_contiguous
    np.testing.assert_array_equal(got, want)
    # Pillow's bicubic (the same antialiased filter, its own fixed-point rounding) agrees to within 1.
    from PIL import Image

    pil = np.asarray(Image.fromarray(frames[0]).resize((new_w, new_h), Image.BICUBIC))
    assert np.abs(pil.astype(int) - got[0].astype(int)).max() <= 1


def test_processor_equals_transformers_image_processor(tiny_ckpt):
    """A 2-frame video of one image is what the image processor makes of that image (it repeats the
    frame over the temporal patch)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    (image,) = random_images([(112, 168)], seed=3)
    want = Qwen2VLImageProcessorPil(min_pixels=4 * 784, max_pixels=256 * 784)(images=[image], return_tensors="pt")
    got, grid = process_video(np.stack([image, image]), QwenVideoConfig.from_checkpoint(tiny_ckpt))
    assert grid == tuple(want["image_grid_thw"][0].tolist())
    torch.testing.assert_close(got, want["pixel_values"])


@pytest.mark.parametrize("frames", [1, 2, 5, 8])
def test_patchify_equals_transformers(hf_video, frames):
    processor, _ = hf_video
    video = torch.randn(frames, 3, 56, 84)
    got, grid = patchify(video, 14, 2, 2)
    want, *want_grid = processor.patchify(video[None], patch_size=14, merge_size=2, temporal_patch_size=2)
    assert grid == tuple(want_grid)
    torch.testing.assert_close(got, want[0], atol=0, rtol=0)


def _video(frames: int, seed: int, height: int = 56, width: int = 84, fps: float = 2.0) -> DecodedVisual:
    pixels = np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)
    return DecodedVisual(pixels, pixel_hash(pixels), kind="video", fps=fps)


def _whole_video_rows(hf_model, adapter, video: DecodedVisual) -> torch.Tensor:
    pixel_values, grid = process_video(video.pixels, adapter.video_config)
    with torch.no_grad():
        return hf_model.model.visual(pixel_values, grid_thw=torch.tensor([grid])).pooler_output


@pytest.fixture(scope="module")
def three_workers(three_worker_pipelines, tiny_ckpt):
    p = three_worker_pipelines.get(tiny_ckpt)  # shared with other modules: its adapter is put back after this one
    p.coordinator.adapter.video_chunk_patches = 96  # 4 temporal groups of 4x6 patches per chunk
    yield p
    del p.coordinator.adapter.video_chunk_patches  # the class's value again


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"{n}workers")
def pipe(request, three_workers):
    return over_first_workers(three_workers, request.param)


@pytest.mark.parametrize("frames", [2, 16, 64])
def test_sharded_video_equals_transformers(pipe, hf_model, frames):
    adapter = pipe.coordinator.adapter
    video = _video(frames, seed=frames)
    (got,) = pipe.coordinator.encode([video])
    torch.testing.assert_close(got, _whole_video_rows(hf_model, adapter, video), atol=1e-5, rtol=1e-4)
    chunks = len(adapter.units(adapter.make_item(video)))
    assert chunks == -(-frames // 8)
    workers_used = sum(1 for shard in pipe.coordinator.last_report.assignment if 0 in shard)
    assert workers_used == min(chunks, len(pipe.coordinator.workers))


def test_videos_mixed_with_images(pipe, hf_model, tiny_ckpt):
    adapter = pipe.coordinator.adapter
    images = random_images([(300, 200), (60, 60), (100, 900)], seed=5)
    videos = [_video(64, seed=1), _video(5, seed=2, height=84, width=28)]
    visuals = [DecodedVisual(images[0], pixel_hash(images[0])), videos[0],
               DecodedVisual(images[1], pixel_hash(images[1])), videos[1],
               DecodedVisual(images[2], pixel_hash(images[2]))]
    got = pipe.coordinator.encode(visuals)
    image_rows = reference_embeddings(hf_model, tiny_ckpt, images)
    want = [image_rows[0], _whole_video_rows(hf_model, adapter, videos[0]), image_rows[1],
            _whole_video_rows(hf_model, adapter, videos[1]), image_rows[2]]
    for ours, theirs in zip(got, want):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    if len(pipe.coordinator.workers) > 1:  # the long video's chunks went to several workers
        assert sum(1 for shard in pipe.coordinator.last_report.assignment if 1 in shard) > 1


def test_pipeline_encode_takes_videos(pipe, hf_model, tiny_ckpt):
    """Issue 29 item 7: `Pipeline.encode` reads a video part as `generate` does and returns all its rows
    (t·h·w / merge², no EVS), equal transformers' tower on the whole video. A frames list is a video at 2 fps,
    which the default plan keeps whole, at its size (56x84 is within the tiny preset's pixel bounds)."""
    adapter = pipe.coordinator.adapter
    video = _video(16, seed=9)  # 8 temporal groups of 4x6 patches: two chunks of 4 groups
    image = random_images([(300, 200)], seed=10)[0]
    got = pipe.encode([{"type": "video", "video": list(video.pixels)}, image])
    assert got[0].shape[0] == 8 * 4 * 6 // 4 and len(adapter.units(adapter.make_item(video))) == 2
    torch.testing.assert_close(got[0], _whole_video_rows(hf_model, adapter, video), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got[1], reference_embeddings(hf_model, tiny_ckpt, [image])[0], atol=1e-5, rtol=1e-4)


def test_video_geometry_and_cost(tiny_ckpt):
    adapter = vision_adapter(tiny_ckpt)
    item = adapter.make_item(_video(7, seed=0))
    assert (item.kind, item.grid, item.num_tokens) == ("video", (4, 4, 6), 24)
    assert adapter.seconds_per_grid(_video(2, seed=0, fps=0.5)) == 4.0
    units = adapter.units(item)
    assert [u.unit_index for u in units] == [0] and units[0].grid == item.grid  # under the default chunk size
    group = adapter.cost(adapter.make_item(_video(2, seed=0)), "attention")
    assert adapter.cost(item, "attention") == pytest.approx(4 * group)  # attention stays within each group
    with pytest.raises(ValueError, match="multiples of 28"):
        adapter.make_item(_video(2, seed=0, height=50))


def _prompt(lang, runs: list[tuple[str, int]]) -> list[int]:
    text = lang.tokenizer.encode("see ")
    ids = list(text)
    for kind, count in runs:
        token = lang.video_token_id if kind == "video" else lang.image_token_id
        ids += [lang.vision_start_token_id, *[token] * count, lang.vision_end_token_id, *text]
    return ids


POSITION_CASES = {  # (visual items, whether transformers' `get_rope_index` agrees with the original rule)
    "images": ([("image", (1, 8, 6), None), ("image", (1, 4, 10), None)], True),
    "short-videos": ([("video", (2, 8, 8), 0.5), ("image", (1, 4, 4), None), ("video", (4, 6, 10), 0.25)], True),
    "video": ([("video", (4, 4, 6), 1.0)], False),  # time 12 passes the 2 x 3 merged grid
    "images-and-videos": ([("image", (1, 8, 6), None), ("video", (3, 4, 6), 4.0), ("video", (2, 2, 2), 0.5),
                           ("image", (1, 4, 4), None)], False),
    "60s-at-2fps": ([("video", (60, 4, 4), 1.0)], False),
}


@pytest.mark.parametrize("case", POSITION_CASES)
def test_positions_follow_the_original_rule(tiny_ckpt, hf_model, case):
    """raypipe's positions are the rule's (tests/mrope_reference.py), and transformers' `get_rope_index`'s
    exactly where that agrees with the rule: images, and videos whose time stays within their extent."""
    visuals, agrees = POSITION_CASES[case]
    lang = language_adapter(tiny_ckpt)
    layouts = [VisualLayout(kind, grid, seconds) for kind, grid, seconds in visuals]
    ids = _prompt(lang, [(x.kind, lang.tokens_per_image(x.grid)) for x in layouts])
    got, delta = lang.positions(ids, layouts)
    want, first = rule_positions(ids, visuals, hf_model.config)
    assert torch.equal(got, want) and len(ids) + delta == first
    input_ids = torch.tensor([ids])
    types = (input_ids == lang.image_token_id).int() + 2 * (input_ids == lang.video_token_id).int()
    videos = [x for x in layouts if x.kind == "video"]
    images = [x.grid for x in layouts if x.kind == "image"]
    theirs, their_delta = hf_model.model.get_rope_index(
        input_ids, types, image_grid_thw=torch.tensor(images) if images else None,
        video_grid_thw=torch.tensor([x.grid for x in videos]) if videos else None,
        second_per_grid_ts=torch.tensor([x.seconds_per_grid for x in videos]) if videos else None)
    assert (torch.equal(got, theirs[:, 0]) and delta == int(their_delta[0, 0])) == agrees
    assert len(set(got[0].tolist())) < len(ids)  # the first axis is not the plain index


def test_the_cache_key_follows_the_sampling(tiny_ckpt):
    """The embedding cache is keyed by the sampled frames' hash: the same file under other sampling
    parameters is another key, under the same ones the same key."""
    from raypipe.inputs.video import VideoLimits, load_video
    from raypipe.testing.sample_videos import index_frames, make_video

    adapter = vision_adapter(tiny_ckpt)
    data = make_video(index_frames(40, 96, 128), fps=10)

    def key(**sampling):
        return load_video(data, VideoLimits(), adapter.plan_frames(VideoSampling(**sampling))).content_hash

    assert key(fps=2.0) == key(fps=2.0)
    assert len({key(fps=2.0), key(fps=1.0), key(fps=2.0, max_pixels=4 * 28 * 28)}) == 3
