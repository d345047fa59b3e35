"""Step3 in the decode engine: greedy equals transformers' generate() token for token, K=1 and K=8.

Every prompt is longer than the tiny preset's 16-token sliding window, so the sliding layers'
window (and its masks in prefill, in decode and across rows of different lengths) decides the
output; the full-attention layer sees the whole prompt; the MoE layers route each token to 2 of 4
experts.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from raypipe import SamplingParams
from raypipe.models.prompt import build_prompt
from raypipe.models.registry import vision_adapter
from tests import decode_reference as decode_ref
from tests import step3_reference as ref
from tests.conftest import random_images

MAX_NEW = 20
# (text, image sizes): text only, one image, several (with and without crops), a long text.
REQUESTS = [
    ("Say something.", []),
    ("What is in this picture?", [(300, 200)]),
    ("Compare these three, please:", [(120, 100), (60, 500), (224, 224)]),
    ("hi", [(400, 700)]),
    ("A much longer text-only prompt that makes this row longer than the others in the batch, "
     "and much longer than the sliding window.", []),
    ("two", [(20, 400), (50, 80)]),
    ("x", []),
    ("Describe.", [(700, 120)]),
]


@pytest.fixture(scope="module")
def engines(step3_ckpt):
    with decode_ref.engine_pool(step3_ckpt, max_num_seqs=8, max_model_len=512) as get:
        yield get


@pytest.fixture(scope="module")
def cases(step3_ckpt, step3_hf_model, engines):
    """Prompt, transformers' image features and transformers' greedy tokens for each request."""
    engine = engines(8)
    vision = vision_adapter(step3_ckpt)
    eos = engine.adapter.eos_token_ids[0]
    window = engine.adapter.text_config.sliding_window
    out = []
    for i, (text, sizes) in enumerate(REQUESTS):
        images = random_images(sizes, seed=i)
        content = [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": text}]
        prompt = build_prompt([{"role": "user", "content": content}], engine.tokenizer, vision)
        assert prompt.num_prompt_tokens > window
        features = ref.image_features(step3_hf_model, step3_ckpt, images)
        want = ref.generate(step3_hf_model, prompt.prompt_token_ids, features, MAX_NEW)
        out.append((prompt, features, want[: want.index(eos) + 1] if eos in want else want))
    assert len({tuple(w) for _, _, w in out}) > 1  # the prompts lead to different outputs
    return out


@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize("case", [0, 1, 2, 4], ids=["text", "one_image", "three_images", "long_text"])
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
    max_tokens = [MAX_NEW, 5, 17, MAX_NEW, 1, 9, 13, 20]

    async def one(i):
        await asyncio.sleep(0.01 * i)  # arrive while earlier requests are mid-generation
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


@pytest.mark.parametrize("k", [1, 8])
def test_preempted_sequences_resume_with_the_same_tokens(engines, cases, k):
    """On resume a preempted sequence continues from its longest cached prefix whose window blocks are
    still cached (its own, registered when it was preempted), recomputing the rest. The copies share
    the prompt's blocks, so the pool has room for one prompt and 4 blocks: their outputs' blocks
    (3 each) overflow it."""
    outs, stats = decode_ref.preempted_copies(engines, k, cases[1], SamplingParams(max_tokens=MAX_NEW),
                                              spare_blocks=4)
    assert [out.token_ids for out in outs] == [cases[1][2]] * 4
    assert stats["preemptions"] > 0 and stats["kv_blocks_used"] == 0 and stats["running"] == 0
    assert stats["sliding_kv_blocks_used"] == 0
    assert stats["prefix_caching"] is True and stats["chunked_prefill"] is True


def test_window_blocks_leave_the_pool_as_the_window_moves_on(engines, cases):
    """While one long sequence decodes, its full-attention blocks grow with its length and its sliding
    layers' blocks stay at what the window spans (read from the pools' counts after every token)."""
    engine = engines(1)
    prompt, features, want = cases[4]
    size, window = engine.config.block_size, engine.adapter.text_config.sliding_window
    seen = []

    async def run():
        out = []
        async for delta in engine.generate("window-blocks", prompt, features, SamplingParams(max_tokens=MAX_NEW)):
            out += delta.token_ids
            stats = engine.stats()
            seen.append((stats["kv_blocks_used"], stats["sliding_kv_blocks_used"]))
        return out

    assert asyncio.run(run()) == want
    full, sliding = zip(*seen[:-1])  # the last delta comes after its blocks went back
    length = len(prompt.prompt_token_ids) + len(want)
    assert max(full) == -(-(length - 1) // size) > 2 * (-(-(window - 1 + 1) // size) + 1)
    assert max(sliding) <= -(-(window - 1 + 1) // size) + 1  # window keys and the next token, any offset
    assert engine.stats()["sliding_kv_blocks_used"] == 0


def test_a_hit_needs_the_window_before_it(engines, cases):
    """A prompt whose full-attention blocks are all cached but whose window blocks near the end were
    evicted hits only as far as its window blocks are still cached; greedy stays equal to generate()."""
    from raypipe.decode.prefix_hash import extend_block_hashes

    engine = engines(1)
    prompt, features, want = cases[4]  # text only: its block hashes are the tokens' alone
    ids, size = prompt.prompt_token_ids, engine.config.block_size
    first = asyncio.run(engine.generate_output("window-hit-0", prompt, features, SamplingParams(max_tokens=MAX_NEW)))
    assert first.token_ids == want
    hashes: list[bytes] = []
    extend_block_hashes(hashes, ids, size, (len(ids) - 1) // size, ())
    assert len(hashes) >= 6
    # Keep the window blocks of the first 3 blocks (taken and let go: now the most recently used),
    # evict every other cached window block (fresh blocks taken from the LRU's old end and let go).
    pool = engine.window.pool
    early = pool.take_cached(hashes[:3])
    assert len(early) == 3
    pool.release(early)
    pool.release(pool.allocate(pool.num_available - 3))
    assert all(h in engine.pool.cached for h in hashes)  # every full-attention block still cached
    again = asyncio.run(engine.generate_output("window-hit-1", prompt, features, SamplingParams(max_tokens=MAX_NEW)))
    assert again.token_ids == want
    assert again.num_cached_tokens == 3 * size  # the query at 3 blocks sees block 2 only (window <= block)
    third = asyncio.run(engine.generate_output("window-hit-2", prompt, features, SamplingParams(max_tokens=MAX_NEW)))
    assert third.token_ids == want and third.num_cached_tokens == len(hashes) * size  # windows cached again


@pytest.mark.parametrize("limit", [float("inf"), 0.05])
def test_grouped_experts_equal_transformers_expert_loop(step3_hf_model, limit):
    """On CUDA the engine runs Step3's routed experts as transformers' grouped GEMMs (models/step3/grouped_experts.py:
    its expert loop reads the routing on the host, so a decode step could not be captured). The same kernel here on
    the CPU against transformers' loop: the SwiGLU clamp off and on, and with a rank's sentinel index (tokens routed
    to experts another rank holds contribute nothing)."""
    import copy

    from raypipe.models.step3.grouped_experts import to_grouped

    loop = copy.deepcopy(next(m for m in step3_hf_model.modules() if type(m).__name__ == "Step3p7Experts"))
    loop.limit = limit
    grouped = copy.deepcopy(loop)
    to_grouped(grouped)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, loop.hidden_dim, generator=generator)
    weights, index = torch.rand(13, loop.num_experts, generator=generator).topk(2, dim=-1)
    with torch.no_grad():
        want = loop(hidden, index, weights)
        assert want.abs().max() > 0
        torch.testing.assert_close(grouped(hidden, index, weights), want)
        elsewhere = torch.where(index == 0, loop.num_experts, index)  # expert 0 is another rank's
        grouped._is_expert_parallel = True
        want = loop(hidden, elsewhere, weights)
        torch.testing.assert_close(grouped(hidden, elsewhere, weights), want)
