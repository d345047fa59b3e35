"""The reasoning split (`models/reasoning.py`) against vLLM's `qwen3` reasoning parser rule written out
plainly (as its stream applies it: a model-written `<think>` drops alone), whole and streamed in pieces of every size
and token by token; constraints applied after the thinking block; the thinking switch
refused by a template without one."""

from __future__ import annotations

import pytest

from raypipe.models.prompt import build_prompt
from raypipe.models.registry import FAMILIES
from raypipe.models.reasoning import PARSERS, ReasoningStream, constrain_answer, split_reasoning

ANSWERS = ["plan</think>\n\nanswer", "</think>\n\nanswer", "plan</think>", "plan only, cut short", "",
           "<think>\nplan</think>answer", "a</think>b</think>c", "thinking about </thin and <think",
           "plan <think>more</think>answer", "a</think>b<think>c", "p<think>q<think>r</think>s", "x</think>"]


def vllm_qwen3(text: str, thinking_on: bool) -> tuple[str | None, str | None]:
    """vLLM's rule as its stream applies it: with thinking off the prompt ended the reasoning, so all is
    content; else the first generated `<think>` before any `</think>` is dropped (the tag only: a stream cannot
    take back the text before it), text before `</think>` is reasoning and after it content, and without
    `</think>` everything is reasoning (cut short); empty parts are None."""
    if not thinking_on:
        return None, text or None
    head = text.split("<think>", 1)[0]
    if "<think>" in text and "</think>" not in head:
        text = head + text.split("<think>", 1)[1]
    if "</think>" not in text:
        return text or None, None
    reasoning, content = text.split("</think>", 1)
    return reasoning or None, content or None


def streamed(text: str, size: int, thinking_on: bool) -> tuple[str | None, str | None]:
    stream = ReasoningStream(thinking_on)
    parts = [stream.feed(text[i:i + size]) for i in range(0, len(text), size)] + [stream.finish()]
    reasoning, content = "".join(r for r, _ in parts), "".join(c for _, c in parts)
    return reasoning or None, content or None


@pytest.mark.parametrize("thinking_on", [True, False])
def test_split_follows_the_qwen3_parser_rule_whole_and_streamed(thinking_on):
    for text in ANSWERS:
        want = vllm_qwen3(text, thinking_on)
        assert split_reasoning(text, thinking_on) == want, text
        for size in range(1, max(len(text), 1) + 1):
            assert streamed(text, size, thinking_on) == want, (text, size)


def test_a_think_token_inside_the_reasoning_splits_whole_and_streamed_alike():
    """Token by token on the Qwen3.5 preset's vocabulary (`<think>` is one token): the model writes reasoning, a
    `<think>` token, more reasoning, `</think>`, the answer. The whole reply used to drop the reasoning before that
    token, which the stream had sent already; now only the tag goes, in both."""
    from transformers import AutoTokenizer

    from raypipe.models.registry import preset_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(preset_checkpoint("tiny-qwen3.5"))
    think, close = (tokenizer.convert_tokens_to_ids(tag) for tag in ("<think>", "</think>"))
    ids = tokenizer.encode("first plan, ") + [think] + tokenizer.encode("second plan") + [close] + tokenizer.encode(
        "the answer")
    whole = split_reasoning(tokenizer.decode(ids), True)
    stream = ReasoningStream(True)
    parts = [stream.feed(tokenizer.decode([token])) for token in ids] + [stream.finish()]
    assert whole == ("first plan, second plan", "the answer")
    assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == whole


def test_thinking_is_on_unless_switched_off():
    qwen3_5, qwen2_5 = (next(f for f in FAMILIES if f.model_type == kind) for kind in ("qwen3_5", "qwen2_5_vl"))
    assert qwen3_5.thinks(None) and qwen3_5.thinks({"enable_thinking": True})
    assert not qwen3_5.thinks({"enable_thinking": False}) and not qwen2_5.thinks(None)
    assert {f.reasoning for f in FAMILIES} <= {"", *PARSERS}


def test_a_constraint_applies_after_the_thinking_block(tiny_ckpt):
    """The compiled grammar (a matcher of the decoder's own compiler, through the worker pool): free text (no EOS,
    no spelled-out tag) until the `</think>` token, then exactly the constraint; off, the constraint from the start."""
    from transformers import AutoTokenizer

    from raypipe.decode.config import EngineConfig
    from raypipe.decode.grammar import GrammarCompiler, GrammarLimits
    from raypipe.inputs.structured import StructuredOutput
    from raypipe.models.registry import preset_checkpoint

    schema = StructuredOutput(json='{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}')
    assert constrain_answer(schema, False) is schema and constrain_answer(None, True) is None
    tokenizer = AutoTokenizer.from_pretrained(preset_checkpoint("tiny-qwen3.5"))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    compiler = GrammarCompiler(tokenizer, len(tokenizer), (eos,), GrammarLimits(
        **{name: getattr(EngineConfig(), f"grammar_{name}") for name in ("max_bytes", "max_depth", "max_ref_depth",
                                                                        "max_rules")},
        **{name: getattr(EngineConfig(), f"grammar_compile_{name}") for name in ("timeout_s", "workers",
                                                                                "memory_bytes", "stack_bytes")}))
    try:
        def matcher(structured, text):
            m = compiler.matcher(structured)
            return m, m.consume_tokens(tokenizer.encode(text))

        thinking = constrain_answer(schema, True)
        m, ok = matcher(thinking, "plan: {not json} <thin")
        assert ok and not m.is_accepting()  # anything before the tag, and no EOS there
        assert matcher(thinking, "plan</think>")[0].compute_ff_tokens() == tokenizer.encode('{"a":')
        m, ok = matcher(thinking, 'plan</think>{"a":12}')
        assert ok and m.is_accepting()
        assert not matcher(thinking, 'plan</think> {"a":1}')[1]  # the answer starts right after the tag
        spelled = tokenizer.encode("plan") + [tokenizer.convert_tokens_to_ids(c) for c in "</think>"]
        assert not compiler.matcher(thinking).consume_tokens(spelled)  # the tag only as its token
        assert not matcher(schema, 'plan</think>{"a":1}')[1] and matcher(schema, '{"a":1}')[1]
        choice = constrain_answer(StructuredOutput(choice=("red", "blue")), True)
        m, ok = matcher(choice, "x</think>blue")
        assert ok and m.is_accepting()
    finally:
        compiler.close()


def test_a_template_without_a_thinking_switch_ignores_it(tiny_ckpt):
    """vLLM passes `chat_template_kwargs` to the template, which ignores what it does not read: the prompt is
    transformers' own rendering without the switch."""
    from transformers import AutoTokenizer

    from raypipe.models.registry import vision_adapter

    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt)
    messages = [{"role": "user", "content": "hi"}]
    prompt = build_prompt(messages, tokenizer, vision_adapter(tiny_ckpt), chat_template_kwargs={"enable_thinking": False})
    assert prompt.prompt_token_ids == list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                         tokenize=True, return_dict=False))


def test_sampled_answers_follow_the_constraint_after_thinking():
    """The decode engine (no Serve) sampling the Qwen3.5 preset at temperature 1 under a schema after thinking:
    every answer's tokens replay on an independent llguidance matcher of the composed grammar, a finished answer's
    content validates and its reasoning never holds the tag, a cut one a prefix of a valid answer."""
    import asyncio
    import json

    import jsonschema
    import llguidance
    import llguidance.hf

    from raypipe import SamplingParams
    from raypipe.decode.config import EngineConfig
    from raypipe.decode.engine import LLMEngine
    from raypipe.decode.grammar_worker import JSON_OPTIONS, after_thinking
    from raypipe.inputs.structured import StructuredOutput
    from raypipe.models.registry import preset_checkpoint

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    engine = LLMEngine(preset_checkpoint("tiny-qwen3.5"), EngineConfig(max_num_seqs=4, max_model_len=256))
    try:
        tokenizer = engine.tokenizer
        prompt = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")
        structured = constrain_answer(StructuredOutput(json=json.dumps(schema)), True)

        async def run():
            return await asyncio.gather(*(engine.generate_output(
                f"s{seed}", prompt, params=SamplingParams(max_tokens=48, temperature=1.0, seed=seed, structured=structured))
                for seed in range(6)))

        outputs = asyncio.run(run())
    finally:
        engine.shutdown()
    grammar = after_thinking(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS), "</think>")
    lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    finished = 0
    for out in outputs:
        ids = [t for t in out.token_ids if t not in engine.adapter.eos_token_ids]
        assert llguidance.LLMatcher(lltokenizer, grammar).consume_tokens(ids), out.text
        reasoning, content = split_reasoning(out.text, True)
        if out.finish_reason == "stop":
            finished += 1
            jsonschema.validate(json.loads(content), schema)
            assert "</think>" not in (reasoning or "")
        else:
            assert out.finish_reason == "length"  # its tokens still replayed: a prefix of a valid answer
    assert finished >= 1  # the composed grammar was exercised through its end
