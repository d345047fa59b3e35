"""Qwen3-VL images and videos sharded over encoder workers equal transformers' `get_image_features` and
`get_video_features` on the whole batch, the merger's rows and every deepstack level (fp32, atol 1e-5,
rtol 1e-4), over 1/2/3 workers; a long video's chunks of temporal groups spread over several workers."""

import numpy as np
import pytest
import torch

from raypipe.inputs.media import DecodedVisual, pixel_hash
from raypipe.models.registry import preset_checkpoint, vision_adapter
from tests import qwen3_vl_reference as ref
from tests.conftest import random_images

# thumbnails to a big one; grids from 2x2 to 16x16 patches (before the tower's own resize bounds)
SIZES = [(300, 200), (32, 32), (256, 256), (100, 500), (50, 80), (224, 224), (480, 96)]


def _video(frames: int, seed: int, height: int = 64, width: int = 96) -> DecodedVisual:
    """Sampled frames at tower size (multiples of 32), as a frame plan hands them to the encoders."""
    pixels = np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)
    return DecodedVisual(pixels, pixel_hash(pixels), kind="video", fps=2.0)


@pytest.fixture(scope="module")
def reference():
    return reference_batch("tiny-qwen3-vl")


def reference_batch(preset: str):
    """The batch (images, a long video, a short odd-length one) and transformers' rows for each item."""
    from transformers import AutoModelForImageTextToText

    ckpt = preset_checkpoint(preset)
    hf = AutoModelForImageTextToText.from_pretrained(ckpt).eval()
    processor = ref.hf_processor(ckpt)
    images = random_images(SIZES, seed=5)
    videos = [_video(40, seed=1), _video(5, seed=2, height=32, width=128)]
    image_rows = ref.features(hf, dict(processor.image_processor(images=images, return_tensors="pt")))
    processed = [ref.video_pixels(processor.video_processor, video.pixels) for video in videos]
    video_rows = ref.video_features(hf, torch.cat([rows for rows, _ in processed]), [grid for _, grid in processed])
    visuals = [DecodedVisual(image, pixel_hash(image)) for image in images]
    visuals[2:2] = [videos[0]]
    visuals.append(videos[1])
    expected = image_rows[:2] + video_rows[:1] + image_rows[2:] + video_rows[1:]
    return ckpt, visuals, expected


@pytest.fixture(scope="module")
def pool(three_worker_pipelines, reference):
    """Three encoder workers (the session's); each test balances over the first 1, 2 or 3 of them."""
    return three_worker_pipelines.get(reference[0]).coordinator.pool


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_sharded_embeddings_match_transformers(pool, reference, workers):
    check_sharded(pool, reference, workers, levels=2)  # the merger's rows + 2 deepstack levels


def check_sharded(pool, reference, workers: int, levels: int) -> None:
    """The batch over the first `workers` of `pool` equals transformers' rows; each row is `1 + levels` wide."""
    from raypipe.encode.coordinator import Coordinator
    from raypipe.encode.pool import EncoderPool

    ckpt, visuals, expected = reference
    adapter = vision_adapter(ckpt)
    adapter.video_chunk_patches = 96  # 4 temporal groups of 4x6 patches per chunk: the long video is 5 chunks
    coordinator = Coordinator(adapter, EncoderPool(pool.workers[:workers], pool.options))
    got = coordinator.encode(visuals)
    assignment = coordinator.last_report.assignment
    assert len(adapter.units(adapter.make_item(visuals[2]))) == 5
    assert sum(bool(shard) for shard in assignment) == workers  # every worker took part
    assert sum(1 for shard in assignment if 2 in shard) == min(workers, 5)  # the long video's chunks spread
    hidden = adapter.vision_config.out_hidden_size
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.shape == theirs.shape and ours.shape[1] == (1 + levels) * hidden
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
