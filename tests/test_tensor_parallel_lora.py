"""LoRA adapters on a tensor-parallel decode group (raypipe/parallel/, models/lora.py): a group of two ranks
(gloo on CPU) serving a mixed batch of three adapters (ranks 4, 8 with rsLoRA, 2; attention, MLP, every
linear) and base rows, with images, gives every row the greedy tokens of the one-device engine and of
PEFT's `generate()` with that adapter, K=1 and K=8, on Qwen2.5-VL (column- and row-parallel attention and
MLP) and Qwen3.5 (its gated delta net's fused q | k | v projection split by heads, `out_proj` row-parallel),
and on Qwen2.5-VL's compressed-tensors W4A16 preset (LoRA over packed int4 layers, PEFT over transformers'
decompressed model).
An adapter loaded at run time on the group, into a slot another adapter held, serves the one-device
engine's tokens.

One group per preset for the module (its start costs seconds); K is switched between runs on the same
engines (it shapes rounds only, never outputs).
"""

from __future__ import annotations

import pytest
import torch

from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.models.registry import preset_checkpoint
from raypipe.parallel import runner_factory
from raypipe.testing.lora_adapters import write_adapters
from tests.test_lora import ADAPTERS, LANGUAGE, ROWS, ExpertCase, Served, run_on
from tests.test_tensor_parallel import with_k

# Loaded at run time, into the slot of one of ADAPTERS (max_loras 3): the full rank, layers of every split
# kind (column: v_proj; row: o_proj, down_proj; head-split fused: in_proj_qkv).
LATE = {"violet": dict(r=16, lora_alpha=12, target_modules=LANGUAGE + r"(v_proj|o_proj|down_proj|in_proj_qkv)")}
LATE_ROWS = [(1, "violet"), (0, None), (2, "violet"), (0, "red")]


@pytest.fixture(scope="module", params=[pytest.param(("tiny", None), id="tiny"),
                                        pytest.param(("tiny-qwen3.5", None), id="tiny-qwen3.5"),
                                        pytest.param(("tiny-w4a16", "tiny"), id="tiny-w4a16", marks=pytest.mark.extended)])
def served(request, tmp_path_factory, ray_local):
    """PEFT's tokens per row, and a one-device engine and a group of two, both started with ADAPTERS (on the
    int4 preset, over its packed layers: each rank cuts them on group boundaries, its adapter parts alike)."""
    preset, base = request.param
    folder = tmp_path_factory.mktemp(f"tp-lora-{preset}")
    made = Served(preset, folder, base)
    made.late = write_adapters(made.adapters_on, folder / "late", LATE)
    engines = []
    for tp in (1, 2):
        config = EngineConfig(max_num_seqs=4, max_model_len=512, block_size=8, num_threads=1, max_loras=3,
                              tensor_parallel_size=tp, lora_modules={n: str(f) for n, f in made.folders.items()})
        engines.append(LLMEngine(made.ckpt, config, runner_factory=runner_factory(config)))
    made.single, made.group = engines
    yield made
    for engine in engines:
        engine.shutdown()


@pytest.mark.parametrize("k", [1, 8])
def test_group_with_adapters_equals_one_device_and_peft(served, k):
    assert {name for _, name in ROWS} == {None, *ADAPTERS}
    assert all(name is None or served.expected[i, name] != served.expected[i, None] for i, name in ROWS)
    want = [served.expected[row] for row in ROWS]
    one = [o.token_ids for o in run_on(served, with_k(served.single, k), ROWS, f"tp1-{k}")]
    two = [o.token_ids for o in run_on(served, with_k(served.group, k), ROWS, f"tp2-{k}")]
    assert two == one == want
    stats = served.group.stats()
    assert stats["failed_rounds"] == 0 and stats["lora_in_slots"] == 3


def test_adapter_loaded_at_run_time_on_a_group_equals_one_device(served):
    """"violet" is loaded while the engines run and takes a slot an earlier adapter held (three slots, four
    adapters): the slot is rewritten on every rank, its layers the others do not target zeroed."""
    outs = []
    for engine in (served.single, served.group):
        with_k(engine, 8).load_lora("violet", str(served.late["violet"]))
        writes = engine.stats()["lora_slot_writes"]
        outs.append([o.token_ids for o in run_on(served, engine, LATE_ROWS, f"late-tp{engine.config.tensor_parallel_size}")])
        assert engine.stats()["lora_slot_writes"] > writes
    one, two = outs
    assert two == one
    assert one[0] != served.expected[1, None] and one[1:4:2] == [served.expected[0, None], served.expected[0, "red"]]


@pytest.mark.parametrize("preset, split", [("tiny-qwen3-vl-moe", "experts"),
                                           pytest.param("tiny-step3", "experts", marks=pytest.mark.extended),
                                           ("tiny-step3", "tensor"),
                                           pytest.param("tiny-qwen3-vl-moe-fp8", "experts", marks=pytest.mark.extended)])
def test_adapters_on_experts_on_a_group_equal_one_device_and_peft(preset, split, tmp_path, ray_local):
    """Each rank holds whole experts (its share) and keeps its experts' factors of every adapter; the layer's
    routing and its sum over ranks wrap the adapted experts as they wrapped the plain ones. Step3's "tensor" split:
    each rank holds a slice of every expert's width and its slices of the factors (partial down deltas, summed).
    FP8 block-wise experts: each rank rebuilds its own experts' weights for the adapters' loop; PEFT runs over
    transformers' dequantized model (tests/test_lora.py)."""
    if preset.endswith("-fp8"):
        from tests.test_quantized_moe import reference_model

        hf, _ = reference_model(preset_checkpoint(preset), torch.float32)
        case = ExpertCase(preset, tmp_path, hf=hf.float(), base=preset.removesuffix("-fp8"))
    else:
        case = ExpertCase(preset, tmp_path)
    outs = []
    for tp in (1, 2):
        config = EngineConfig(max_num_seqs=4, max_model_len=256, num_scheduler_steps=8, num_threads=1,
                              tensor_parallel_size=tp, expert_split=split,
                              lora_modules={n: str(f) for n, f in case.folders.items()})
        engine = LLMEngine(case.ckpt, config, runner_factory=runner_factory(config))
        try:
            outs.append(case.run(engine, f"experts-tp{tp}"))
        finally:
            engine.shutdown()
    assert outs[1] == outs[0] == case.want
