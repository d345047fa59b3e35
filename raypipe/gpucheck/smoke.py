"""Section `smoke`: the engine and every family's vision tower run in a process that has no Ray.

Every family's tower encodes one image on the device, and the engine generates from an image prompt on
the presets the plan names (a full-attention model and a hybrid one). It answers "does it run at all,
here" first and fast; whether the numbers are right is the `tests` section's question.
"""

from __future__ import annotations

import asyncio
import time

import torch

from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.gpucheck.workload import encode_visuals, image_prompt, images
from raypipe.inputs.sampling import SamplingParams
from raypipe.models.registry import resolve_model, vision_adapter
from raypipe.runtime.device import resolve_dtype

MAX_TOKENS = 8
KV_BYTES = 64 << 20  # not the default 80% of a GPU's free memory: later sections need it


def run(plan, recorder) -> None:
    device = torch.device(plan.device)
    dtype = resolve_dtype(plan.dtype, device)
    for preset in plan.smoke_presets:
        start = time.perf_counter()
        vision = vision_adapter(resolve_model(preset))
        tower = vision.load_tower(device, dtype)
        (embedding,) = encode_visuals(vision, tower, images([(224, 160)]))
        recorder.add(check="tower", preset=preset, family=type(vision).__name__, rows=embedding.shape[0],
                     width=embedding.shape[1], finite=bool(torch.isfinite(embedding).all()),
                     seconds=round(time.perf_counter() - start, 2))
        del tower
    for preset in plan.smoke_engine_presets:
        start = time.perf_counter()
        checkpoint = resolve_model(preset)
        engine = LLMEngine(checkpoint, EngineConfig(max_num_seqs=4, max_model_len=1024, dtype=plan.dtype,
                                                    kv_cache_memory=KV_BYTES))
        try:
            vision = vision_adapter(checkpoint)
            prompt = image_prompt(engine.tokenizer, vision)
            embeds = encode_visuals(vision, vision.load_tower(device, dtype), prompt.visuals)
            out = asyncio.run(engine.generate_output("smoke", prompt.without_pixels(), embeds,
                                                     SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)))
            recorder.add(check="engine", preset=preset, prompt_tokens=len(prompt.prompt_token_ids),
                         tokens=len(out.token_ids), decode_step=engine.stats()["decode_step"]["mode"],
                         seconds=round(time.perf_counter() - start, 2))
        finally:
            engine.shutdown()
