"""Generation after a long video (issue 29, item 1): a 60 s and a 10-minute clip at 2 fps, long enough
that transformers 5.23's `get_rope_index` and the original implementation's rule part ways, generate
through raypipe's engine (K=1 and K=8, EVS off and at 0.5) exactly the tokens of the oracle
(tests/mrope_reference.py): transformers' own vision tower and text model, driven at the rule's
positions in a manual greedy loop.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from raypipe import SamplingParams
from raypipe.inputs.media import DecodedVisual, pixel_hash
from raypipe.models import evs
from raypipe.models.prompt import VideoOptions, build_prompt
from raypipe.models.registry import vision_adapter
from tests import decode_reference as ref
from tests.mrope_reference import greedy_at_positions, rule_positions
from tests.test_video_generate import hf_inputs, messages, raypipe_embeddings

FPS = 2.0
# Frames as sampled at 2 fps, at the smallest size the tiny preset's video processor makes (56 x 56:
# 2 x 2 tokens a group), so that even the 10-minute clip is cheap.
CLIPS = {"60s": 120, "10min": 1200}
RATES = [0.0, 0.5]
MAX_NEW = 12


def clip(frames: int, seed: int) -> DecodedVisual:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (frames // 2, 56, 56, 3), dtype=np.uint8).repeat(2, axis=0)
    return DecodedVisual(pixels, pixel_hash(pixels), "video", FPS)


@pytest.fixture(scope="module")
def engines(tiny_ckpt):
    with ref.engine_pool(tiny_ckpt, max_num_seqs=2, max_model_len=4096) as get:
        yield get


@pytest.fixture(scope="module")
def cases(tiny_ckpt, hf_model, engines):
    """(clip, rate) -> (prompt, raypipe's embeddings, the oracle's positions and tokens)."""
    vision = vision_adapter(tiny_ckpt)
    tower = vision.load_tower(torch.device("cpu"), torch.float32)
    eos = hf_model.config.text_config.eos_token_id
    out = {}
    for seed, (name, frames) in enumerate(CLIPS.items()):
        chat = messages([clip(frames, seed)])
        whole = build_prompt(chat, engines(1).tokenizer, vision)
        inputs = hf_inputs(hf_model, vision, whole)
        with torch.no_grad():
            hf_rows = hf_model.model.visual(inputs["pixel_values_videos"],
                                            grid_thw=inputs["video_grid_thw"]).pooler_output
        [layout] = whole.visual_layouts
        assert layout.grid == (frames // 2, 4, 4) and layout.seconds_per_grid == 1.0
        embeds = raypipe_embeddings(vision, tower, whole)
        for rate in RATES:
            prompt = build_prompt(chat, engines(1).tokenizer, vision, video=VideoOptions(pruning_rate=rate))
            mask = evs.retention_mask(hf_rows, layout.grid[0], rate) if rate else None
            positions, first = rule_positions(prompt.prompt_token_ids, [("video", layout.grid, 1.0)], hf_model.config,
                                              kept=[mask])
            rows = hf_rows if mask is None else hf_rows[mask]
            want = greedy_at_positions(hf_model, prompt.prompt_token_ids, rows, positions, first, MAX_NEW, eos)
            out[name, rate] = (prompt, embeds, positions, first, want)
    return out


@pytest.mark.parametrize("name", CLIPS)
def test_the_clips_are_long_enough_for_the_rules_to_differ(cases, hf_model, name):
    """transformers' `get_rope_index` puts the text after these videos elsewhere than the rule does."""
    prompt, _, positions, first, _ = cases[name, 0.0]
    ids = torch.tensor([prompt.prompt_token_ids])
    types = 2 * (ids == hf_model.config.video_token_id).int()
    theirs, delta = hf_model.model.get_rope_index(ids, types, video_grid_thw=torch.tensor([prompt.visual_grids[0]]),
                                                  second_per_grid_ts=torch.tensor([1.0]))
    last_video_time = (prompt.visual_grids[0][0] - 1) * hf_model.config.vision_config.tokens_per_second
    assert int(positions[0].max()) > last_video_time and first == int(positions[0, -1]) + 1
    assert int(theirs[0, 0, -1]) < last_video_time < ids.shape[1] + int(delta)  # the jump at decode


@pytest.mark.parametrize("rate", RATES, ids=["whole", "evs0.5"])
@pytest.mark.parametrize("name", CLIPS)
def test_positions_follow_the_rule(tiny_ckpt, engines, cases, name, rate):
    prompt, embeds, positions, first, _ = cases[name, rate]
    adapter = engines(1).adapter
    kept = [evs.retention_mask(embeds[0], prompt.visual_grids[0][0], rate) if rate else None]
    got, delta = adapter.positions(prompt.prompt_token_ids, prompt.visual_layouts, kept)
    assert torch.equal(got, positions)
    assert len(prompt.prompt_token_ids) + delta == first


@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize("rate", RATES, ids=["whole", "evs0.5"])
@pytest.mark.parametrize("name", CLIPS)
def test_generation_after_a_long_video_matches_the_oracle(engines, cases, name, rate, k):
    prompt, embeds, _, _, want = cases[name, rate]
    out = asyncio.run(engines(k).generate_output(f"long-{name}-{rate}-{k}", prompt, embeds,
                                                 SamplingParams(max_tokens=MAX_NEW)))
    assert out.token_ids == want
