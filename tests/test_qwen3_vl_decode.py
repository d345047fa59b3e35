"""Qwen3-VL (dense and MoE) through raypipe's prompt building and decode engine, against transformers.

Prompt ids equal `Qwen3VLProcessor`'s, positions equal transformers' `get_rope_index` and the rule
written out plainly, and greedy decoding equals `generate()` on the full model from pixels, token for
token: text, one and several images, K=1 and K=8 with staggered joins, a prompt prefilled in chunks that
end inside an image, and a prefix-cache hit ending inside an image. The tiny presets are sensitive enough
for this to mean something: dropping either deepstack level, or positions without mrope, changes the
greedy tokens (shown here).
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from raypipe import SamplingParams
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.models.prompt import build_prompt
from raypipe.models.registry import preset_checkpoint, vision_adapter
from tests import qwen3_vl_reference as ref
from tests.conftest import random_images
from tests.decode_reference import staggered

MAX_NEW = 20
BLOCK = 8
# Image sizes per prompt: none, one, several, thumbnails to wide strips (grids 4x4 to 16x16 patches).
PROMPTS = [[], [(64, 96)], [(64, 96), (128, 64), (50, 50)], [(256, 256)], [(40, 300)], [(300, 40), (64, 64)],
           [(32, 32)], [(200, 120), (120, 200)]]


class Model:
    """One preset's checkpoint, transformers' model and processor, raypipe's vision adapter."""

    def __init__(self, name: str):
        from transformers import AutoModelForImageTextToText

        self.ckpt = preset_checkpoint(name)
        self.hf = AutoModelForImageTextToText.from_pretrained(self.ckpt).eval()
        self.processor = ref.hf_processor(self.ckpt)
        self.vision = vision_adapter(self.ckpt)
        self.engines: dict[tuple, LLMEngine] = {}

    def engine(self, k: int, **limits) -> LLMEngine:
        key = (k, tuple(sorted(limits.items())))
        if key not in self.engines:
            config = {"max_num_seqs": 4, "max_model_len": 512, "block_size": BLOCK, **limits}
            self.engines[key] = LLMEngine(self.ckpt, EngineConfig(num_scheduler_steps=k, **config))
        return self.engines[key]

    def case(self, sizes, text="Describe it.", seed=0, max_new=MAX_NEW):
        """(raypipe's prompt, transformers' embeddings of its images, transformers' inputs, greedy ids)."""
        images = random_images(sizes, seed=seed)
        ours = [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                             {"type": "text", "text": text}]}]
        theirs = [{"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": text}]}]
        inputs = ref.hf_inputs(self.processor, theirs, images)
        prompt = build_prompt(ours, self.processor.tokenizer, self.vision)
        eos = self.hf.generation_config.eos_token_id
        return prompt, ref.features(self.hf, inputs), inputs, ref.hf_generate(self.hf, inputs, max_new, eos)

    def close(self):
        for engine in self.engines.values():
            engine.shutdown()


@pytest.fixture(scope="module", params=["tiny-qwen3-vl", "tiny-qwen3-vl-moe"])
def model(request):
    made = Model(request.param)
    yield made
    made.close()


def generate(engine, tag, case, max_new=MAX_NEW):
    return asyncio.run(engine.generate_output(tag, case[0], case[1], SamplingParams(max_tokens=max_new))).token_ids


def test_prompt_ids_and_positions_match_transformers(model):
    language = model.engine(1).adapter
    merge = model.hf.config.vision_config.spatial_merge_size
    image_token = model.hf.config.image_token_id
    for i, sizes in enumerate(PROMPTS):
        prompt, _, inputs, _ = model.case(sizes, seed=i, max_new=1)
        ids = inputs["input_ids"]
        assert prompt.prompt_token_ids == ids[0].tolist(), f"prompt {i}"
        grids = inputs["image_grid_thw"].tolist() if sizes else []
        assert [list(g) for g in prompt.visual_grids] == grids
        ours, delta = language.positions(prompt.prompt_token_ids, prompt.visual_layouts)
        theirs, their_delta = model.hf.model.get_rope_index(ids, inputs["mm_token_type_ids"],
                                                            image_grid_thw=inputs.get("image_grid_thw"))
        assert torch.equal(ours, theirs[:, 0]) and delta == int(their_delta), f"prompt {i}"
        rule, rule_delta = ref.rule_positions(prompt.prompt_token_ids, prompt.visual_grids, image_token, merge)
        assert torch.equal(ours, rule) and delta == rule_delta, f"prompt {i}"


@pytest.mark.parametrize("k", [1, 8])
def test_greedy_matches_generate_with_staggered_joins(model, k):
    cases = [model.case(sizes, seed=i) for i, sizes in enumerate(PROMPTS[:4])]
    outs = staggered(model.engine(k), cases, [SamplingParams(max_tokens=MAX_NEW)] * len(cases), f"stagger-{k}")
    assert [out.token_ids for out in outs] == [c[3] for c in cases]


def test_chunked_prefill_with_chunks_ending_inside_images(model):
    case = model.case(PROMPTS[2], seed=2)
    length = len(case[0].prompt_token_ids)
    engine = model.engine(8, max_num_batched_tokens=length // 4, enable_prefix_caching=False)
    before = engine.stats()["chunked_prefills"]
    assert generate(engine, "chunked", case) == case[3]
    assert engine.stats()["chunked_prefills"] - before == 1
    image_token = model.hf.config.image_token_id
    ids = case[0].prompt_token_ids
    inside = [n for n in range(length // 4, length, length // 4) if ids[n - 1] == ids[n] == image_token]
    assert inside, "no chunk boundary falls inside an image"


def test_prefix_hit_ending_inside_an_image(model):
    engine = model.engine(1, enable_prefix_caching=True)
    first = model.case([(128, 160)], "Describe it.", seed=30)
    second = model.case([(128, 160)], "Which colors?", seed=30)
    assert generate(engine, "prefix-1", first) == first[3]
    before = engine.stats()["prefix_cache_hit_tokens"]
    assert generate(engine, "prefix-2", second) == second[3]
    hits = engine.stats()["prefix_cache_hit_tokens"] - before
    ids = second[0].prompt_token_ids
    image_token = model.hf.config.image_token_id
    common = len(os.path.commonprefix([ids, first[0].prompt_token_ids]))
    assert hits == common // BLOCK * BLOCK > ids.index(image_token)
    assert ids[hits - 1] == ids[hits] == image_token, "the hit should end inside the image"


def test_dropped_deepstack_levels_and_flat_positions_change_greedy_tokens(model):
    """The tiny presets are an oracle for deepstack and positions: get either wrong and the tokens change."""
    case = model.case(PROMPTS[2], seed=2)
    engine = model.engine(8, enable_prefix_caching=False)
    assert generate(engine, "whole", case) == case[3]
    hidden = model.hf.config.text_config.hidden_size
    for level in range(model.vision.levels):
        dropped = [embed.clone() for embed in case[1]]
        for embed in dropped:
            embed[:, hidden * (1 + level): hidden * (2 + level)] = 0
        assert generate(engine, f"drop-{level}", (case[0], dropped)) != case[3], f"level {level}"
    flat = model.engine(8, enable_prefix_caching=False, max_num_seqs=2)  # its own engine: positions patched
    flat.adapter.positions = lambda ids, layouts, kept=(): (torch.arange(len(ids)).expand(3, -1).clone(), 0)
    assert generate(flat, "flat", case) != case[3]
