"""Qwen3.5 videos (dense and MoE) against transformers: prompt ids (a timestamp before each temporal group)
equal `Qwen3VLProcessor`'s rules, positions equal `Qwen3_5Model.get_rope_index` and Qwen3-VL's rule
written out (vLLM's Qwen3.5 positions a video as Qwen3-VL's: one `(1, h, w)` item per temporal group, text
one past the largest position so far), up to a 30 s video, where Qwen2.5-VL's transformers rule parted from
the original; and greedy decoding equals `generate()` from pixels (video, video + image; K=1 and K=8,
staggered). Frame plans and processed tensors are Qwen3-VL's own code, checked in test_qwen3_vl_video.py.
"""

from __future__ import annotations

import pytest
import torch

from raypipe import SamplingParams
from raypipe.errors import InvalidInput
from raypipe.models.prompt import VideoOptions, build_prompt
from tests import qwen3_vl_reference as ref
from tests import test_qwen3_vl_video as qwen3_vl
from tests.decode_reference import staggered
from tests.test_qwen3_vl_decode import Model

LONG = (120, 4, 64, 64)  # 30 s at 4 fps: 60 sampled frames at 2 fps, 30 temporal groups


@pytest.fixture(scope="module", params=["tiny-qwen3.5", "tiny-qwen3.5-moe"])
def model(request):
    made = Model(request.param)
    made.preset = request.param
    yield made
    made.close()


@pytest.fixture
def with_long_video(monkeypatch):
    monkeypatch.setattr(qwen3_vl, "VIDEOS", [*qwen3_vl.VIDEOS, LONG])
    return len(qwen3_vl.VIDEOS) - 1


def test_prompt_ids_and_positions_match_transformers(model, with_long_video):
    language = model.engine(1).adapter
    config = model.hf.config
    merge = config.vision_config.spatial_merge_size
    for i in (0, 3, 7, with_long_video):
        for with_image in (False, True):
            prompt, ids, kinds = qwen3_vl._prompt(model, i, with_image)
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
    assert kinds[0][1][0] == 30  # the long video's temporal groups


# One K per preset keeps the module short: K=1 and K=8 both run for each in test_qwen3_5_decode.py.
K = {"tiny-qwen3.5": 8, "tiny-qwen3.5-moe": 1}


def test_greedy_matches_generate_for_videos_and_images(model):
    k = K[model.preset]
    cases = [qwen3_vl._case(model, 1, False), qwen3_vl._case(model, 7, True)]
    outs = staggered(model.engine(k), cases, [SamplingParams(max_tokens=qwen3_vl.MAX_NEW)] * len(cases), f"video-{k}")
    assert [out.token_ids for out in outs] == [c[2] for c in cases]


def test_evs_is_refused_with_its_code(model):
    """Qwen3-VL's EVS is not carried over to Qwen3.5 untested: a pruning rate is refused with its code."""
    messages = [{"role": "user", "content": [{"type": "video", "video": qwen3_vl.encoded(0)}]}]
    with pytest.raises(InvalidInput) as refused:
        build_prompt(messages, model.processor.tokenizer, model.vision, video=VideoOptions(pruning_rate=0.5))
    assert refused.value.code == "invalid_video_pruning_rate" and "Qwen3.5" in str(refused.value)
    whole = build_prompt(messages, model.processor.tokenizer, model.vision)
    assert whole.prompt_token_ids == build_prompt(messages, model.processor.tokenizer, model.vision,
                                                  video=VideoOptions(pruning_rate=0.0)).prompt_token_ids
