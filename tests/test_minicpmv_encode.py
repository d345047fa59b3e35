"""MiniCPM-V 4.6: prompts equal its processor's, and slices sharded over Ray workers equal transformers'
vision path per image (overview + slices, in the language model's layout)."""

import pytest
import torch

from raypipe.models.prompt import build_prompt
from raypipe.models.registry import language_adapter, vision_adapter
from tests import minicpmv_reference as ref
from tests.conftest import over_first_workers, random_images


@pytest.fixture(scope="module")
def hf_minicpmv(minicpmv_ckpt):
    from transformers import MiniCPMV4_6ForConditionalGeneration

    return MiniCPMV4_6ForConditionalGeneration.from_pretrained(minicpmv_ckpt).eval()


@pytest.mark.parametrize("sizes", [[], [(60, 50)], [(700, 700), (30, 400), (300, 500)]], ids=["text", "one", "three"])
def test_prompt_equals_processor(minicpmv_ckpt, sizes):
    lang, vision = language_adapter(minicpmv_ckpt), vision_adapter(minicpmv_ckpt)
    images = random_images(sizes, seed=len(sizes))
    parts = [{"type": "text", "text": "Compare these:"}] + [{"type": "image", "image": im} for im in images]
    messages = [{"role": "user", "content": parts + [{"type": "text", "text": "\nand say why."}]}]
    prompt = build_prompt({"messages": messages}, lang.tokenizer, vision)
    text = lang.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = ref.processor(minicpmv_ckpt)(text=[text], images=images or None, return_tensors="pt")["input_ids"][0]
    assert prompt.prompt_token_ids == want.tolist()
    assert [lang.token_runs(g) for g in prompt.visual_grids] == [vision.token_runs(vision.grid_for(*s)) for s in sizes]
    if len(sizes) == 3:
        assert max(g[0] * g[1] for g in prompt.visual_grids) == 9  # one image has the maximum of slices


@pytest.fixture(scope="module")
def three_workers(three_worker_pipelines, minicpmv_ckpt):
    return three_worker_pipelines.get(minicpmv_ckpt)


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"{n}workers")
def pipe(request, three_workers):
    return over_first_workers(three_workers, request.param)


@pytest.mark.parametrize("count", [1, 2, 5, 9])
def test_sharded_slices_match_transformers(pipe, hf_minicpmv, minicpmv_ckpt, count):
    images = random_images(ref.SIZES[:count], seed=10 + count)
    expected = ref.image_embeddings(hf_minicpmv, minicpmv_ckpt, images)
    got = pipe.encode(images)
    assert len(got) == count
    for ours, want in zip(got, expected):
        assert ours.shape == want.shape
        torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-4)
    shards = pipe.coordinator.last_report.assignment
    assert sorted(set(i for shard in shards for i in shard)) == list(range(count))
    if len(shards) > 1 and count >= 2:  # units of one image went to more than one worker
        assert sum(len(shard) for shard in shards) > count
