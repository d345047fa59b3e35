"""End to end through Ray: Pipeline.generate / generate_stream -> encoders -> DecodeEngine actor."""

from __future__ import annotations

import asyncio
import os

import pytest
import ray

from raypipe import InvalidInput, Pipeline, SamplingParams
from raypipe.pipeline import decode_threads
from raypipe.models.registry import vision_adapter
from tests import decode_reference as ref

MAX_NEW = 16


@pytest.fixture(scope="module", params=[1, 8], ids=["K1", "K8"])
def pipe(request, ray_local, tiny_ckpt):
    pipeline = Pipeline.from_pretrained(tiny_ckpt, num_encoders=2, num_scheduler_steps=request.param)
    yield pipeline
    pipeline.shutdown()


@pytest.fixture(scope="module")
def expected(tiny_ckpt, hf_model):
    from raypipe.models.registry import language_adapter

    tokenizer = language_adapter(tiny_ckpt).tokenizer
    vision = vision_adapter(tiny_ckpt)
    out = []
    for i in range(len(ref.REQUESTS)):
        prompt = ref.prepare(i, tokenizer, vision)
        embeds = ref.embeddings(hf_model, tiny_ckpt, prompt)
        out.append(ref.hf_generate(hf_model, prompt, embeds, MAX_NEW, tokenizer.convert_tokens_to_ids("<|im_end|>")))
    return out


def test_generate_matches_transformers_for_a_mixed_batch(pipe, expected):
    requests = [ref.request(i) for i in range(len(ref.REQUESTS))]
    outs = pipe.generate(requests, SamplingParams(max_tokens=MAX_NEW))
    assert [out.token_ids for out in outs] == expected
    assert [out.num_image_tokens > 0 for out in outs] == [bool(sizes) for _, sizes in ref.REQUESTS]
    assert pipe.stats()["decode"]["max_running_seen"] > 1


def test_generate_stream_yields_deltas_that_add_up(pipe, expected):
    async def collect():
        return [d async for d in pipe.generate_stream(ref.request(2), SamplingParams(max_tokens=MAX_NEW))]

    deltas = asyncio.run(collect())
    assert [t for d in deltas for t in d.token_ids] == expected[2]
    assert deltas[-1].finish_reason is not None and all(d.finish_reason is None for d in deltas[:-1])


def test_bad_request_names_its_index_and_runs_nothing(pipe):
    bad_image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(InvalidInput) as info:
        pipe.generate([ref.request(0), bad_image])
    assert info.value.item == "requests[1].images[0]"
    with pytest.raises(InvalidInput) as info:
        pipe.generate([ref.request(0), [{"role": "user", "content": "x" * 5000}]])
    assert info.value.item == "requests[1].prompt" and info.value.code == "prompt_too_long"
    with pytest.raises(InvalidInput):
        pipe.generate([ref.request(0)], [SamplingParams(), SamplingParams()])  # params count mismatch


def test_decode_actor_gets_an_explicit_thread_count(pipe):
    # Encoders run on this CPU beside it: half the cores (at least 1), set by Pipeline, not Ray's
    # OMP_NUM_THREADS=1 default; alone it would get every core.
    info = ray.get(pipe._engine_actor().info.remote())
    assert info["threads"] == decode_threads(os.cpu_count() or 1, encoders_on_cpu=True) == pipe.engine_config.num_threads
    assert decode_threads(16, encoders_on_cpu=False) == 16 and decode_threads(16, encoders_on_cpu=True) == 8
    assert decode_threads(1, encoders_on_cpu=True) == 1
