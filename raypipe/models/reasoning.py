"""Reasoning output: a chat answer's thinking block told apart from its content, as vLLM's `qwen3`
reasoning parser does for Qwen3 / Qwen3.5.

Whether an answer starts thinking is the family's to say (`ModelFamily.thinks`). Qwen3.5's chat template opens the block in the prompt (`<think>\\n`), so the model writes its reasoning,
`</think>`, then the answer; with `enable_thinking` false the prompt holds an empty, closed block and
everything generated is the answer. The rule (vLLM's `Qwen3ReasoningParser`, and its serving layer's
check that the prompt already ended the reasoning), whole and streamed alike:

- thinking off: all content;
- the first `<think>` the model writes before `</think>` is dropped, the tag alone (older templates
  have the model open the block itself). vLLM's whole-reply parser also drops what came before the
  tag, while its stream has sent that text already; here both keep it, so a whole reply and the
  same reply streamed say the same;
- text before the first `</think>` is reasoning, after it content, each None when empty;
- no `</think>` at all: the answer was cut short while thinking, so all of it is reasoning.

Streamed, every delta before `</think>` is reasoning and every delta after it content (vLLM's
`extract_reasoning_streaming`); `ReasoningStream` holds back only a tail that may be the start of a tag,
so the concatenated deltas equal the whole answer's split. Not taken from vLLM: its implicit end of
reasoning at a `<tool_call>` followed by `<function=` (Qwen3.5's XML call format); raypipe's templates
ask for Qwen2.5's JSON calls, which are parsed from the content after the block (`tools.py`).

Output constraints (`response_format`, `structured_outputs`, `guided_*`, forced tool calls) apply to
the answer after the thinking block, as vLLM applies them once its reasoning parser saw the block end
(`constrain_answer`): the grammar lets the model reason freely, requires `</think>`, then the
constraint (`raypipe.decode.grammar_worker.after_thinking`). Cut by `max_tokens` inside the block,
the answer is all reasoning (finish_reason "length", no content), as in vLLM.
"""

from __future__ import annotations

import dataclasses

from raypipe.inputs.structured import StructuredOutput

PARSERS = ("qwen3",)  # `ModelFamily.reasoning` values with a parser here (whether an answer thinks: `thinks`)
OPEN, CLOSE = "<think>", "</think>"


def constrain_answer(structured: StructuredOutput | None, is_thinking: bool) -> StructuredOutput | None:
    """The request's output constraint, applied after the thinking block when the answer starts thinking."""
    if structured is None or not is_thinking:
        return structured
    return dataclasses.replace(structured, thinking_end=CLOSE)


def split_reasoning(text: str, is_thinking: bool) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer by the rule above; None where empty."""
    if not is_thinking:
        return None, text or None
    before, opened, after = text.partition(OPEN)
    if opened and CLOSE not in before:
        text = before + after
    reasoning, closed, content = text.partition(CLOSE)
    if not closed:
        return text or None, None
    return reasoning or None, content or None


class ReasoningStream:
    """Streamed text split into (reasoning, content) pieces to send now; `finish` flushes what was held.

    A tail that may be the start of `<think>` or `</think>` is held until the next piece tells."""

    def __init__(self, is_thinking: bool):
        self.in_reasoning = is_thinking
        self.held = ""
        self.dropped_open = False  # a model-written `<think>` is dropped once

    def feed(self, piece: str) -> tuple[str, str]:
        if not self.in_reasoning:
            return "", piece
        text = self.held + piece
        if not self.dropped_open:
            opened, closed = text.find(OPEN), text.find(CLOSE)
            if opened >= 0 and not 0 <= closed < opened:
                text, self.dropped_open = text[:opened] + text[opened + len(OPEN):], True
        reasoning, closed, content = text.partition(CLOSE)
        if closed:
            self.in_reasoning, self.held = False, ""
            return reasoning, content
        keep = _partial_tag_length(text)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        return (held, "") if self.in_reasoning else ("", held)


def _partial_tag_length(text: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a tag."""
    return max((n for n in range(1, len(CLOSE)) for tag in (OPEN, CLOSE) if text.endswith(tag[:n])), default=0)
