"""Decode groups of two ranks over gloo for the Qwen3 generation of families, each against one device and
transformers' generate() from pixels, K=1 and K=8, images with requests joining a running batch:

- Qwen3-VL dense: attention heads (GQA kv heads, q_norm/k_norm whole per head) and MLP width by raypipe's
  own plan (its config has none), deepstack visual rows added on both ranks;
- Qwen3-VL-MoE: attention by the config's plan, experts split across ranks (half of every layer's experts
  whole on each rank, the router on both);
- Qwen3.5 dense: gated full attention and MLP by the config's plan, gated-delta-net heads by raypipe's rule
  (their conv and recurrent state rows halved);
- Qwen3.5 MoE: the same, with its experts (stored one tensor per expert) split across ranks at load and the
  shared expert tensor-parallel.

Each rank's process reports its own decoder-layer bytes: about half of one device's. One preset per module
fixture (its group started once); K switches between runs on the same engines.
"""

from __future__ import annotations

import pytest

from raypipe import SamplingParams
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.parallel import runner_factory
from raypipe.parallel.shards import sharded_parameter_bytes
from tests.test_qwen3_vl_decode import MAX_NEW, PROMPTS, Model
from tests.test_tensor_parallel import on_both

# preset -> bounds of one rank's share of the decoder layers' bytes (norms, routers and the shared
# expert's gate stay whole on each rank)
PRESETS = {"tiny-qwen3-vl": (0.5, 0.52), "tiny-qwen3-vl-moe": (0.5, 0.56), "tiny-qwen3.5": (0.5, 0.53),
           "tiny-qwen3.5-moe": (0.5, 0.56)}


@pytest.fixture(scope="module", params=list(PRESETS))
def model(request, ray_local):
    made = Model(request.param)
    made.name = request.param
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


@pytest.fixture(scope="module")
def cases(model):
    return [model.case(sizes, seed=i) for i, sizes in enumerate(PROMPTS[:4])]


@pytest.mark.parametrize("k", [1, 8])
def test_group_greedy_equals_one_device_and_generate(model, engines, cases, k):
    one, two = on_both(engines, k, cases, [SamplingParams(max_tokens=MAX_NEW)] * len(cases), model.name)
    assert two == one == [c[3] for c in cases]


def test_each_rank_holds_half_of_the_decoder_layers(model, engines):
    """Attention and MLP halve with their heads and width, experts with their count, gated-delta-net layers
    with their heads; norms and routers stay whole."""
    single, group = engines
    ranks = group.runner.info()  # measured in each rank's own process
    assert len({r["pid"] for r in ranks}) == 2
    layers = [r["parameter_bytes"]["decoder_layers"] for r in ranks]
    one_device = sharded_parameter_bytes(single.runner.model)["decoder_layers"]
    low, high = PRESETS[model.name]
    assert layers[0] == layers[1] and low < layers[0] / one_device < high
