"""Sharded encoding over Ray workers equals transformers' own vision tower on the whole batch."""

import pytest
import torch

from tests.conftest import over_first_workers, random_images, reference_embeddings

# Mixed sizes: thumbnails, a wide strip, a tall one, a big one (grids from 4x4 to 36x26 patches).
SIZES = [(300, 200), (28, 28), (640, 480), (100, 900), (50, 80), (224, 224), (900, 120), (60, 60), (480, 360)]


@pytest.fixture(scope="module")
def three_workers(three_worker_pipelines, tiny_ckpt):
    return three_worker_pipelines.get(tiny_ckpt)


@pytest.fixture(scope="module", params=[(1, "patches"), (2, "patches"), (3, "patches"), (3, "attention")],
                ids=lambda p: f"{p[0]}workers-{p[1]}")
def pipe(request, three_workers):
    workers, cost_model = request.param
    return over_first_workers(three_workers, workers, cost_model)


@pytest.mark.parametrize("count", [1, 2, 5, 9])
def test_matches_transformers(pipe, hf_model, tiny_ckpt, count):
    images = random_images(SIZES[:count], seed=count)
    expected = reference_embeddings(hf_model, tiny_ckpt, images)
    got = pipe.encode(images)
    assert len(got) == count
    for ours, ref in zip(got, expected):
        assert ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)
    report = pipe.coordinator.last_report
    workers = len(pipe.coordinator.workers)
    assert sorted(i for shard in report.assignment for i in shard) == list(range(count))
    if count < workers:  # some worker received nothing and the call still completed
        assert any(not shard for shard in report.assignment)


def test_empty_input(pipe):
    assert pipe.encode([]) == []


def test_large_images_travel_at_tower_size(pipe, hf_model, tiny_ckpt):
    """Issue 9 item 7: images are resized where decoded; embeddings still equal the tower on the ORIGINAL."""
    sizes = [(1000, 700), (333, 1500), (2000, 2000)]
    images = random_images(sizes, seed=11)
    coordinator = pipe.coordinator
    shipped = []
    submit = coordinator.submit
    coordinator.submit = lambda decoded: shipped.extend(image.pixels.shape for image in decoded) or submit(decoded)
    try:
        got = pipe.encode(images)
    finally:
        del coordinator.submit  # back to the class's method
    adapter = coordinator.adapter
    assert shipped == [(*adapter.tower_size(h, w), 3) for h, w in sizes]
    assert sum(h * w * 3 for h, w, _ in shipped) * 5 < sum(h * w * 3 for h, w in sizes)
    for ours, ref in zip(got, reference_embeddings(hf_model, tiny_ckpt, images)):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)
