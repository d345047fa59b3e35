"""The engine's forwards compiled whole (compiled_forward.py): greedy tokens still equal transformers' generate(),
for rows joining while others decode, with images, with prefix-cache hits, and nothing compiles after the
engine's start. One engine for the module: its six graphs compile when it starts (about a minute cold)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch._dynamo.utils import counters

from raypipe import SamplingParams
from raypipe.decode import attention, compiled_forward
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.models import packed_linear  # noqa: F401 - registers raypipe::packed_gemm
from tests import decode_reference as ref

MAX_NEW = 24
MAX_TOKENS = [MAX_NEW, 5, 17, MAX_NEW, 1, 9, 13, 20]


@pytest.fixture(scope="module")
def cases(tiny_ckpt, hf_model):
    return ref.generate_cases(tiny_ckpt, hf_model, MAX_NEW)


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    engine = LLMEngine(tiny_ckpt, EngineConfig(max_num_seqs=8, max_model_len=256, num_scheduler_steps=8,
                                               block_size=8, compiled_forward=True))
    yield engine
    engine.shutdown()


def staggered(engine, cases, tag: str) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n) for n in MAX_TOKENS]
    return [out.token_ids for out in ref.staggered(engine, cases, params, tag)]


def test_compiled_forwards_match_generate_and_compile_nothing_after_start(engine, cases):
    step = engine.stats()["decode_step"]
    assert step["mode"] == "compiled_forward" and step["warmup_seconds"] > 0
    graphs, compiled = counters["stats"]["unique_graphs"], engine.runner.compiled_forward
    calls, steps = dict(compiled.calls), engine.stats()["decode_steps"]
    prompt, embeds, want = cases[2]
    alone = asyncio.run(engine.generate_output("alone", prompt, embeds, SamplingParams(max_tokens=MAX_NEW)))
    assert alone.token_ids == want
    outs = staggered(engine, cases, "staggered")  # rows join while others decode: the batch size changes
    for i, out in enumerate(outs):
        assert out == cases[i][2][: MAX_TOKENS[i]], f"request {i}"
    again = asyncio.run(engine.generate_output("again", prompt, embeds, SamplingParams(max_tokens=MAX_NEW)))
    assert again.token_ids == want and again.num_cached_tokens > 0  # a prefill after cached keys
    assert engine.stats()["max_running_seen"] > 2
    assert compiled.calls["prefill"] > calls["prefill"]
    # Every decode step ran compiled, those of rounds with a prefill too (it runs first, on every core)
    assert compiled.calls["decode"] - calls["decode"] == engine.stats()["decode_steps"] - steps > 0
    assert counters["stats"]["unique_graphs"] == graphs  # every shape met was one the start compiled


def test_compiled_and_eager_forwards_give_the_same_tokens(engine, tiny_ckpt, cases):
    eager = LLMEngine(tiny_ckpt, EngineConfig(max_num_seqs=8, max_model_len=256, num_scheduler_steps=8,
                                              block_size=8))
    try:
        assert eager.stats()["decode_step"]["mode"] == "eager" and eager.runner.compiled_forward is None
        assert staggered(eager, cases, "eager") == staggered(engine, cases, "compiled-again")
    finally:
        eager.shutdown()


def test_sibling_gemms_on_one_input_become_one_call():
    gemm = torch.ops.raypipe.packed_gemm.default
    graph = torch.fx.Graph()
    x, other, weight = graph.placeholder("x"), graph.placeholder("other"), graph.placeholder("weight")
    siblings = [graph.call_function(gemm, (x, weight, None)) for _ in range(3)]  # q, k and v on one input
    elsewhere = graph.call_function(gemm, (other, weight, None))
    graph.output((*siblings, elsewhere))
    compiled_forward._OneGemmPerInput()(graph)
    calls = [n for n in graph.nodes if n.target is gemm]
    assert [c.args[0].name for c in calls] == ["x", "other"]
    assert list(graph.output_node().args[0]) == [calls[0]] * 3 + [calls[1]]


def test_where_forwards_stay_eager():
    class HybridCache:
        layer_types = ["linear_attention", "full_attention"]

    assert compiled_forward.supports(HybridCache(), torch.device("cpu")) == \
        "layer kinds ['linear_attention'] keep their cache code eager"
    assert "CPU engines" in compiled_forward.supports(HybridCache(), torch.device("cuda"))


def test_a_forward_that_does_not_compile_leaves_the_engine_eager(tiny_ckpt, monkeypatch):
    def fails(self, cache, prefill_cache, dtype):
        raise RuntimeError("inductor could not lower something\nand more")

    monkeypatch.setattr(compiled_forward.CompiledForward, "warm_up", fails)
    engine = LLMEngine(tiny_ckpt, EngineConfig(max_num_seqs=2, max_model_len=128, compiled_forward=True))
    try:
        step = engine.stats()["decode_step"]
        assert step == {"mode": "eager",
                        "reason": "the compiled forward did not compile: inductor could not lower something"}
        runner = engine.runner
        assert runner.compiled_forward is None and not runner.cache.opaque_attention
        assert not any(getattr(m, attention.OPAQUE_ATTENTION, False) for m in runner.model.modules())
        out = asyncio.run(engine.generate_output("eager", [1, 2, 3], [], SamplingParams(max_tokens=3)))
        assert len(out.token_ids) == 3
    finally:
        engine.shutdown()


def test_engines_started_after_others_compile_their_own_graphs(engine, tiny_ckpt):
    """Dynamo counts recompiles per code object, and every engine's forwards share theirs: past its limit (8) it
    runs a frame eager and only logs it, so a third engine in a process ran its prefills eager and a fifth
    everything, while saying "compiled_forward". Two more after the module's each compile their six graphs."""
    for n in range(2):
        graphs = counters["stats"]["unique_graphs"]
        later = LLMEngine(tiny_ckpt, EngineConfig(max_num_seqs=2, max_model_len=128, compiled_forward=True))
        try:
            assert later.stats()["decode_step"]["mode"] == "compiled_forward"
            assert counters["stats"]["unique_graphs"] - graphs == compiled_forward.WARM_UP_GRAPHS, f"engine {n + 2}"
        finally:
            later.shutdown()
