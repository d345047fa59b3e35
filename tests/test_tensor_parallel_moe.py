"""A decode group for Qwen3-VL-MoE, two ranks over gloo: attention heads tensor-parallel (the config's plan),
experts split across ranks (each rank holds half of every layer's experts whole, the router on both), deepstack
visual rows on both ranks. Greedy tokens equal one device's and transformers' generate() from pixels, K=1 and
K=8, with images and requests joining a running batch; each rank's process holds half of the experts."""

from __future__ import annotations

import pytest

from raypipe import SamplingParams
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.parallel import runner_factory
from raypipe.parallel.shards import sharded_parameter_bytes
from tests.test_qwen3_vl_decode import MAX_NEW, PROMPTS, Model
from tests.test_tensor_parallel import on_both


@pytest.fixture(scope="module")
def model(ray_local):
    made = Model("tiny-qwen3-vl-moe")
    yield made
    made.close()


@pytest.fixture(scope="module")
def engines(model):
    made = []
    for tp in (1, 2):
        config = EngineConfig(max_num_seqs=4, max_model_len=512, num_threads=1, tensor_parallel_size=tp)
        made.append(LLMEngine(model.ckpt, config, runner_factory=runner_factory(config)))
    yield made
    for engine in made:
        engine.shutdown()


@pytest.mark.parametrize("k", [1, 8])
def test_group_greedy_equals_one_device_and_generate(model, engines, k):
    cases = [model.case(sizes, seed=i) for i, sizes in enumerate(PROMPTS[:4])]
    one, two = on_both(engines, k, cases, [SamplingParams(max_tokens=MAX_NEW)] * len(cases), "moe")
    assert two == one == [c[3] for c in cases]


def test_each_rank_holds_half_of_the_decoder_layers(engines):
    """Attention halves with its heads and the experts with their count; routers and norms stay whole."""
    single, group = engines
    ranks = group.runner.info()  # measured in each rank's own process
    layers = [r["parameter_bytes"]["decoder_layers"] for r in ranks]
    one_device = sharded_parameter_bytes(single.runner.model)["decoder_layers"]
    assert layers[0] == layers[1] and 0.5 < layers[0] / one_device < 0.56
