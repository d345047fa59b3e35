"""Prompt log-probabilities (vLLM's `prompt_logprobs`) against transformers' log-softmax of the prompt.

Position i's logits score prompt token i + 1: the engine's values, top candidates and ranks must be
transformers' own, whole or computed over several chunks, and a prompt asking for them computes every
position (no prefix-cache hit), while its output stays what it is without them.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from raypipe import SamplingParams
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine

PROMPT = [int(t) for t in torch.randint(10, 250, (41,), generator=torch.Generator().manual_seed(3))]
K = 3


@pytest.fixture(scope="module")
def reference(hf_model):
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([PROMPT])).logits[0, :-1].float()
    return logits.log_softmax(dim=-1)  # row i scores PROMPT[i + 1]


def run(engine, params: SamplingParams, request_id: str):
    async def go():
        return await engine.generate_output(request_id, PROMPT, (), params)
    return asyncio.run(go())


@pytest.mark.parametrize("chunk", [None, 16])
def test_prompt_logprobs_are_transformers_log_softmax_of_the_prompt(tiny_ckpt, reference, chunk):
    config = EngineConfig(max_model_len=256, max_num_seqs=2, **({"max_num_batched_tokens": chunk} if chunk else {}))
    engine = LLMEngine(tiny_ckpt, config)
    try:
        plain = run(engine, SamplingParams(max_tokens=6, temperature=0.0), "plain")
        out = run(engine, SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=K), "asked")
        again = run(engine, SamplingParams(max_tokens=6, temperature=0.0), "again")
    finally:
        engine.shutdown()
    assert out.token_ids == plain.token_ids  # asking changes nothing else
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    assert out.num_cached_tokens == 0 and again.num_cached_tokens > 0  # computed whole, though the cache had it
    for i, entry in enumerate(out.prompt_logprobs[1:]):
        row, token = reference[i], PROMPT[i + 1]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry.rank == int((row > row[token]).sum()) + 1
        top = row.topk(K)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)
