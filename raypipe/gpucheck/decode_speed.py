"""Section `decode`: decode tokens/s of the engine (static-shape step with CUDA graphs, and eager) against
transformers' `generate()` on one left-padded static batch, at each batch size of the plan.

Every request makes exactly `decode_max_tokens` tokens (EOS ignored, `min_new_tokens` for transformers),
so the three make the same number of tokens from the same prompts; tokens/s counts them over the wall
time of the whole batch, prefill included. Each mode is warmed up once on other prompts first (graph
capture and the first kernels' autotuning are start-up costs, reported as `start_s`). A mode the model
cannot run (CUDA graphs for a model with a module that cannot be captured: one reading values on the host) is
listed as skipped with the engine's reason.
"""

from __future__ import annotations

import gc
import time

import torch

from raypipe.bench.decode import make_prompts
from raypipe.bench.detok import run as run_ignoring_eos
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.gpucheck.synthetic import checkpoint_for
from raypipe.runtime.device import resolve_dtype

PROMPT_SEED, WARMUP_SEED = 0, 1000  # distinct prompts: the warm-up leaves nothing in the prefix cache to hit
# One KV bucket holds every prompt and its 128 new tokens: `small`'s prompts (its chat template adds a system
# prompt) reach 163 tokens at batch 64; at 256 the first H200 run's longest ones stopped short (7,766 of 8,192)
KV_BUCKET = 320


def run(plan, recorder) -> None:
    for preset in plan.decode_presets:
        checkpoint = checkpoint_for(preset, plan, recorder)
        if checkpoint is None:
            continue
        for mode in plan.decode_modes:
            if mode == "graphs" and plan.device != "cuda":
                recorder.skip(f"{preset} graphs", "CUDA graphs need a GPU")
                continue
            try:
                (measure_transformers if mode == "transformers" else measure_engine)(checkpoint, preset, mode,
                                                                                      plan, recorder)
            finally:
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()


def measure_engine(checkpoint, preset: str, mode: str, plan, recorder) -> None:
    batches = plan.decode_batches
    config = EngineConfig(max_num_seqs=max(batches), max_model_len=KV_BUCKET, dtype=plan.dtype,
                          compiled_decode=mode == "graphs", decode_batch_buckets=tuple(batches),
                          decode_kv_buckets=(KV_BUCKET,))
    start = time.perf_counter()
    engine = LLMEngine(checkpoint, config)
    try:
        step = engine.stats()["decode_step"]
        if mode == "graphs" and step["mode"] != "cuda_graphs":
            recorder.skip(f"{preset} graphs", f"the engine runs {step['mode']}: {step.get('reason', '')}")
            return
        generate(engine, make_prompts(engine.tokenizer, max(batches), WARMUP_SEED), 2)
        start_s = time.perf_counter() - start
        for batch in batches:
            prompts = make_prompts(engine.tokenizer, batch, PROMPT_SEED + batch)
            seconds, tokens = generate(engine, prompts, plan.decode_max_tokens)
            recorder.add(preset=preset, mode=mode, batch=batch, tokens=tokens, seconds=round(seconds, 3),
                         tok_s=round(tokens / seconds, 1), start_s=round(start_s, 1), decode_step=step["mode"])
    finally:
        engine.shutdown()


def generate(engine, prompts, max_tokens: int) -> tuple[float, int]:
    """Seconds and tokens of every prompt at once through the engine, EOS ignored."""
    outputs, seconds = run_ignoring_eos(engine, prompts, max_tokens)
    return seconds, sum(len(token_ids) for token_ids, _ in outputs)


@torch.inference_mode()
def measure_transformers(checkpoint, preset: str, mode: str, plan, recorder) -> None:
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    device = torch.device(plan.device)
    start = time.perf_counter()
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=resolve_dtype(plan.dtype, device))
    model = model.eval().to(device)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    static_batch(model, make_prompts(tokenizer, 1, WARMUP_SEED), 2, pad)
    start_s = time.perf_counter() - start
    for batch in plan.decode_batches:
        prompts = make_prompts(tokenizer, batch, PROMPT_SEED + batch)
        seconds, tokens = static_batch(model, prompts, plan.decode_max_tokens, pad)
        recorder.add(preset=preset, mode=mode, batch=batch, tokens=tokens, seconds=round(seconds, 3),
                     tok_s=round(tokens / seconds, 1), start_s=round(start_s, 1), decode_step="generate()")
    del model


def static_batch(model, prompts, max_tokens: int, pad: int) -> tuple[float, int]:
    """One left-padded batch through `generate()`, exactly `max_tokens` new tokens per row."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    _sync(model.device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                         do_sample=False, pad_token_id=pad)
    _sync(model.device)
    return time.perf_counter() - start, int(out[:, width:].numel())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
