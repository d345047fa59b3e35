"""A burst of chats on one system prompt, sent together: the shared prompt is computed once, and every
request but the first hits all of it, whatever the model's layer kinds.

Twelve chats with one ~90-token system prompt and their own user turns, submitted to the in-process
engine at once (`asyncio.gather`). Full attention (`tiny`): every request after the first reuses the
whole block-aligned shared prefix. Hybrid models (`tiny-minicpmv`, `tiny-qwen3.5`: gated delta-net
layers beside full attention) can only continue where a state snapshot lies; the prefill that computes
the shared prompt keeps one where the waiting prompts leave it (their branch point), so they hit the
same prefix as with full attention, not the periodic snapshot before it. Greedy output equals
transformers' `generate()` for every request.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from raypipe import SamplingParams
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.models.prompt import build_prompt
from raypipe.models.registry import preset_checkpoint, vision_adapter

MAX_NEW = 6
SYSTEM = "You are the guide of the city museum. Answer in one short, kind sentence and always name the room."
QUESTIONS = ["Where is the map?", "When does it open?", "Who painted the blue door?", "How old is the bell?",
             "Can I take photos?", "Is there a cafe?", "Which room has the ships?", "What is upstairs?",
             "Do you sell tickets?", "Why is the hall closed?", "Any tours today?", "Show me the coins."]


@pytest.fixture(scope="module", params=["tiny", "tiny-minicpmv", "tiny-qwen3.5"])
def model(request):
    from transformers import AutoModelForImageTextToText

    ckpt = preset_checkpoint(request.param)
    engine = LLMEngine(ckpt, EngineConfig(max_num_seqs=len(QUESTIONS), max_model_len=512))
    yield engine, vision_adapter(ckpt), AutoModelForImageTextToText.from_pretrained(ckpt).eval()
    engine.shutdown()


def reference(hf, ids: list[int], eos: set[int]) -> list[int]:
    """transformers' greedy `generate()`: ids after the prompt, up to and including the first EOS."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=MAX_NEW, do_sample=False)[0, len(ids):].tolist()
    return next((out[: i + 1] for i, token in enumerate(out) if token in eos), out)


def test_a_burst_on_one_system_prompt_computes_it_once(model):
    engine, vision, hf = model
    prompts = [build_prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                            engine.tokenizer, vision) for question in QUESTIONS]
    ids = [p.prompt_token_ids for p in prompts]
    block = engine.config.block_size
    shared = next(i for i, tokens in enumerate(zip(*ids)) if len(set(tokens)) > 1) // block * block
    stats = engine.stats()
    if "snapshot_every_blocks" in stats:  # else the periodic snapshots alone would give the full hits
        assert shared % (stats["snapshot_every_blocks"] * block) != 0

    async def burst():
        return await asyncio.gather(*(engine.generate_output(f"burst-{i}", p, [], SamplingParams(max_tokens=MAX_NEW))
                                      for i, p in enumerate(prompts)))

    outs = asyncio.run(burst())
    assert [out.num_cached_tokens for out in outs] == [0] + [shared] * (len(QUESTIONS) - 1)
    assert engine.stats()["prefill_tokens"] - stats["prefill_tokens"] == sum(map(len, ids)) - shared * (len(ids) - 1)
    eos = set(engine.adapter.eos_token_ids)
    assert [out.token_ids for out in outs] == [reference(hf, p, eos) for p in ids]
