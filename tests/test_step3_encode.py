"""Step3 over Ray: views of images spread over encoder workers, reassembled per image, equal
transformers' own vision path (`get_image_features`: crops then global view) on the whole batch."""

import pytest
import torch

from raypipe import Pipeline
from tests import step3_reference as ref
from tests.conftest import over_first_workers, random_images


@pytest.fixture(scope="module")
def three_workers(ray_local, step3_ckpt):
    with Pipeline.from_pretrained(step3_ckpt, num_encoders=3) as p:
        yield p


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"{n}workers")
def pipe(request, three_workers):
    return over_first_workers(three_workers, request.param)


@pytest.mark.parametrize("count", [1, 2, 5, 9])
def test_matches_transformers(pipe, step3_hf_model, step3_ckpt, count):
    images = random_images(ref.SIZES[:count], seed=count)
    expected = ref.image_features(step3_hf_model, step3_ckpt, images)
    got = pipe.encode(images)
    assert len(got) == count
    for ours, want in zip(got, expected):
        assert ours.shape == want.shape
        torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-4)
    report = pipe.coordinator.last_report
    workers = len(pipe.coordinator.workers)
    assert sorted(set(i for shard in report.assignment for i in shard)) == list(range(count))
    if count >= 2 and workers > 1:
        assert all(report.assignment)  # views of even two images spread over every worker
