"""MiniCPM-V 4.6's hybrid language model (gated-delta-net state rows + full-attention K/V rows) in the
engine: greedy equals transformers' generate() token for token, for K=1 and K=8."""

from __future__ import annotations

import asyncio

import pytest

from raypipe import SamplingParams
from raypipe.models.prompt import build_prompt
from raypipe.models.registry import vision_adapter
from tests import decode_reference as decode_ref
from tests import minicpmv_reference as ref
from tests.conftest import random_images
from tests.decode_reference import messages

MAX_NEW = 16
# (text, image sizes): text only, one image, several (one without slices), different lengths.
REQUESTS = [
    ("Say something.", []),
    ("What is in this picture?", [(300, 500)]),
    ("Compare these:", [(60, 50), (450, 460), (100, 1000)]),
    ("hi", [(224, 224)]),
    ("A longer text-only prompt, longer than the others in the batch by a fair margin.", []),
    ("two", [(30, 400), (200, 260)]),
    ("x", []),
    ("Describe it.", [(400, 300)]),
]


@pytest.fixture(scope="module")
def engines(minicpmv_ckpt):
    with decode_ref.engine_pool(minicpmv_ckpt, max_num_seqs=8, max_model_len=1024) as get:
        yield get


@pytest.fixture(scope="module")
def hf(minicpmv_ckpt):
    from transformers import MiniCPMV4_6ForConditionalGeneration

    return MiniCPMV4_6ForConditionalGeneration.from_pretrained(minicpmv_ckpt).eval()


@pytest.fixture(scope="module")
def cases(minicpmv_ckpt, engines, hf):
    """Prompt, transformers' image embeddings and its greedy tokens for each request."""
    tokenizer, vision = engines(8).tokenizer, vision_adapter(minicpmv_ckpt)
    out = []
    for i, (text, sizes) in enumerate(REQUESTS):
        prompt = build_prompt(messages(text, random_images(sizes, seed=i)), tokenizer, vision)
        embeds = ref.image_embeddings(hf, minicpmv_ckpt, [image.pixels for image in prompt.visuals])
        out.append((prompt, embeds, ref.hf_generate(hf, prompt.prompt_token_ids, embeds, MAX_NEW)))
    assert len({tuple(want) for _, _, want in out}) == len(out)  # the oracle tells prompts apart
    return out


def run(coro):
    return asyncio.run(coro)


def greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize("case", [0, 1, 2], ids=["text", "one_image", "three_images"])
def test_single_request_matches_generate(engines, cases, k, case):
    prompt, embeds, want = cases[case]
    out = run(engines(k).generate_output(f"single-{k}-{case}", prompt, embeds, greedy()))
    assert out.token_ids == want


@pytest.mark.parametrize("k", [1, 8])
def test_staggered_requests_join_a_running_batch(engines, cases, k):
    engine = engines(k)
    before = engine.stats()
    max_tokens = [MAX_NEW, 5, 12, MAX_NEW, 1, 9, 13, 3]

    async def one(i):
        await asyncio.sleep(0.01 * i)  # arrive while earlier requests are mid-generation
        prompt, embeds, _ = cases[i]
        return await engine.generate_output(f"batch-{k}-{i}", prompt, embeds, greedy(max_tokens[i]))

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(len(cases))))

    for i, out in enumerate(run(all_of_them())):
        assert out.token_ids == cases[i][2][: max_tokens[i]], f"request {i}"
    after = engine.stats()
    assert after["max_running_seen"] > 1 and after["prefill_batches"] - before["prefill_batches"] >= 2
    assert after["running"] == 0


def test_prompts_of_different_lengths_prefilled_together(engines, cases, hf):
    # Lengths within the scheduler's padding cap share one prefill group; a linear-attention state
    # must not run on through a shorter row's padding (the runner splits such groups by length).
    # Without prefix caching: the prompts share prefixes, and hits would make their chunks differ.
    engine = engines(8, enable_prefix_caching=False)
    base = cases[4][0].prompt_token_ids
    prompts = [base[:-3], base[:-2], base, base[:-2] + base[-1:]]
    wants = [ref.hf_generate(hf, ids, [], MAX_NEW) for ids in prompts]

    async def at_once():
        # Submitted in one turn of the event loop: the engine takes them in one round.
        return await asyncio.gather(*(engine.generate_output(f"group-{i}", ids, [], greedy())
                                      for i, ids in enumerate(prompts)))

    before = engine.stats()["prefill_batches"]
    assert [out.token_ids for out in run(at_once())] == wants
    assert engine.stats()["prefill_batches"] - before == 1  # one group of different lengths


def test_seeded_sampling_is_independent_of_the_batch(engines, cases):
    engine = engines(8)
    prompt, embeds, _ = cases[2]
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=40, top_p=0.95, seed=7)
    alone = run(engine.generate_output("seed-alone", prompt, embeds, params)).token_ids

    async def busy():
        others = [engine.generate_output(f"noise-{i}", cases[i][0], cases[i][1],
                                         SamplingParams(max_tokens=10, temperature=1.0)) for i in (0, 3, 5)]
        return (await asyncio.gather(*others, engine.generate_output("seed-busy", prompt, embeds, params)))[-1]

    assert run(busy()).token_ids == alone


def test_abort_frees_state_rows_and_moves_the_others(engines, cases):
    engine = engines(1)

    async def scenario():
        long = asyncio.ensure_future(engine.generate_output("abort-me", cases[1][0], cases[1][1], greedy(400)))
        await asyncio.sleep(0.05)
        # Two more join behind it (rows 1 and 2); aborting row 0 moves the last row's state into it.
        rest = [asyncio.ensure_future(engine.generate_output(f"stay-{i}", cases[i][0], cases[i][1], greedy()))
                for i in (2, 3)]
        while engine.stats()["running"] < 3:
            await asyncio.sleep(0.005)
        engine.abort("abort-me")
        aborted = await long
        return aborted, [await r for r in rest]

    aborted, rest = run(scenario())
    assert aborted.finish_reason == "abort"
    assert [out.token_ids for out in rest] == [cases[2][2], cases[3][2]]
    stats = engine.stats()
    assert stats["running"] == 0 and stats["requests_aborted"] >= 1


@pytest.mark.parametrize("k", [1, 8])
def test_preempted_sequences_resume_with_the_same_tokens(engines, cases, k):
    """On resume a preempted sequence continues from its longest cached prefix with a snapshot of its
    gated-delta-net state there (its own, registered when it was preempted), recomputing the rest."""
    outs, stats = decode_ref.preempted_copies(engines, k, cases[1], greedy())
    assert [out.token_ids for out in outs] == [cases[1][2]] * 4
    assert stats["preemptions"] > 0 and stats["kv_blocks_used"] == 0 and stats["running"] == 0
    assert stats["prefix_caching"] is True and stats["chunked_prefill"] is True

