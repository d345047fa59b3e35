"""LLaVA-OneVision in the decode engine: greedy equals transformers' generate() token for token, K=1 and K=8,
with requests joining a running batch (Qwen2 text model, every layer full attention, 1-D positions)."""

from __future__ import annotations

import asyncio

import pytest

from raypipe import SamplingParams
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.models.prompt import build_prompt
from raypipe.models.registry import vision_adapter
from tests import llava_ov_reference as ref
from tests.conftest import random_images

MAX_NEW = 16
# (text, image sizes): text only, one image, several of mixed aspect ratios (one shrunk past anyres_max).
REQUESTS = [
    ("Say something.", []),
    ("What is in this picture?", [(100, 60)]),
    ("Compare these three, please:", [(40, 170), (300, 290), (20, 30)]),
    ("hi", [(500, 70)]),
    ("A much longer text-only prompt that makes this row longer than the others in the batch.", []),
    ("two", [(160, 100), (56, 56)]),
    ("x", []),
    ("Describe.", [(120, 230)]),
]


@pytest.fixture(scope="module")
def engines(llava_ckpt):
    made = {}

    def get(k: int) -> LLMEngine:
        if k not in made:
            made[k] = LLMEngine(llava_ckpt, EngineConfig(max_num_seqs=8, max_model_len=1024, num_scheduler_steps=k))
        return made[k]

    yield get
    for engine in made.values():
        engine.shutdown()


@pytest.fixture(scope="module")
def cases(llava_ckpt, llava_hf_model, engines):
    """Prompt, transformers' image features and transformers' greedy tokens for each request."""
    engine = engines(8)
    vision = vision_adapter(llava_ckpt)
    eos = engine.adapter.eos_token_ids[0]
    out = []
    for i, (text, sizes) in enumerate(REQUESTS):
        images = random_images(sizes, seed=i)
        content = [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": text}]
        prompt = build_prompt([{"role": "user", "content": content}], engine.tokenizer, vision)
        features = ref.image_features(llava_hf_model, llava_ckpt, images)
        want = ref.generate(llava_hf_model, prompt.prompt_token_ids, features, MAX_NEW)
        out.append((prompt, features, want[: want.index(eos) + 1] if eos in want else want))
    assert len({tuple(w) for _, _, w in out}) > 1  # the prompts lead to different outputs
    return out


@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize("case", [0, 1, 2], ids=["text", "one_image", "three_images"])
def test_single_request_matches_generate(engines, cases, k, case):
    prompt, features, want = cases[case]
    out = asyncio.run(engines(k).generate_output(f"single-{k}-{case}", prompt, features,
                                                 SamplingParams(max_tokens=MAX_NEW)))
    assert out.token_ids == want
    assert out.num_image_tokens == prompt.num_image_tokens


@pytest.mark.parametrize("k", [1, 8])
def test_staggered_requests_join_a_running_batch(engines, cases, k):
    engine = engines(k)
    before = engine.stats()
    max_tokens = [MAX_NEW, 5, 15, MAX_NEW, 1, 9, 13, 16]

    async def one(i):
        await asyncio.sleep(0.003 * i)  # arrive while earlier requests are mid-generation
        prompt, features, _ = cases[i]
        return await engine.generate_output(f"batch-{k}-{i}", prompt, features,
                                            SamplingParams(max_tokens=max_tokens[i]))

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(len(cases))))

    for i, out in enumerate(asyncio.run(all_of_them())):
        assert out.token_ids == cases[i][2][: max_tokens[i]], f"request {i}"
    after = engine.stats()
    assert after["max_running_seen"] > 1
    assert after["prefill_batches"] - before["prefill_batches"] >= 2  # later requests joined a running batch
    assert after["running"] == 0 and after["waiting"] == 0


def test_the_same_image_with_another_question_reuses_its_cached_blocks(engines, cases, llava_ckpt, llava_hf_model):
    """Every layer is full attention, so prefix caching is on by default: the blocks up to the question
    come from the cache, and the output is still transformers' own."""
    engine = engines(8)
    assert engine.stats()["prefix_caching"] is True
    first, features, _ = cases[1]
    image = random_images(REQUESTS[1][1], seed=1)[0]
    content = [{"type": "image", "image": image}, {"type": "text", "text": "Which colors are there?"}]
    prompt = build_prompt([{"role": "user", "content": content}], engine.tokenizer, vision_adapter(llava_ckpt))
    want = ref.generate(llava_hf_model, prompt.prompt_token_ids, features, MAX_NEW)
    eos = engine.adapter.eos_token_ids[0]
    want = want[: want.index(eos) + 1] if eos in want else want
    asyncio.run(engine.generate_output("prefix-first", first, features, SamplingParams(max_tokens=MAX_NEW)))
    before = engine.stats()["prefix_cache_hit_tokens"]
    out = asyncio.run(engine.generate_output("prefix-again", prompt, features, SamplingParams(max_tokens=MAX_NEW)))
    hits = engine.stats()["prefix_cache_hit_tokens"] - before
    assert out.token_ids == want
    common = next(i for i, (a, b) in enumerate(zip(first.prompt_token_ids, prompt.prompt_token_ids)) if a != b)
    block = engine.config.block_size
    image_end = max(i for i, t in enumerate(prompt.prompt_token_ids)
                    if t in engine.adapter.placeholder_token_ids.values()) + 1
    assert hits == common // block * block >= image_end // block * block
    assert hits > 0
