"""A request resumed on an engine from the output another engine streamed before it died (decode/resume.py).

Each case runs a request whole, then again from a cut: the first `cut` output tokens and the characters of
their text the caller had received, as the Serve ingress resumes it. The resumed request's deltas must carry
exactly the rest: the whole run's tokens and text after the cut. Greedy is checked against transformers'
`generate()` (the whole run equals it, so the resumed one must too); seeded sampling, stop strings held back
at the cut and a structured-output constraint are checked against the whole run.
"""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

from raypipe import InvalidInput, SamplingParams
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.decode.resume import Resume
from raypipe.inputs.structured import StructuredOutput
from tests import decode_reference as ref

PROMPT = [5, 17, 42, 99, 3, 250, 11, 64, 8, 31]


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    engine = LLMEngine(tiny_ckpt, EngineConfig(max_model_len=256, max_num_seqs=4, num_scheduler_steps=4))
    yield engine
    engine.shutdown()


def run(engine, params: SamplingParams, resume: Resume | None = None, request_id: str = "r"):
    async def go():
        deltas = [d async for d in engine.generate(request_id, PROMPT, (), params, resume=resume)]
        return [t for d in deltas for t in d.token_ids], [d.text for d in deltas], deltas[-1].finish_reason
    return asyncio.run(go())


def resumed_equals_whole(engine, params: SamplingParams, cut: int) -> tuple[list[int], str]:
    whole_ids, whole_texts, whole_reason = run(engine, params, request_id="whole")
    assert len(whole_ids) > cut, "the case must run past its cut"
    # What the caller had at the cut: the deltas of the whole run up to the one holding token `cut`.
    ids_so_far, sent = [], 0
    async def cut_deltas():
        nonlocal sent
        async for delta in engine.generate("first", PROMPT, (), params):
            if len(ids_so_far) + len(delta.token_ids) > cut:
                return  # leaving early aborts it, as a dead replica's stream ends
            ids_so_far.extend(delta.token_ids)
            sent += len(delta.text)
    asyncio.run(cut_deltas())
    rest_ids, rest_texts, reason = run(engine, params, Resume(tuple(ids_so_far), sent), request_id="resumed")
    assert ids_so_far + rest_ids == whole_ids
    assert "".join(whole_texts)[:sent] + "".join(rest_texts) == "".join(whole_texts)
    assert reason == whole_reason
    return whole_ids, "".join(whole_texts)


def test_a_resumed_greedy_request_continues_as_transformers_generates(engine, hf_model):
    ids, _ = resumed_equals_whole(engine, SamplingParams(max_tokens=24, temperature=0.0), cut=9)
    prompt = SimpleNamespace(prompt_token_ids=PROMPT, visual_grids=[])
    assert ids == ref.hf_generate(hf_model, prompt, [], 24, cut_at=engine.adapter.eos_token_ids[0])


def test_a_resumed_seeded_request_draws_what_the_whole_run_drew(engine):
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    resumed_equals_whole(engine, params, cut=7)
    unseeded_cut_twice = [run(engine, dataclasses.replace(params, seed=s), request_id=f"s{s}")[0] for s in (1, 2)]
    assert unseeded_cut_twice[0] != unseeded_cut_twice[1]  # the seed matters, so the equality above could fail


def test_a_resume_keeps_the_text_held_back_for_a_stop_string(engine):
    whole, texts, _ = run(engine, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    text = "".join(texts)
    stop = text[10:14]  # a string the output reaches: the text before it is held back until it is ruled out
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop + "\x00never"])
    resumed_equals_whole(engine, params, cut=6)


def test_a_resumed_constrained_request_keeps_its_grammar_state(engine):
    params = SamplingParams(max_tokens=40, temperature=0.0,
                            structured=StructuredOutput(regex=r"(ab|cd){3,12}x"))
    _, text = resumed_equals_whole(engine, params, cut=3)
    assert text.endswith("x") or len(text) >= 6


def test_a_resume_the_request_cannot_have_produced_is_refused(engine):
    params = SamplingParams(max_tokens=8, temperature=0.0)
    for resume, says in ((Resume((), 0), "at least one"), (Resume((10**7,), 0), "must be in"),
                         (Resume(tuple(range(20, 28)), 0), "no token"), (Resume((20,), 10**6), "characters")):
        with pytest.raises(InvalidInput, match=says):
            run(engine, params, resume)
    constrained = SamplingParams(max_tokens=8, temperature=0.0, structured=StructuredOutput(regex=r"(ab)+"))
    ids, _, _ = run(engine, SamplingParams(max_tokens=3, temperature=0.0, structured=StructuredOutput(regex="[0-9]+")))
    with pytest.raises(InvalidInput, match="constraint"):
        run(engine, constrained, Resume(tuple(ids), 0))
    assert run(engine, params)[0]  # the engine serves on
