"""Randomized differential test: `LLMEngine` against transformers' `generate()`, scenario by scenario.

Each scenario draws an engine (K, rows, `max_model_len`: mostly 128, in some scenarios a length that
is not a multiple of the block size, and either the default KV pool or one so small that running
sequences are preempted and recomputed: as small as the engine accepts, one `max_model_len` sequence
in whole blocks) and a set of requests with random prompts (in half the
scenarios most of them share a prefix, which the prefix cache then serves), staggered
arrivals, budgets, stop strings, stop token ids, EOS on or ignored, greedy processors
(repetition penalty, logit bias, min_tokens), requests that leave their stream early, and sampled
"noise" requests that only make the batch busy. Every greedy request must equal `generate()` with
the same processors, cut at `max_model_len` and by the plain one-token-at-a-time stop reference
below; a request that left early must have received a prefix of that. The engine must end empty.

The hybrid family (MiniCPM-V 4.6: gated delta-net state + full attention) runs `HYBRID_SCENARIOS`
scenarios of its own, every one with shared prefixes, the smallest pool and a round budget of a few
blocks: its prefix hits restore state snapshots, its preemptions resume from them, and its prompts
are prefilled in chunks that continue from the rows' state.

The suite runs `SCENARIOS` scenarios with a fixed seed; `RAYPIPE_DIFF_SCENARIOS=300` (and
`RAYPIPE_DIFF_SEED`) runs a longer one. Run with `-s` to see what was compared.
"""

from __future__ import annotations

import asyncio
import os
import random

import pytest
import torch

from raypipe import SamplingParams
from tests import decode_reference as ref

SCENARIOS = int(os.environ.get("RAYPIPE_DIFF_SCENARIOS", "4"))
HYBRID_SCENARIOS = int(os.environ.get("RAYPIPE_DIFF_SCENARIOS", "2"))
HYBRID_SNAPSHOTS = 4  # state snapshots the hybrid scenarios' small pool holds
SEED = int(os.environ.get("RAYPIPE_DIFF_SEED", "8"))
MAX_MODEL_LEN = 128
SMALL_POOL_TOKENS = 112  # the longest request (64-token prompt + 48 tokens) fits, two seldom do
ODD_MODEL_LENS = (24, 37, 50, 77)  # not multiples of the block size (16): the pool holds whole blocks
TEXT_TOKENS = 256  # the tiny tokenizer's byte tokens: every id decodes to text


@pytest.fixture(scope="module")
def engines(tiny_ckpt):
    with ref.engine_pool(tiny_ckpt, max_model_len=MAX_MODEL_LEN) as get:
        yield get


@pytest.fixture(scope="module")
def hybrid_engines(minicpmv_ckpt):
    with ref.engine_pool(minicpmv_ckpt, max_model_len=MAX_MODEL_LEN) as get:
        yield get


@pytest.fixture(scope="module")
def hybrid_hf_model(minicpmv_ckpt):
    from transformers import MiniCPMV4_6ForConditionalGeneration

    return MiniCPMV4_6ForConditionalGeneration.from_pretrained(minicpmv_ckpt).eval()


def stable_text(tokenizer, ids: list[int]) -> list[str]:
    """Text after each token: the decode of the longest prefix that does not end inside a character."""
    texts, last = [], ""
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n], skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            last = text
        texts.append(last)
    return texts


def expected(tokenizer, free: list[int], params: SamplingParams, stop_ids: set[int], room: int
             ) -> tuple[list[int], str, str]:
    """What the engine must return, from `generate()`'s tokens `free` (not cut at any stop); `room`:
    the tokens `max_model_len` leaves after the prompt."""
    ids = free[: min(params.max_tokens, room)]
    finish = "length"
    for i, token in enumerate(ids):
        if token in stop_ids:
            ids, finish = ids[: i + 1], "stop"
            break
    texts = stable_text(tokenizer, ids)
    checked = 0
    for n, text in enumerate(texts, start=1):
        if n >= params.min_tokens and params.stop:
            hits = [i for s in params.stop if (i := text.find(s, max(checked - len(s) + 1, 0))) >= 0]
            if hits:
                return ids[:n], text[: min(hits)], "stop"
        checked = len(text)
    return ids, tokenizer.decode(ids, skip_special_tokens=True), finish


def hf_free_run(hf_model, prompt: list[int], params: SamplingParams, stop_ids: set[int], room: int
                ) -> list[int]:
    """Greedy `generate()` with the request's processors, stopping only at its stop ids (and after `room` tokens)."""
    ids = torch.tensor([prompt])
    kwargs = dict(max_new_tokens=min(params.max_tokens, room), do_sample=False, repetition_penalty=params.repetition_penalty,
                  eos_token_id=sorted(stop_ids) or [10 ** 6], pad_token_id=0)
    if params.logit_bias:
        kwargs["sequence_bias"] = {(t,): b for t, b in params.logit_bias.items()}
    if params.min_tokens:
        kwargs["min_new_tokens"] = min(params.min_tokens, room)
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    return out[0, ids.shape[1]:].tolist()


def scenario(rng: random.Random, tokenizer, hf_model, eos: int, hybrid: bool = False):
    """One scenario; `hybrid`: always shared prefixes and the smallest pool."""
    k, rows, small_pool = rng.choice([1, 2, 3, 5, 8]), rng.choice([2, 4, 6]), hybrid or rng.random() < 0.5
    max_model_len = rng.choice(ODD_MODEL_LENS) if rng.random() < 0.4 else MAX_MODEL_LEN
    with_shared = hybrid or rng.random() < 0.5
    shared = [rng.randrange(TEXT_TOKENS) for _ in range(rng.randint(16, 40))] if with_shared else []
    requests = []
    for i in range(rng.randint(3, 8)):
        prefix = shared[: rng.randint(len(shared) // 2, len(shared))] if rng.random() < 0.8 else []
        prompt = (prefix + [rng.randrange(TEXT_TOKENS) for _ in range(rng.randint(1, 24))])[: max_model_len - 1]
        room = max_model_len - len(prompt)
        delay = rng.random() * 0.05
        if rng.random() < 0.2:  # sampled noise: only makes the batch busy
            params = SamplingParams(max_tokens=rng.randint(1, 40), temperature=1.0, top_k=rng.choice([0, 20]),
                                    frequency_penalty=rng.choice([0.0, 0.5]), seed=rng.choice([None, i]))
            requests.append(dict(prompt=prompt, params=params, delay=delay, noise=True))
            continue
        options = dict(max_tokens=rng.randint(1, 48), ignore_eos=rng.random() < 0.5)
        if rng.random() < 0.3:
            options["repetition_penalty"] = rng.choice([0.8, 1.3, 2.0])
        if rng.random() < 0.3:
            options["logit_bias"] = {rng.randrange(TEXT_TOKENS): rng.choice([-100.0, 3.0, 8.0])}
        if rng.random() < 0.2:
            options["min_tokens"] = rng.randint(0, options["max_tokens"])
        params = SamplingParams(**options)
        stop_ids = set() if params.ignore_eos else {eos}
        free = hf_free_run(hf_model, prompt, params, stop_ids, room)
        if rng.random() < 0.3 and len(free) > 2:
            params.stop_token_ids = [rng.choice(free[1:])]
            stop_ids.add(params.stop_token_ids[0])
            free = hf_free_run(hf_model, prompt, params, stop_ids, room)
        text = tokenizer.decode(free, skip_special_tokens=True).replace("\ufffd", "")
        if rng.random() < 0.6 and text:
            stops = []
            for _ in range(rng.randint(1, 3)):  # pieces of the text it will produce: they overlap and hit
                start = rng.randrange(len(text))
                stops.append(text[start: start + rng.randint(1, 4)])
            params.stop = stops
        requests.append(dict(prompt=prompt, params=params, delay=delay, noise=False,
                             want=expected(tokenizer, free, params, stop_ids, room),
                             leave_after=rng.choice([None, None, None, 1, 2])))
    return k, rows, small_pool, max_model_len, bool(shared), requests


async def run_scenario(engine, requests, tag: str):
    async def one(i, r):
        await asyncio.sleep(r["delay"])
        deltas = []
        async for delta in engine.generate(f"{tag}-{i}", r["prompt"], [], r["params"]):
            deltas.append(delta)
            if r.get("leave_after") == len(deltas) and delta.finish_reason is None:
                break
        return deltas

    return await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))


def test_engine_matches_generate_on_random_scenarios(engines, hf_model):
    compared = compare_scenarios(engines, hf_model, SCENARIOS)
    if SCENARIOS >= 4:  # the default run has both kinds of scenario (how often they preempt or hit is timing)
        assert compared["small_pool"] > 0 and compared["shared_prefix"] > 0 and compared["odd_model_len"] > 0


def test_hybrid_engine_matches_generate_with_shared_prefixes_and_a_tiny_pool(hybrid_engines, hybrid_hf_model):
    compared = compare_scenarios(hybrid_engines, hybrid_hf_model, HYBRID_SCENARIOS, hybrid=True)
    assert compared["small_pool"] == compared["shared_prefix"] == compared["scenarios"]


def compare_scenarios(engines, hf_model, scenarios: int, hybrid: bool = False) -> dict:
    """Run `scenarios` scenarios on `engines`, each request checked against `hf_model`; what was compared."""
    rng = random.Random(SEED)
    tokenizer = engines(1).tokenizer
    eos = engines(1).adapter.eos_token_ids[0]
    bytes_per_token, block = engines(1).runner.bytes_per_token, engines(1).config.block_size
    compared = dict(scenarios=0, requests=0, tokens=0, left_early=0, noise=0, small_pool=0, shared_prefix=0,
                    odd_model_len=0, preemptions=0, cached_tokens=0, snapshot_hits=0)
    for s in range(scenarios):
        k, rows, small_pool, max_model_len, shared_prefix, requests = scenario(rng, tokenizer, hf_model, eos, hybrid)
        compared["small_pool"] += small_pool
        compared["shared_prefix"] += shared_prefix
        compared["odd_model_len"] += max_model_len % block != 0
        limits = dict(max_num_seqs=rows, max_model_len=max_model_len)
        if hybrid:  # small round budgets: chunks continue from row state, groups mix continuing and joining rows
            limits["max_num_batched_tokens"] = rng.choice([16, 24, 40])
        if small_pool:  # at 128, SMALL_POOL_TOKENS (the engine's max_model_len then); else one sequence's blocks
            pool = SMALL_POOL_TOKENS if max_model_len == MAX_MODEL_LEN else -(-max_model_len // block) * block
            limits.update(max_model_len=min(max_model_len, pool))
            if hybrid:  # room for a few state snapshots beside the blocks (the default share would hold none)
                state = engines(1).runner.cache.state_bytes_per_row
                total = bytes_per_token * pool + HYBRID_SNAPSHOTS * state + 2
                limits.update(kv_cache_memory=total,
                              state_snapshot_memory_fraction=(HYBRID_SNAPSHOTS * state + 1) / total)
            else:
                limits.update(kv_cache_memory=bytes_per_token * pool)
        engine = engines(k, **limits)
        before = engine.stats()
        results = asyncio.run(run_scenario(engine, requests, f"s{s}"))
        for i, (r, deltas) in enumerate(zip(requests, results)):
            where = (f"scenario {s} (K={k}, rows={rows}, max_model_len={max_model_len}, small pool {small_pool}) "
                     f"request {i}: {r['prompt']} {r['params']}")
            tokens = [t for d in deltas for t in d.token_ids]
            text = "".join(d.text for d in deltas)
            assert all(d.finish_reason is None for d in deltas[:-1]), where
            if r["noise"]:
                compared["noise"] += 1
                assert 1 <= len(tokens) <= r["params"].max_tokens, where
                continue
            want_tokens, want_text, want_finish = r["want"]
            if deltas[-1].finish_reason is None:  # left early: a prefix of the whole answer
                compared["left_early"] += 1
                assert tokens == want_tokens[: len(tokens)] and want_text.startswith(text), where
            else:
                assert (tokens, text, deltas[-1].finish_reason) == (want_tokens, want_text, want_finish), where
            compared["requests"] += 1
            compared["tokens"] += len(tokens)
        compared["scenarios"] += 1
        for _ in range(200):  # aborts land at the next round boundary
            if engine.stats()["running"] == engine.stats()["waiting"] == 0:
                break
            asyncio.run(asyncio.sleep(0.01))
        after = engine.stats()
        assert after["running"] == after["waiting"] == 0 and after["kv_blocks_used"] == 0
        compared["preemptions"] += after["preemptions"] - before["preemptions"]
        compared["cached_tokens"] += after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
        compared["snapshot_hits"] += after.get("snapshot_hits", 0) - before.get("snapshot_hits", 0)
    print(f"\ndifferential (seed {SEED}): {compared}")
    assert compared["requests"] > 0
    return compared
