"""Structured outputs in the decode engine: every finished output follows its constraint, greedy
tokens do not depend on K or on the batch, and equal transformers' own `generate()` with a logits
processor over the same grammar engine (llguidance)."""

from __future__ import annotations

import asyncio
import json
import re
import time

import jsonschema
import llguidance
import llguidance.torch
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from raypipe import InvalidInput, SamplingParams, StructuredOutput
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
from raypipe.decode.grammar import constraint_value
from raypipe.decode.grammar_worker import grammar_text
from raypipe.decode.sampler import SamplingBatch
from raypipe.models.registry import vision_adapter
from raypipe.testing.structured_schemas import BAD_SCHEMAS, SCHEMAS
from tests import decode_reference as ref

MAX_TOKENS = 96  # every schema in SCHEMAS fits with room to spare at byte-level tokens


@pytest.fixture(scope="module")
def engines(tiny_ckpt):
    made = {k: LLMEngine(tiny_ckpt, EngineConfig(max_num_seqs=8, max_model_len=384, num_scheduler_steps=k))
            for k in (1, 8)}
    yield made
    for engine in made.values():
        engine.shutdown()


@pytest.fixture(scope="module")
def prompt(engines):
    return engines[1].tokenizer.encode("Reply in JSON.")


def _params(schema, temperature=0.0, seed=None) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed, structured={"json": schema})


def _check(out, schema) -> bool:
    """The output validates if it finished; True if it finished."""
    if out.finish_reason != "stop":
        assert out.finish_reason == "length"
        return False
    jsonschema.validate(json.loads(out.text), schema)
    return True


def test_schemas_hold_greedy_and_sampled_for_any_k_and_batch(engines, prompt):
    """Every schema: greedy and seeded sampling at K=1 and K=8, alone and all at once in a busy
    batch next to unconstrained rows; greedy tokens are the same in all of them."""
    alone = {}
    for name, schema in SCHEMAS.items():
        for k in (1, 8):
            for temperature, seed in ((0.0, None), (1.0, 7)):
                out = asyncio.run(engines[k].generate_output(f"{name}-{k}-{seed}", prompt,
                                                             params=_params(schema, temperature, seed)))
                alone[name, k, seed] = out
    for name in SCHEMAS:
        assert alone[name, 1, None].token_ids == alone[name, 8, None].token_ids, name
        assert alone[name, 1, 7].token_ids == alone[name, 8, 7].token_ids, name

    async def busy():
        engine = engines[8]
        noise = [engine.generate_output(f"noise-{i}", prompt[:i + 1],
                                        params=SamplingParams(max_tokens=20 + i, temperature=1.0, seed=i))
                 for i in range(3)]
        constrained = [engine.generate_output(f"busy-{name}-{seed}", prompt,
                                              params=_params(schema, temperature, seed))
                       for name, schema in SCHEMAS.items() for temperature, seed in ((0.0, None), (1.0, 7))]
        return (await asyncio.gather(*noise, *constrained))[len(noise):]

    crowded = iter(asyncio.run(busy()))
    finished = 0
    for name, schema in SCHEMAS.items():
        for seed in (None, 7):
            out = next(crowded)
            assert out.token_ids == alone[name, 8, seed].token_ids, (name, seed)
            finished += _check(out, schema)
            finished += _check(alone[name, 1, seed], schema)
    assert finished >= 0.9 * 4 * len(SCHEMAS)  # "length" ones need not parse, but most must finish


class GrammarProcessor(LogitsProcessor):
    """transformers' side of the comparison: an llguidance matcher masking `generate()`'s scores."""

    def __init__(self, tokenizer, vocab_size: int, eos: int, structured: StructuredOutput, prompt_len: int):
        self.matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos),
                                            grammar_text(structured.kind, constraint_value(structured)))
        self.mask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.prompt_len:
            assert self.matcher.consume_token(int(input_ids[0, -1]))
        llguidance.torch.fill_next_token_bitmask(self.matcher, self.mask, 0)
        scores = scores.clone()
        llguidance.torch.apply_token_bitmask_inplace(scores, self.mask)
        return scores


@pytest.mark.parametrize("case", [0, 1])
def test_greedy_constrained_equals_transformers_generate(engines, tiny_ckpt, hf_model, case):
    engine = engines[8]
    eos = engine.adapter.eos_token_ids[0]
    prepared = ref.prepare(case, engine.tokenizer, vision_adapter(tiny_ckpt))
    embeds = ref.embeddings(hf_model, tiny_ckpt, prepared)
    constraints = [StructuredOutput(json=SCHEMAS[name]) for name in ("nested", "pattern", "array_of_objects")]
    constraints += [StructuredOutput(regex=r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"),
                    StructuredOutput(choice=["positive", "negative", "neutral"])]
    for structured in constraints:
        processor = GrammarProcessor(engine.tokenizer, engine.runner.vocab_size, eos, structured,
                                     len(prepared.prompt_token_ids))
        want = ref.hf_generate(hf_model, prepared, embeds, MAX_TOKENS, eos,
                               logits_processor=LogitsProcessorList([processor]))
        out = asyncio.run(engine.generate_output("vs-hf", prepared, embeds,
                                                 SamplingParams(max_tokens=MAX_TOKENS, structured=structured)))
        assert out.token_ids == want, structured
        assert out.finish_reason == "stop" and want[-1] == eos


def test_regex_choice_and_grammar_kinds(engines, prompt):
    engine = engines[8]
    cases = [(StructuredOutput(regex=r"\d{3}-[A-F]{2}"), lambda t: re.fullmatch(r"\d{3}-[A-F]{2}", t)),
             (StructuredOutput(choice=("yes", "no", "maybe so")), lambda t: t in ("yes", "no", "maybe so")),
             (StructuredOutput(grammar='start: "(" num ("," num)* ")"\nnum: /[0-9]{1,2}/'),
              lambda t: re.fullmatch(r"\(\d{1,2}(,\d{1,2})*\)", t)),
             (StructuredOutput(json_object=True), lambda t: isinstance(json.loads(t), dict))]
    for i, (structured, valid) in enumerate(cases):
        for seed in range(3):
            out = asyncio.run(engine.generate_output(f"kind-{i}-{seed}", prompt, params=SamplingParams(
                max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, structured=structured)))
            if out.finish_reason == "stop" or structured.kind != "json_object":
                assert out.finish_reason == "stop" and valid(out.text), (structured, out.text)


@pytest.mark.parametrize("name", list(BAD_SCHEMAS))
def test_bad_schema_is_refused_naming_the_problem(engines, prompt, name):
    schema, words = BAD_SCHEMAS[name]
    with pytest.raises(InvalidInput, match=re.escape(words)) as info:
        engines[1].check_request(prompt, _params(schema))
    assert info.value.item == "sampling_params.structured.json"


@pytest.mark.parametrize("value, words", [({"json": {}, "regex": "a"}, "exactly one"), ({"choice": []}, "non-empty"),
                                          ({"jsn": {}}, "jsn"), ({"json": "{nope"}, "not valid JSON"),
                                          ({"regex": "a(b"}, "unclosed group"), ({"grammar": "start: foo"}, "foo")])
def test_malformed_constraints_are_refused(engines, prompt, value, words):
    with pytest.raises(InvalidInput, match=re.escape(words)):
        engines[1].check_request(prompt, SamplingParams(structured=value))


def test_each_distinct_constraint_compiles_once(engines, monkeypatch):
    engine = engines[1]
    compiler = GrammarCompiler(engine.tokenizer, engine.runner.vocab_size, engine.adapter.eos_token_ids, timeout_s=5.0)
    brace = engines[1].tokenizer.encode("{")[0]
    compiled = []
    original = compiler._compile
    monkeypatch.setattr(compiler, "_compile", lambda s: compiled.append(s) or original(s))
    for _ in range(3):
        for schema in (SCHEMAS["flat"], SCHEMAS["enum"], dict(SCHEMAS["flat"])):
            matcher = compiler.matcher(StructuredOutput(json=schema))
            assert matcher.consume_token(brace)  # a fresh copy each time: never one advanced by another request
    assert len(compiled) == 2


def test_unconstrained_batches_carry_no_grammar(engines, prompt):
    engine = engines[1]
    seq = type("S", (), {"params": SamplingParams(), "matcher": None, "output_ids": [], "generator": None})()
    assert SamplingBatch.build([seq], [frozenset()], engine.runner.vocab_size, engine.device).grammar is None


def test_a_schema_over_the_compile_time_limit_is_refused_and_the_engine_goes_on(engines, tiny_ckpt, prompt):
    """8000 required properties take ~0.6 s to compile here; at a 0.05 s limit the request is refused at once
    (sent again: without a second compile), and a normal request sent with it, and one after, are untouched."""
    slow = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 50}}}$"}
                                             for i in range(8000)}, "required": [f"p{i}" for i in range(8000)]}
    expected = asyncio.run(engines[8].generate_output("ref", prompt, params=_params(SCHEMAS["flat"])))
    engine = LLMEngine(tiny_ckpt, EngineConfig(max_num_seqs=8, max_model_len=384, num_scheduler_steps=8,
                                               grammar_compile_timeout_s=0.05))

    async def both():
        return await asyncio.gather(engine.generate_output("slow", prompt, params=_params(slow)),
                                    engine.generate_output("normal", prompt, params=_params(SCHEMAS["flat"])),
                                    return_exceptions=True)

    try:
        for _ in range(2):
            start = time.perf_counter()
            refused, normal = asyncio.run(both())
            assert time.perf_counter() - start < 0.5
            assert isinstance(refused, InvalidInput) and refused.code == "grammar_too_complex"
            assert refused.item == "sampling_params.structured.json" and "0.05 s" in str(refused)
            assert normal.token_ids == expected.token_ids and _check(normal, SCHEMAS["flat"])
        with pytest.raises(InvalidInput, match="did not compile within"):
            engine.check_request(prompt, _params(slow))
        after = asyncio.run(engine.generate_output("after", prompt, params=_params(SCHEMAS["flat"])))
        assert after.token_ids == expected.token_ids
    finally:
        engine.shutdown()
