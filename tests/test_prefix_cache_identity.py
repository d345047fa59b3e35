"""Prefix-cache keys of visual items are identities (content hash + the parameters that shaped the
item's tokens), not the bits of their embeddings (Qwen2.5-VL, tiny preset).

The same image encoded twice need not give the same bits: which images share its forward, the
machine's kernels and the dtype change them. On this CPU the tiny tower's rows happen to be bitwise
equal whatever the companions, so the re-encode here also runs on a worker started with other CPU
kernels (`ATEN_CPU_CAPABILITY=default`, as a node with another CPU would), and the test checks that
its rows really differ before it checks that the prefix cache still hits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
import ray
import torch

from raypipe import SamplingParams
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.decode.prefix_hash import placeholder_runs
from raypipe.encode.coordinator import Coordinator
from raypipe.encode.pool import EncoderPool, WorkerOptions
from raypipe.encode.worker import RemoteEncoderWorker
from raypipe.models.prompt import build_prompt
from raypipe.models.registry import vision_adapter
from tests import decode_reference as ref
from tests.conftest import random_images

BLOCK = 8


@pytest.fixture(scope="module")
def workers(ray_local, tiny_ckpt):
    """`(here, elsewhere)`: two tiny encoder workers, the second with other CPU kernels."""
    here = WorkerOptions(str(tiny_ckpt), "float32", num_threads=1).start()
    elsewhere = RemoteEncoderWorker.options(
        num_cpus=0, runtime_env={"env_vars": {"ATEN_CPU_CAPABILITY": "default"}}).remote(
        str(tiny_ckpt), dtype="float32", num_threads=1)
    ray.get([here.info.remote(), elsewhere.info.remote()])
    yield here, elsewhere
    for worker in (here, elsewhere):
        ray.kill(worker)


def test_an_image_re_encoded_elsewhere_still_hits_the_prefix_cache(workers, tiny_ckpt):
    vision = vision_adapter(tiny_ckpt)
    here, elsewhere = workers
    image, *companions = random_images([(112, 168), (84, 140), (224, 224)], seed=7)
    engine = LLMEngine(tiny_ckpt, EngineConfig(max_num_seqs=2, max_model_len=512, block_size=BLOCK))
    try:
        first = build_prompt(ref.messages("What is in this picture?", [image]), engine.tokenizer, vision)
        second = build_prompt(ref.messages("Which colors do you see?", [image]), engine.tokenizer, vision)
        # Two encoder replicas, no embedding cache: the image alone on one; on the other, between two
        # companions in one shard, on the worker with other kernels.
        [rows_a] = Coordinator(vision, EncoderPool([here])).encode(first.visuals)
        trio = build_prompt(ref.messages("x", [companions[0], image, companions[1]]), engine.tokenizer, vision)
        rows_b = Coordinator(vision, EncoderPool([elsewhere])).encode(trio.visuals)[1]
        assert trio.visuals[1].content_hash == first.visuals[0].content_hash
        assert not torch.equal(rows_a, rows_b)  # other bits ...
        torch.testing.assert_close(rows_b, rows_a, atol=1e-5, rtol=1e-4)  # ... of the same embedding

        def hits(tag, prompt, rows) -> int:
            before = engine.stats()["prefix_cache_hit_tokens"]
            asyncio.run(engine.generate_output(tag, prompt.without_pixels(), [rows], SamplingParams(max_tokens=4)))
            return engine.stats()["prefix_cache_hit_tokens"] - before

        assert hits("first", first, rows_a) == 0
        # Cached now: the first prompt's full blocks. The second reuses every block of their common
        # prefix (the image included), short of its last token.
        ids = second.prompt_token_ids
        common = len(os.path.commonprefix([ids, first.prompt_token_ids]))
        image_end = max(i for i, t in enumerate(ids) if t in vision.placeholder_token_ids.values()) + 1
        assert common > image_end
        assert hits("second", second, rows_b) == min(common, len(ids) - 1) // BLOCK * BLOCK
    finally:
        engine.shutdown()


def test_other_processing_of_the_same_pixels_is_another_key(tiny_ckpt):
    """The digest follows the content hash and every layout parameter that shapes the item's tokens
    (grid, a video's seconds per grid and EVS rate); the same identity gives the same digest."""
    from raypipe.models.registry import language_adapter

    lang = language_adapter(tiny_ckpt)
    vision = vision_adapter(tiny_ckpt)
    video = build_prompt(
        {"prompt_token_ids": [1, vision.placeholder_token_ids["video"], 2],
         "videos": [[frame for frame in random_images([(56, 84)] * 4, seed=3)]]}, lang.tokenizer, vision)
    layout = video.visual_layouts[0]
    assert layout.content_hash == video.visuals[0].content_hash and layout.kind == "video"

    def digest(changed) -> bytes:
        return placeholder_runs(video.prompt_token_ids, [changed], lang)[0][2]

    same = digest(layout)
    assert digest(dataclasses.replace(layout)) == same
    others = [dataclasses.replace(layout, content_hash="0" * 32),
              dataclasses.replace(layout, seconds_per_grid=layout.seconds_per_grid * 2),
              dataclasses.replace(layout, pruning_rate=0.5),
              dataclasses.replace(layout, grid=(layout.grid[0], layout.grid[1] * 2, layout.grid[2] // 2)),
              dataclasses.replace(layout, content_hash=None)]
    digests = [digest(other) for other in others]
    assert same not in digests and len(set(digests)) == len(digests)
    assert digest(others[-1]) != digests[-1]  # no identity: a digest of its own every time
