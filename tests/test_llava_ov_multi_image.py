"""LLaVA-OneVision with several images in one prompt: each image gets its base view only, as transformers' chat path
(`apply_chat_template` + the processor: `batch_num_images`) and the model's recipe have it; an image alone keeps its
AnyRes tiles; `tile_every_image` tiles every image, as the processor does when handed a flat image list. Prompt ids,
embeddings (in process, and over Ray with the encoder cache on) and greedy decoding against transformers."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from raypipe import SamplingParams
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.encode.coordinator import Coordinator
from raypipe.encode.pool import EncoderPool
from raypipe.errors import InvalidInput
from raypipe.models.llava_onevision.base_view import base_view
from raypipe.models.prompt import VideoOptions, build_prompt
from raypipe.models.registry import language_adapter, preset_checkpoint, vision_adapter
from raypipe.serve.openai.parsing import parse_request
from tests import llava_ov_reference as ref
from tests import minicpmv_video_reference as vref
from tests.conftest import random_images

MAX_NEW = 10
# (image sizes, tile_every_image): one image (tiles either way), two and three images (base views), two tiled.
CASES = {"one_image": ([(100, 60)], False), "two_images": ([(100, 60), (40, 170)], False),
         "three_images": ([(300, 290), (20, 30), (56, 56)], False), "two_tiled": ([(100, 60), (40, 170)], True)}


def _messages(images, split_turns: bool = False) -> list[dict]:
    """A chat with `images` among text; `split_turns` puts the last image in a later user turn."""
    parts = [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": "Compare them."}]
    if not split_turns:
        return [{"role": "user", "content": parts}]
    return [{"role": "user", "content": parts[:-2] + [parts[-1]]}, {"role": "assistant", "content": "Seen."},
            {"role": "user", "content": [parts[-2], {"type": "text", "text": "And this one?"}]}]


@pytest.fixture(scope="module")
def adapters(llava_ckpt):
    return language_adapter(llava_ckpt), vision_adapter(llava_ckpt)


@pytest.fixture(scope="module")
def tower(adapters):
    return adapters[1].load_tower(torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def engine(llava_ckpt):
    made = LLMEngine(llava_ckpt, EngineConfig(max_num_seqs=2, max_model_len=1024))
    yield made
    made.shutdown()


@pytest.fixture(scope="module")
def cases(llava_ckpt, llava_hf_model, adapters):
    """Per case: our prompt, transformers' prompt ids, image features and greedy tokens."""
    lang, vision = adapters
    out = {}
    for i, (name, (sizes, tile)) in enumerate(CASES.items()):
        images = random_images(sizes, seed=10 + i)
        messages = _messages(images, split_turns=name == "three_images")
        request = {"messages": messages, "mm_processor_kwargs": {"tile_every_image": True}} if tile else messages
        prompt = build_prompt(request, lang.tokenizer, vision)
        if tile:  # the processor given the images as a flat list: the chat path never does that
            text = lang.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = ref.prompt_ids(llava_ckpt, text, images, tile_every_image=True)
            features = ref.image_features(llava_hf_model, llava_ckpt, images, tile_every_image=True)
            want = ref.generate(llava_hf_model, ids, features, MAX_NEW)
        else:  # transformers' chat path end to end
            inputs = ref.chat_inputs(llava_ckpt, messages)
            ids = inputs["input_ids"][0].tolist()
            with torch.no_grad():
                features = list(llava_hf_model.model.get_image_features(
                    inputs["pixel_values"], inputs["image_sizes"],
                    batch_num_images=inputs["batch_num_images"]).pooler_output)
            want = ref.generate_chat(llava_hf_model, inputs, MAX_NEW)
        out[name] = prompt, ids, features, want, images
    return out


@pytest.mark.parametrize("name", CASES)
def test_prompt_ids_equal_transformers(adapters, cases, name):
    prompt, ids, features, _, _ = cases[name]
    assert prompt.prompt_token_ids == ids
    assert prompt.num_image_tokens == sum(len(f) for f in features)
    assert sum(n for layout in prompt.visual_layouts for n in adapters[0].prompt_runs(layout)) == len(
        [t for t in ids if t == adapters[1].image_token_id])
    if name == "two_images":  # the numbers: a base view's 16 rows and a newline row each
        assert prompt.num_image_tokens == 34 < cases["two_tiled"][0].num_image_tokens


@pytest.mark.parametrize("name", CASES)
def test_embeddings_equal_get_image_features(adapters, tower, cases, name):
    vision = adapters[1]
    prompt, _, features, _, _ = cases[name]
    for visual, want in zip(prompt.visuals, features, strict=True):
        item = vision.make_item(visual)
        torch.testing.assert_close(vision.join_units(item, tower.encode(vision.units(item))), want,
                                   atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", CASES)
def test_greedy_equals_generate(engine, cases, name):
    prompt, _, features, want, _ = cases[name]
    out = asyncio.run(engine.generate_output(f"multi-{name}", prompt, features, SamplingParams(max_tokens=MAX_NEW)))
    eos = engine.adapter.eos_token_ids[0]
    assert out.token_ids == (want[: want.index(eos) + 1] if eos in want else want)


def test_encoder_cache_keeps_base_view_and_tiles_apart(llava_workers, llava_hf_model, llava_ckpt, adapters, cases):
    """The same image as a prompt's only image (tiles), then beside another (base view), then tiled on request,
    through one coordinator with its cache on: three different embeddings, each transformers' own."""
    lang, vision = adapters
    coordinator = Coordinator(vision, EncoderPool(llava_workers[:2]), cache_bytes=1 << 24)
    _, _, _, _, images = cases["two_images"]
    alone = build_prompt(_messages(images[:1]), lang.tokenizer, vision)
    together = build_prompt(_messages(images), lang.tokenizer, vision)
    tiled = build_prompt({"messages": _messages(images), "mm_processor_kwargs": {"tile_every_image": True}},
                         lang.tokenizer, vision)
    first = coordinator.encode(alone.visuals)[0]
    torch.testing.assert_close(first, ref.image_features(llava_hf_model, llava_ckpt, images[:1])[0],
                               atol=1e-5, rtol=1e-4)
    # Base views: never encoded before; tiled: the first image's tiles are the first call's (a cache hit).
    for prompt, flat, hits in ((together, False, 0), (tiled, True, 1)):
        got = coordinator.encode(prompt.visuals)
        for ours, want in zip(got, ref.image_features(llava_hf_model, llava_ckpt, images, tile_every_image=flat),
                              strict=True):
            torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-4)
        assert coordinator.last_report.cache_hits == hits


def test_token_id_requests_follow_the_same_rule(llava_ckpt, adapters):
    """Raw ids with one `<image>` per image: base views for several, tiles on request, as the processor."""
    lang, vision = adapters
    images = random_images([(160, 100), (30, 400)], seed=3)
    text = "<|im_start|>user\n<image>\n<image>\nWhich is wider?<|im_end|>\n<|im_start|>assistant\n"
    ids = lang.tokenizer(text, add_special_tokens=False)["input_ids"]
    for tile in (False, True):
        request = {"prompt_token_ids": ids, "images": images, "mm_processor_kwargs": {"tile_every_image": tile}}
        assert build_prompt(request, lang.tokenizer, vision).prompt_token_ids == ref.prompt_ids(
            llava_ckpt, text, images, tile_every_image=tile)


def test_images_and_a_video(llava_ckpt, adapters):
    """Two images beside a video get their base views (the video does not count as an image); one keeps its tiles."""
    lang, vision = adapters
    source = random_images([(48, 64)] * 5, seed=4)
    for sizes in ([(100, 60), (40, 170)], [(100, 60)]):
        images = random_images(sizes, seed=5)
        parts = [{"type": "image", "image": image} for image in images] + [
            {"type": "video", "video": source}, {"type": "text", "text": "What happens?"}]
        prompt = build_prompt([{"role": "user", "content": parts}], lang.tokenizer, vision, video=VideoOptions())
        text = lang.tokenizer.apply_chat_template([{"role": "user", "content": [
            {"type": p["type"]} if p["type"] != "text" else p for p in parts]}], add_generation_prompt=True,
            tokenize=False)
        with pytest.MonkeyPatch.context() as monkeypatch:
            vref.install(monkeypatch)
            video = ref.preprocess_video(llava_ckpt, np.stack(source), 2.0)  # a frames list plays at 2 fps
        assert prompt.prompt_token_ids == ref.prompt_ids(llava_ckpt, text, images, [video])
        assert [layout.grid[0] == 0 for layout in prompt.visual_layouts] == [len(images) > 1] * len(images) + [False]


def test_bad_tile_every_image_is_refused(adapters):
    lang, vision = adapters
    messages = _messages(random_images([(40, 40), (50, 30)], seed=6))
    for kwargs in ({"tile_every_image": "yes"}, {"tile_every_image": 1}, {"tiles": True}, ["tile_every_image"]):
        with pytest.raises(InvalidInput) as err:
            build_prompt({"messages": messages, "mm_processor_kwargs": kwargs}, lang.tokenizer, vision)
        assert err.value.code == "invalid_mm_processor_kwargs"
    qwen = preset_checkpoint("tiny")
    with pytest.raises(InvalidInput) as err:  # a family without the rule has nothing to tile
        build_prompt({"messages": messages, "mm_processor_kwargs": {"tile_every_image": True}},
                     language_adapter(qwen).tokenizer, vision_adapter(qwen))
    assert err.value.code == "invalid_mm_processor_kwargs"
    with pytest.raises(InvalidInput) as err:  # Serve: a strict boolean
        parse_request(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
                      b'"mm_processor_kwargs": {"tile_every_image": "yes"}}')
    assert err.value.code == "invalid_type" and err.value.item == "mm_processor_kwargs.tile_every_image"


@pytest.mark.parametrize("side", [56, 384])
def test_base_view_pixels_equal_pad_to_square_and_resize(adapters, side):
    """Band by band, without the square: the same bytes as the processor's `pad_to_square` + `resize`, for tall,
    wide, square, tiny and extreme images, at the tiny tower's size and the release's."""
    from transformers.image_utils import SizeDict

    processor = adapters[1].processor
    color = tuple(int(x * 255) for x in processor.image_mean)
    for image in random_images(ref.SIZES + [(2, 3), (3000, 20), (20, 3000), (57, 56)], seed=side):
        square = processor.pad_to_square(np.moveaxis(image, -1, 0), background_color=color)
        want = processor.resize(square, size=SizeDict(height=side, width=side), resample=processor.resample)
        assert np.array_equal(base_view(image, side, color, processor.resample), np.moveaxis(want, 0, -1))
