"""The static-shape decode step (compiled_step.py): greedy tokens still equal transformers' generate().

Small bucket sets keep torch.compile time in CI low: batch buckets (2, 8) and KV buckets (128, 256),
so the staggered batch grows across the 2 -> 8 batch boundary and prompts of 58-144 tokens decode
across the 128 -> 256 KV boundary.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from torch._dynamo.utils import counters

from raypipe import SamplingParams
from raypipe.decode import compiled_step
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from tests import decode_reference as ref
from tests.conftest import gpu

MAX_NEW = 24
MAX_TOKENS = [MAX_NEW, 5, 17, MAX_NEW, 1, 9, 13, 20]
BUCKETS = dict(decode_batch_buckets=(2, 8), decode_kv_buckets=(128, 256))


def make_engine(ckpt, k: int, compiled: bool) -> LLMEngine:
    return LLMEngine(ckpt, EngineConfig(max_num_seqs=8, max_model_len=256, num_scheduler_steps=k,
                                        compiled_decode=compiled, **BUCKETS))


@pytest.fixture(scope="module")
def cases(tiny_ckpt, hf_model):
    return ref.generate_cases(tiny_ckpt, hf_model, MAX_NEW)


def staggered(engine, cases, tag: str) -> list[list[int]]:
    async def one(i):
        await asyncio.sleep(0.004 * i)  # arrive while earlier requests are mid-generation
        prompt, embeds, _ = cases[i]
        out = await engine.generate_output(f"{tag}-{i}", prompt, embeds, SamplingParams(max_tokens=MAX_TOKENS[i]))
        return out.token_ids

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(len(cases))))

    return asyncio.run(all_of_them())


@pytest.mark.parametrize("k", [1, 8])
def test_compiled_step_matches_generate_across_bucket_boundaries(tiny_ckpt, cases, k):
    graphs = counters["stats"]["unique_graphs"]
    engine = make_engine(tiny_ckpt, k, compiled=True)
    try:
        step = engine.stats()["decode_step"]
        assert step["mode"] == "torch.compile" and step["warmup_seconds"] > 0
        assert engine.runner.static_step is not None
        # One request alone (batch bucket 2, one padding row), then all eight staggered.
        prompt, embeds, want = cases[2]
        alone = asyncio.run(engine.generate_output(f"alone-{k}", prompt, embeds, SamplingParams(max_tokens=MAX_NEW)))
        assert alone.token_ids == want
        outs = staggered(engine, cases, f"staggered-{k}")
        for i, out in enumerate(outs):
            assert out == cases[i][2][: MAX_TOKENS[i]], f"request {i}"
        stats = engine.stats()
        assert stats["max_running_seen"] > 2  # the batch crossed the 2 -> 8 bucket boundary
        used = set(engine.runner.static_step._buckets)
        assert {b for b, _ in used} == {2, 8} and {kv for _, kv in used} == {128, 256}
        # The batch dimension is dynamic to inductor: the batch buckets of a KV bucket share one graph (at most
        # 2 here, not one per bucket's 4; the second engine reuses the first's)
        assert counters["stats"]["unique_graphs"] - graphs <= len(BUCKETS["decode_kv_buckets"])
    finally:
        engine.shutdown()


def test_compile_disabled_gives_the_same_tokens(tiny_ckpt, cases):
    engine = make_engine(tiny_ckpt, 8, compiled=False)
    try:
        assert engine.stats()["decode_step"]["mode"] == "eager"
        assert engine.runner.static_step is None
        outs = staggered(engine, cases, "eager")
        for i, out in enumerate(outs):
            assert out == cases[i][2][: MAX_TOKENS[i]], f"request {i}"
    finally:
        engine.shutdown()


def test_buckets_cover_the_limits():
    assert compiled_step.batch_buckets_for(32) == (1, 2, 4, 8, 16, 24, 32)
    assert compiled_step.batch_buckets_for(5) == (1, 2, 4, 5)
    assert compiled_step.kv_buckets_for(4096) == (256, 512, 1024, 2048, 4096)
    assert compiled_step.kv_buckets_for(100) == (100,)


def test_a_layer_kind_without_a_static_step_falls_back_to_eager():
    class PerLayerKindCache:  # a kind no cache of raypipe's implements yet (Llama 4's chunked attention)
        layer_types = ["full_attention", "chunked_attention", "linear_attention"]

    reason = compiled_step.supports(PerLayerKindCache())
    assert reason == "layer kinds ['chunked_attention'] have no static-shape decode step"
    PerLayerKindCache.layer_types = ["full_attention", "sliding_attention", "linear_attention"]
    assert compiled_step.supports(PerLayerKindCache()) is None  # every kind of tests/test_static_step_kinds.py


@gpu
def test_cuda_graphs_match_generate(tiny_ckpt, cases):
    engine = LLMEngine(tiny_ckpt, EngineConfig(max_num_seqs=8, max_model_len=256, num_scheduler_steps=8,
                                               dtype="float32", **BUCKETS))
    try:
        assert engine.stats()["decode_step"]["mode"] == "cuda_graphs"
        outs = staggered(engine, [(p, [e.cuda() for e in em], w) for p, em, w in cases], "cuda")
        for i, out in enumerate(outs):
            assert out == cases[i][2][: MAX_TOKENS[i]], f"request {i}"
    finally:
        engine.shutdown()
        torch.cuda.empty_cache()


def test_compiled_buckets_are_cached_under_raypipes_cache(monkeypatch, tmp_path):
    from raypipe.decode.compiled_step import use_compile_cache

    monkeypatch.setenv("RAYPIPE_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert use_compile_cache() == tmp_path / "inductor"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's choice wins
    assert use_compile_cache() == tmp_path / "mine"


def test_every_static_step_in_a_process_may_compile_all_its_graphs(monkeypatch):
    """Dynamo counts recompiles per code object and every engine's step compiles the same `_forward`: the
    limit must cover the graphs of every step made in the process, or a later engine runs eager unannounced
    (seen with 26 engines in one test process: dynamo stopped compiling at its default of 8)."""
    from raypipe.decode import compiled_step

    dynamo = torch._dynamo.config
    monkeypatch.setattr(compiled_step, "_graphs_asked", 0)
    # torch's own patch restores the settings (pytest's monkeypatch deletes them from torch's config module)
    with dynamo.patch(recompile_limit=8, accumulated_recompile_limit=8):
        for _ in range(3):  # three engines of 6 buckets each, as a test module's engine pool makes them
            compiled_step._compile(lambda x: x, 6, dynamic_batch=False)
        assert dynamo.recompile_limit > 18 and dynamo.accumulated_recompile_limit > 18
    assert dynamo.recompile_limit >= 8
