"""LLaVA-OneVision over Ray: base views and tiles split evenly over encoder workers, packed per image,
equal transformers' `get_image_features` (tower, projector, AnyRes packing) on the whole batch."""

import pytest
import torch

from raypipe import Pipeline
from tests import llava_ov_reference as ref
from tests.conftest import random_images


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"{n}workers")
def pipe(request, ray_local, llava_ckpt):
    with Pipeline.from_pretrained(llava_ckpt, num_encoders=request.param, cache_bytes=0) as p:
        yield p


@pytest.mark.parametrize("count", [1, 2, 5, 9])
def test_matches_transformers(pipe, llava_hf_model, llava_ckpt, count):
    images = random_images(ref.SIZES[:count], seed=count)
    expected = ref.image_features(llava_hf_model, llava_ckpt, images)
    got = pipe.encode(images)
    assert len(got) == count
    for ours, want in zip(got, expected):
        assert ours.shape == want.shape
        torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-4)
    report = pipe.coordinator.last_report
    workers = len(pipe.coordinator.workers)
    assert sorted(set(i for shard in report.assignment for i in shard)) == list(range(count))
    assert max(report.loads) - min(report.loads) <= max(report.loads) / 2 or count == 1  # an even split of units
    if workers > 1:
        assert all(report.assignment)  # even one image's base view and tiles spread over every worker
