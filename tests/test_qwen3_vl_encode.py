"""Qwen3-VL images sharded over encoder workers equal transformers' `get_image_features` on the whole
batch, the merger's rows and every deepstack level (fp32, atol 1e-5, rtol 1e-4), over 1/2/3 workers."""

import pytest
import torch

from raypipe import Pipeline
from raypipe.models.registry import preset_checkpoint
from tests import qwen3_vl_reference as ref
from tests.conftest import random_images

# thumbnails to a big one; grids from 2x2 to 16x16 patches (before the tower's own resize bounds)
SIZES = [(300, 200), (32, 32), (256, 256), (100, 500), (50, 80), (224, 224), (480, 96)]


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForImageTextToText

    ckpt = preset_checkpoint("tiny-qwen3-vl")
    hf = AutoModelForImageTextToText.from_pretrained(ckpt).eval()
    images = random_images(SIZES, seed=5)
    inputs = dict(ref.hf_processor(ckpt).image_processor(images=images, return_tensors="pt"))
    return ckpt, images, ref.features(hf, inputs)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_sharded_embeddings_match_get_image_features(ray_local, reference, workers):
    ckpt, images, expected = reference
    with Pipeline.from_pretrained(ckpt, num_encoders=workers) as pipe:
        got = pipe.encode(images)
        assignment = pipe.coordinator.last_report.assignment
    assert sorted(i for shard in assignment for i in shard) == list(range(len(images)))
    assert sum(bool(shard) for shard in assignment) == workers  # every worker took part
    hidden = pipe.coordinator.adapter.vision_config.out_hidden_size
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.shape == theirs.shape and ours.shape[1] == 3 * hidden  # the merger's rows + 2 deepstack levels
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
