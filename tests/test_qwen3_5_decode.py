"""Qwen3.5 (dense and MoE) through raypipe's prompt building and decode engine, against transformers.

Prompt ids equal `Qwen3VLProcessor`'s (the processor transformers maps `qwen3_5` to) with thinking on and
off, positions equal `Qwen3_5Model.get_rope_index` and Qwen3-VL's rule written out plainly, and greedy
decoding of the hybrid language model (gated-delta-net state rows, full-attention K/V in the paged pool,
MoE experts) equals `generate()` on the full model from pixels, token for token: text and images, K=1 and
K=8 with staggered joins, and preempted sequences recomputed on resume. The tiny presets are an oracle
for positions: flat positions change the greedy tokens (shown here).
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from raypipe import SamplingParams
from raypipe.errors import InvalidInput
from raypipe.models.prompt import build_prompt
from tests import decode_reference as decode_ref
from tests import qwen3_vl_reference as ref
from tests.conftest import random_images
from tests.decode_reference import staggered
from tests.test_qwen3_vl_decode import BLOCK, MAX_NEW, PROMPTS, Model


@pytest.fixture(scope="module", params=["tiny-qwen3.5", "tiny-qwen3.5-moe"])
def model(request):
    made = Model(request.param)
    yield made
    made.close()


def generate(engine, tag, case, max_new=MAX_NEW):
    return asyncio.run(engine.generate_output(tag, case[0], case[1], SamplingParams(max_tokens=max_new))).token_ids


def _thinking_off(model, sizes, seed):
    """(raypipe's prompt with `enable_thinking` false, the processor's ids for the same chat)."""
    images = random_images(sizes, seed=seed)
    ours = [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                         {"type": "text", "text": "Describe it."}]}]
    theirs = [{"role": "user", "content": [*({"type": "image"} for _ in images),
                                           {"type": "text", "text": "Describe it."}]}]
    text = model.processor.apply_chat_template(theirs, add_generation_prompt=True, tokenize=False,
                                               enable_thinking=False)
    ids = model.processor(text=[text], images=images or None, return_tensors="pt")["input_ids"][0].tolist()
    prompt = build_prompt(ours, model.processor.tokenizer, model.vision,
                          chat_template_kwargs={"enable_thinking": False})
    return prompt, ids


def test_prompt_ids_and_positions_match_transformers(model):
    language = model.engine(1).adapter
    merge = model.hf.config.vision_config.spatial_merge_size
    image_token = model.hf.config.image_token_id
    tokenizer = model.processor.tokenizer
    for i, sizes in enumerate(PROMPTS):
        prompt, _, inputs, _ = model.case(sizes, seed=i, max_new=1)
        ids = inputs["input_ids"]
        assert prompt.prompt_token_ids == ids[0].tolist(), f"prompt {i}"
        assert tokenizer.decode(ids[0, -2:]) == "<think>\n"  # thinking is on by default
        ours, delta = language.positions(prompt.prompt_token_ids, prompt.visual_layouts)
        theirs, their_delta = model.hf.model.get_rope_index(ids, inputs["mm_token_type_ids"],
                                                            image_grid_thw=inputs.get("image_grid_thw"))
        assert torch.equal(ours, theirs[:, 0]) and delta == int(their_delta), f"prompt {i}"
        rule, rule_delta = ref.rule_positions(prompt.prompt_token_ids, prompt.visual_grids, image_token, merge)
        assert torch.equal(ours, rule) and delta == rule_delta, f"prompt {i}"
        off, their_off = _thinking_off(model, sizes, seed=i)
        assert off.prompt_token_ids == their_off, f"prompt {i}, thinking off"
        assert tokenizer.decode(their_off[-6:]) == "<think>\n\n</think>\n\n"


def test_thinking_switch_is_checked_and_keys_the_template_lacks_are_ignored(model):
    """A switch of the wrong type is refused; a key the template does not read is ignored, as vLLM ignores it
    (the prompt is the one without it)."""
    messages = [{"role": "user", "content": "hi"}]
    tokenizer = model.processor.tokenizer
    with pytest.raises(InvalidInput) as refused:
        build_prompt(messages, tokenizer, model.vision, chat_template_kwargs={"enable_thinking": "no"})
    assert refused.value.code == "invalid_chat_template_kwargs"
    assert refused.value.item == "chat_template_kwargs.enable_thinking"
    plain = build_prompt(messages, tokenizer, model.vision).prompt_token_ids
    ignored = build_prompt(messages, tokenizer, model.vision, chat_template_kwargs={"add_vision_id": True, "tokenize": 1})
    assert ignored.prompt_token_ids == plain


@pytest.mark.parametrize("k", [1, 8])
def test_greedy_matches_generate_with_staggered_joins(model, k):
    cases = [model.case(sizes, seed=i) for i, sizes in enumerate(PROMPTS[:4])]
    assert len({tuple(c[3]) for c in cases}) == len(cases)  # the oracle tells the prompts apart
    outs = staggered(model.engine(k), cases, [SamplingParams(max_tokens=MAX_NEW)] * len(cases), f"stagger-{k}")
    assert [out.token_ids for out in outs] == [c[3] for c in cases]


def test_preempted_sequences_resume_with_the_same_tokens(model, k=8):
    """On resume a preempted sequence's gated-delta-net state is recomputed from its tokens so far (K=8: a
    sequence is preempted mid-round; MiniCPM-V's test runs the same text model at K=1 too)."""
    case = model.case(PROMPTS[1], seed=1)
    outs, stats = decode_ref.preempted_copies(model.engine, k, case, SamplingParams(max_tokens=MAX_NEW))
    assert [out.token_ids for out in outs] == [case[3]] * 4
    assert stats["preemptions"] > 0 and stats["kv_blocks_used"] == 0 and stats["running"] == 0


def test_flat_positions_change_greedy_tokens(model):
    """The tiny presets are an oracle for positions: 1-D positions instead of mrope change the tokens."""
    case = model.case(PROMPTS[7], seed=7)  # two large images: a prompt whose answer both presets position-check
    flat = model.engine(8, max_num_seqs=2)  # its own engine: positions patched
    assert generate(flat, "right", case) == case[3]
    flat.adapter.positions = lambda ids, layouts, kept=(): (torch.arange(len(ids)).expand(3, -1).clone(), 0)
    assert generate(flat, "flat", case) != case[3]


def test_prompt_prefilled_in_four_chunks_matches_generate(model):
    """Chunked prefill over the hybrid layers: each chunk continues from the row's gated-delta-net state."""
    case = model.case(PROMPTS[2], seed=2)
    length = len(case[0].prompt_token_ids)
    engine = model.engine(8, max_num_batched_tokens=length // 4, enable_prefix_caching=False)
    before = engine.stats()
    assert generate(engine, "chunked", case) == case[3]
    after = engine.stats()
    assert after["chunked_prefills"] - before["chunked_prefills"] == 1
    assert after["prefill_tokens"] - before["prefill_tokens"] >= length  # in chunks of at most length // 4


def test_prefix_hit_through_a_state_snapshot_matches_generate(model):
    """Prefix caching is on for this hybrid family: a second question on the same image continues from a state
    snapshot at a block boundary of the first prompt, and decodes as `generate()` does."""
    engine = model.engine(1)
    first = model.case([(128, 160)], "Describe it.", seed=30)
    second = model.case([(128, 160)], "Which colors?", seed=30)
    assert generate(engine, "prefix-1", first) == first[3]
    before = engine.stats()["prefix_cache_hit_tokens"]
    assert generate(engine, "prefix-2", second) == second[3]
    hits = engine.stats()["prefix_cache_hit_tokens"] - before
    common = len(os.path.commonprefix([second[0].prompt_token_ids, first[0].prompt_token_ids]))
    assert 0 < hits <= common and hits % BLOCK == 0
