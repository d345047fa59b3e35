"""Shared by the decode tests: prompts with images, and transformers' own `generate()` as the oracle."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.decode.kv_pool_size import budget_for
from raypipe.decode.sliding_window import window_pool_shape
from raypipe.models.prompt import build_prompt
from tests.conftest import random_images, reference_embeddings

# (text, image sizes) per request: different prompt lengths and image counts.
REQUESTS = [
    ("Say something.", []),
    ("What is in this picture?", [(56, 84)]),
    ("Compare these three images, please:", [(56, 84), (112, 56), (60, 60)]),
    ("hi", [(84, 84)]),
    ("A much longer text-only prompt that makes this row longer than the others in the batch.", []),
    ("two", [(28 * 3, 28 * 5), (56, 56)]),
    ("x", []),
    ("Describe.", [(140, 70)]),
]


def messages(text: str, images: list[np.ndarray]) -> list[dict]:
    parts = [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def request(i: int, seed: int = 0) -> list[dict]:
    text, sizes = REQUESTS[i]
    return messages(text, random_images(sizes, seed=seed + i))


def prepare(i: int, tokenizer, vision, seed: int = 0):
    return build_prompt(request(i, seed), tokenizer, vision)


def embeddings(hf_model, ckpt, prompt) -> list[torch.Tensor]:
    """Per-image embeddings from transformers' own vision tower (not raypipe's encoder)."""
    if not prompt.visuals:
        return []
    return reference_embeddings(hf_model, ckpt, [image.pixels for image in prompt.visuals])


def generate_cases(ckpt, hf_model, max_new_tokens: int) -> list[tuple]:
    """`(prompt, embeddings, generate()'s ids)` of every request in `REQUESTS`."""
    from raypipe.models.registry import language_adapter, vision_adapter

    language, vision = language_adapter(ckpt), vision_adapter(ckpt)
    out = []
    for i in range(len(REQUESTS)):
        prompt = prepare(i, language.tokenizer, vision)
        embeds = embeddings(hf_model, ckpt, prompt)
        out.append((prompt, embeds, hf_generate(hf_model, prompt, embeds, max_new_tokens, language.eos_token_ids[0])))
    return out


def hf_generate(hf_model, prompt, embeds: list[torch.Tensor], max_new_tokens: int, cut_at: int,
                **generate_kwargs) -> list[int]:
    """Greedy `generate()` on the full transformers model (with `generate_kwargs`, e.g. its logits
    processors' options); ids after the prompt, up to and including the first `cut_at`."""
    return hf_generate_scored(hf_model, prompt, embeds, max_new_tokens, cut_at, **generate_kwargs)[0]


def hf_generate_scored(hf_model, prompt, embeds: list[torch.Tensor], max_new_tokens: int, cut_at: int,
                       **generate_kwargs) -> tuple[list[int], list[torch.Tensor]]:
    """`hf_generate`'s ids and the logits each was chosen from (in the model's dtype)."""
    device = hf_model.device
    ids = torch.tensor([prompt.prompt_token_ids], device=device)
    kwargs = {}
    if prompt.visual_grids:
        pooled = tuple(e.to(device) for e in embeds)
        kwargs = dict(image_grid_thw=torch.tensor(prompt.visual_grids, device=device),
                      mm_token_type_ids=(ids == hf_model.config.image_token_id).int(),
                      mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=pooled)})
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs,
                                **generate_kwargs)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    tokens = tokens[: tokens.index(cut_at) + 1] if cut_at in tokens else tokens
    return tokens, [step[0] for step in out.logits[: len(tokens)]]


def assert_greedy_equal_up_to_ties(got: list[int], expected: list[int], logits: list[torch.Tensor],
                                   dtype: torch.dtype) -> bool:
    """`got` equals `expected` (`hf_generate_scored`'s ids and logits), except that it may leave it at a step where
    the reference's logits for both tokens are within one unit in the last place of the model's `dtype` (a tie at
    that precision: another summation order rounds either way); the rest is then not compared. Whether it left."""
    for step, (ours, theirs) in enumerate(zip(got, expected)):
        if ours == theirs:
            continue
        scores = logits[step].float()
        best = scores[theirs].item()
        ulp = torch.finfo(dtype).eps * 2.0 ** np.floor(np.log2(abs(best)))
        assert best - scores[ours].item() <= ulp, (
            f"step {step}: {ours} instead of {theirs}, whose logit {best} is more than one ulp ({ulp}) above "
            f"{scores[ours].item()}: {got} vs {expected}")
        return True
    assert got == expected
    return False


@contextlib.contextmanager
def engine_pool(ckpt, **defaults):
    """`get(k, **limits)`: one `LLMEngine` per (K, limits) over `defaults`, made on first use, shut down at exit."""
    made = {}

    def get(k: int, **limits) -> LLMEngine:
        key = (k, tuple(sorted(limits.items())))
        if key not in made:
            made[key] = LLMEngine(ckpt, EngineConfig(**{**defaults, "num_scheduler_steps": k, **limits}))
        return made[key]

    try:
        yield get
    finally:
        for engine in made.values():
            engine.shutdown()


def staggered(engine, cases, params: list, tag: str, gap_s: float = 0.004) -> list:
    """`RequestOutput`s of `cases` (prompt, embeddings, ...) submitted `gap_s` apart, so later ones
    arrive while earlier ones are mid-generation, each with its `SamplingParams`."""

    async def one(i):
        await asyncio.sleep(gap_s * i)
        prompt, embeds = cases[i][0], cases[i][1]
        return await engine.generate_output(f"{tag}-{i}", prompt, embeds, params[i])

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(len(cases))))

    return asyncio.run(all_of_them())


def kv_budget(engine, full_blocks: int, *, k: int, block_size: int, max_model_len: int) -> int:
    """`EngineConfig.kv_cache_memory` that gives an engine like `engine` (with K = `k` and these block
    size and length) `full_blocks` full-attention blocks: a model with row state gives
    `state_snapshot_memory_fraction` of the budget to state snapshots, one with sliding-window layers
    a share to their window pool (`kv_pool_size.py`)."""
    text = engine.adapter.text_config
    return budget_for(full_blocks, bytes_per_token=engine.runner.bytes_per_token, block_size=block_size,
                      max_model_len=max_model_len,
                      state_fraction=engine.config.state_snapshot_memory_fraction if engine.runner.cache.row_state_kinds else 0.0,
                      window_bytes_per_token=engine.runner.window_bytes_per_token,
                      **window_pool_shape(text, block_size=block_size, max_model_len=max_model_len, num_scheduler_steps=k,
                                          max_num_batched_tokens=engine.config.max_num_batched_tokens))


def preempted_copies(engines, k: int, case, params, block_size: int = 8, spare_blocks: int | None = None) -> tuple[list, dict]:
    """Four copies of `case` at once on `engines(k, ...)` whose paged pool holds a prompt's blocks and
    `spare_blocks` more (default: another prompt's and one): two are admitted and, as they grow, the
    newer is preempted and later recomputed. Their `RequestOutput`s and the engine's stats after.
    `max_model_len` is what that pool holds (the engine refuses a pool that cannot hold one
    `max_model_len` sequence). Where copies share the prompt's cached blocks (a copy admitted after
    the first one's prompt was cached), fewer spare blocks keep the preemption coming."""
    prompt_blocks = -(-len(case[0].prompt_token_ids) // block_size)
    pool_blocks = prompt_blocks + (prompt_blocks + 1 if spare_blocks is None else spare_blocks)
    budget = kv_budget(engines(1), pool_blocks, k=k, block_size=block_size, max_model_len=pool_blocks * block_size)
    engine = engines(k, kv_cache_memory=budget, block_size=block_size, max_model_len=pool_blocks * block_size)
    outs = staggered(engine, [case] * 4, [params] * 4, f"preempt-{k}", gap_s=0.0)
    return outs, engine.stats()
