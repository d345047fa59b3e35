"""Order restoration, the embedding cache, dead workers and bad input, through real Ray actors."""

import threading
import time

import numpy as np
import pytest
import ray
import torch

from raypipe import InvalidInput, Pipeline
from raypipe.inputs.images import load_image, load_images
from tests.conftest import over_first_workers, random_images, reference_embeddings


def two_workers(tiny_ckpt) -> Pipeline:
    return Pipeline.from_pretrained(tiny_ckpt, num_encoders=2, cache_bytes=10 * 1024 * 1024)


@pytest.fixture()
def pipe(ray_local, tiny_ckpt):
    """A fresh pool, for tests that kill its workers or change its settings."""
    with two_workers(tiny_ckpt) as p:
        yield p


@pytest.fixture(scope="module")
def shared(ray_local, tiny_ckpt):
    """One pool for the tests that leave it as they found it (no worker killed, no setting changed; their
    images are their own, so no test hits another's cache entries; tests needing another coordinator setting
    get their own coordinator over its workers, `over_first_workers`): a pool's start is ~15 s of CI."""
    with two_workers(tiny_ckpt) as p:
        yield p


def items_encoded(pipe):
    return [info["items_encoded"] for info in pipe.worker_info()]


def test_order_restored_when_balancer_reorders(shared, hf_model, tiny_ckpt):
    pipe = shared
    # Ascending sizes: the balancer visits them in reverse, so every shard is out of input order.
    images = random_images([(56, 56), (112, 112), (168, 168), (224, 224), (280, 280)], seed=1)
    got = pipe.encode(images)
    shards = pipe.coordinator.last_report.assignment
    assert shards[0][0] == 4 and any(shard != sorted(shard) for shard in shards)
    for ours, ref in zip(got, reference_embeddings(hf_model, tiny_ckpt, images)):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)


def test_cache_hits_skip_workers(shared):
    pipe = shared
    images = random_images([(100, 100), (200, 150), (60, 90)], seed=2)
    cache = pipe.stats()["encoder"]["cache"]
    first = pipe.encode(images)
    before = items_encoded(pipe)
    again = pipe.encode([images[2], images[0], images[1], images[0]])
    assert items_encoded(pipe) == before  # nothing re-encoded
    assert pipe.coordinator.last_report.cache_hits == 4
    for got, ref in zip(again, [first[2], first[0], first[1], first[0]]):
        assert torch.equal(got, ref)
    stats = pipe.stats()["encoder"]["cache"]
    assert stats["hits"] - cache["hits"] >= 3 and stats["misses"] - cache["misses"] == 3


def test_duplicates_in_one_batch_encoded_once(shared):
    pipe = shared
    image = random_images([(120, 80)], seed=3)[0]
    before = sum(items_encoded(pipe))
    out = pipe.encode([image, image.copy(), image])
    assert sum(items_encoded(pipe)) - before == 1
    assert torch.equal(out[0], out[1]) and torch.equal(out[1], out[2])


def test_cache_respects_byte_budget(shared):
    p = over_first_workers(shared, 1, cache_bytes=30_000)  # its own coordinator and cache, the pool's worker
    images = random_images([(224, 224)] * 4, seed=4)  # 64 tokens x 64 x 4 B = 16 KiB each
    p.encode(images)
    cache = p.coordinator.cache
    assert cache.bytes <= 30_000 and len(cache) == 1 and cache.evictions == 3
    p.encode(images[-1:])
    assert cache.hits == 1


def test_dead_worker_before_call_is_retried(pipe, hf_model, tiny_ckpt):
    images = random_images([(300, 300), (200, 200), (100, 100), (150, 90)], seed=5)
    ray.kill(pipe.coordinator.workers[0])
    got = pipe.encode(images)
    assert pipe.coordinator.last_report.retried_shards == 1
    for ours, ref in zip(got, reference_embeddings(hf_model, tiny_ckpt, images)):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)
    # The dead actor was replaced: the next call runs on two live workers again.
    more = random_images([(90, 90), (80, 120)], seed=6)
    pipe.encode(more)
    assert pipe.coordinator.last_report.retried_shards == 0
    assert pipe.stats()["encoder"]["workers_replaced"] == 1


def test_worker_killed_mid_call(pipe, hf_model, tiny_ckpt):
    images = random_images([(448, 448)] * 6, seed=7)  # a few hundred ms of work per shard
    victim = pipe.coordinator.workers[1]
    result = {}
    call = threading.Thread(target=lambda: result.setdefault("out", pipe.encode(images)))
    call.start()
    time.sleep(0.05)
    ray.kill(victim)
    call.join(timeout=120)
    got = result["out"]
    for ours, ref in zip(got, reference_embeddings(hf_model, tiny_ckpt, images)):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)


def test_bad_input_then_next_call_works(shared):
    pipe = shared
    good = random_images([(64, 64)], seed=8)[0]
    with pytest.raises(InvalidInput) as err:
        pipe.encode([good, b"not an image"])
    assert err.value.item == "images[1]"
    with pytest.raises(InvalidInput):
        pipe.encode([np.zeros((1, 1, 3), np.uint8)])
    assert pipe.encode([good])[0].shape[1] == 64


def test_concurrent_calls_are_correct_and_leave_nothing_in_flight(shared, hf_model, tiny_ckpt):
    pipe = shared
    batches = [random_images([(200 + 28 * i, 160), (90, 90 + 14 * i)], seed=30 + i) for i in range(4)]
    results = [None] * len(batches)

    def call(i):
        results[i] = pipe.encode(batches[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for images, got in zip(batches, results):
        for ours, ref in zip(got, reference_embeddings(hf_model, tiny_ckpt, images)):
            torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)
    assert pipe.coordinator.inflight_loads == [0.0, 0.0]


def test_unknown_cost_model_fails_at_start(ray_local, tiny_ckpt):
    from raypipe.encode.coordinator import Coordinator
    from raypipe.models.registry import vision_adapter

    with pytest.raises(ValueError, match="unknown cost model"):
        Coordinator(vision_adapter(tiny_ckpt), [object()], cost_model="pixels")


# --- issue 9: liveness apart from busyness, proactive replacement, routing around loading workers -

def test_ping_answers_while_worker_is_busy(pipe):
    item = pipe.coordinator.adapter.make_item(
        pipe.coordinator.adapter.resize_for_tower(load_image(
            random_images([(448, 448)], seed=40)[0])))
    busy = [w.encode_timed.remote([item], repeats=400) for w in pipe.coordinator.workers]  # seconds of work each
    time.sleep(0.5)
    start = time.monotonic()
    health = pipe.coordinator.check_workers(timeout_s=2.0)
    assert health == {"workers": 2, "alive": 2, "loading": 0} and time.monotonic() - start < 2.0
    assert ray.wait(busy, num_returns=2, timeout=0)[0] == []  # the encode work was indeed still running
    for ref in busy:
        ray.cancel(ref, force=False)


def test_dead_workers_are_replaced_without_a_request(pipe, hf_model, tiny_ckpt):
    for worker in pipe.coordinator.workers:
        ray.kill(worker)
    time.sleep(0.5)
    first = pipe.coordinator.check_workers(timeout_s=2.0)
    assert first["alive"] == 0 and pipe.coordinator.workers_replaced == 2
    deadline = time.monotonic() + 90
    while pipe.coordinator.check_workers(timeout_s=2.0)["alive"] < 2:
        assert time.monotonic() < deadline, "replacements never came up"
        time.sleep(0.2)
    images = random_images([(120, 90), (64, 200)], seed=41)
    for ours, ref in zip(pipe.encode(images), reference_embeddings(hf_model, tiny_ckpt, images)):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)
    assert pipe.coordinator.last_report.retried_shards == 0


def test_loading_replacement_gets_no_shard(pipe, hf_model, tiny_ckpt):
    ray.kill(pipe.coordinator.workers[0])
    pipe.encode(random_images([(200, 200), (150, 150)], seed=42))  # meets the dead worker: replaced, retried
    assert pipe.coordinator.last_report.retried_shards == 1
    images = random_images([(90, 90), (100, 60), (70, 140), (60, 60)], seed=43)
    start = time.monotonic()
    got = pipe.encode(images)  # the replacement is still loading its weights: everything goes to worker 1
    elapsed = time.monotonic() - start
    assert pipe.coordinator.last_report.assignment[0] == [], pipe.coordinator.last_report
    assert sorted(pipe.coordinator.last_report.assignment[1]) == [0, 1, 2, 3]
    for ours, ref in zip(got, reference_embeddings(hf_model, tiny_ckpt, images)):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)
    assert elapsed < 3.0  # not stalled behind the replacement's start-up (~4 s: process, imports, weights)


def test_calibrated_cost_model_is_fitted_from_worker_receipts(shared, hf_model, tiny_ckpt):
    pipe = over_first_workers(shared, 2, cost_model="calibrated")  # a new coordinator: no receipts yet
    coordinator = pipe.coordinator
    first = random_images([(56, 56), (280, 280), (112, 224), (84, 84)], seed=5)
    pipe.encode(first)  # before any receipt: the attention model (the prior) balances
    fit = pipe.stats()["encoder"]["cost_fit"]["cpu"]
    assert fit["shards"] == 2 and fit["fit"] is not None and fit["rel_rms_error"] is not None
    second = random_images([(168, 112), (56, 112), (224, 224)], seed=6)
    items = [coordinator.adapter.make_item(d) for d in load_images(second)]
    fitted = coordinator.calibration.for_device("cpu").unit_costs(  # the fitted seconds per image, now
        [coordinator.adapter.cost(i, "patches") for i in items], [coordinator.adapter.cost(i, "attention") for i in items])
    got = pipe.encode(second)
    report = coordinator.last_report
    assert report.loads == pytest.approx([sum(fitted[i] for i in shard) for shard in report.assignment])
    assert sum(report.loads) < 10  # seconds, not patch counts or FLOPs
    for ours, ref in zip(got, reference_embeddings(hf_model, tiny_ckpt, second)):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)
