"""A tensor-parallel decode group (raypipe/parallel/): Qwen2.5-VL over two ranks (gloo on CPU) gives the
same greedy tokens as one device and as transformers' generate(), K=1 and K=8, with images, prefix-cache
hits, preemption and chunked prefill; its log-probabilities match one device's; each rank holds half of
the decoder layers' weights, as its own process reports.

One group for the module (starting one costs seconds: an actor, its imports, its shard); K is switched
between runs on the same engines (it shapes rounds only, never outputs).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from raypipe import SamplingParams
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.models.registry import language_adapter, preset_checkpoint, vision_adapter
from raypipe.parallel import runner_factory
from raypipe.parallel.rank_runner import weight_shard
from raypipe.parallel.shards import sharded_parameter_bytes, tp_plan
from raypipe.parallel.step3_shards import Step3Shard
from tests import decode_reference as ref
from tests.conftest import STATIC_STEPS_FORCED

MAX_NEW = 16
BLOCK = 8
POOL_BLOCKS = 24  # 192 tokens of K/V for 8 concurrent requests of ~30-110: the newest are preempted
CONFIG = dict(max_num_seqs=8, max_model_len=POOL_BLOCKS * BLOCK, block_size=BLOCK, num_threads=1,
              max_num_batched_tokens=48)  # prompts longer than 48 tokens are prefilled in chunks


def start(ckpt, tp: int, kv_cache_memory: int) -> LLMEngine:
    config = EngineConfig(**CONFIG, tensor_parallel_size=tp, kv_cache_memory=kv_cache_memory)
    return LLMEngine(ckpt, config, runner_factory=runner_factory(config))


@pytest.fixture(scope="module")
def engines(tiny_ckpt, ray_local):
    probe = LLMEngine(tiny_ckpt, EngineConfig(max_num_seqs=1, max_model_len=64))
    per_token = probe.runner.bytes_per_token  # one device's K/V bytes per token (every head)
    probe.shutdown()
    # kv_cache_memory is per device: a rank holds half the heads, so half the bytes give the same blocks.
    single = start(tiny_ckpt, 1, POOL_BLOCKS * BLOCK * per_token)
    group = start(tiny_ckpt, 2, POOL_BLOCKS * BLOCK * per_token // 2)
    yield single, group
    group.shutdown()
    single.shutdown()


@pytest.fixture(scope="module")
def cases(engines, hf_model, tiny_ckpt):
    """(prompt, transformers' image embeddings, transformers' greedy tokens) per request."""
    engine = engines[0]
    vision = vision_adapter(tiny_ckpt)
    eos = engine.adapter.eos_token_ids[0]
    out = []
    for i in range(len(ref.REQUESTS)):
        prompt = ref.prepare(i, engine.tokenizer, vision)
        embeds = ref.embeddings(hf_model, tiny_ckpt, prompt)
        out.append((prompt, embeds, ref.hf_generate(hf_model, prompt, embeds, MAX_NEW, eos)))
    assert len({tuple(want) for _, _, want in out}) > 1
    assert max(len(p.prompt_token_ids) for p, _, _ in out) > CONFIG["max_num_batched_tokens"]
    return out


def with_k(engine: LLMEngine, k: int) -> LLMEngine:
    engine.config.num_scheduler_steps = k
    return engine


def on_both(engines, k: int, cases, params, tag: str) -> tuple[list, list]:
    """Token ids of `cases` (staggered arrivals) on one device and on the group, both at K=k."""
    single, group = (with_k(e, k) for e in engines)
    return ([o.token_ids for o in ref.staggered(single, cases, params, f"{tag}-tp1-{k}")],
            [o.token_ids for o in ref.staggered(group, cases, params, f"{tag}-tp2-{k}")])


def one_device_and_group(checkpoint, cases, *, block: int, max_new: int, shares: dict | None = None,
                         **config) -> list[LLMEngine]:
    """One device and a group of two with the same pool: about two of the longest `cases`' worth of blocks,
    so a batch of all of them preempts. The budget buys those full-attention blocks with their window-pool
    and snapshot shares (`shares`: EngineConfig fields that size them, on both engines and the probe);
    a rank holds half the heads, so half the bytes."""
    longest = -(-(max(len(p.prompt_token_ids) for p, _, _ in cases) + max_new) // block)
    probe = LLMEngine(checkpoint, EngineConfig(max_num_seqs=1, max_model_len=64, block_size=block, **(shares or {})))
    budget = ref.kv_budget(probe, 2 * longest, k=EngineConfig().num_scheduler_steps, block_size=block,
                           max_model_len=longest * block)
    probe.shutdown()
    made = []
    for tp in (1, 2):
        engine_config = EngineConfig(max_num_seqs=8, max_model_len=longest * block, block_size=block, num_threads=1,
                                     kv_cache_memory=-(-budget // tp), tensor_parallel_size=tp,
                                     **(shares or {}), **config)
        made.append(LLMEngine(checkpoint, engine_config, runner_factory=runner_factory(engine_config)))
    return made


def test_group_with_a_compiled_static_step_equals_generate(engines, cases, tiny_ckpt):
    """compiled_decode=True on a group: every rank builds the static step over its own shard and cache and warms it
    up beside rank 0 (torch.compile: gloo all-reduces between the compiled pieces); a staggered K=8 batch with images,
    chunked prefills and a small pool gives transformers' tokens."""
    config = EngineConfig(**{**CONFIG, "num_scheduler_steps": 8}, tensor_parallel_size=2, compiled_decode=True,
                          kv_cache_memory=POOL_BLOCKS * BLOCK * engines[0].runner.bytes_per_token // 2,
                          decode_batch_buckets=(CONFIG["max_num_seqs"],), decode_kv_buckets=(CONFIG["max_model_len"],))
    group = LLMEngine(tiny_ckpt, config, runner_factory=runner_factory(config))
    try:
        assert group.stats()["decode_step"]["mode"] == "torch.compile", group.stats()["decode_step"]
        outs = ref.staggered(group, cases, [SamplingParams(max_tokens=MAX_NEW)] * len(cases), "static")
        assert [o.token_ids for o in outs] == [want for _, _, want in cases]
        assert group.stats()["chunked_prefills"] > 0
    finally:
        group.shutdown()


@pytest.mark.parametrize("k", [1, 8])
def test_group_greedy_equals_one_device_and_generate(engines, cases, k):
    group = engines[1]
    before = group.stats()
    one, two = on_both(engines, k, cases, [SamplingParams(max_tokens=MAX_NEW)] * len(cases), "qwen")
    want = [w for _, _, w in cases]
    assert two == one == want
    after = group.stats()
    assert after["preemptions"] > 0  # the K=1 run preempts (K=8 rounds free rows sooner and may not)
    assert after["chunked_prefills"] > before["chunked_prefills"]
    assert after["decode_step"]["mode"] == ("torch.compile" if STATIC_STEPS_FORCED else "eager")
    assert after["failed_rounds"] == 0


def test_group_reuses_cached_prefixes(engines, cases, hf_model):
    group = with_k(engines[1], 8)
    prompt, embeds, want = cases[2]  # three images
    hits = []
    for i in range(2):
        before = group.stats()["prefix_cache_hit_tokens"]
        out = asyncio.run(group.generate_output(f"again-{i}", prompt, embeds, SamplingParams(max_tokens=MAX_NEW)))
        assert out.token_ids == want
        hits.append(group.stats()["prefix_cache_hit_tokens"] - before)
    assert hits[1] >= (len(prompt.prompt_token_ids) - 1) // BLOCK * BLOCK > 0


def test_group_logprobs_match_one_device(engines, cases):
    """Log-softmax of the logits, top 5 per step: fp32, atol 1e-5 / rtol 1e-4 (the all-reduce sums the
    two ranks' partial products in another order than one GEMM does)."""
    prompt, embeds, _ = cases[5]
    assert_same_top_logprobs(engines, prompt, embeds, SamplingParams(max_tokens=MAX_NEW, logprobs=5))


def assert_same_top_logprobs(engines, prompt, embeds, params: SamplingParams) -> None:
    """The same tokens on every engine, and the same top log-probabilities per step within fp32 tolerance."""
    outs = [asyncio.run(e.generate_output("logprobs", prompt, embeds, params)) for e in engines]
    assert outs[0].token_ids == outs[1].token_ids
    for a, b in zip(outs[0].logprobs, outs[1].logprobs):
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        torch.testing.assert_close(torch.tensor([lp for _, lp in b.top]), torch.tensor([lp for _, lp in a.top]),
                                   atol=1e-5, rtol=1e-4)


def test_each_rank_holds_half_of_the_decoder_layers(engines):
    single, group = engines
    whole = sharded_parameter_bytes(single.runner.model)["decoder_layers"]
    ranks = group.runner.info()  # measured in each rank's own process
    assert [r["rank"] for r in ranks] == [0, 1] and len({r["pid"] for r in ranks}) == 2
    layer_bytes = [r["parameter_bytes"]["decoder_layers"] for r in ranks]
    assert layer_bytes[0] == layer_bytes[1]
    assert 0.5 <= layer_bytes[0] / whole < 0.52  # the norms (a few hundred bytes) are on both ranks
    assert len({r["num_blocks"] for r in ranks}) == 1 == (ranks[0]["num_blocks"] == single.runner.cache.num_blocks)


def test_a_plan_the_group_cannot_shard_exactly_is_refused_by_its_styles():
    """Step3's plan gathers attention outputs (`colwise_gather_output`): `tp_plan` refuses it by name, which is
    why Step3 is sharded by raypipe's own rule (tests/test_tensor_parallel_step3.py)."""
    text_config = language_adapter(preset_checkpoint("tiny-step3")).text_config
    with pytest.raises(ValueError, match="colwise_gather_output"):
        tp_plan(text_config)
    assert isinstance(weight_shard(text_config, 0, 2, None), Step3Shard)
