"""Qwen3-VL videos (dense and MoE) against transformers: frame indices and sizes equal
`Qwen3VLVideoProcessor`'s, processed tensors its `patchify` of the same frames, prompt ids (timestamps
before each temporal group) its processor's rules, positions its `get_rope_index` and the rule written
out, and greedy decoding `generate()` token for token (video, video + image; K=1 and K=8, staggered).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize
from transformers.video_utils import VideoMetadata as HFVideoMetadata

from raypipe import SamplingParams
from raypipe.errors import InvalidInput
from raypipe.inputs.video import VideoMetadata, VideoSampling
from raypipe.models.prompt import build_prompt
from raypipe.models.qwen2_5_vl.video import process_video
from raypipe.testing.sample_videos import make_video
from tests import qwen3_vl_reference as ref
from tests.conftest import random_images
from tests.decode_reference import staggered
from tests.test_qwen3_vl_decode import Model

MAX_NEW = 16
# (frames, source fps, height, width): durations from 1 s to 8 s, odd frame counts, wide and tall frames
VIDEOS = [(8, 4, 64, 64), (20, 5, 90, 120), (30, 10, 48, 200), (9, 3, 120, 90), (50, 25, 64, 96), (3, 1, 70, 70),
          (16, 8, 200, 48), (41, 5, 100, 100)]


@pytest.fixture(scope="module", params=["tiny-qwen3-vl", "tiny-qwen3-vl-moe"])
def model(request):
    made = Model(request.param)
    yield made
    made.close()


def encoded(i: int) -> bytes:
    frames, fps, height, width = VIDEOS[i]
    return make_video(random_images([(height, width)] * frames, seed=i), fps=fps)


def test_frame_plan_matches_the_video_processor(model):
    processor = model.processor.video_processor
    for frames, fps, height, width in VIDEOS:
        meta = VideoMetadata(total_num_frames=frames, fps=fps, duration_s=frames / fps, width=width, height=height)
        for sampling, knobs in ((VideoSampling(), {}), (VideoSampling(fps=1.0), {"fps": 1.0}),
                                (VideoSampling(num_frames=5), {"num_frames": 5})):
            plan = model.vision.plan_frames(sampling)(meta)
            theirs = processor.sample_frames(HFVideoMetadata(total_num_frames=frames, fps=fps), **knobs)
            assert list(plan.indices) == theirs.tolist(), (frames, fps, knobs)
            n = len(plan.indices)
            patches = -(-n // 2) * (plan.height // 16) * (plan.width // 16)
            assert patches == processor.get_num_of_video_patches(n, height, width), (frames, fps, height, width)
            assert plan.height % 32 == plan.width % 32 == 0
            # the processor's smart_resize with its per-frame cap, written from its rule
            cap = max(min(768 * 32 * 32, processor.size.longest_edge // n), int(processor.size.shortest_edge * 1.05))
            assert (plan.height, plan.width) == smart_resize(n, height, width, 2, 32, processor.size.shortest_edge,
                                                             cap * n)
    with pytest.raises(InvalidInput) as refused:
        model.vision.plan_frames(VideoSampling(total_pixels=10**6))
    assert refused.value.code == "invalid_video_sampling"


def test_processed_tensors_match_the_video_processor(model):
    for i, (frames, height, width) in enumerate([(4, 64, 96), (5, 32, 32), (8, 96, 64)]):
        stack = np.stack(random_images([(height, width)] * frames, seed=i))
        ours, grid = process_video(stack, model.vision.video_config)
        theirs, their_grid = ref.video_pixels(model.processor.video_processor, stack)
        assert grid == their_grid and torch.equal(ours, theirs)


def _prompt(model, i: int, with_image: bool):
    """(raypipe's prompt, the processor's ids, the visual items' grids by kind) for video `i` (and an image)."""
    images = random_images([(64, 96)], seed=100 + i) if with_image else []
    video = encoded(i)
    parts = [{"type": "video", "video": video}, *({"type": "image", "image": im} for im in images),
             {"type": "text", "text": "What happens?"}]
    prompt = build_prompt([{"role": "user", "content": parts}], model.processor.tokenizer, model.vision)
    decoded = prompt.visuals[0]
    grid = tuple(model.vision.make_item(decoded).grid)
    frames, fps = VIDEOS[i][:2]
    indices = model.vision.plan_frames(VideoSampling())(
        VideoMetadata(frames, fps, frames / fps, VIDEOS[i][3], VIDEOS[i][2])).indices
    metadata = HFVideoMetadata(total_num_frames=frames, fps=fps, frames_indices=list(indices))
    theirs = [{"role": "user", "content": [{"type": "video"}, *({"type": "image"} for _ in images),
                                           {"type": "text", "text": "What happens?"}]}]
    ids = ref.video_prompt_ids(model.processor, theirs, images, [(grid, metadata)])
    kinds = [("video", grid)] + [("image", tuple(g)) for g in prompt.visual_grids[1:]]
    return prompt, ids, kinds


def test_prompt_ids_and_positions_match_transformers(model):
    language = model.engine(1).adapter
    config = model.hf.config
    merge = config.vision_config.spatial_merge_size
    for i in range(len(VIDEOS)):
        for with_image in (False, True):
            prompt, ids, kinds = _prompt(model, i, with_image)
            assert prompt.prompt_token_ids == ids, (i, with_image)
            ours, delta = language.positions(prompt.prompt_token_ids, prompt.visual_layouts)
            tensor = torch.tensor([ids])
            types = (tensor == config.image_token_id).int() + 2 * (tensor == config.video_token_id).int()
            images = [g for kind, g in kinds if kind == "image"]
            theirs, their_delta = model.hf.model.get_rope_index(
                tensor, types, image_grid_thw=torch.tensor(images) if images else None,
                video_grid_thw=torch.tensor([kinds[0][1]]))
            assert torch.equal(ours, theirs[:, 0]) and delta == int(their_delta), (i, with_image)
            rule, rule_delta = ref.rule_positions(ids, ref.rule_video_grids(kinds),
                                                  {config.image_token_id, config.video_token_id}, merge)
            assert torch.equal(ours, rule) and delta == rule_delta, (i, with_image)


def _case(model, i: int, with_image: bool):
    """(prompt, transformers' embeddings per visual item, its greedy ids from pixels)."""
    prompt, ids, kinds = _prompt(model, i, with_image)
    video = prompt.visuals[0]
    video_rows, video_grid = process_video(video.pixels, model.vision.video_config)  # == the processor's (above)
    embeds = ref.video_features(model.hf, video_rows, [video_grid])
    inputs = {"input_ids": torch.tensor([ids]), "pixel_values_videos": video_rows,
              "video_grid_thw": torch.tensor([video_grid])}
    if with_image:
        image_inputs = dict(model.processor.image_processor(images=[v.pixels for v in prompt.visuals[1:]],
                                                            return_tensors="pt"))
        embeds += ref.features(model.hf, image_inputs)
        inputs.update(image_inputs)
    tensor = inputs["input_ids"]
    config = model.hf.config
    inputs["mm_token_type_ids"] = (tensor == config.image_token_id).int() + 2 * (tensor == config.video_token_id).int()
    inputs["attention_mask"] = torch.ones_like(tensor)
    return prompt, embeds, ref.hf_generate(model.hf, inputs, MAX_NEW, model.hf.generation_config.eos_token_id)


@pytest.mark.parametrize("k", [1, 8])
def test_greedy_matches_generate_for_videos_and_images(model, k):
    cases = [_case(model, 1, False), _case(model, 7, True), _case(model, 2, True)]
    outs = staggered(model.engine(k), cases, [SamplingParams(max_tokens=MAX_NEW)] * len(cases), f"video-{k}")
    assert [out.token_ids for out in outs] == [c[2] for c in cases]


def test_raw_token_ids_with_the_templates_video_part_expand_the_same(model):
    """A `prompt_token_ids` request carrying the template's `<|vision_start|><|video_pad|><|vision_end|>` (or
    the bare `<|video_pad|>`) gets the same ids as the chat: the three tokens replaced by the timestamped groups."""
    chat, ids, _ = _prompt(model, 3, False)
    tokenizer = model.processor.tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "video"},
                                                                       {"type": "text", "text": "What happens?"}]}],
                                         add_generation_prompt=True, tokenize=False)
    for template in (text, text.replace("<|vision_start|><|video_pad|><|vision_end|>", "<|video_pad|>")):
        raw = tokenizer(template, add_special_tokens=False)["input_ids"]
        prompt = build_prompt({"prompt_token_ids": raw, "videos": [encoded(3)]}, tokenizer, model.vision)
        assert prompt.prompt_token_ids == ids == chat.prompt_token_ids
