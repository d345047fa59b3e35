"""A tensor-parallel decode group for MiniCPM-V 4.6's hybrid language model, two ranks over gloo: each rank
holds half of the full-attention heads (paged K/V) and half of the gated-delta-net heads (their conv and
recurrent state rows). Greedy tokens equal one device's and transformers' generate(), K=1 and K=8, with
images, requests joining a running batch and preemption (a preempted row's state recomputed on both ranks),
with prefix caching on: both engines hold the same number of state snapshot slots (each rank its own heads')."""

from __future__ import annotations

import pytest

from raypipe import SamplingParams
from raypipe.models.prompt import build_prompt
from raypipe.models.registry import language_adapter, vision_adapter
from tests import decode_reference
from tests import minicpmv_reference as ref
from tests.conftest import random_images
from tests.test_tensor_parallel import on_both, one_device_and_group

MAX_NEW = 12
BLOCK = 8
SNAPSHOT_SHARE = 0.5
REQUESTS = [("Say something.", []), ("What is in this picture?", [(300, 500)]),
            ("Compare these:", [(60, 50), (450, 460), (100, 1000)]), ("hi", [(224, 224)]), ("x", [])]
# Only the repeat test sends it: on a prompt no earlier test cached, which blocks and snapshots a hit finds
# does not depend on how the staggered runs before it interleaved, so both engines hit the same.
REPEATED = ("Describe it.", [(200, 300)])


@pytest.fixture(scope="module")
def cases(minicpmv_ckpt):
    from transformers import MiniCPMV4_6ForConditionalGeneration

    hf = MiniCPMV4_6ForConditionalGeneration.from_pretrained(minicpmv_ckpt).eval()
    tokenizer, vision = language_adapter(minicpmv_ckpt).tokenizer, vision_adapter(minicpmv_ckpt)
    out = []
    for i, (text, sizes) in enumerate([*REQUESTS, REPEATED]):
        prompt = build_prompt(decode_reference.messages(text, random_images(sizes, seed=i)), tokenizer, vision)
        embeds = ref.image_embeddings(hf, minicpmv_ckpt, [image.pixels for image in prompt.visuals])
        out.append((prompt, embeds, ref.hf_generate(hf, prompt.prompt_token_ids, embeds, MAX_NEW)))
    assert len({tuple(want) for _, _, want in out}) == len(out)
    return out


@pytest.fixture(scope="module")
def engines(minicpmv_ckpt, cases, ray_local):
    """One device and a group of two with the same number of blocks and state snapshot slots: about two of the
    longest requests' worth of blocks, so a batch of all of them preempts. Prefix caching on (the default),
    so the group keeps mirrored state snapshots; half the budget for them, so a prompt's snapshot outlives
    the one its request takes where it stops."""
    made = one_device_and_group(minicpmv_ckpt, cases, block=BLOCK, max_new=MAX_NEW,
                                shares={"state_snapshot_memory_fraction": SNAPSHOT_SHARE})
    yield made
    for engine in made:
        engine.shutdown()


@pytest.mark.parametrize("k", [1, 8])
def test_group_greedy_equals_one_device_and_generate(engines, cases, k):
    cases = cases[: len(REQUESTS)]
    single, group = engines
    assert single.runner.cache.num_blocks == group.runner.cache.num_blocks
    assert single.runner.num_snapshots == group.runner.num_snapshots > 0
    one, two = on_both(engines, k, cases, [SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)] * len(cases), "mini")
    assert two == one == [w for _, _, w in cases]
    assert group.stats()["failed_rounds"] == 0
    # The pool fits about two of the longest requests, so K=8's batch preempts. K=1's staggered batch stopped
    # preempting with the burst change (a prefill keeps a state where waiting prompts branch off it; requests
    # of one event-loop turn reach the scheduler together): bisected to that merge, outputs unchanged.
    if k == 8:
        assert group.stats()["preemptions"] > 0


def test_each_rank_holds_half_of_the_linear_attention_state(engines):
    single, group = engines
    rows = [layer for layer in group.runner.cache.caches if layer.layer_type == "linear_attention"]
    whole = [layer for layer in single.runner.cache.caches if layer.layer_type == "linear_attention"]
    assert rows and all(a.recurrent.shape[1] * 2 == b.recurrent.shape[1] and a.conv.shape[1] * 2 == b.conv.shape[1]
                        for a, b in zip(rows, whole))
    ranks = group.runner.info()
    assert ranks[0]["parameter_bytes"]["decoder_layers"] == ranks[1]["parameter_bytes"]["decoder_layers"]


def test_group_repeat_hits_through_a_mirrored_state_snapshot(engines, cases):
    """`REPEATED` twice on each engine: generate()'s tokens both times, the repeat continuing from a
    state snapshot (restored on every rank, each its own heads' rows), as many hit tokens on both."""
    import asyncio

    prompt, features, want = cases[-1]
    hits = []
    for engine in engines:
        for i in range(2):
            before = engine.stats()
            out = asyncio.run(engine.generate_output(f"repeat-{id(engine)}-{i}", prompt, features,
                                                     SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)))
            assert out.token_ids == want
        after = engine.stats()
        hits.append((after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"],
                     after["snapshot_hits"] - before["snapshot_hits"]))
    assert hits[0] == hits[1] and hits[1][0] > 0 and hits[1][1] == 1
