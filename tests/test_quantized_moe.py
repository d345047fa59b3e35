"""FP8 block-wise Qwen3-VL-MoE with its experts quantized (docs/quantization.md): the engine keeps every layer's
fused experts as stored (e4m3 `gate_up_proj` / `down_proj`, a block grid of scales per expert) and rebuilds
them for the layer's forward only.

The oracle is transformers' `generate()` from pixels on the same checkpoint, in bf16. transformers 5.23's FP8
quantizer dequantizes the linears at load on a CPU, but not Qwen3-VL-MoE's fused experts: it reports their
`*_scale_inv` tensors as unexpected and loads the e4m3 values unscaled (shown below). So the reference model's
experts hold what transformers' own `Fp8Dequantize` (the op its quantizer loads FP8 weights with) decompresses
from the stored tensors. Greedy tokens must be equal, K=1 and K=8, with images; the experts' resident bytes in
the engine's process must be about half of bf16's.
"""

from __future__ import annotations

import types

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForImageTextToText

from raypipe import SamplingParams
from raypipe.models.checkpoint import safetensors_files
from raypipe.models.prompt import build_prompt
from raypipe.models.quantized.fp8_block import Fp8BlockExperts, dequantize_blocks
from raypipe.models.registry import preset_checkpoint, vision_adapter
from tests import qwen3_vl_reference as ref
from tests.conftest import random_images
from tests.decode_reference import engine_pool, staggered

PRESET = "tiny-qwen3-vl-moe-fp8"
MAX_NEW = 12
PROMPTS = [[(64, 96)], [(64, 96), (128, 64)], []]  # one image, two, none
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def stored_experts(ckpt) -> dict[str, torch.Tensor]:
    """The checkpoint's fused-experts tensors (weights and their `_scale_inv`), by key."""
    out = {}
    for path in safetensors_files(ckpt):
        with safe_open(str(path), framework="pt") as f:
            out.update({key: f.get_tensor(key) for key in f.keys() if ".mlp.experts." in key})
    return out


def transformers_dequantized(stored: dict[str, torch.Tensor], key: str, dtype=torch.bfloat16) -> torch.Tensor:
    """Expert weights `key` as transformers' FP8 load op (`Fp8Dequantize`) decompresses them, in `dtype`."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    dequantize = Fp8Dequantize(FineGrainedFP8HfQuantizer(FineGrainedFP8Config()))
    out = dequantize.convert({"weight": stored[key], "weight_scale_inv": stored[f"{key}_scale_inv"]})
    return out["weight"].to(dtype)


def reference_model(ckpt, dtype=torch.bfloat16):
    """transformers' model of the checkpoint: linears by its FP8 quantizer, experts by its `Fp8Dequantize`."""
    hf = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=dtype).eval()
    stored = stored_experts(ckpt)
    for i, layer in enumerate(hf.model.language_model.layers):
        for name in EXPERT_WEIGHTS:
            key = f"model.language_model.layers.{i}.mlp.experts.{name}"
            getattr(layer.mlp.experts, name).data = transformers_dequantized(stored, key, dtype)
    return hf, stored


@pytest.fixture(scope="module")
def moe():
    ckpt = preset_checkpoint(PRESET)
    hf, stored = reference_model(ckpt)
    with engine_pool(ckpt, dtype="bfloat16", max_num_seqs=4, max_model_len=512) as engines:
        yield ckpt, hf, stored, engines


def case(ckpt, hf, processor, sizes, seed):
    """(raypipe's prompt, transformers' image features with deepstack levels, transformers' greedy ids)."""
    images = random_images(sizes, seed=seed)
    ours = [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                         {"type": "text", "text": "Describe it."}]}]
    theirs = [{"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": "Describe it."}]}]
    inputs = ref.hf_inputs(processor, theirs, images)
    prompt = build_prompt(ours, processor.tokenizer, vision_adapter(ckpt))
    eos = hf.generation_config.eos_token_id
    return prompt, ref.features(hf, inputs), ref.hf_generate(hf, inputs, MAX_NEW, eos)


def test_transformers_fp8_load_leaves_the_fused_experts_unscaled():
    """Why the reference sets the experts itself: transformers' own load of this checkpoint on a CPU does not
    apply the experts' block scales (if this fails, transformers reads them: use its load as the oracle)."""
    ckpt = preset_checkpoint(PRESET)
    loaded = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.bfloat16)
    stored = stored_experts(ckpt)
    key = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    experts = loaded.model.language_model.layers[0].mlp.experts
    assert not torch.equal(experts.gate_up_proj.data, transformers_dequantized(stored, key))
    assert torch.equal(experts.gate_up_proj.data, stored[key].to(torch.bfloat16))


def test_the_engine_rebuilds_the_experts_transformers_dequantizes(moe):
    ckpt, hf, stored, engines = moe
    layers = [m for m in engines(1).runner.model.modules() if isinstance(m, Fp8BlockExperts)]
    assert len(layers) == hf.config.text_config.num_hidden_layers
    for i, layer in enumerate(layers):
        for name in EXPERT_WEIGHTS:
            assert getattr(layer, name).dtype == torch.float8_e4m3fn  # kept as stored
            key = f"model.language_model.layers.{i}.mlp.experts.{name}"
            ours = dequantize_blocks(getattr(layer, name), getattr(layer, f"{name}_scale_inv"), layer.block,
                                     torch.bfloat16)
            assert torch.equal(ours, transformers_dequantized(stored, key)), key


def test_greedy_tokens_equal_transformers_with_images(moe):
    ckpt, hf, _, engines = moe
    processor = ref.hf_processor(ckpt)
    cases = [case(ckpt, hf, processor, sizes, seed) for seed, sizes in enumerate(PROMPTS)]
    assert len({tuple(c[2]) for c in cases}) > 1  # the prompts lead to different tokens
    for k in (1, 8):  # staggered: requests join a running batch (prefills beside the decode loop)
        outs = staggered(engines(k), cases, [SamplingParams(max_tokens=MAX_NEW)] * len(cases), f"moe-{k}")
        assert [out.token_ids for out in outs] == [c[2] for c in cases], f"K={k}"


def test_the_experts_hold_about_half_of_their_bf16_bytes(moe):
    """Measured in the engine's process (the engine runs in this one): the stored tensors' bytes over the
    same experts' weights in bf16 (2 bytes each)."""
    _, _, _, engines = moe
    layers = [m for m in engines(1).runner.model.modules() if isinstance(m, Fp8BlockExperts)]
    stored = sum(getattr(m, name).untyped_storage().nbytes() for m in layers for name in m.stored)
    bf16 = sum(getattr(m, name).numel() * 2 for m in layers for name in EXPERT_WEIGHTS)
    assert 0.5 <= stored / bf16 <= 0.52, stored / bf16


def _experts_apart(fused, folder):
    """`fused`'s checkpoint with every layer's experts stored one tensor per expert and projection, each with its
    own grid of block scales (Qwen's Qwen3-VL-MoE -FP8 layout, `mlp.experts.<e>.gate_proj.weight` and
    `.weight_scale_inv`), every other file and tensor as they are."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(fused, folder)
    tensors = {}
    for path in safetensors_files(fused):
        with safe_open(str(path), framework="pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})
        (folder / path.name).unlink()
    apart = {}
    for key, tensor in tensors.items():
        prefix, _, name = key.rpartition(".mlp.experts.")
        if not prefix:
            apart[key] = tensor
            continue
        weight, _, scale = name.partition("_scale_inv")
        suffix = "weight_scale_inv" if name != weight else "weight"
        for e, part in enumerate(tensor):
            if weight == "gate_up_proj":
                gate, up = part.chunk(2)
                apart[f"{prefix}.mlp.experts.{e}.gate_proj.{suffix}"] = gate.contiguous()
                apart[f"{prefix}.mlp.experts.{e}.up_proj.{suffix}"] = up.contiguous()
            else:
                apart[f"{prefix}.mlp.experts.{e}.down_proj.{suffix}"] = part.contiguous()
    save_file(apart, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_experts_stored_apart_as_qwens_fp8_releases_load_as_the_fused_checkpoint(tmp_path):
    """The same weights and scales stored one expert at a time load into the engine's language model bit for bit
    as the fused checkpoint's (whose tokens the tests above hold against transformers); a width that is no whole
    number of scale blocks is refused, naming the layer."""
    from raypipe.models.expert_layout import fused_experts
    from raypipe.models.registry import language_adapter

    fused = preset_checkpoint(PRESET)
    apart = _experts_apart(fused, tmp_path / "apart")
    assert any(".mlp.experts.0.gate_proj.weight_scale_inv" in key for key in stored_experts(apart))
    want = language_adapter(fused).load_model(torch.device("cpu"), torch.bfloat16).state_dict()
    got = language_adapter(apart).load_model(torch.device("cpu"), torch.bfloat16).state_dict()
    assert want.keys() == got.keys() and any(t.dtype == torch.float8_e4m3fn for t in got.values())
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key].view(torch.uint8), tensor.view(torch.uint8)), key
    width = 24  # 1.5 blocks of 16 rows
    state = {f"layers.0.mlp.experts.0.{p}.{kind}": torch.zeros(shape)
             for p, shape in (("gate_proj", (width, 16)), ("up_proj", (width, 16)), ("down_proj", (16, width)))
             for kind in ("weight",)}
    state |= {f"layers.0.mlp.experts.0.{p}.weight_scale_inv": torch.ones(2, 1) for p in ("gate_proj", "up_proj")}
    state["layers.0.mlp.experts.0.down_proj.weight_scale_inv"] = torch.ones(1, 2)
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts: an expert width of 24 rows .* 16-row"):
        fused_experts(state, types.SimpleNamespace(quantization_config={"weight_block_size": [16, 16]}))


def test_a_forward_rebuilds_only_the_experts_it_routes_to_and_equals_rebuilding_all(moe, monkeypatch):
    """Tokens routed to two of the four experts: the layer dequantizes those two only (the rebuilt tensors'
    leading size), and its output equals transformers' experts module over every expert rebuilt, bit for bit."""
    import copy

    from raypipe.models.quantized import fp8_block

    _, _, _, engines = moe
    layer = next(m for m in engines(1).runner.model.modules() if isinstance(m, Fp8BlockExperts))
    hidden = torch.randn(6, layer.gate_up_proj.shape[2], dtype=torch.bfloat16)
    top_k_index = torch.tensor([[3, 1], [1, 3], [3, 3], [1, 1], [3, 1], [1, 3]])
    top_k_weights = torch.rand(6, 2, dtype=torch.bfloat16)
    rebuilt = []
    real = fp8_block.dequantize_blocks
    monkeypatch.setattr(fp8_block, "dequantize_blocks", lambda w, *rest: rebuilt.append(w.shape[0]) or real(w, *rest))
    with torch.inference_mode():
        got = layer(hidden, top_k_index, top_k_weights)
        every = copy.copy(layer.experts)
        for name in EXPERT_WEIGHTS:
            setattr(every, name, real(getattr(layer, name), getattr(layer, f"{name}_scale_inv"), layer.block,
                                      torch.bfloat16))
        want = every(hidden, top_k_index, top_k_weights)
    assert rebuilt == [2, 2] and layer.gate_up_proj.shape[0] == 4
    assert torch.equal(got, want)
