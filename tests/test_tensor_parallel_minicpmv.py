"""A tensor-parallel decode group for MiniCPM-V 4.6's hybrid language model, two ranks over gloo: each rank
holds half of the full-attention heads (paged K/V) and half of the gated-delta-net heads (their conv and
recurrent state rows). Greedy tokens equal one device's and transformers' generate(), K=1 and K=8, with
images, requests joining a running batch and preemption (a preempted row's state recomputed on both ranks),
with prefix caching on: both engines hold the same number of state snapshot slots (each rank its own heads')."""

from __future__ import annotations

import pytest

from raypipe import SamplingParams
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.models.prompt import build_prompt
from raypipe.models.registry import language_adapter, vision_adapter
from raypipe.parallel import runner_factory
from tests import decode_reference
from tests import minicpmv_reference as ref
from tests.conftest import random_images
from tests.test_tensor_parallel import on_both

MAX_NEW = 12
BLOCK = 8
SNAPSHOT_SHARE = 0.5
REQUESTS = [("Say something.", []), ("What is in this picture?", [(300, 500)]),
            ("Compare these:", [(60, 50), (450, 460), (100, 1000)]), ("hi", [(224, 224)]), ("x", [])]


@pytest.fixture(scope="module")
def cases(minicpmv_ckpt):
    from transformers import MiniCPMV4_6ForConditionalGeneration

    hf = MiniCPMV4_6ForConditionalGeneration.from_pretrained(minicpmv_ckpt).eval()
    tokenizer, vision = language_adapter(minicpmv_ckpt).tokenizer, vision_adapter(minicpmv_ckpt)
    out = []
    for i, (text, sizes) in enumerate(REQUESTS):
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
    longest = -(-(max(len(p.prompt_token_ids) for p, _, _ in cases) + MAX_NEW) // BLOCK)
    probe = LLMEngine(minicpmv_ckpt, EngineConfig(max_num_seqs=1, max_model_len=64, block_size=BLOCK,
                                                  state_snapshot_memory_fraction=SNAPSHOT_SHARE))
    budget = decode_reference.kv_budget(probe, 2 * longest, k=EngineConfig().num_scheduler_steps, block_size=BLOCK,
                                        max_model_len=longest * BLOCK)
    probe.shutdown()
    made = []
    for tp in (1, 2):
        config = EngineConfig(max_num_seqs=8, max_model_len=longest * BLOCK, block_size=BLOCK, num_threads=1,
                              kv_cache_memory=-(-budget // tp), tensor_parallel_size=tp,
                              state_snapshot_memory_fraction=SNAPSHOT_SHARE)
        made.append(LLMEngine(minicpmv_ckpt, config, runner_factory=runner_factory(config)))
    yield made
    for engine in made:
        engine.shutdown()


@pytest.mark.parametrize("k", [1, 8])
def test_group_greedy_equals_one_device_and_generate(engines, cases, k):
    single, group = engines
    assert single.runner.cache.num_blocks == group.runner.cache.num_blocks
    assert single.runner.num_snapshots == group.runner.num_snapshots > 0
    one, two = on_both(engines, k, cases, [SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)] * len(cases), "mini")
    assert two == one == [w for _, _, w in cases]
    assert group.stats()["preemptions"] > 0 and group.stats()["failed_rounds"] == 0


def test_each_rank_holds_half_of_the_linear_attention_state(engines):
    single, group = engines
    rows = [layer for layer in group.runner.cache.caches if layer.layer_type == "linear_attention"]
    whole = [layer for layer in single.runner.cache.caches if layer.layer_type == "linear_attention"]
    assert rows and all(a.recurrent.shape[1] * 2 == b.recurrent.shape[1] and a.conv.shape[1] * 2 == b.conv.shape[1]
                        for a, b in zip(rows, whole))
    ranks = group.runner.info()
    assert ranks[0]["parameter_bytes"]["decoder_layers"] == ranks[1]["parameter_bytes"]["decoder_layers"]


def test_group_repeat_hits_through_a_mirrored_state_snapshot(engines, cases):
    """The one-image prompt twice on each engine: generate()'s tokens both times, the repeat continuing from a
    state snapshot (restored on every rank, each its own heads' rows), as many hit tokens on both."""
    import asyncio

    prompt, features, want = cases[1]
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
