"""Structured outputs in the decode engine: every finished output follows its constraint, greedy
tokens do not depend on K or on the batch, and equal transformers' own `generate()` with a logits
processor over the same grammar engine (llguidance)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import json
import re
import time

import jsonschema
import llguidance
import llguidance.torch
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from raypipe import InvalidInput, SamplingParams, StructuredOutput
from raypipe.decode.config import EngineConfig
from raypipe.decode.engine import LLMEngine
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


def _grammar_text(structured: StructuredOutput) -> str:
    """The engine's grammar text for `structured` (imported here: the module also runs against older code)."""
    from raypipe.decode.grammar import constraint_value
    from raypipe.decode.grammar_worker import grammar_text

    return grammar_text(structured.kind, constraint_value(structured))


class GrammarProcessor(LogitsProcessor):
    """transformers' side of the comparison: an llguidance matcher masking `generate()`'s scores."""

    def __init__(self, tokenizer, vocab_size: int, eos: int, structured: StructuredOutput, prompt_len: int):
        self.matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos),
                                            _grammar_text(structured))
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


def test_each_distinct_constraint_compiles_once(engines, tiny_ckpt):
    """Three requests each of two distinct schemas (one sent again as an equal copy), some at once: two
    trial compiles in a worker, two matcher builds here, and every request gets a matcher of its own."""
    engine = LLMEngine(tiny_ckpt, EngineConfig(max_num_seqs=8, max_model_len=384))
    brace = engine.tokenizer.encode("{")[0]
    asked = []
    original = engine.grammars.pool.compile
    engine.grammars.pool.compile = lambda kind, value, *after: asked.append(value) or original(kind, value, *after)
    try:
        schemas = [SCHEMAS["flat"], SCHEMAS["enum"], dict(SCHEMAS["flat"])] * 3
        with concurrent.futures.ThreadPoolExecutor(4) as threads:
            matchers = list(threads.map(lambda s: engine.grammars.matcher(StructuredOutput(json=s)), schemas))
        for matcher in matchers:
            assert matcher.consume_token(brace)  # a fresh copy each time: never one advanced by another request
        assert len(asked) == 2 and engine.grammars.compiles == 2
    finally:
        engine.shutdown()


def test_unconstrained_batches_carry_no_grammar(engines, prompt):
    engine = engines[1]
    seq = type("S", (), {"params": SamplingParams(), "matcher": None, "output_ids": [], "generator": None})()
    assert SamplingBatch.build([seq], [frozenset()], engine.runner.vocab_size, engine.device).grammar is None


def test_a_schema_over_the_compile_time_limit_is_refused_and_the_engine_goes_on(engines, tiny_ckpt, prompt, caplog):
    """8000 required properties take ~0.6 s to compile here (2.6 s under load); at a 0.2 s limit the request
    is refused once the limit passes, its worker process killed mid-compile (the compile does end, given
    time: compiled in this process afterwards), sent again: refused from the cache, within the limit,
    without a second compile; a normal request sent with it, and one after, are untouched. The limit leaves
    a normal schema's ~1 ms compile room on a loaded machine (at 0.05 s it was refused under load).

    The refusal's own wall time is bounded below only: it also holds the replacement worker's start and
    the event loop's other work, which in CI once took 2.3 s against a 1.6 s whole compile."""
    from raypipe.decode.grammar import constraint_value
    from raypipe.decode.grammar_worker import trial_compile

    limit = 0.2
    slow = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 50}}}$"}
                                             for i in range(8000)}, "required": [f"p{i}" for i in range(8000)]}
    expected = asyncio.run(engines[8].generate_output("ref", prompt, params=_params(SCHEMAS["flat"])))
    engine = LLMEngine(tiny_ckpt, EngineConfig(max_num_seqs=8, max_model_len=384, num_scheduler_steps=8,
                                               grammar_compile_timeout_s=limit, grammar_max_bytes=1 << 20))

    async def refused_after():
        start = time.perf_counter()
        with pytest.raises(InvalidInput) as refused:
            await engine.generate_output("slow", prompt, params=_params(slow))
        return refused.value, time.perf_counter() - start

    async def both():
        return await asyncio.gather(refused_after(),
                                    engine.generate_output("normal", prompt, params=_params(SCHEMAS["flat"])))

    try:
        waited = []
        for _ in range(2):
            (refused, seconds), normal = asyncio.run(both())
            waited.append(seconds)
            assert refused.code == "grammar_too_complex"
            assert refused.item == "sampling_params.structured.json" and f"{limit:g} s" in str(refused)
            assert normal.token_ids == expected.token_ids and _check(normal, SCHEMAS["flat"])
        with pytest.raises(InvalidInput, match="did not compile within"):
            engine.check_request(prompt, _params(slow))
        assert engine.grammars.compiles == 1  # the normal schema only
        after = asyncio.run(engine.generate_output("after", prompt, params=_params(SCHEMAS["flat"])))
        assert after.token_ids == expected.token_ids
        start = time.perf_counter()
        compiled = trial_compile(engine.grammars.tokenizer, "json", constraint_value(_params(slow).structured))
        whole = time.perf_counter() - start
        assert "grammar" in compiled  # it does compile, given time: the refusal came before it could end
        stopped = [r for r in caplog.records if "stopped after the time limit" in r.getMessage()]
        assert len(stopped) == 1, [r.getMessage() for r in caplog.records]  # killed once, not twice
        assert limit <= waited[0] and waited[1] < limit, (waited, whole)
    finally:
        engine.shutdown()


# --- issue 30: constraints from strangers ------------------------------------------------------------

def _chain(n: int) -> dict:
    """A schema whose root is a chain of `n` `$defs`, each a required `k` pointing at the next."""
    defs = {f"d{i}": {"type": "object", "properties": {"k": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["k"]}
            for i in range(n)}
    return {"$defs": {**defs, f"d{n}": {"type": "integer"}}, "$ref": "#/$defs/d0"}


def _lark_chain(n: int) -> str:
    return "start: r0\n" + "\n".join(f'r{i}: "x" r{i + 1} | "y"' for i in range(n)) + f'\nr{n}: "z"'


NO_BASE_CASE = {"$defs": {"a": {"type": "object", "properties": {"k": {"$ref": "#/$defs/a"}}, "required": ["k"]}},
                "$ref": "#/$defs/a"}


def test_static_limits_refuse_before_any_compile(engines, prompt):
    """Each limit refuses with "grammar_too_complex" and names itself; nothing reaches a compiler worker."""
    engine = engines[1]
    before = engine.grammars.compiles
    deep = {"type": "string"}
    for _ in range(60):  # 120 levels of JSON nesting
        deep = {"type": "object", "properties": {"a": deep}}
    cases = [({"json": _chain(2000)}, "grammar_max_ref_depth"), ({"grammar": _lark_chain(5000)}, "grammar_max_rules"),
             ({"json": deep}, "grammar_max_depth"), ({"regex": "a" * 300_000}, "grammar_max_bytes")]
    for structured, limit in cases:
        with pytest.raises(InvalidInput, match=limit) as info:
            engine.check_request(prompt, SamplingParams(structured=structured))
        assert info.value.code == "grammar_too_complex"
    assert engine.grammars.compiles == before
    # Recursion and long but shallow chains are not refused by the $ref limit.
    engine.check_request(prompt, SamplingParams(structured={"json": _chain(90)}))
    recursive = {"$defs": {"t": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/t"},
                                                                       "maxItems": 2}}}}, "$ref": "#/$defs/t"}
    engine.check_request(prompt, SamplingParams(structured={"json": recursive}))


def test_a_crashing_compile_is_a_400_and_the_engine_goes_on(tiny_ckpt, prompt):
    """Past the static limits (raised here), llguidance segfaults on these two: in the worker process, which
    is replaced; this process goes on and the next constraint compiles."""
    engine = LLMEngine(tiny_ckpt, EngineConfig(max_num_seqs=4, max_model_len=384, grammar_max_ref_depth=10**6,
                                               grammar_max_rules=10**6, grammar_max_bytes=10**7))
    try:
        for structured in ({"json": _chain(1500)}, {"grammar": _lark_chain(5000)}):
            with pytest.raises(InvalidInput, match="SIGSEGV") as info:
                engine.check_request(prompt, SamplingParams(structured=structured))
            assert info.value.code == "grammar_too_complex"
        out = asyncio.run(engine.generate_output("after", prompt, params=_params(SCHEMAS["flat"])))
        assert _check(out, SCHEMAS["flat"])
    finally:
        engine.shutdown()


def test_a_dead_end_after_the_forced_prefix_is_refused_at_admission(engines, prompt):
    with pytest.raises(InvalidInput, match="allows no output after its forced prefix") as info:
        engines[1].check_request(prompt, _params(NO_BASE_CASE))
    assert info.value.code == "invalid_grammar"


def test_a_matcher_error_mid_output_ends_the_request_with_an_error(engines, prompt):
    """The recursive branch is not forced (an integer is allowed too), so admission lets it through; a logit
    bias makes the model take it, the matcher fails after "{": an error naming the constraint, not "stop"."""
    engine = engines[8]
    brace = engine.tokenizer.encode("{")[0]
    schema = {"anyOf": [NO_BASE_CASE, {"type": "integer"}], "$defs": NO_BASE_CASE["$defs"]}
    params = SamplingParams(max_tokens=32, structured={"json": schema}, logit_bias={brace: 100.0})
    with pytest.raises(InvalidInput, match="constraint failed after") as info:
        asyncio.run(engine.generate_output("dead-end", prompt, params=params))
    assert info.value.code == "grammar_failed" and info.value.item == "sampling_params.structured.json"
    after = asyncio.run(engine.generate_output("after", prompt, params=_params(SCHEMAS["flat"])))
    assert _check(after, SCHEMAS["flat"])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_grammar_wins_over_min_tokens(engines, prompt, temperature):
    """A choice finishes before min_tokens: it ends as the grammar says. A grammar that may go on (a+) does
    go on until min_tokens."""
    engine = engines[8]
    for seed in range(3):
        params = SamplingParams(max_tokens=16, min_tokens=8, temperature=temperature, seed=seed,
                                structured={"choice": ["yes", "no"]})
        out = asyncio.run(engine.generate_output(f"choice-{seed}", prompt, params=params))
        assert out.text in ("yes", "no") and out.finish_reason == "stop", out.text
        params = SamplingParams(max_tokens=16, min_tokens=6, temperature=temperature, seed=seed,
                                structured={"regex": "a+"})
        out = asyncio.run(engine.generate_output(f"regex-{seed}", prompt, params=params))
        assert re.fullmatch("a+", out.text) and len(out.token_ids) >= 6, out.text


def test_sampling_a_forbidden_token_is_an_assertion(engines, prompt):
    from raypipe.decode.grammar import GrammarRows, MaskedTokenSampled

    engine = engines[1]
    matcher = engine.grammars.matcher(StructuredOutput(choice=["yes"]))
    rows = GrammarRows([0], [matcher], engine.runner.vocab_size, engine.device)
    logits = rows.apply(torch.zeros(1, engine.runner.vocab_size))
    forbidden = int((logits[0] == float("-inf")).nonzero()[0])
    with pytest.raises(MaskedTokenSampled):
        rows.advance(torch.tensor([forbidden]), logits)


def test_integral_numbers_deep_schemas_and_one_of(engines, prompt):
    engine = engines[8]
    array = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 1e9, "minItems": 1.0}
    out = asyncio.run(engine.generate_output("1e9", prompt, params=_params(array)))
    assert _check(out, array)
    deep = {"type": "integer"}
    for _ in range(250):  # 500 levels of JSON: refused by the depth limit, by name
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(InvalidInput, match="grammar_max_depth"):
        engine.check_request(prompt, _params(deep))
    overlapping = {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                             {"type": "object", "properties": {"b": {"type": "integer"}}}]}
    with pytest.raises(InvalidInput, match="oneOf") as info:
        engine.check_request(prompt, _params(overlapping))
    assert "coerce_one_of" not in str(info.value)


def test_date_time_values_parse_with_python_datetime(engines, prompt):
    """llguidance's own date-time allows second 60 and February 29 of any year; Python's parser refuses both."""
    engine = engines[8]
    stamp = {"type": "object", "properties": {"t": {"type": "string", "format": "date-time"}}, "required": ["t"],
             "additionalProperties": False}
    finished = 0
    for seed in range(16):
        out = asyncio.run(engine.generate_output(f"dt-{seed}", prompt, params=_params(stamp, 1.0, seed)))
        if _check(out, stamp):
            datetime.datetime.fromisoformat(json.loads(out.text)["t"])  # Python's parser: second 60 is refused
            finished += 1
    assert finished >= 12


def _leaf():
    return st.one_of(
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(0, 200)),
        st.just({"type": "boolean"}), st.just({"type": "null"}),
        st.lists(st.sampled_from(["red", "x", "a b", "é"]), min_size=1, max_size=3, unique=True).map(
            lambda values: {"enum": values}),
        st.integers(1, 5).map(lambda n: {"type": "string", "maxLength": n}),
        st.just({"type": "string", "format": "date-time"}))


def _schema():
    def containers(inner):
        objects = st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, min_size=1, max_size=3).flatmap(
            lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
                lambda required: {"type": "object", "properties": props, "required": required,
                                  "additionalProperties": False}))
        arrays = st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner, st.integers(0, 3))
        nullable = inner.map(lambda s: {"anyOf": [s, {"type": "null"}]})
        return st.one_of(objects, arrays, nullable)
    return st.recursive(_leaf(), containers, max_leaves=5)


def _date_times_parse(value, schema) -> None:
    """Every string the schema asks to be a date-time parses with Python's `datetime`."""
    if schema.get("format") == "date-time" and isinstance(value, str):
        datetime.datetime.fromisoformat(value)
    for key, sub in schema.get("properties", {}).items():
        if isinstance(value, dict) and key in value:
            _date_times_parse(value[key], sub)
    if "items" in schema and isinstance(value, list):
        for item in value:
            _date_times_parse(item, schema["items"])
    for sub in schema.get("anyOf", ()):
        _date_times_parse(value, sub)


@settings(max_examples=50, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(schema=_schema(), max_tokens=st.integers(4, 48), min_fraction=st.floats(0, 1),
       stop=st.sampled_from([None, [","], ["}"], ["a"]]), seed=st.sampled_from([None, 0, 1]))
def test_property_every_finished_output_validates_and_no_token_was_masked(engines, prompt, schema, max_tokens,
                                                                         min_fraction, stop, seed):
    """Random schemas and random max_tokens / min_tokens / stop / sampling. Oracle: an llguidance matcher of
    its own replays the output tokens (each must be one the constraint allowed; EOS before min_tokens only
    where the constraint allowed nothing else), and jsonschema + `datetime` check every output ended by EOS."""
    engine = engines[8]
    eos = engine.adapter.eos_token_ids[0]
    min_tokens = int(min_fraction * max_tokens)
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, stop=stop, temperature=0.0 if seed is None
                            else 1.0, seed=seed, structured={"json": schema})
    out = asyncio.run(engine.generate_output("property", prompt, params=params))
    structured = params.structured
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(engine.tokenizer, n_vocab=engine.runner.vocab_size,
                                                                eos_token=eos),
                                   _grammar_text(structured))
    mask = llguidance.torch.allocate_token_bitmask(1, engine.runner.vocab_size)
    for i, token in enumerate(out.token_ids):
        if token == eos and i < min_tokens:
            llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
            allowed = torch.zeros(1, engine.runner.vocab_size)
            llguidance.torch.apply_token_bitmask_inplace(allowed, mask)
            assert torch.isfinite(allowed[0]).nonzero().view(-1).tolist() == [eos], "EOS before min_tokens"
        assert matcher.consume_token(token), (i, token, out.text)
    if out.finish_reason == "length":
        assert len(out.token_ids) == max_tokens
    elif out.token_ids[-1] == eos:
        value = json.loads(out.text)
        jsonschema.validate(value, schema)
        _date_times_parse(value, schema)
    else:  # a stop string, at or after min_tokens
        assert out.finish_reason == "stop" and any(s in engine.tokenizer.decode(out.token_ids) for s in stop)
        assert len(out.token_ids) >= min_tokens
