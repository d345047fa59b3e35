"""CUDA paths (skipped without a GPU): the vision tower on the device, and the decode loop's
side-stream copy of sampled ids into pinned memory, checked against transformers on the same device."""

import asyncio

import pytest
import torch

from raypipe import SamplingParams
from tests import decode_reference as ref
from tests.conftest import gpu, random_images, reference_embeddings

pytestmark = gpu


@pytest.fixture(scope="module")
def hf_cuda(tiny_ckpt):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_ckpt).eval().to("cuda")


def test_vision_tower_on_cuda_matches_cpu_reference(tiny_ckpt, hf_model):
    from raypipe.inputs.images import load_image
    from raypipe.models.registry import vision_adapter

    adapter = vision_adapter(tiny_ckpt)
    tower = adapter.load_tower(torch.device("cuda"), torch.float32)
    images = random_images([(300, 200), (56, 56), (640, 480)], seed=21)
    got = tower.encode([adapter.make_item(load_image(image)) for image in images])
    for ours, want in zip(got, reference_embeddings(hf_model, tiny_ckpt, images)):
        assert ours.device.type == "cpu"  # results leave the worker as CPU tensors
        torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-3)


def test_decode_engine_on_cuda_matches_generate_on_cuda(tiny_ckpt, hf_cuda):
    from raypipe.decode.config import EngineConfig
    from raypipe.decode.engine import LLMEngine
    from raypipe.models.registry import vision_adapter

    engine = LLMEngine(tiny_ckpt, EngineConfig(max_num_seqs=8, max_model_len=512, num_scheduler_steps=8,
                                               dtype="float32"))
    vision = vision_adapter(tiny_ckpt)
    cases = []
    for i in range(len(ref.REQUESTS)):
        prompt = ref.prepare(i, engine.tokenizer, vision)
        embeds = ref.embeddings(hf_cuda, tiny_ckpt, prompt)
        want = ref.hf_generate(hf_cuda, prompt, embeds, 16, engine.adapter.eos_token_ids[0])
        cases.append((prompt, embeds, want))

    async def all_requests():
        calls = [engine.generate_output(f"gpu-{i}", p, e, SamplingParams(max_tokens=16)) for i, (p, e, _) in
                 enumerate(cases)]
        return await asyncio.gather(*calls)

    try:
        outputs = asyncio.run(all_requests())
    finally:
        engine.shutdown()
    assert [out.token_ids for out in outputs] == [want for _, _, want in cases]

