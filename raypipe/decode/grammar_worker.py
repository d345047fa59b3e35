"""The grammar compiler's child process: every llguidance call on a user's constraint runs here first.

llguidance 1.9.1 segfaults on some inputs (a `$ref` chain ~1,000 deep, ~3,000 chained Lark rules) and
a compile may run for seconds inside native code, which no Python thread can interrupt. So the
decoder never compiles a constraint it has not seen succeed here: this process (started by
`raypipe.decode.grammar_pool`, kept warm, killed and replaced on a timeout or a crash) turns a
constraint into llguidance's grammar text, trial-compiles a matcher under a memory limit
(RLIMIT_AS) and on a thread with a quarter of the stack the decoder's own build gets, walks its
forced prefix, and answers with the grammar text or the reason it is refused. A compiled matcher
cannot cross a process boundary (llguidance has no serialized form of one), so the decoder then
builds its own from the text, once per distinct constraint.

Run as a script with `python -I` (not `-m raypipe...`): it imports only the standard library and
llguidance, so it starts in ~0.1 s and cannot drag torch or transformers in. Protocol: one JSON
object per line on stdin/stdout; the first stdin line sets the tokenizer and limits.
"""

from __future__ import annotations

import json
import re
import resource
import sys
import threading

import llguidance

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
FORCED_PREFIX_TOKENS = 256  # forced tokens walked at admission (a dead end right after them is refused here)


# `format: date-time` / `date` as patterns that Python's `datetime.fromisoformat` and pydantic's `datetime`
# accept: llguidance's own formats allow second 60 (RFC 3339 leap seconds), February 29 of any year,
# year 0000 and lower-case "t"/"z", which both reject. Here: years 0001-9999, days per month with
# February 29 in leap years only, seconds 00-59, at most 6 fraction digits, "Z" or an offset.
_YEAR = "(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         f"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)")
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
FORMAT_PATTERNS = {"date-time": f"^{_DATE}T{_TIME}$", "date": f"^{_DATE}$"}


def with_format_patterns(schema):
    """`schema` with each `format` in FORMAT_PATTERNS replaced by its pattern (where no pattern is set)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("format") in FORMAT_PATTERNS and "pattern" not in node:
                node["pattern"] = FORMAT_PATTERNS[node.pop("format")]
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return schema


def grammar_text(kind: str, value) -> str:
    """llguidance's grammar for a constraint of `kind` (`StructuredOutput.kind`) and its value (not yet checked)."""
    matcher = llguidance.LLMatcher
    if kind == "json":
        return matcher.grammar_from_json_schema(with_format_patterns(json.loads(value)), defaults=JSON_OPTIONS)
    if kind == "json_object":
        return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return matcher.grammar_from_regex(value)
    if kind == "choice":
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    return matcher.grammar_from_lark(value)


def after_thinking(grammar: str, end: str) -> str:
    """`grammar` (llguidance's text of one constraint) applied after a thinking block closed by the token `end`.

    The reasoning is free text that never spells `end` out in characters, then the `end` token itself
    (in the thinking presets and Qwen3.5's tokenizer `</think>` is an added token, which llguidance
    reads as a special token: free text cannot produce it), then the constraint, right after the tag
    as vLLM applies it once the reasoning has ended (no whitespace in between: the answer is the
    constrained text exactly). The constraint is a named sub-grammar with a lexer of its own; until
    the tag, EOS is not allowed, so an answer cut by `max_tokens` inside the block is all reasoning."""
    # llguidance's text is a serialized `TopLevelGrammar` (JSON) or, from `grammar_from_lark`, the Lark text itself.
    grammars = json.loads(grammar)["grammars"] if grammar.startswith("{") else [{"lark_grammar": grammar}]
    grammars[0] = {**grammars[0], "name": "answer"}
    spelled = re.escape(end).replace("/", "\\/")
    wrapper = (f"start: REASONING {end} @answer\n"
               f"REASONING: /(?s:.*)/ & ~/(?s:.*){spelled}(?s:.*)/")
    return json.dumps({"grammars": [{"lark_grammar": wrapper}, *grammars]})


def readable_error(error: str) -> str:
    """llguidance's error on one line, without the parser state dump it appends (at most 500 characters)."""
    text = " ".join(line.strip() for line in error.split("<state>", 1)[0].splitlines() if line.strip())
    return text if len(text) <= 500 else text[:500] + "..."


def trial_compile(tokenizer: llguidance.LLTokenizer, kind: str, value, thinking_end: str | None = None) -> dict:
    """{"grammar": text} if the constraint compiles and its forced prefix leads somewhere, else {"error": why}.

    With `thinking_end` the text is `after_thinking`'s, checked as a whole after the constraint's own checks."""
    try:
        grammar = grammar_text(kind, value)
    except (ValueError, RuntimeError) as exc:  # a schema llguidance cannot read at all
        return {"error": readable_error(str(exc))}
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    if matcher.is_error():
        return {"error": readable_error(matcher.get_error())}
    # A constraint that fails right after its forced tokens (e.g. a recursive $ref with no base case
    # after "{") would otherwise only fail mid-generation.
    forced = matcher.compute_ff_tokens()[:FORCED_PREFIX_TOKENS]
    if forced:
        matcher.consume_tokens(forced)
        if matcher.is_error():
            text = tokenizer.decode_str(forced)
            text = text if len(text) <= 40 else text[:40] + "..."
            return {"error": f"it allows no output after its forced prefix {text!r}: {readable_error(matcher.get_error())}",
                    "code": "invalid_grammar"}
    if thinking_end is not None:
        grammar = after_thinking(grammar, thinking_end)
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        if matcher.is_error():
            return {"error": f"it cannot follow the thinking block: {readable_error(matcher.get_error())}"}
    return {"grammar": grammar}


def serve(stdin, stdout) -> None:
    setup = json.loads(stdin.readline())
    resource.setrlimit(resource.RLIMIT_AS, (setup["memory_bytes"], setup["memory_bytes"]))
    tokenizer = llguidance.LLTokenizer(setup["tokenizer"], n_vocab=setup["n_vocab"], eos_token=setup["eos"])
    threading.stack_size(setup["stack_bytes"])
    stdout.write('{"ready": true}\n')
    stdout.flush()
    for line in stdin:  # EOF: the decoder went away
        request = json.loads(line)
        answer: dict = {}

        def run() -> None:
            try:
                answer.update(trial_compile(tokenizer, request["kind"], request["value"], request.get("thinking_end")))
            except MemoryError:
                answer.update(error="it needs more memory than the compiler may use", code="grammar_too_complex")

        worker = threading.Thread(target=run)  # with `stack_bytes` of stack (set above)
        worker.start()
        worker.join()
        stdout.write(json.dumps(answer) + "\n")
        stdout.flush()


if __name__ == "__main__":
    serve(sys.stdin, sys.stdout)
