"""Reasoning output: a chat answer's thinking block told apart from its content, as vLLM's `qwen3`
reasoning parser does for Qwen3 / Qwen3.5.

Whether an answer starts thinking is the family's to say (`ModelFamily.thinks`). Qwen3.5's chat template opens the block in the prompt (`<think>\\n`), so the model writes its reasoning,
`</think>`, then the answer; with `enable_thinking` false the prompt holds an empty, closed block and
everything generated is the answer. The rule (vLLM's `Qwen3ReasoningParser.extract_reasoning`, and its
serving layer's check that the prompt already ended the reasoning):

- thinking off: all content;
- a `<think>` the model writes itself is dropped with whatever came before it (older templates);
- text before the first `</think>` is reasoning, after it content, each None when empty;
- no `</think>` at all: the answer was cut short while thinking, so all of it is reasoning.

Streamed, every delta before `</think>` is reasoning and every delta after it content (vLLM's
`extract_reasoning_streaming`); `ReasoningStream` holds back only a tail that may be the start of a tag,
so the concatenated deltas equal the whole answer's split. Not taken from vLLM: its implicit end of
reasoning at a `<tool_call>` followed by `<function=` (Qwen3.5's XML call format); raypipe's templates
ask for Qwen2.5's JSON calls, which are parsed from the content after the block (`tools.py`).

Output constraints (`response_format`, `structured_outputs`, `guided_*`, forced tool calls) constrain
the generation from its first token, which with thinking on is the reasoning: such requests are
refused (`check_constraint`) and work with thinking off.
"""

from __future__ import annotations

from raypipe.errors import InvalidInput

PARSERS = ("qwen3",)  # `ModelFamily.reasoning` values with a parser here (whether an answer thinks: `thinks`)
OPEN, CLOSE = "<think>", "</think>"


def check_constraint(is_thinking: bool, constrained_by: str | None) -> None:
    """Refuse an output constraint (named by the request field that set it) on an answer that starts thinking."""
    if is_thinking and constrained_by is not None:
        raise InvalidInput(f"{constrained_by} would constrain this model's reasoning, which comes first: send "
                           'chat_template_kwargs {"enable_thinking": false} with it', item=constrained_by,
                           code="constraint_with_thinking")


def split_reasoning(text: str, is_thinking: bool) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer by the rule above; None where empty."""
    if not is_thinking:
        return None, text or None
    before, opened, after = text.partition(OPEN)
    text = after if opened else before
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
                text, self.dropped_open = text[opened + len(OPEN):], True
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
