"""Encoder forwards at token budgets: packed, padded forwards on metadata prepared outside the tower give
each unit exactly the rows of transformers' own tower (Qwen2.5-VL and Qwen3-VL images and video chunks,
MiniCPM-V overviews and slices), for mixes that fill, underfill and exceed the largest budget; torch.compile on
equals off; CUDA graphs (GPU only) equal eager forwards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raypipe.encode.budget_forwards import BudgetedForwards
from raypipe.encode.budgets import TokenBudgets, pack
from raypipe.inputs.media import DecodedVisual, pixel_hash
from raypipe.models.qwen2_5_vl.video import process_video
from raypipe.models.registry import vision_adapter
from tests.conftest import gpu, random_images, reference_embeddings

SMALL = TokenBudgets(min_tokens=16, max_tokens=256)  # the tiny preset's images are 16 to 1024 patches
# (h, w) -> patches: 56x56 16, 112x112 64, 84x140 60, 140x196 140, 200x300 and 300x280 above 256
FILL = [(112, 112), (112, 112), (84, 140), (56, 56)]  # 64 + 64 + 60 + 16 = 204 patches: one forward of 256
MIX = [(300, 280), (56, 56), (140, 196), (112, 112), (200, 300), (84, 140), (56, 56), (140, 196)]


def test_pack_smallest_first_into_power_of_two_budgets():
    budgets = TokenBudgets(min_tokens=16, max_tokens=64)
    forwards = pack([40, 5, 100, 20, 7, 64, 3], budgets)
    assert [(f.units, f.budget) for f in forwards] == [([6, 1, 4, 3], 64), ([0], 64), ([5], 64), ([2], None)]
    assert pack([3], budgets)[0].budget == 16  # underfilled: the smallest budget
    assert budgets.sizes == [16, 32, 64]
    with pytest.raises(ValueError, match="power of two"):
        TokenBudgets(max_tokens=100)


def test_one_switch_turns_budgets_off_everywhere(qwen):
    from raypipe.cli import build_parser
    from raypipe.config import model_config_from_args
    from raypipe.jobs.batch import options_from_args
    from raypipe.serve.app import AppArgs

    off = TokenBudgets(enabled=False)
    assert BudgetedForwards.for_tower(qwen[1], off) is None  # the worker then runs its eager forwards
    assert BudgetedForwards.for_tower(qwen[1], TokenBudgets(enabled=True)) is not None
    assert BudgetedForwards.for_tower(qwen[1], TokenBudgets()) is None  # default: CUDA only (qwen[1] is on the CPU)
    assert TokenBudgets().on_for(torch.device("cuda")) and not TokenBudgets().on_for(torch.device("cpu"))
    assert model_config_from_args(build_parser().parse_args(["demo", "--no-encoder-budgets"])).encoder_budgets == off
    batch = build_parser().parse_args(["batch", "--input", "in", "--output", "out", "--no-encoder-budgets"])
    assert options_from_args(batch).model.encoder_budgets == off
    assert AppArgs.model_validate({"encoder_budgets": {"enabled": False}}).as_model_config().encoder_budgets == off


@pytest.fixture(scope="module")
def qwen(tiny_ckpt):
    adapter = vision_adapter(tiny_ckpt)
    return adapter, adapter.load_tower(torch.device("cpu"), torch.float32)


def _items(adapter, images):
    return [adapter.make_item(DecodedVisual(image, pixel_hash(image))) for image in images]


@pytest.mark.parametrize("sizes", [FILL, MIX, [(56, 84)]], ids=["fill", "mix", "underfill"])
def test_qwen_packed_equals_transformers(qwen, hf_model, tiny_ckpt, sizes):
    adapter, tower = qwen
    images = random_images(sizes, seed=len(sizes))
    forwards = BudgetedForwards(tower, SMALL)
    got = forwards.encode(_items(adapter, images))
    for ours, theirs in zip(got, reference_embeddings(hf_model, tiny_ckpt, images), strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    stats = forwards.stats
    assert stats["padding_tokens"] > 0
    if sizes is MIX:  # two units above the largest budget ran alone, the rest packed
        assert stats["eager_units"] == 2 and stats["packed_forwards"] >= 2


def test_qwen_video_chunks_packed_equal_transformers(qwen, hf_model):
    adapter, tower = qwen
    pixels = np.random.default_rng(3).integers(0, 256, (12, 56, 84, 3), dtype=np.uint8)
    video = DecodedVisual(pixels, pixel_hash(pixels), kind="video", fps=2.0)
    adapter.video_chunk_patches = 48  # 2 temporal groups of 4x6 patches per chunk: 3 chunks
    item = adapter.make_item(video)
    chunks = adapter.units(item)
    image = random_images([(112, 112)], seed=9)
    got = BudgetedForwards(tower, TokenBudgets(min_tokens=16, max_tokens=128)).encode(
        [*chunks, *_items(adapter, image)])
    pixel_values, grid = process_video(pixels, adapter.video_config)
    with torch.no_grad():
        whole = hf_model.model.visual(pixel_values, grid_thw=torch.tensor([grid])).pooler_output
    torch.testing.assert_close(torch.cat(got[:len(chunks)]), whole, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got[-1], reference_embeddings(hf_model, adapter.checkpoint, image)[0],
                               atol=1e-5, rtol=1e-4)


def test_compiled_forwards_equal_eager(qwen):
    adapter, tower = qwen
    items = _items(adapter, random_images(FILL[:3], seed=4))
    budgets = TokenBudgets(min_tokens=256, max_tokens=256)  # one budget: one compile
    compiled = BudgetedForwards(tower, TokenBudgets(min_tokens=256, max_tokens=256, compile_cpu=True))
    assert compiled.stats["compiled"]
    for ours, theirs in zip(compiled.encode(items), BudgetedForwards(tower, budgets).encode(items), strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


@gpu
def test_cuda_graphs_equal_eager_forwards(tiny_ckpt):
    adapter = vision_adapter(tiny_ckpt)
    tower = adapter.load_tower(torch.device("cuda"), torch.bfloat16)
    if not tower.graph_capturable:
        pytest.skip("CUDA graphs need flash attention (flash_attn) for the Qwen2.5-VL tower")
    budgets = TokenBudgets(min_tokens=16, max_tokens=256)
    graphed = BudgetedForwards(tower, budgets)
    assert graphed.stats["graphs"] == len(budgets.sizes) and graphed.stats["graph_bytes"] > 0
    items = _items(adapter, random_images(MIX, seed=7))
    for ours, theirs in zip(graphed.encode(items), tower.encode(items), strict=True):
        torch.testing.assert_close(ours.float(), theirs.float(), atol=2e-2, rtol=2e-2)  # bf16


@pytest.fixture(scope="module")
def hf_minicpmv(minicpmv_ckpt):
    from transformers import MiniCPMV4_6ForConditionalGeneration

    return MiniCPMV4_6ForConditionalGeneration.from_pretrained(minicpmv_ckpt).eval()


# The tiny preset's overviews and slices are 240 or 256 patches.
@pytest.mark.parametrize("budgets", [TokenBudgets(min_tokens=64, max_tokens=128), TokenBudgets(max_tokens=512),
                                     TokenBudgets(max_tokens=4096)], ids=["all-above", "pairs", "fill"])
def test_minicpmv_packed_equals_transformers(minicpmv_ckpt, hf_minicpmv, budgets):
    """NaViT-packed overviews and slices, padded with units of their own."""
    from tests import minicpmv_reference as ref

    adapter = vision_adapter(minicpmv_ckpt)
    tower = adapter.load_tower(torch.device("cpu"), torch.float32)
    images = random_images(ref.SIZES[:5], seed=15)
    units = [adapter.units(item) for item in _items(adapter, images)]
    forwards = BudgetedForwards(tower, budgets)
    got = forwards.encode([u for image in units for u in image])
    start = 0
    for image_units, want in zip(units, ref.image_embeddings(hf_minicpmv, minicpmv_ckpt, images), strict=True):
        ours = torch.cat(got[start:start + len(image_units)])
        start += len(image_units)
        torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-4)
    above = budgets.max_tokens < 240
    assert (forwards.stats["eager_units"] > 0) == above
    assert (forwards.stats["packed_forwards"] > 0 and forwards.stats["padding_tokens"] > 0) == (not above)


@pytest.mark.parametrize("preset", ["tiny-qwen3-vl", "tiny-qwen3.5"])
def test_qwen3_vl_packed_equals_transformers(preset):
    """Qwen3-VL (deepstack levels on the columns) and Qwen3.5 (the same tower without them): images and a
    video's chunks packed into budgets equal transformers' `get_image_features` / `get_video_features`,
    every level."""
    from transformers import AutoModelForImageTextToText

    from raypipe.models.registry import preset_checkpoint
    from tests import qwen3_vl_reference as ref

    ckpt = preset_checkpoint(preset)
    adapter = vision_adapter(ckpt)
    tower = adapter.load_tower(torch.device("cpu"), torch.float32)
    hf = AutoModelForImageTextToText.from_pretrained(ckpt).eval()
    processor = ref.hf_processor(ckpt)
    images = random_images([(64, 64), (100, 200), (300, 90), (32, 32), (256, 256)], seed=3)
    pixels = np.random.default_rng(3).integers(0, 256, (12, 64, 96, 3), dtype=np.uint8)
    adapter.video_chunk_patches = 48  # 2 temporal groups of 4x6 patches per chunk: 3 chunks
    chunks = adapter.units(adapter.make_item(DecodedVisual(pixels, pixel_hash(pixels), kind="video", fps=2.0)))
    forwards = BudgetedForwards(tower, SMALL)
    got = forwards.encode([*_items(adapter, images), *chunks])
    want = ref.features(hf, dict(processor.image_processor(images=images, return_tensors="pt")))
    video_rows, video_grid = ref.video_pixels(processor.video_processor, pixels)
    want += ref.video_features(hf, video_rows, [video_grid])
    for ours, theirs in zip([*got[:len(images)], torch.cat(got[len(images):])], want, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    assert forwards.stats["padding_tokens"] > 0 and forwards.stats["packed_forwards"] >= 2
