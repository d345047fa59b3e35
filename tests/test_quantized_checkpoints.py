"""Quantized checkpoints (docs/quantization.md): the language model runs from FP8 block-wise and
compressed-tensors checkpoints with its weights kept quantized.

Each format's tiny preset is written by the format's own library (`raypipe.models.quantized.presets`).
The oracle is transformers' `generate()` on the same quantized checkpoint, through transformers' own
quantizer: for `fp8` the FineGrainedFP8 quantizer, which on a CPU dequantizes the blocks at load (to
bf16 whatever dtype is asked, so both run in bf16, the dtype such checkpoints run in); for
compressed-tensors' formats `CompressedTensorsConfig(dequantize=True)`, where compressed-tensors'
compressors decompress every weight at load (both in fp32, the CPU default and faster there). The engine instead keeps the stored tensors and
dequantizes one layer per forward; greedy tokens must be equal, K=1 and K=8, for a request with an
image (whose embeddings come from transformers' unquantized vision tower).
"""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch
from transformers import AutoModelForImageTextToText, CompressedTensorsConfig

from raypipe import SamplingParams
from raypipe.models.quantized.quant_config import quantization_plan
from raypipe.models.quantized.stored_experts import StoredExperts
from raypipe.models.quantized.stored_linear import StoredWeightLinear
from raypipe.models.registry import language_adapter, preset_checkpoint, vision_adapter
from tests import decode_reference as ref

MAX_NEW = 8
IMAGE_REQUEST = 1  # decode_reference.REQUESTS: one image
# format -> range of the quantized layers' stored bytes over the same weights' bytes in bf16
FORMATS = {"fp8": (0.45, 0.55), "fp8-dynamic": (0.45, 0.55), "w8a8": (0.45, 0.55), "w4a16": (0.25, 0.3)}
CASES = [(base, fmt) for base in ("tiny", "tiny-qwen3.5") for fmt in FORMATS] + [("tiny-qwen3.5-moe", "w4a16")]
# Groups of 16 (the halves of its 32-wide expert and shared-expert projections): a bf16 scale per 16 int4 weights.
RANGES = {"tiny-qwen3.5-moe-w4a16": (0.3, 0.33)}


@pytest.fixture(scope="module", params=CASES, ids=[f"{base}-{fmt}" for base, fmt in CASES])
def quantized(request):
    base, fmt = request.param
    ckpt = preset_checkpoint(f"{base}-{fmt}")
    dtype = "bfloat16" if fmt == "fp8" else "float32"
    dequantize = {} if fmt == "fp8" else {"quantization_config": CompressedTensorsConfig(dequantize=True)}
    hf = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=getattr(torch, dtype), **dequantize).eval()
    with ref.engine_pool(ckpt, dtype=dtype, max_num_seqs=2, max_model_len=512) as engines:
        yield fmt, ckpt, hf, engines


def test_greedy_tokens_equal_transformers_on_the_quantized_checkpoint(quantized):
    fmt, ckpt, hf, engines = quantized
    prompt = ref.prepare(IMAGE_REQUEST, language_adapter(ckpt).tokenizer, vision_adapter(ckpt))
    embeds = ref.embeddings(hf, ckpt, prompt)
    eos = hf.generation_config.eos_token_id
    expected = ref.hf_generate(hf, prompt, embeds, MAX_NEW, cut_at=eos[0] if isinstance(eos, list) else eos)
    for k in (1, 8):
        out = asyncio.run(engines(k).generate_output(f"{fmt}-{k}", prompt.without_pixels(), embeds,
                                                     SamplingParams(max_tokens=MAX_NEW)))
        assert out.token_ids == expected, f"K={k}"


def test_quantized_layers_hold_a_fraction_of_their_bf16_bytes(quantized):
    """Linears and, in a mixture-of-experts model, every layer's experts (all quantized, kept as stored)."""
    fmt, ckpt, hf, engines = quantized
    low, high = RANGES.get(ckpt.name.rsplit("-v", 1)[0], FORMATS[fmt])
    modules = list(engines(1).runner.model.modules())
    layers = [m for m in modules if isinstance(m, StoredWeightLinear)]
    assert layers
    stored = sum(getattr(m, n).nbytes for m in layers for n in m.stored)
    bf16 = sum(m.in_features * m.out_features * 2 for m in layers)
    assert low <= stored / bf16 <= high, stored / bf16
    text = hf.config.get_text_config()
    experts = [m for m in modules if isinstance(m, StoredExperts)]
    assert len(experts) == (text.num_hidden_layers if getattr(text, "num_experts", 0) else 0)
    if experts:
        stored = sum(getattr(m, n).nbytes for m in experts for n in m.stored)
        bf16 = len(experts) * text.num_experts * 3 * text.moe_intermediate_size * text.hidden_size * 2
        assert low <= stored / bf16 <= high, stored / bf16


@pytest.mark.parametrize("config, field", [
    ({"quant_method": "awq"}, "quant_method"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "activation_scheme"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, "scale_fmt"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float",
                                                                        "strategy": "tensor_group", "group_size": 16}}}},
     "config_groups.group_0.format"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": "four"}}}}, "num_bits"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "kv_cache_scheme": {"num_bits": 8}},
     "kv_cache_scheme"),
])
def test_an_unsupported_quantization_config_is_refused_naming_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        quantization_plan({"quantization_config": config})


@pytest.mark.parametrize("preset, block", [("tiny-fp8", [0, 128]), ("tiny-qwen3-vl-moe-fp8", 128)])
def test_the_language_model_load_refuses_a_malformed_config(tmp_path, preset, block):
    """Also where the loader fuses per-expert FP8 scales (Qwen3-VL, Qwen3.5): the plan's message, not a TypeError."""
    source = preset_checkpoint(preset)
    for path in source.iterdir():
        (tmp_path / path.name).symlink_to(path)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = block
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantization_config\.weight_block_size"):
        language_adapter(tmp_path).load_model(torch.device("cpu"), torch.float32)
    shutil.rmtree(tmp_path)


@pytest.mark.parametrize("shape", [(300, 200), (4, 64), (256, 384)])
def test_fp8_partial_blocks_dequantize_as_transformers_does_with_the_block_size(shape):
    """Sizes that are not a multiple of the 128 block (the presets' never are both): the last blocks are
    partial, as in transformers' own block dequantization that takes the block size (its FP8 backward's)."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    from raypipe.models.quantized.fp8_block import Fp8BlockLinear

    out_features, in_features = shape
    generator = torch.Generator().manual_seed(0)
    layer = Fp8BlockLinear(in_features, out_features, (128, 128), bias=False, dtype=torch.float32)
    layer.weight = torch.randn(shape, generator=generator).to(torch.float8_e4m3fn)
    layer.weight_scale_inv = torch.rand(-(-out_features // 128), -(-in_features // 128), generator=generator)
    expected = _dequantize_fp8_weight(layer.weight, layer.weight_scale_inv, [128, 128], torch.float32)
    assert torch.equal(layer.dequantize(torch.float32), expected)


def test_experts_stored_apart_with_one_tensor_missing_are_refused_naming_it(tmp_path):
    """A per-expert checkpoint (llmcompressor's layout) missing one expert's tensor: a ValueError naming it, not a
    KeyError from the stacking (what it raised before)."""
    from safetensors.torch import load_file, save_file

    source = preset_checkpoint("tiny-qwen3.5-moe-w4a16")
    for path in source.iterdir():
        shutil.copy(path, tmp_path / path.name)
    [weights] = tmp_path.glob("*.safetensors")
    state = load_file(weights)
    key = "model.language_model.layers.0.mlp.experts.2.up_proj.weight_scale"
    del state[key]
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=key.removeprefix("model.language_model.").replace(".", r"\.")):
        language_adapter(tmp_path).load_model(torch.device("cpu"), torch.float32)

