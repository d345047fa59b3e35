"""Issue 29 items 8 and 7: an item of several units (LLaVA-OneVision tiles, a video's frames) is joined on an
encoder worker, where torch is loaded already, so no request starts a process (a Ray task did: a fresh worker
process, seconds of imports, whenever Ray had stopped its idle one); a join whose worker died is re-run on a
live one; `Pipeline.encode` takes videos. Embeddings equal transformers' `get_image_features` /
`get_video_features` (images encoded one by one are each tiled: transformers' flat image list). The
session's `tiny-llava-ov` workers serve (starting a pool costs seconds on 2 cores)."""

import dataclasses
import time

import numpy as np
import pytest
import ray
import torch
from ray.exceptions import RayActorError

from raypipe import InvalidInput
from raypipe.encode.assemble import assemble, join_worker
from raypipe.encode.cache import EmbeddingCache
from raypipe.encode.coordinator import Coordinator
from raypipe.encode.dispatch import dispatch
from raypipe.encode.plan import plan
from raypipe.encode.pool import EncoderPool, WorkerOptions
from raypipe.inputs.images import ImageLimits, load_images
from raypipe.models.registry import vision_adapter
from raypipe.pipeline import Pipeline
from raypipe.testing.node_processes import live_children, parent_pid
from tests import llava_ov_reference as ref
from tests import minicpmv_video_reference as vref
from tests.conftest import random_images

# Longer than Ray keeps an idle task worker beyond its soft limit (`idle_worker_killing_time_threshold_ms`,
# 1 s): a join in a task would then need a fresh process.
IDLE_S = 1.5
FPS = 2.0  # a frames list is a video at 2 frames per second (`frames_fps`)


@pytest.fixture(scope="module")
def coordinator(llava_workers, llava_ckpt):
    return Coordinator(vision_adapter(llava_ckpt), EncoderPool(llava_workers[:2]), cache_bytes=0)


@pytest.fixture(scope="module")
def patched():
    with pytest.MonkeyPatch.context() as monkeypatch:
        vref.install(monkeypatch)  # transformers' video processor runnable here (torchvision stand-ins)
        yield


def _node_workers(coordinator) -> set[int]:
    """The Ray worker processes of this node: the raylet's live children (it starts every worker)."""
    return live_children(parent_pid(ray.get(coordinator.workers[0].ping.remote())))


def test_multi_unit_items_start_no_process(coordinator, llava_ckpt, llava_hf_model):
    sizes = [(300, 290), (160, 100), (100, 60)]  # 10, 7 and 5 units: base view + AnyRes tiles
    coordinator.encode(load_images(random_images(sizes, seed=90)))  # warm-up
    workers = coordinator.pool.workers
    infos = ray.get([w.info.remote() for w in workers])
    before = _node_workers(coordinator)
    for round_ in range(2):
        time.sleep(IDLE_S)
        images = random_images(sizes, seed=91 + round_)  # new images: nothing cached
        got = coordinator.encode(load_images(images))
        assert _node_workers(coordinator) <= before, "a process was started on the request's path"
        for ours, want in zip(got, ref.image_features(llava_hf_model, llava_ckpt, images, tile_every_image=True)):
            torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-4)
    joined = [after["items_joined"] - info["items_joined"] for after, info in
              zip(ray.get([w.info.remote() for w in workers]), infos)]
    assert sum(joined) == 2 * len(sizes)  # every join ran on an encoder worker


def test_join_runs_on_the_worker_holding_most_bytes(coordinator):
    adapter = coordinator.adapter
    work = plan([adapter.make_item(v) for v in load_images(random_images([(300, 290)], seed=95))], adapter,
                EmbeddingCache(0), split_units=True)
    uids = work.unit_ids(0)  # the base view (one more row) and 9 tiles
    assert join_worker(uids, {uid: 0 if uid.index < 5 else 1 for uid in uids}, work, adapter) == 0
    assert join_worker(uids, {uid: 0 if uid.index < 4 else 1 for uid in uids}, work, adapter) == 1


def test_a_join_does_not_wait_behind_an_encode(coordinator):
    """Joins have their own thread on the worker: one answers while that worker is busy encoding."""
    adapter, worker = coordinator.adapter, coordinator.workers[0]
    item = adapter.make_item(load_images(random_images([(300, 290)], seed=94))[0])
    units = adapter.units(item)
    *parts, _ = worker.encode.options(num_returns=len(units) + 1).remote(units)
    busy = worker.encode_timed.remote(units, repeats=300)  # over a second of encoding
    time.sleep(0.3)
    joined, receipt = worker.join.remote(dataclasses.replace(item, pixels=np.zeros((0, 0, 3), np.uint8)), *parts)
    ray.get(receipt)
    assert ray.wait([busy], timeout=0)[0] == []  # answered while the encode still ran
    assert ray.get(joined).shape == (item.num_tokens, adapter.hidden_size)
    ray.get(busy)


def test_pipeline_encode_takes_videos(patched, coordinator, llava_ckpt, llava_hf_model):
    """Images and videos in one call, one tensor each in input order: a video's is all its rows (every kept
    frame's pooled tokens, then the newline row), as `get_video_features` gives them."""
    pipe = Pipeline(llava_ckpt, coordinator, ImageLimits(), owns_ray=False)  # the session's workers: no shutdown
    images = random_images([(160, 100), (56, 56)], seed=96)
    source = np.random.default_rng(97).integers(0, 256, (9, 64, 48, 3), dtype=np.uint8)
    got = pipe.encode([images[0], {"type": "video", "video": list(source)}, {"type": "image", "image": images[1]}])
    image_rows = ref.image_features(llava_hf_model, llava_ckpt, images, tile_every_image=True)
    want = [image_rows[0], ref.video_features(llava_hf_model, ref.preprocess_video(llava_ckpt, source, FPS)),
            image_rows[1]]
    assert [t.shape for t in got] == [t.shape for t in want]
    for ours, theirs in zip(got, want):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    with pytest.raises(InvalidInput) as err:
        pipe.encode([images[0], {"type": "video", "video": b"not a video"}])
    assert err.value.item == "videos[0]"


def test_join_on_a_dead_worker_is_rerun(llava_workers, llava_ckpt, llava_hf_model):
    """The worker holding most of an image's units dies after encoding them: its join is re-run on the live
    worker, which fetches every unit (they live in the object store, not in the dead process)."""
    doomed = WorkerOptions(str(llava_ckpt), "float32", num_threads=1).start()
    workers = [llava_workers[0], doomed]
    pool = EncoderPool(workers)  # no options: nothing replaces the dead worker; retries go to worker 0
    adapter = vision_adapter(llava_ckpt)
    images = random_images([(300, 290), (120, 230)], seed=98)
    work = plan([adapter.make_item(v) for v in load_images(images)], adapter, EmbeddingCache(0), split_units=True)
    uids = [uid for t in range(len(work.todo)) for uid in work.unit_ids(t)]
    shards = [uids[:2], uids[2:]]  # `doomed` holds most units of both images
    unit_refs, holders, retried = dispatch(work, shards, workers, pool, max_attempts=3, on_receipt=lambda *_: None)
    assert retried == 0 and [join_worker(work.unit_ids(t), holders, work, adapter) for t in range(2)] == [1, 1]
    ray.kill(doomed)
    _wait_until_dead(doomed)
    encoded, retried_joins = assemble(work, unit_refs, holders, workers, pool, EmbeddingCache(0), adapter,
                                      max_attempts=3)
    assert retried_joins == 2
    want = ref.image_features(llava_hf_model, llava_ckpt, images, tile_every_image=True)
    for ours, want in zip(ray.get([e.ref for e in encoded]), want):
        torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-4)


def _wait_until_dead(actor, timeout_s: float = 30.0) -> None:
    """`ray.kill` returns before the actor dies: a call made right after it was once still answered (CI)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=timeout_s)
        except RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError(f"the killed actor still answers after {timeout_s} s")
