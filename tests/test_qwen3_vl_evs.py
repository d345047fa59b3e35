"""Qwen3-VL EVS (`video_pruning_rate`, dense and MoE) against vLLM's Qwen3-VL rule and transformers' text model.

transformers has no EVS, so the oracle is vLLM's rule restated plainly here (`vllm_group_counts`: its
`Qwen3VLMultiModalProcessor._get_prompt_updates` split of the kept count over the temporal groups;
`tests.test_evs.reference_mask`: its `compute_retention_mask`, over the whole row the tower yields, deepstack
levels included, as vLLM's Qwen3-VL tower hands it over; `qwen3_vl_reference.rule_positions`: its
`get_mrope_input_positions`, a pruned group's run on the first cells of its grid) driving transformers' own
`Qwen3VLTextModel` + `lm_head` with the pruned rows, every deepstack level pruned with the main rows.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from raypipe import SamplingParams
from raypipe.errors import InvalidInput
from raypipe.models.prompt import VideoOptions, build_prompt
from raypipe.models.qwen2_5_vl.video import process_video
from tests import qwen3_vl_reference as ref
from tests.conftest import random_images
from tests.mrope_reference import greedy_at_positions
from tests.test_evs import reference_mask
from tests.test_qwen3_vl_decode import Model
from tests.test_qwen3_vl_video import VIDEOS, encoded

MAX_NEW = 16
RATES = [0.3, 0.5, 0.75, 0.9]


@pytest.fixture(scope="module", params=["tiny-qwen3-vl", "tiny-qwen3-vl-moe"])
def model(request):
    made = Model(request.param)
    yield made
    made.close()


def vllm_group_counts(groups: int, per_group: int, rate: float) -> list[int]:
    """Video tokens vLLM's Qwen3-VL puts in each temporal group's run: the first group whole, the rest of
    `max(per_group, int(total * (1 - rate)))` spread evenly over the other groups, one more each for the
    earliest while a remainder lasts."""
    kept = max(per_group, int(groups * per_group * (1 - rate)))
    if groups == 1:
        return [per_group]
    rest = max(kept - per_group, 0)
    return [per_group] + [rest // (groups - 1) + (1 if g < rest % (groups - 1) else 0) for g in range(groups - 1)]


def prompts(model, i: int, rate: float, with_image: bool = False):
    """(the unpruned prompt, the prompt at `rate`) for video `i` (then an image) and a question."""
    images = random_images([(64, 96)], seed=100 + i) if with_image else []
    parts = [{"type": "video", "video": encoded(i)}, *({"type": "image", "image": im} for im in images),
             {"type": "text", "text": "What happens?"}]
    messages = [{"role": "user", "content": parts}]
    tokenizer = model.processor.tokenizer
    return (build_prompt(messages, tokenizer, model.vision),
            build_prompt(messages, tokenizer, model.vision, video=VideoOptions(pruning_rate=rate)))


def cut_runs(ids: list[int], token: int, counts: list[int]) -> list[int]:
    """`ids` with the n-th run of `token` cut to `counts[n]` tokens."""
    out, runs = [], iter(counts)
    for value, run in itertools.groupby(ids):
        run = list(run)
        out += run[:next(runs)] if value == token else run
    return out


def video_runs(ids: list[int], token: int) -> int:
    return sum(1 for value, _ in itertools.groupby(ids) if value == token)


def test_planned_counts_and_positions_follow_vllms_rule(model):
    language = model.engine(1).adapter
    config = model.hf.config
    merge = config.vision_config.spatial_merge_size
    empty_groups = 0
    for i in range(len(VIDEOS)):
        for rate in RATES:
            whole, pruned = prompts(model, i, rate)
            t, h, w = whole.visual_layouts[0].grid
            per_group = h * w // merge**2
            counts = vllm_group_counts(t, per_group, rate)
            assert sum(counts) == max(per_group, int(t * per_group * (1 - rate)))
            # the timestamps and every group's vision start/end stay; only the runs shrink
            assert pruned.prompt_token_ids == cut_runs(whole.prompt_token_ids, config.video_token_id, counts), (i, rate)
            assert pruned.num_prompt_tokens == whole.num_prompt_tokens - (t * per_group - sum(counts))
            assert pruned.num_image_tokens == sum(counts)
            empty_groups += counts.count(0)
            ids = pruned.prompt_token_ids
            ours, delta = language.positions(ids, pruned.visual_layouts)
            rule, rule_delta = ref.rule_positions(ids, [(1, h, w)] * video_runs(ids, config.video_token_id),
                                                  config.video_token_id, merge)
            assert torch.equal(ours, rule) and delta == rule_delta, (i, rate)
    assert empty_groups, "no rate left a group without tokens"


@pytest.mark.parametrize("k,rate", [(1, 0.5), (8, 0.8)])
def test_greedy_matches_the_text_model_fed_the_same_pruned_rows(model, k, rate):
    """The engine, given transformers' own embeddings, prunes them and decodes as transformers' text model does
    with vLLM's choice of rows (every deepstack level pruned alike) at vLLM's positions; levels from other
    rows change the tokens."""
    config = model.hf.config
    hidden = config.text_config.hidden_size
    _, pruned = prompts(model, 3, rate, with_image=True)
    rows, grid = process_video(pruned.visuals[0].pixels, model.vision.video_config)
    [video] = ref.video_features(model.hf, rows, [grid])
    image_inputs = dict(model.processor.image_processor(images=[v.pixels for v in pruned.visuals[1:]],
                                                        return_tensors="pt"))
    images = ref.features(model.hf, image_inputs)
    mask = torch.tensor(reference_mask(video, grid[0], rate))
    # vLLM scores the whole row (its tower returns the levels concatenated); at 0.5 that is not the main rows'
    # choice (at 0.8 the first group alone stays, however rows are scored)
    assert (mask.tolist() != reference_mask(video[:, :hidden], grid[0], rate)) == (rate == 0.5)

    ids = pruned.prompt_token_ids
    merge = config.vision_config.spatial_merge_size
    grids = [(1, grid[1], grid[2])] * video_runs(ids, config.video_token_id) + image_inputs["image_grid_thw"].tolist()
    positions, delta = ref.rule_positions(ids, grids, {config.image_token_id, config.video_token_id}, merge)
    eos = model.hf.generation_config.eos_token_id
    kept = video[mask]
    want = greedy_at_positions(model.hf, ids, torch.cat([kept, *images]), positions, len(ids) + delta, MAX_NEW, eos)
    out = asyncio.run(model.engine(k).generate_output(f"evs-{k}", pruned, [video, *images],
                                                      SamplingParams(max_tokens=MAX_NEW)))
    assert out.token_ids == want

    misplaced = kept.clone()
    # each kept row with the levels of the row at its place one group later (wrapping round): a rule that pruned
    # the levels apart from the main rows
    later = (mask.nonzero()[:, 0] + video.shape[0] // grid[0]) % video.shape[0]
    misplaced[:, hidden:] = video[later, hidden:]
    assert greedy_at_positions(model.hf, ids, torch.cat([misplaced, *images]), positions, len(ids) + delta, MAX_NEW,
                               eos) != want


def test_rate_zero_is_no_pruning_and_bad_rates_are_refused(model):
    whole, zero = prompts(model, 3, 0.0)
    assert zero.prompt_token_ids == whole.prompt_token_ids and zero.visual_layouts == whole.visual_layouts
    for rate in (1.0, -0.1, 1.5, float("nan")):
        with pytest.raises(InvalidInput) as refused:
            build_prompt([{"role": "user", "content": [{"type": "video", "video": encoded(3)}]}],
                         model.processor.tokenizer, model.vision, video=VideoOptions(pruning_rate=rate))
        assert refused.value.code == "invalid_video_pruning_rate"
