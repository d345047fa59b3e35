"""CUDA paths (marked `gpu`, skipped without a GPU; `python -m raypipe.gpucheck` runs them on the lent
machine): the vision tower on the device, and the decode loop's side-stream copy of sampled ids into
pinned memory, checked against transformers on the same device; every family's tower and language model
in bf16 against transformers; CUDA-graph decode against eager decode in bf16, and with LoRA adapters against PEFT."""

import asyncio
import gc

import pytest
import torch

from raypipe import SamplingParams
from tests import decode_reference as ref
from tests.conftest import gpu, random_images, reference_embeddings

pytestmark = gpu


@pytest.fixture(autouse=True)
def free_gpu_memory():
    """Engines and models of one test leave the device to the next: an engine started with the default KV
    budget takes a share of the memory free at its start, which the caching allocator would still hold."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def hf_cuda(tiny_ckpt):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_ckpt).eval().to("cuda")


@pytest.fixture
def cudnn_in_fp32():
    """cuDNN's convolutions (the towers' patch embeddings) in fp32: torch lets them run in TF32 by default, whose
    10-bit mantissa put the tower 5e-3 from the CPU reference on an H200 (fp32 agrees to 1e-4)."""
    allowed = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = allowed


def test_vision_tower_on_cuda_matches_cpu_reference(tiny_ckpt, hf_model, cudnn_in_fp32):
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



# Every family, in bf16 on the GPU: the vision tower against transformers' own vision path (fp32, CPU: the
# exact reference), and the engine's greedy tokens against transformers' generate() in bf16 on the same GPU.
FAMILY_PRESETS = ["tiny", "tiny-minicpmv", "tiny-step3", "tiny-llava-ov", "tiny-qwen3-vl", "tiny-qwen3.5"]
TOWER_SIZES = [(300, 200), (56, 56), (640, 480)]
BF16_MAX_RELATIVE_ERROR = 0.05  # ||ours - fp32 reference|| / ||reference|| per image; bf16 keeps 8 bits
# bf16 greedy decoding parts from transformers' at near ties (even on the first token): each engine token is
# checked against transformers' logits on the engine's own sequence instead (see `language_gaps`)
BF16_MAX_LOGIT_GAP = 0.1  # in standard deviations of that position's logits
KV_BYTES = 64 << 20  # each engine's pool: the default (80% of the free GPU memory) would crowd the next test
LM_PROMPTS = ["Describe a red sofa near the window.", "What is two plus two?", "Hello", "Name three blue things."]


def hf_reference_model(ckpt):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(ckpt).eval()


def tower_reference(preset: str, hf, ckpt, images) -> list[torch.Tensor]:
    """transformers' per-image rows in raypipe's layout, from the family's own reference."""
    from tests import llava_ov_reference, minicpmv_reference, qwen3_vl_reference, step3_reference

    if preset == "tiny":
        return reference_embeddings(hf, ckpt, images)
    if preset == "tiny-minicpmv":
        return minicpmv_reference.image_embeddings(hf, ckpt, images)
    if preset == "tiny-step3":
        return step3_reference.image_features(hf, ckpt, images)
    if preset == "tiny-llava-ov":
        return llava_ov_reference.image_features(hf, ckpt, images, tile_every_image=True)  # each image alone
    processor = qwen3_vl_reference.hf_processor(ckpt)
    return qwen3_vl_reference.features(hf, dict(processor.image_processor(images=images, return_tensors="pt")))


def tower_errors(preset: str, device: str) -> list[float]:
    """Relative error of each image's bf16 rows on `device` against the fp32 reference."""
    from raypipe.inputs.images import load_images
    from raypipe.models.registry import preset_checkpoint, vision_adapter

    ckpt = preset_checkpoint(preset)
    adapter = vision_adapter(ckpt)
    tower = adapter.load_tower(torch.device(device), torch.bfloat16)
    images = random_images(TOWER_SIZES, seed=3)
    want = tower_reference(preset, hf_reference_model(ckpt), ckpt, images)
    errors = []
    for visual, reference in zip(load_images(images), want, strict=True):
        item = adapter.make_item(visual)
        ours = adapter.join_units(item, tower.encode(adapter.units(item))).float().cpu()
        assert ours.shape == reference.shape
        errors.append(float((ours - reference).norm() / reference.norm()))
    return errors


def language_gaps(preset: str, device: str, max_tokens: int = 8) -> tuple[list[float], str]:
    """For the engine's greedy tokens (bf16 on `device`) from text prompts, how far below transformers' best
    logit each one is, teacher-forced on the engine's own tokens (bf16, same device), in units of that
    position's logit standard deviation: 0 where both pick the same token. Also the engine's decode step."""
    from raypipe.decode.config import EngineConfig
    from raypipe.decode.engine import LLMEngine
    from raypipe.models.registry import preset_checkpoint

    ckpt = preset_checkpoint(preset)
    engine = LLMEngine(ckpt, EngineConfig(max_num_seqs=4, max_model_len=256, dtype="bfloat16",
                                          kv_cache_memory=KV_BYTES, decode_batch_buckets=(4,),
                                          decode_kv_buckets=(256,)))
    prompts = [list(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                         add_generation_prompt=True, return_dict=False))
               for text in LM_PROMPTS]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    async def all_requests():
        return await asyncio.gather(*(engine.generate_output(f"lm-{i}", p, [], params) for i, p in enumerate(prompts)))

    try:
        ours = [out.token_ids for out in asyncio.run(all_requests())]
        mode = engine.stats()["decode_step"]["mode"]
    finally:
        engine.shutdown()
    hf = hf_reference_model(ckpt).to(device=device, dtype=torch.bfloat16)
    gaps = []
    for prompt, tokens in zip(prompts, ours, strict=True):
        assert len(tokens) == max_tokens
        ids = torch.tensor([prompt + tokens], device=device)
        with torch.no_grad():
            logits = hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, len(prompt) - 1:-1].float()
        chosen = logits.gather(1, torch.tensor(tokens, device=device)[:, None])[:, 0]
        gaps.extend(((logits.max(-1).values - chosen) / logits.std(-1)).tolist())
    return gaps, mode


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_every_family_tower_in_bf16_matches_transformers(preset):
    errors = tower_errors(preset, "cuda")
    assert max(errors) < BF16_MAX_RELATIVE_ERROR, errors


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_every_family_language_model_in_bf16_matches_transformers(preset):
    gaps, mode = language_gaps(preset, "cuda")
    assert max(gaps) < BF16_MAX_LOGIT_GAP, (mode, gaps)  # every token transformers' best or a near tie
    assert sum(gap == 0 for gap in gaps) >= len(gaps) * 3 // 4, (mode, gaps)  # and most of them exactly its pick


# Every layer kind: full attention; gated-delta-net rows and MoE experts (grouped GEMMs); sliding windows beside
# Step3's experts (grouped on CUDA, models/step3/grouped_experts.py: transformers' loop reads the routing on the host).
CUDA_GRAPH_PRESETS = ["tiny", "tiny-qwen3.5-moe", "tiny-step3"]


@pytest.mark.parametrize("preset", CUDA_GRAPH_PRESETS)
def test_cuda_graph_decode_in_bf16_equals_eager(preset):
    """The static-shape step (CUDA graphs) against the eager step, same engine code, bf16: padding rows and KV
    columns change GEMM shapes only, so the greedy tokens agree."""
    from raypipe.decode.config import EngineConfig
    from raypipe.decode.engine import LLMEngine
    from raypipe.models.registry import preset_checkpoint

    ckpt = preset_checkpoint(preset)
    outputs, modes = [], []
    for compiled in (True, False):
        engine = LLMEngine(ckpt, EngineConfig(max_num_seqs=4, max_model_len=256, dtype="bfloat16",
                                              kv_cache_memory=KV_BYTES, compiled_decode=compiled,
                                              decode_batch_buckets=(1, 4), decode_kv_buckets=(256,)))
        prompts = [engine.tokenizer.encode(text) for text in LM_PROMPTS]

        async def all_requests():
            params = SamplingParams(max_tokens=16, ignore_eos=True)
            return await asyncio.gather(*(engine.generate_output(f"g-{i}", p, [], params)
                                          for i, p in enumerate(prompts)))

        try:
            outputs.append([out.token_ids for out in asyncio.run(all_requests())])
            modes.append(engine.stats()["decode_step"])
        finally:
            engine.shutdown()
    assert [m["mode"] for m in modes] == ["cuda_graphs", "eager"], modes
    agreeing = [next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), len(g)) for g, e in zip(*outputs)]
    assert sum(agreeing) >= 0.75 * sum(len(g) for g in outputs[0]), (agreeing, outputs)  # bf16 near ties aside


def test_cuda_graph_decode_serves_mixed_adapters_equal_to_peft(tmp_path):
    """LoRA slots inside the CUDA graphs (fp32): started with "red" (attention layers), given "green" (MLP layers,
    wrapped after the graphs were captured, so they are captured again) and "blue" at run time, a K=8 batch
    mixing three adapters and base rows equals PEFT's `generate()` per adapter (on the CPU, fp32), with the
    embeddings handed over as CPU tensors, as encoder workers send them."""
    from raypipe.decode.config import EngineConfig
    from raypipe.decode.engine import LLMEngine
    from tests.test_lora import ROWS, Served, run_on

    served = Served("tiny", tmp_path)
    engine = LLMEngine(served.ckpt, EngineConfig(
        max_num_seqs=4, max_model_len=512, block_size=8, num_scheduler_steps=8, dtype="float32",
        kv_cache_memory=KV_BYTES, decode_batch_buckets=(4,), decode_kv_buckets=(512,),
        lora_modules={"red": str(served.folders["red"])}))
    try:
        assert engine.decode_step["mode"] == "cuda_graphs", engine.decode_step
        for name in ("green", "blue"):
            engine.load_lora(name, str(served.folders[name]))
        assert [o.token_ids for o in run_on(served, engine, ROWS, "graphs")] == [served.expected[r] for r in ROWS]
        assert engine.decode_step["mode"] == "cuda_graphs", engine.decode_step
    finally:
        engine.shutdown()
