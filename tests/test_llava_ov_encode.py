"""LLaVA-OneVision over Ray: base views and tiles split evenly over encoder workers, packed per image,
equal transformers' `get_image_features` (tower, projector, AnyRes packing) on the whole batch.

The session's three workers (`llava_workers`) serve the 1-, 2- and 3-worker coordinators (the first k):
starting a pool per worker count cost ~20 s of the family's test time on 2 cores."""

import pytest
import torch

from raypipe.encode.coordinator import Coordinator
from raypipe.encode.pool import EncoderPool
from raypipe.inputs.images import ImageLimits, load_images
from raypipe.models.registry import vision_adapter
from tests import llava_ov_reference as ref
from tests.conftest import random_images


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"{n}workers")
def coordinator(request, llava_workers, llava_ckpt):
    return Coordinator(vision_adapter(llava_ckpt), EncoderPool(llava_workers[:request.param]), cache_bytes=0)


@pytest.mark.parametrize("count", [1, 2, 5, 9])
def test_matches_transformers(coordinator, llava_hf_model, llava_ckpt, count):
    images = random_images(ref.SIZES[:count], seed=count)
    expected = ref.image_features(llava_hf_model, llava_ckpt, images, tile_every_image=True)  # encoded each alone
    got = coordinator.encode(load_images(images, ImageLimits()))
    assert len(got) == count
    for ours, want in zip(got, expected):
        assert ours.shape == want.shape
        torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-4)
    report = coordinator.last_report
    assert sorted(set(i for shard in report.assignment for i in shard)) == list(range(count))
    assert max(report.loads) - min(report.loads) <= max(report.loads) / 2 or count == 1  # an even split of units
    if len(coordinator.workers) > 1:
        assert all(report.assignment)  # even one image's base view and tiles spread over every worker
