"""Tensor parallelism over quantized checkpoints (docs/quantization.md): each rank reads only its slices of
the stored weights and of their scales, packed int4 words and zero points, cut on block, group and packing
boundaries; a tensor_parallel_size that would cut one is refused at start, naming the layer and the sizes.

- A rank's layers, loaded through the shard as the group loads them, dequantize to exactly its rows
  (column-parallel) or columns (row-parallel) of one device's dequantized weights, from about half of the
  stored bytes (no Ray: the shard's reads alone, every format, both presets); asymmetric int4's zero
  points, packed along the rows, likewise (a layer compressed by compressed-tensors in the test).
- A split inside a scale block, a group or a packed word is refused naming the layer and the sizes, at
  the layer and at a real group start.
- A decode group of two ranks gives one device's greedy tokens, K=1 and K=8, requests with images joining a
  running batch, for FP8 and W4A16 on `tiny` and FP8 on `tiny-qwen3.5` (gated delta net: its fused
  q | k | v projection split in three runs), and each rank's own process holds about half of the decoder
  layers' bytes. One group per case (a rank actor costs seconds to start; `GROUP_CASES` says which).
- FP8 Qwen3-VL-MoE (`tiny-qwen3-vl-moe-fp8`, one more case of the above): each rank holds half of every
  layer's experts whole, their block scales with them (a scale grid is per expert, so no split of experts
  can cut a block): a rank's stored expert tensors are exactly its experts' of one device's, half the bytes.
"""

from __future__ import annotations

import types

import pytest
import torch
from transformers import AutoModelForImageTextToText

from raypipe import SamplingParams
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.models.checkpoint import read_config
from raypipe.models.quantized.stored_experts import StoredExperts
from raypipe.models.quantized.presets import write_quantized
from raypipe.models.quantized.quant_config import quantization_plan
from raypipe.models.quantized.stored_linear import StoredWeightLinear
from raypipe.models.registry import language_adapter, preset_checkpoint, vision_adapter
from raypipe.parallel import runner_factory
from raypipe.parallel.shards import WeightShard, sharded_parameter_bytes
from tests import decode_reference as ref, qwen3_vl_reference
from tests.test_quantized_moe import PRESET as MOE_PRESET, PROMPTS as MOE_PROMPTS, case as moe_case
from tests.test_tensor_parallel import on_both

MAX_NEW = 12
REQUESTS = (0, 1, 2, 3)  # decode_reference.REQUESTS: no image, one, three, one more
CASES = [("tiny", fmt) for fmt in ("fp8", "fp8-dynamic", "w8a8", "w4a16")] + \
        [("tiny-qwen3.5", fmt) for fmt in ("fp8", "w4a16")] + \
        [("tiny-qwen3-vl-moe", "fp8"), ("tiny-qwen3.5-moe", "w4a16")]
IDS = [f"{base}-{fmt}" for base, fmt in CASES]
# A decode group per case costs ~14 s: the groups run one format per kind of stored layer (FP8 blocks, packed
# int4 with zero points) on `tiny`, FP8 on the hybrid, and both kinds of quantized experts (FP8 blocks fused,
# compressed-tensors int4 per expert) on the MoE models. The other formats' ranks are
# proven by the no-Ray slice test above (every format: a rank's layers dequantize to exactly its part of one
# device's), and their forward through a rank is the same `StoredWeightLinear` partial / finish path.
GROUP_CASES = [("tiny", "fp8"), ("tiny", "w4a16"), ("tiny-qwen3.5", "fp8"), ("tiny-qwen3-vl-moe", "fp8"),
               ("tiny-qwen3.5-moe", "w4a16")]
# One rank's decoder-layer bytes over one device's: norms, per-channel scales of row-parallel layers,
# `weight_shape`s and the unquantized gated-delta-net parts (conv, per-head gates) are whole or split too, an
# MoE layer's router stays whole.
HALF = (0.5, 0.54)
NO_REDUCE = types.SimpleNamespace(all_reduce=None)  # the shard's collectives, for loads that run no forward


def rank_decoder(ckpt, rank: int):
    adapter = language_adapter(ckpt)
    return adapter.load_model(torch.device("cpu"), torch.float32,
                              shard=WeightShard(adapter.text_config, rank, 2, NO_REDUCE))


def held_bytes(layer: StoredWeightLinear) -> int:
    """The storage behind a layer's stored tensors (a view of a larger tensor holds all of it)."""
    return sum(getattr(layer, name).untyped_storage().nbytes() for name in layer.stored)


@pytest.mark.parametrize("base, fmt", CASES, ids=IDS)
def test_each_rank_reads_its_rows_or_columns_of_every_quantized_layer(base, fmt):
    ckpt = preset_checkpoint(f"{base}-{fmt}")
    whole = dict(language_adapter(ckpt).load_model(torch.device("cpu"), torch.float32).named_modules())
    stored_bytes = [0, 0]
    for rank in (0, 1):
        for name, layer in rank_decoder(ckpt, rank).named_modules():
            if not isinstance(layer, StoredWeightLinear):
                continue
            dim, features = layer.part
            full = whole[name].dequantize(torch.float32)
            rows = torch.cat([full[cut] if dim == 0 else full[:, cut] for cut in features], dim)
            assert torch.equal(layer.dequantize(torch.float32), rows), name
            stored_bytes[rank] += held_bytes(layer)
    one_device = sum(held_bytes(m) for m in whole.values() if isinstance(m, StoredWeightLinear))
    assert stored_bytes[0] == stored_bytes[1] and 0.5 <= stored_bytes[0] / one_device < 0.52


@pytest.fixture(scope="module")
def hf_models():
    """The base presets' transformers models (the vision tower is not quantized): image embeddings."""
    return {base: AutoModelForImageTextToText.from_pretrained(preset_checkpoint(base)).eval()
            for base in dict(GROUP_CASES)}


@pytest.fixture(scope="module", params=GROUP_CASES, ids=[f"{base}-{fmt}" for base, fmt in GROUP_CASES])
def group(request, ray_local, hf_models):
    base, fmt = request.param
    ckpt = preset_checkpoint(f"{base}-{fmt}")
    made = []
    for tp in (1, 2):
        config = EngineConfig(max_num_seqs=4, max_model_len=512, num_threads=1, tensor_parallel_size=tp)
        made.append(LLMEngine(ckpt, config, runner_factory=runner_factory(config)))
    vision, tokenizer = vision_adapter(ckpt), made[0].tokenizer
    if f"{base}-{fmt}" == MOE_PRESET:  # Qwen3-VL's image rows carry deepstack levels: the processor's features
        processor = qwen3_vl_reference.hf_processor(ckpt)
        cases = [moe_case(ckpt, hf_models[base], processor, sizes, seed) for seed, sizes in enumerate(MOE_PROMPTS)]
    else:
        cases = []
        for i in REQUESTS:
            prompt = ref.prepare(i, tokenizer, vision)
            cases.append((prompt.without_pixels(), ref.embeddings(hf_models[base], ckpt, prompt)))
    yield made, cases
    for engine in made:
        engine.shutdown()


@pytest.mark.parametrize("k", [1, 8])
def test_group_greedy_equals_one_device(group, k):
    engines, cases = group
    one, two = on_both(engines, k, cases, [SamplingParams(max_tokens=MAX_NEW)] * len(cases), f"quant-{k}")
    assert two == one
    assert len({tuple(ids) for ids in one}) > 1  # the prompts lead to different tokens: the test can tell them apart


def test_each_rank_holds_half_of_the_decoder_layers(group):
    (single, pair), _ = group
    ranks = pair.runner.info()  # measured in each rank's own process
    assert len({r["pid"] for r in ranks}) == 2
    layers = [r["parameter_bytes"]["decoder_layers"] for r in ranks]
    one_device = sharded_parameter_bytes(single.runner.model)["decoder_layers"]
    assert layers[0] == layers[1] and HALF[0] <= layers[0] / one_device < HALF[1], (layers, one_device)


@pytest.mark.parametrize("preset", [MOE_PRESET, "tiny-qwen3.5-moe-w4a16"])
def test_each_rank_reads_its_whole_experts_with_their_scales(preset):
    """FP8 blocks stored fused (Qwen3-VL-MoE) and compressed-tensors int4 stored per expert (Qwen3.5-MoE): a rank's
    stored tensors are exactly its experts' of one device's."""
    ckpt = preset_checkpoint(preset)
    whole = [m for m in language_adapter(ckpt).load_model(torch.device("cpu"), torch.float32).modules()
             if isinstance(m, StoredExperts)]
    count = whole[0].experts.num_experts // 2
    stored_bytes = []
    for rank in (0, 1):
        parts = [m for m in rank_decoder(ckpt, rank).modules() if isinstance(m, StoredExperts)]
        assert len(parts) == len(whole)
        for part, full in zip(parts, whole):
            assert part.experts.num_experts == count
            for name in part.stored:
                assert torch.equal(getattr(part, name), getattr(full, name)[rank * count: (rank + 1) * count]), name
        stored_bytes.append(sum(held_bytes(m) for m in parts))
    one_device = sum(held_bytes(m) for m in whole)
    assert stored_bytes[0] == stored_bytes[1] == one_device // 2


def layer_of(config: dict, in_features: int, out_features: int):
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    return quantization_plan({"quantization_config": config}).layer_for(["model.layers.0.mlp.down_proj"], linear,
                                                                         torch.float32)


def w4a16(strategy: str, group_size: int | None) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": strategy, "group_size": group_size}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}


FP8_128 = {"quant_method": "fp8", "weight_block_size": [128, 128]}


@pytest.mark.parametrize("config, shape, dim, world_size, refused", [
    (FP8_128, (256, 64), 0, 2, r"a 128x128 scale block of 128 output features "
                               r"\(weight_scale_inv\): this rank's output features 0:32 of 64"),
    (FP8_128, (256, 256), 1, 4, r"a 128x128 scale block of 128 input features .* 0:64 of 256"),
    (FP8_128, (256, 512), 0, 4, None),  # 128 rows a rank: on block boundaries
    # a partial last block (300 = 2 x 128 + 44) does not make a cut inside a block possible
    (FP8_128, (300, 512), 1, 2, r"a 128x128 .* input features 0:150 of 300"),
    (w4a16("group", 64), (64, 128), 1, 2, r"a group of 64 input features \(one scale\) of 64 input features"
                                          r" \(weight_scale\): this rank's input features 0:32 of 64"),
    (w4a16("group", 64), (256, 64), 1, 2, None),
    (w4a16("group", 64), (128, 64), 0, 4, None),  # rows: a group scale is per row
    (w4a16("channel", None), (24, 8), 1, 2, r"a run of int4 values packed into 1 int32 word\(s\) of 8 input features "
                                            r"\(weight_packed\): this rank's input features 0:12 of 24"),
])
def test_a_split_inside_a_block_group_or_packed_word_is_refused_naming_the_sizes(config, shape, dim, world_size,
                                                                                  refused):
    in_features, out_features = shape
    layer = layer_of(config, in_features, out_features)
    size = (out_features, in_features)[dim] // world_size
    split = lambda: layer.split("layers.0.mlp.down_proj", dim, [slice(0, size)], world_size)  # noqa: E731
    if refused is None:
        assert split().in_features * (world_size if dim else 1) == in_features
    else:
        prefix = rf"^layers\.0\.mlp\.down_proj: tensor_parallel_size {world_size} would cut "
        with pytest.raises(ValueError, match=prefix + refused):
            split()


def test_a_group_whose_degree_cuts_a_scale_block_is_refused_at_start(tmp_path):
    """The tiny preset's FP8 checkpoint written with 128x128 blocks (its widths are 32-128): two ranks would
    each hold half of a block's rows. Rank 0 loads before any other rank starts, so the start stops there."""
    write_quantized(preset_checkpoint("tiny"), tmp_path, "fp8", fp8_block=(128, 128))
    assert read_config(tmp_path)["quantization_config"]["weight_block_size"] == [128, 128]
    config = EngineConfig(max_num_seqs=1, max_model_len=64, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj: tensor_parallel_size 2 would cut a "
                                         r"128x128 scale block of 128 output features"):
        LLMEngine(tmp_path, config, runner_factory=runner_factory(config))


@pytest.mark.parametrize("dim, rank", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_asymmetric_int4_zero_points_packed_along_rows_split_with_their_words(dim, rank):
    """Asymmetric pack-quantized int4 (AutoAWQ's layout once compressed-tensors converts it) packs its zero
    points eight rows to an int32 word: a rank's rows start on a word, its columns on a group. The layer is
    compressed by compressed-tensors itself from random weights; each rank's part dequantizes to its slice."""
    from compressed_tensors.quantization.utils import calculate_qparams

    config = w4a16("group", 16)
    config["config_groups"]["group_0"]["weights"]["symmetric"] = False
    out_features, in_features = 32, 64
    whole = layer_of(config, in_features, out_features)
    assert "weight_zero_point" in whole.stored
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))
    grouped = weight.unflatten(-1, (-1, 16))
    scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), whole.scheme.weights)
    stored = whole.compressor.compress({"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point},
                                       whole.scheme)
    assert stored["weight_zero_point"].shape == (out_features // 8, in_features // 16)  # packed along rows
    whole.load_state_dict(stored, strict=False)
    size = (out_features, in_features)[dim] // 2
    cut = slice(rank * size, (rank + 1) * size)
    part = whole.split("layers.0.mlp.down_proj", dim, [cut], 2)
    part.load_state_dict({name: part.read_part(name, tensor) for name, tensor in stored.items()}, strict=False)
    full = whole.dequantize(torch.float32)
    assert torch.equal(part.dequantize(torch.float32), full[cut] if dim == 0 else full[:, cut])
    with pytest.raises(ValueError, match=r"packed into 1 int32 word\(s\) of 8 output features \(weight_zero_point\): "
                                         r"this rank's output features 0:12 of 24"):
        layer_of(config, in_features, 24).split("layers.0.mlp.down_proj", 0, [slice(0, 12)], 2)
