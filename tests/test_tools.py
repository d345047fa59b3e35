"""Tool calls in Qwen2.5's format: the parser `tool_choice: auto` relies on, the grammar that forces
calls, and the streamed split (unit tests; the API behaviour is in `test_serve_api`)."""

from __future__ import annotations

import json

import pytest

from raypipe.serve.openai.tools import ToolCallStream, parse_tool_calls, tool_call_grammar

NAMES = {"get_weather", "add"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def test_well_formed_calls_are_parsed_with_content_before_them():
    content, calls = parse_tool_calls("Let me check.\n" + CALL + "\n" + CALL2 + "\n", NAMES)
    assert content == "Let me check.\n"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert calls[1]["function"]["arguments"] == '{"a": 1, "b": 2}'
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert calls[0]["id"] != calls[1]["id"]
    assert parse_tool_calls(CALL, NAMES)[0] is None  # no content at all


@pytest.mark.parametrize("text", [
    "no calls here",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # truncated
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',  # not JSON
    '<tool_call>\n{"name": "delete_all", "arguments": {}}\n</tool_call>',  # unknown function
    '<tool_call>\n{"name": "add", "arguments": "1, 2"}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "add"}\n</tool_call>',  # no arguments
    '<tool_call>\n["add", {}]\n</tool_call>',
    CALL + " and then some text",  # text after the calls
    CALL + "\nbetween\n" + CALL2,  # text between calls
])
def test_malformed_calls_stay_content(text):
    assert parse_tool_calls(text, NAMES) is None
    stream = ToolCallStream(NAMES)
    sent = "".join(stream.feed(text[i:i + 3]) for i in range(0, len(text), 3))
    rest, calls = stream.finish()
    assert sent + rest == text and calls == []


def test_stream_holds_back_only_what_may_be_a_call():
    text = "Sure <tool <b>" + CALL
    stream = ToolCallStream(NAMES)
    sent = [stream.feed(ch) for ch in text]
    assert "".join(sent) == "Sure <tool <b>"  # a '<tool' that did not become '<tool_call>' is released
    assert sent[len("Sure <tool") - 1] == "" and sent[len("Sure <tool")] == "<tool "  # ... once it cannot be one
    rest, calls = stream.finish()
    assert rest == "" and [c["function"]["name"] for c in calls] == ["get_weather"]


def test_grammar_accepts_exactly_the_calls_of_the_given_tools(tiny_ckpt):
    import llguidance.hf
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_ckpt)
    tokenizer = llguidance.hf.from_tokenizer(hf)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"], "additionalProperties": False}

    def accepts(grammar: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        return bool(matcher.consume_tokens(hf.encode(text, add_special_tokens=False))) and matcher.is_accepting()

    one = tool_call_grammar({"add": schema}, parallel=False)
    several = tool_call_grammar({"add": schema, "get_weather": {"type": "object"}}, parallel=True)
    assert accepts(one, CALL2) and not accepts(one, CALL2 + "\n" + CALL2)
    assert not accepts(one, CALL2.replace('"b": 2', '"b": "2"'))  # arguments follow the schema
    assert not accepts(one, CALL)
    assert accepts(several, CALL2 + "\n" + CALL + "\n" + CALL2)


def test_tool_strings_in_the_template_stay_plain_text(tiny_ckpt):
    from transformers import AutoTokenizer

    from raypipe.models.prompt import chat_template_ids

    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def render(text: str) -> tuple[list[int], list, list]:
        tools = [{"type": "function", "function": {"name": "add", "description": f"adds {text}",
                                                   "parameters": {"type": "object", "properties": {text: {}}}}}]
        messages = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"type": "function", "function": {"name": "add", "arguments": {"a": f"q\"{text}"}}}]},
                    {"role": "tool", "content": "5", "tool_call_id": "call_1"}]
        return chat_template_ids(tokenizer, messages, tools), tools, messages

    ids, tools, messages = render("x")
    rendered = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert ids == tokenizer.encode(rendered, add_special_tokens=False)  # nothing to keep apart: the same ids
    forged, _, _ = render("<|im_end|>")
    assert forged.count(im_end) == ids.count(im_end) == 4  # system (tools), user, assistant, tool turns
    assert '\\"<|im_end|>' in tokenizer.decode(forged)  # JSON-escaped as the template writes it


def test_forced_call_arguments_may_use_local_references(tiny_ckpt):
    """A tool's parameters with `$defs` and a recursive `#` reference: the forced-call grammar resolves them
    against that tool's schema, not the call body's root (it failed to compile when the schema was nested)."""
    import llguidance.hf
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_ckpt)
    tokenizer = llguidance.hf.from_tokenizer(hf)
    point = {"type": "object", "properties": {"x": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
             "required": ["x"], "additionalProperties": False}
    schema = {"type": "object", "$defs": {"point": point}, "properties": {"p": {"$ref": "#/$defs/point"}},
              "required": ["p"], "additionalProperties": False}
    grammar = tool_call_grammar({"add": {"type": "object"}, "walk": schema}, parallel=True)

    def accepts(arguments: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        assert not matcher.get_error()
        text = f'<tool_call>\n{{"name": "walk", "arguments": {arguments}}}\n</tool_call>'
        return bool(matcher.consume_tokens(hf.encode(text, add_special_tokens=False))) and matcher.is_accepting()

    assert accepts('{"p": {"x": 1}}')
    assert accepts('{"p": {"x": 1, "next": {"p": {"x": 2, "next": null}}}}')  # "#" is walk's own root
    assert not accepts('{"p": {"y": 1}}')
    assert not accepts('{"p": {"x": 1, "next": {"x": 2}}}')
