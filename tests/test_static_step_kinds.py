"""The static-shape decode step (compiled_step.py) over every layer kind, token for token against the eager step.

Full attention has its own test against `generate()` (tests/test_compiled_decode.py); here the other kinds:
- `tiny-qwen3.5-moe`: gated-delta-net row state (conv and recurrent rows, read through the bucket's row
  index, padding rows on the spare row) beside full attention, and MoE experts (transformers' grouped GEMMs);
- `tiny-step3`: sliding-window layers (window tables padded like block tables) beside full attention, and
  Step3's experts, whose routing loop reads tensor values on the host (graph breaks: compiled in pieces).

One batch bucket of 4 rows with `max_num_seqs=4`: six staggered requests keep the batch between 1 and 4 rows,
so padding rows run beside the running ones while joining requests prefill their rows (a padding row that
wrote those rows' state would change their tokens). A second set of prompts, another mix of rows in the same
bucket, must compile nothing new. The eager engine's tokens equal transformers' `generate()` in the family
tests (test_qwen3_5_decode, test_step3_decode).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch._dynamo.utils import counters

from raypipe import SamplingParams
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.models.registry import preset_checkpoint

LENGTHS = [37, 70, 12, 55, 90, 23]  # prompt tokens
MAX_TOKENS = [24, 6, 17, 24, 3, 11]
CONFIG = dict(max_num_seqs=4, max_model_len=128, num_scheduler_steps=4)


def prompts(seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 200, (n,), generator=generator).tolist() for n in LENGTHS]


def staggered(engine: LLMEngine, batch: list[list[int]], tag: str) -> list[list[int]]:
    async def one(i):
        await asyncio.sleep(0.004 * i)  # arrive while earlier requests decode
        params = SamplingParams(max_tokens=MAX_TOKENS[i], ignore_eos=True)
        return (await engine.generate_output(f"{tag}-{i}", batch[i], (), params)).token_ids

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(len(batch))))

    return asyncio.run(all_of_them())


@pytest.mark.parametrize("preset", ["tiny-qwen3.5-moe", "tiny-step3"])
def test_static_step_equals_eager_step_and_a_new_mix_compiles_nothing(preset):
    checkpoint = preset_checkpoint(preset)
    eager = LLMEngine(checkpoint, EngineConfig(**CONFIG, compiled_decode=False))
    try:
        want = [staggered(eager, prompts(seed), f"eager-{seed}") for seed in (0, 1)]
    finally:
        eager.shutdown()
    engine = LLMEngine(checkpoint, EngineConfig(**CONFIG, compiled_decode=True, decode_batch_buckets=(4,),
                                                decode_kv_buckets=(128,)))
    try:
        assert engine.stats()["decode_step"]["mode"] == "torch.compile"
        assert staggered(engine, prompts(0), "static-0") == want[0]
        assert engine.stats()["max_running_seen"] == 4
        graphs = counters["stats"]["unique_graphs"]
        assert staggered(engine, prompts(1), "static-1") == want[1]
        assert counters["stats"]["unique_graphs"] == graphs, "a new mix of rows in the bucket compiled again"
        assert set(engine.runner.static_step._buckets) == {(4, 128)}
    finally:
        engine.shutdown()


def test_a_step_that_does_not_warm_up_falls_back_to_eager_with_its_reason(monkeypatch, caplog):
    """A capture or compile that fails at start (a CUDA graph cannot capture a module that reads tensor values
    on the host) leaves the engine decoding eagerly, saying why, not failing."""
    from raypipe.decode import compiled_step

    def fails(self, *args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(compiled_step.StaticDecodeStep, "warmup", fails)
    engine = LLMEngine(preset_checkpoint("tiny"), EngineConfig(**CONFIG, compiled_decode=True,
                                                               decode_batch_buckets=(4,), decode_kv_buckets=(128,)))
    try:
        step = engine.stats()["decode_step"]
        assert step["mode"] == "eager" and engine.runner.static_step is None
        assert step["reason"].endswith("did not warm up: operation not permitted when stream is capturing")
        assert step["reason"] in caplog.text
        out = asyncio.run(engine.generate_output("after", prompts(0)[0], (), SamplingParams(max_tokens=4,
                                                                                          ignore_eos=True)))
        assert len(out.token_ids) == 4
    finally:
        engine.shutdown()
