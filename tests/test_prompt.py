import base64
import io

import numpy as np
import pytest
from PIL import Image

from raypipe import InvalidInput
from raypipe.models.registry import language_adapter, vision_adapter
from raypipe.prompt import build_prompt
from tests.conftest import random_images


@pytest.fixture(scope="module")
def sides(tiny_ckpt):
    return language_adapter(tiny_ckpt), vision_adapter(tiny_ckpt)


def data_url(pixels: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_placeholders_expand_to_each_images_token_count(sides):
    lang, vision = sides
    a, b = random_images([(56, 84), (112, 56)])
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": data_url(a)}},
        {"type": "image", "image": Image.fromarray(b)}]}]
    prompt = build_prompt({"messages": messages}, lang.tokenizer, vision)
    counts = [lang.tokens_per_image(g) for g in prompt.image_grids]
    assert counts == [6, 8] and prompt.num_image_tokens == 14
    ids = prompt.prompt_token_ids
    assert ids.count(lang.image_token_id) == 14 and ids.count(lang.vision_start_token_id) == 2
    start = ids.index(lang.vision_start_token_id)
    assert ids[start + 1: start + 7] == [lang.image_token_id] * 6 and ids[start + 7] == lang.vision_end_token_id
    assert lang.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    np.testing.assert_array_equal(prompt.images[0].pixels, a)


def test_raw_token_ids_accept_single_or_expanded_placeholders(sides):
    lang, vision = sides
    (image,) = random_images([(56, 84)])
    pad, vs, ve = lang.image_token_id, lang.vision_start_token_id, lang.vision_end_token_id
    short = build_prompt({"prompt_token_ids": [1, vs, pad, ve, 2], "images": [image]}, lang.tokenizer, vision)
    full = build_prompt({"prompt_token_ids": [1, vs] + [pad] * 6 + [ve, 2], "images": [image]}, lang.tokenizer, vision)
    assert short.prompt_token_ids == full.prompt_token_ids == [1, vs] + [pad] * 6 + [ve, 2]
    with pytest.raises(InvalidInput, match="placeholder 0 has 3"):
        build_prompt({"prompt_token_ids": [vs, pad, pad, pad, ve], "images": [image]}, lang.tokenizer, vision)


@pytest.mark.parametrize("request_, item", [
    ([{"role": "user", "content": [{"type": "text", "text": "<|image_pad|> no image"}]}], "images"),
    ({"prompt_token_ids": [1, 2], "images": random_images([(56, 56)])}, "images"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
     "images[0]"),
    ([{"role": "user", "content": [{"type": "audio"}]}], "messages[0].content[0]"),
    ([{"content": "no role"}], "messages[0]"),
    ([], "messages"),
    ({"prompt_token_ids": []}, "prompt_token_ids"),
])
def test_bad_requests_are_invalid_input(sides, request_, item):
    lang, vision = sides
    with pytest.raises(InvalidInput) as info:
        build_prompt(request_, lang.tokenizer, vision)
    assert info.value.item == item
