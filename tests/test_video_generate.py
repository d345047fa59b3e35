"""Greedy generation with videos (alone, with images, in any order), for K=1 and K=8 and with
staggered joins, equals token for token the oracle of tests/mrope_reference.py (transformers' own
vision tower and text model at the original implementation's positions, in a manual greedy loop),
and transformers' `generate()` itself where its `get_rope_index` agrees with that rule (images, and
videos whose time stays within their spatial extent); EVS pruning == `generate()` fed the same
pruned embeddings at the rule's positions for the retained tokens.

transformers' side runs its own tower on the same pixel values, grids and `second_per_grid_ts`
(the processor's tensor work is checked against transformers in test_qwen_video.py); raypipe's side
runs the prompt builder, raypipe's own vision tower (video chunks as separate units) and the engine.
"""

from __future__ import annotations

import asyncio
from unittest import mock

import numpy as np
import pytest
import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from raypipe import SamplingParams
from raypipe.inputs.media import DecodedVisual, pixel_hash
from raypipe.models import evs
from raypipe.models.prompt import VideoOptions, build_prompt
from raypipe.models.qwen2_5_vl.video import process_video
from raypipe.models.registry import vision_adapter
from tests import decode_reference as ref
from tests.mrope_reference import greedy_at_positions, rule_positions

MAX_NEW = 20
# Each request: its visual items in prompt order, ("video", frames, height, width, fps) or ("image", h, w).
# In the first `AGREEING` requests each video's last time (`(t - 1) * seconds_per_grid * tokens_per_second`)
# stays below its merged width or height, so transformers' `get_rope_index` gives the rule's positions;
# in the others it does not (the tiny preset's 4 tokens per second pass a small frame's extent in 2 groups).
AGREEING = 2
REQUESTS = [
    [("image", 56, 84), ("video", 8, 84, 140, 8.0)],
    [("video", 4, 112, 112, 4.0), ("image", 60, 60)],
    [("video", 8, 56, 84, 2.0)],
    [("image", 56, 84), ("video", 5, 84, 56, 1.0)],  # odd frame count: the last group is padded
    [("video", 16, 56, 56, 4.0), ("image", 60, 60), ("video", 4, 28, 112, 0.5)],
    [("video", 12, 84, 84, 2.0)],
]


def make_visuals(spec, seed: int) -> list[DecodedVisual]:
    rng = np.random.default_rng(seed)
    out = []
    for kind, *shape in spec:
        if kind == "image":
            out.append(rng.integers(0, 256, (*shape, 3), dtype=np.uint8))
            continue
        frames, height, width, fps = shape
        pixels = rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8)
        pixels[1::2] = pixels[::2][: frames // 2]  # frames repeat in pairs: EVS has near-duplicates to drop
        out.append(DecodedVisual(pixels, pixel_hash(pixels), "video", fps))
    return out


def messages(visuals) -> list[dict]:
    parts = [{"type": "video", "video": v} if isinstance(v, DecodedVisual) else {"type": "image", "image": v}
             for v in visuals]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What happens here?"}]}]


@pytest.fixture(scope="module")
def engines(tiny_ckpt):
    with ref.engine_pool(tiny_ckpt, max_num_seqs=8, max_model_len=1024) as get:
        yield get


@pytest.fixture(scope="module")
def vision(tiny_ckpt):
    adapter = vision_adapter(tiny_ckpt)
    adapter.video_chunk_patches = 48  # several chunks per video, encoded as separate units
    return adapter


@pytest.fixture(scope="module")
def tower(vision):
    return vision.load_tower(torch.device("cpu"), torch.float32)


def raypipe_embeddings(vision, tower, prompt) -> list[torch.Tensor]:
    out = []
    for visual in prompt.visuals:
        units = vision.units(vision.make_item(visual))
        out.append(torch.cat(tower.encode(units)))
    return out


def hf_inputs(hf_model, vision, prompt) -> dict:
    """transformers' `generate()` inputs for a prompt: pixel values, grids, seconds per grid, token types."""
    ids = torch.tensor([prompt.prompt_token_ids])
    config = hf_model.config
    kwargs = dict(mm_token_type_ids=(ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int())
    images = [v.pixels for v in prompt.visuals if v.kind == "image"]
    videos = [(v, layout) for v, layout in zip(prompt.visuals, prompt.visual_layouts) if v.kind == "video"]
    if images:
        processed = vision.processor(images=images, return_tensors="pt")
        kwargs.update(pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"])
    if videos:
        processed = [process_video(v.pixels, vision.video_config) for v, _ in videos]
        kwargs.update(pixel_values_videos=torch.cat([p for p, _ in processed]),
                      video_grid_thw=torch.tensor([g for _, g in processed]),
                      second_per_grid_ts=torch.tensor([layout.seconds_per_grid for _, layout in videos]))
        assert [tuple(g) for _, g in processed] == [layout.grid for _, layout in videos]
    return kwargs


def hf_generate(hf_model, prompt, eos: int, **kwargs) -> list[int]:
    ids = torch.tensor([prompt.prompt_token_ids])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                                **kwargs)
    tokens = out[0, ids.shape[1]:].tolist()
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def hf_visual_rows(hf_model, inputs: dict, prompt) -> list[torch.Tensor]:
    """Per visual item in prompt order, its rows from transformers' own vision tower."""
    merge = hf_model.config.vision_config.spatial_merge_size
    per_kind = {}
    for kind, pixels, grids in (("image", "pixel_values", "image_grid_thw"),
                                ("video", "pixel_values_videos", "video_grid_thw")):
        if pixels in inputs:
            with torch.no_grad():
                rows = hf_model.model.visual(inputs[pixels], grid_thw=inputs[grids]).pooler_output
            per_kind[kind] = iter(torch.split(rows, (inputs[grids].prod(-1) // merge**2).tolist()))
    return [next(per_kind[layout.kind]) for layout in prompt.visual_layouts]


def rule_visuals(prompt) -> list[tuple]:
    return [(x.kind, x.grid, x.seconds_per_grid) for x in prompt.visual_layouts]


def oracle_generate(hf_model, prompt, rows: list[torch.Tensor], eos: int, kept: list | None = None) -> list[int]:
    """Greedy tokens of transformers' text model at the original rule's positions (tests/mrope_reference.py)."""
    positions, first = rule_positions(prompt.prompt_token_ids, rule_visuals(prompt), hf_model.config, kept)
    return greedy_at_positions(hf_model, prompt.prompt_token_ids, torch.cat(rows), positions, first, MAX_NEW, eos)


@pytest.fixture(scope="module")
def cases(tiny_ckpt, hf_model, engines, vision, tower):
    """Per request: its prompt, raypipe's embeddings, the oracle's tokens and transformers' inputs."""
    engine = engines(1)
    out = []
    for i, spec in enumerate(REQUESTS):
        prompt = build_prompt(messages(make_visuals(spec, seed=i)), engine.tokenizer, vision)
        inputs = hf_inputs(hf_model, vision, prompt)
        want = oracle_generate(hf_model, prompt, hf_visual_rows(hf_model, inputs, prompt),
                               engine.adapter.eos_token_ids[0])
        out.append((prompt, raypipe_embeddings(vision, tower, prompt), want, inputs))
    return out


CASE_IDS = ["image-video8fps", "video4fps-image", "video", "image-video", "video-image-video", "video12"]


@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize("case", range(len(REQUESTS)), ids=CASE_IDS)
def test_video_request_matches_the_oracle(engines, cases, k, case):
    prompt, embeds, want, _ = cases[case]
    out = asyncio.run(engines(k).generate_output(f"video-{k}-{case}", prompt, embeds,
                                                 SamplingParams(max_tokens=MAX_NEW)))
    assert out.token_ids == want
    assert out.num_image_tokens == sum(layout_tokens(engines(k).adapter, prompt))


@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize("case", range(AGREEING), ids=CASE_IDS[:AGREEING])
def test_video_request_matches_generate_where_the_rules_agree(hf_model, engines, cases, k, case):
    prompt, embeds, _, inputs = cases[case]
    ids = torch.tensor([prompt.prompt_token_ids])
    theirs, delta = hf_model.model.get_rope_index(ids, **{name: x for name, x in inputs.items() if "pixel" not in name})
    ours, first = rule_positions(prompt.prompt_token_ids, rule_visuals(prompt), hf_model.config)
    assert torch.equal(theirs[:, 0], ours) and ids.shape[1] + int(delta) == first  # the rules agree here
    assert any(x.kind == "video" and x.grid[0] > 1 for x in prompt.visual_layouts)  # several groups
    want = hf_generate(hf_model, prompt, engines(k).adapter.eos_token_ids[0], **inputs)
    out = asyncio.run(engines(k).generate_output(f"agree-{k}-{case}", prompt, embeds,
                                                 SamplingParams(max_tokens=MAX_NEW)))
    assert out.token_ids == want


def layout_tokens(adapter, prompt) -> list[int]:
    return [adapter.tokens_per_image(layout.grid) for layout in prompt.visual_layouts]


@pytest.mark.parametrize("k", [1, 8])
def test_staggered_video_requests_join_a_running_batch(engines, cases, k):
    engine = engines(k)
    max_tokens = [MAX_NEW, 5, 9, MAX_NEW, 7, 13]

    async def one(i):
        await asyncio.sleep(0.004 * i)
        prompt, embeds, _, _ = cases[i]
        return await engine.generate_output(f"stagger-{k}-{i}", prompt, embeds, SamplingParams(max_tokens=max_tokens[i]))

    async def main():
        return await asyncio.gather(*(one(i) for i in range(len(cases))))

    for (_, _, want, _), limit, out in zip(cases, max_tokens, asyncio.run(main())):
        assert out.token_ids == want[:limit]


@pytest.mark.parametrize("rate", [0.5, 0.75])
@pytest.mark.parametrize("k", [1, 8])
def test_evs_pruned_generation_matches_generate_fed_the_same_tokens(tiny_ckpt, hf_model, engines, vision, tower,
                                                                   rate, k):
    engine = engines(k)
    spec = [("image", 56, 56), ("video", 12, 84, 84, 2.0)]
    visuals = make_visuals(spec, seed=11)
    pruned = build_prompt(messages(visuals), engine.tokenizer, vision, video=VideoOptions(pruning_rate=rate))
    whole = build_prompt(messages(visuals), engine.tokenizer, vision)
    [video_layout] = [x for x in pruned.visual_layouts if x.kind == "video"]
    t = video_layout.grid[0]
    per_group = engine.adapter.tokens_per_image(video_layout.grid) // t
    assert pruned.num_prompt_tokens == whole.num_prompt_tokens - (t * per_group - evs.retained_count(t, per_group, rate))

    # transformers' side: its own tower's embeddings, pruned by the rule, at the rule's positions (`generate()`
    # takes them in place of its `get_rope_index`).
    inputs = hf_inputs(hf_model, vision, whole)
    with torch.no_grad():
        image_embeds = hf_model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
        video_embeds = hf_model.model.visual(inputs["pixel_values_videos"],
                                             grid_thw=inputs["video_grid_thw"]).pooler_output
    mask = evs.retention_mask(video_embeds, t, rate)
    assert int(mask.sum()) == evs.retained_count(t, per_group, rate) and mask[:per_group].all()
    # The rule's positions of the unpruned prompt, with the pruned columns removed; decoding goes on
    # past the whole prompt's largest position.
    full_positions, first = rule_positions(whole.prompt_token_ids, rule_visuals(whole), hf_model.config)
    ids = torch.tensor([whole.prompt_token_ids])
    video_start = int((ids[0] == hf_model.config.video_token_id).nonzero()[0])
    keep = torch.ones(ids.shape[1], dtype=torch.bool)
    keep[video_start: video_start + len(mask)] = mask
    positions = full_positions[:, keep]
    assert torch.equal(positions, rule_positions(pruned.prompt_token_ids, rule_visuals(pruned), hf_model.config,
                                                 [None, mask])[0])
    delta = torch.tensor([[first - int(keep.sum())]])
    pruned_ids = torch.tensor([pruned.prompt_token_ids])
    assert torch.equal(pruned_ids, ids[:, keep])
    config = hf_model.config
    types = (pruned_ids == config.image_token_id).int() + 2 * (pruned_ids == config.video_token_id).int()
    encoder_outputs = {"image": BaseModelOutputWithPooling(pooler_output=(image_embeds,)),
                       "video": BaseModelOutputWithPooling(pooler_output=(video_embeds[mask],))}
    with mock.patch.object(hf_model.model, "get_rope_index", return_value=(positions[:, None], delta)):
        want = hf_generate(hf_model, pruned, engine.adapter.eos_token_ids[0], mm_token_type_ids=types,
                           image_grid_thw=inputs["image_grid_thw"], video_grid_thw=inputs["video_grid_thw"],
                           mm_encoder_outputs=encoder_outputs)

    embeds = raypipe_embeddings(vision, tower, pruned)
    out = asyncio.run(engine.generate_output(f"evs-{k}-{rate}", pruned, embeds, SamplingParams(max_tokens=MAX_NEW)))
    assert out.token_ids == want


def test_evs_rate_zero_is_no_pruning(engines, vision):
    visuals = make_visuals([("video", 8, 56, 84, 2.0)], seed=3)
    tokenizer = engines(1).tokenizer
    off = build_prompt(messages(visuals), tokenizer, vision)
    zero = build_prompt(messages(visuals), tokenizer, vision, video=VideoOptions(pruning_rate=0.0))
    assert off.prompt_token_ids == zero.prompt_token_ids and off.visual_layouts == zero.visual_layouts
