"""Step3 without Ray: the tiny preset, prompt building against `Step3p7Processor`, the per-view
tower against transformers' vision path (the sliding layers' window blocks: test_step3_decode.py)."""

from __future__ import annotations

import random

import pytest
import torch

from raypipe.inputs.images import load_image
from raypipe.models.prompt import build_prompt
from raypipe.models.registry import vision_adapter
from tests import step3_reference as ref
from tests.conftest import random_images


def test_preset_is_a_real_step3_checkpoint(step3_ckpt, step3_hf_model):
    config = step3_hf_model.config
    text, vision = config.text_config, config.vision_config
    assert config.model_type == "step3p7" and text.model_type == "step3p5"
    assert config.initializer_range == text.initializer_range == vision.initializer_range == 0.2
    assert {"sliding_attention", "full_attention"} <= set(text.layer_types)
    assert "sparse" in text.mlp_layer_types and text.num_experts_per_tok > 1 and text.n_routed_experts > 2
    assert text.sliding_window < 40  # shorter than every image prompt below
    for name in ("config.json", "model.safetensors", "tokenizer_config.json", "processor_config.json"):
        assert (step3_ckpt / name).is_file()


@pytest.mark.parametrize("sizes", [[], [(300, 200)], ref.SIZES[:5], [(224, 224), (20, 400)]],
                         ids=["text", "one", "five", "no-crops"])
def test_prompt_equals_step3_processor(step3_ckpt, sizes):
    images = random_images(sizes, seed=len(sizes))
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"}]
                 + [{"type": "image", "image": image} for image in images]
                 + [{"type": "text", "text": "and say what differs."}]}]
    processor = ref.processor(step3_ckpt)
    text = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = processor(images=images or None, text=text)["input_ids"][0]
    prompt = build_prompt(messages, processor.tokenizer, vision_adapter(step3_ckpt))
    assert prompt.prompt_token_ids == list(expected)
    assert prompt.num_image_tokens == list(expected).count(processor.image_token_id)
    # Raw token ids carrying the full expansion are accepted as they are.
    again = build_prompt({"prompt_token_ids": list(expected), "images": images}, processor.tokenizer,
                         vision_adapter(step3_ckpt))
    assert again.prompt_token_ids == list(expected)


def test_views_encoded_in_any_grouping_equal_transformers(step3_ckpt, step3_hf_model):
    adapter = vision_adapter(step3_ckpt)
    images = random_images(ref.SIZES, seed=3)
    items = [adapter.make_item(load_image(image)) for image in images]
    units = [unit for item in items for unit in adapter.units(item)]
    assert len(units) > 2 * len(items)  # most test images have crops
    order = list(range(len(units)))
    random.Random(0).shuffle(order)  # a worker may hold any views of any images, in any order
    tower = adapter.load_tower(torch.device("cpu"), torch.float32)
    outputs = dict(zip(order, tower.encode([units[i] for i in order])))
    expected = ref.image_features(step3_hf_model, step3_ckpt, images)
    first = 0
    for item, want in zip(items, expected):
        count = len(adapter.units(item))
        got = torch.cat([outputs[first + k] for k in range(count)])
        first += count
        assert got.shape == want.shape == (item.num_tokens, adapter.hidden_size)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
