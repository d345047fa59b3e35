"""LLaVA-OneVision without Ray: prompt ids equal transformers' chat path (`apply_chat_template` + processor), feature selection
(layers, lists, strategies) equals transformers' hidden states, and equal-cost units split evenly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from raypipe.encode.partition import partition
from raypipe.inputs.images import load_images
from raypipe.models.llava_onevision.vision import LlavaOnevisionVisionAdapter
from raypipe.models.prompt import build_prompt
from raypipe.models.registry import language_adapter, vision_adapter
from raypipe.models.vision_features import FeatureSelection
from tests import llava_ov_reference as ref
from tests.conftest import random_images


@pytest.mark.parametrize("sizes", [[], [(100, 60)], [(40, 170), (300, 290), (20, 30), (500, 70)]],
                         ids=["text", "one_image", "mixed_aspect_ratios"])
def test_prompt_ids_match_processor(llava_ckpt, sizes):
    images = random_images(sizes, seed=len(sizes))
    messages = [{"role": "user", "content": [{"type": "image", "image": image} for image in images]
                 + [{"type": "text", "text": "What is this?"}]}]
    tokenizer = language_adapter(llava_ckpt).tokenizer
    prompt = build_prompt(messages, tokenizer, vision_adapter(llava_ckpt))
    assert prompt.prompt_token_ids == ref.chat_inputs(llava_ckpt, messages)["input_ids"][0].tolist()


def _encode_in_process(adapter, images):
    tower = adapter.load_tower(torch.device("cpu"), torch.float32)
    out = []
    for image in load_images(images):
        item = adapter.make_item(image)
        out.append(adapter.join_units(item, tower.encode(adapter.units(item))))
    return out, tower


@pytest.mark.parametrize("layer", [[-2, -1], [0, 1], -2], ids=["last_two", "embeddings_and_first", "second_last"])
def test_feature_layers_match_get_image_features(llava_ckpt, tmp_path, layer):
    """A checkpoint whose config selects other layers (a list widens the projector): the same packed rows
    as transformers, with the tower built only up to the deepest selected layer."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    folder = tmp_path / "ckpt"
    shutil.copytree(llava_ckpt, folder)
    config = json.loads((folder / "config.json").read_text())
    config["vision_feature_layer"] = layer
    torch.manual_seed(1)
    model = LlavaOnevisionForConditionalGeneration(LlavaOnevisionConfig(**config)).eval()
    model.save_pretrained(folder)
    images = random_images([(100, 60), (300, 290)], seed=5)
    got, tower = _encode_in_process(LlavaOnevisionVisionAdapter(folder), images)
    depth = model.config.vision_config.num_hidden_layers
    assert len(tower.tower.encoder.layers) == FeatureSelection.from_config(model.config).layers_to_run(depth)
    for ours, want in zip(got, ref.image_features(model, folder, images, tile_every_image=True)):  # each alone
        torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("strategy", ["default", "full", "class"])
@pytest.mark.parametrize("layer", [-1, [0, -1]])
def test_selection_matches_hidden_states(llava_hf_model, strategy, layer):
    """Every strategy and layer form on a SigLIP tower, against its own `hidden_states`."""
    tower = llava_hf_model.model.vision_tower
    pixels = torch.randn(2, 3, 56, 56, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = tower(pixels, output_hidden_states=True).hidden_states
    depth = tower.config.num_hidden_layers
    layers = layer if isinstance(layer, list) else [layer]
    keep = {"default": slice(1, None), "full": slice(None), "class": slice(0, 1)}[strategy]
    want = torch.cat([hidden[i][:, keep] for i in layers], dim=-1)
    config = type("C", (), {"vision_feature_layer": layer, "vision_feature_select_strategy": strategy})
    selection = FeatureSelection.from_config(config)
    torch.testing.assert_close(selection.select(hidden, depth), want, atol=0, rtol=0)
    assert want.shape[1] == selection.tokens_per_image(tower.config)


def test_equal_costs_split_evenly_and_contiguously():
    assert partition([5.0] * 10, 3)[0] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert partition([5.0] * 4, 3, [1.0, 0.0, 0.0])[0] != [[0, 1], [2, 3], []]  # a busy worker: the balancer
    assert sorted(map(len, partition([3.0, 1.0, 1.0, 1.0], 2)[0])) == [1, 3]  # mixed costs: the balancer
