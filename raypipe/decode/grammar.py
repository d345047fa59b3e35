"""Grammar-constrained decoding: compile a request's `StructuredOutput` once, mask its rows every step.

Engine: llguidance (a 3 MB abi3 wheel without dependencies). Measured on this engine's tokenizers
(`python -m raypipe.bench.grammar_engines`): a JSON schema compiles in ~1 ms on a 64k-token
Qwen2-shaped BPE where outlines-core's DFA index took ~135 ms (and grows with the schema and the
vocabulary), and a mask fill costs ~0.01-0.1 ms per row and step (outlines-core ~0.01 ms; up to
~0.15 ms per row on the 64k vocabulary when every step reaches a new lexer state), small against a
decode step of a real model. llguidance also takes what outlines-core
cannot (Lark grammars, recursive schemas), and its matcher can be copied, which makes the compile
cache cheap. xgrammar was not taken: it needs triton and apache-tvm-ffi for the same job.

JSON is compiled compact (no free whitespace, separators "," and ":"): with flexible whitespace a
weak model can emit whitespace until `max_tokens`. A finished grammar allows only EOS, a stopped or
failed matcher too, so a row that overran its stop inside a K-step round keeps a valid mask.

Per request, `GrammarCompiler.matcher` deep-copies a cached compiled matcher (compiled once per
distinct constraint, in a thread of its own that the caller waits on for at most `timeout_s`:
`LLMEngine.generate` waits from a worker thread, never the engine thread). llguidance drops the GIL while it
builds a matcher, so a compile that overruns goes on in the background without slowing the engine; its
constraint is then refused at once (code "grammar_too_complex") until it falls out of the cache, so
resending a pathological schema does not start another compile.
Per step, `GrammarRows` fills the bitmask of the constrained rows only, applies it to their logits
as one vectorized `where`, and after sampling advances each row's matcher by its token. That needs
the sampled ids of those rows on the host every step; on the CPU they are there anyway, on CUDA it is
one small sync per step in rounds that hold a constrained row.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import threading

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from raypipe.errors import InvalidInput
from raypipe.inputs.structured import StructuredOutput

CACHE_SIZE = 256  # distinct compiled constraints kept
TOO_COMPLEX = object()  # cached in place of a matcher: this constraint's compile overran the time limit
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def grammar_text(structured: StructuredOutput) -> str:
    """llguidance's grammar for a constraint (not yet checked)."""
    matcher = llguidance.LLMatcher
    kind = structured.kind
    if kind == "json":
        return matcher.grammar_from_json_schema(structured.json, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return matcher.grammar_from_regex(structured.regex)
    if kind == "choice":
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in structured.choice))
    return matcher.grammar_from_lark(structured.grammar)


def _item(structured: StructuredOutput) -> str:
    """The request field an error about `structured` names."""
    return f"sampling_params.structured.{structured.kind}"


class GrammarCompiler:
    """Compiled constraints for one tokenizer; thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], *, timeout_s: float):
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.timeout_s = timeout_s
        # A compiled matcher, or TOO_COMPLEX for a constraint whose compile overran `timeout_s`.
        self._cache: collections.OrderedDict[StructuredOutput, llguidance.LLMatcher | object] = \
            collections.OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for `structured`; `InvalidInput` naming the problem if it does not compile in time."""
        with self._lock:
            compiled = self._cache.get(structured)
            if compiled is not None:
                self._cache.move_to_end(structured)
        if compiled is TOO_COMPLEX:
            raise self._too_complex(structured)
        if compiled is not None:
            return compiled.deep_copy()
        compiled = self._compile_within_limit(structured)
        with self._lock:
            self._cache[structured] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled.deep_copy()

    def _compile_within_limit(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        """`_compile` in a thread of its own (an overrun one must not hold a pool worker), waited on.

        Not a daemon thread: one still inside llguidance when the interpreter exits segfaults it; llguidance's
        fuel limits bound how long exit waits for it."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def compile_into_future() -> None:
            try:
                future.set_result(self._compile(structured))
            except BaseException as exc:  # handed to the waiting caller
                future.set_exception(exc)

        threading.Thread(target=compile_into_future, name="raypipe-grammar-compile").start()
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            with self._lock:
                self._cache[structured] = TOO_COMPLEX
            raise self._too_complex(structured) from None

    def _too_complex(self, structured: StructuredOutput) -> InvalidInput:
        return InvalidInput(f"{structured.kind} did not compile within {self.timeout_s:g} s; simplify it",
                            item=_item(structured), code="grammar_too_complex")

    def _compile(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        item = _item(structured)
        try:
            grammar = grammar_text(structured)
        except (ValueError, RuntimeError) as exc:  # a schema llguidance cannot read at all
            raise InvalidInput(f"{structured.kind} does not compile: {exc}", item=item,
                               code="invalid_structured_output") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise InvalidInput(f"{structured.kind} does not compile: {error.strip()}", item=item,
                               code="invalid_structured_output")
        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise InvalidInput(f"{structured.kind} does not compile: {matcher.get_error()}", item=item,
                               code="invalid_structured_output")
        return matcher


class GrammarRows:
    """The constrained rows of one sampling batch and their matchers (row order as in the batch)."""

    def __init__(self, rows: list[int], matchers: list[llguidance.LLMatcher], vocab_size: int,
                 device: torch.device):
        self.rows = rows
        self.index = torch.tensor(rows, device=device)
        self.matchers = matchers
        self.vocab_size = vocab_size
        self.bitmask = llguidance.torch.allocate_token_bitmask(len(rows), vocab_size)
        # Byte value -> its 8 bits as additive biases (0 allowed, -inf forbidden). One gather and one add
        # measured ~10x faster than shifting the words into a bool mask and a masked_fill / where.
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        self.byte_bias = torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf")).to(device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (B, V) float32 with every token the grammar forbids at -inf on the constrained rows (in place)."""
        for i, matcher in enumerate(self.matchers):
            llguidance.torch.fill_next_token_bitmask(matcher, self.bitmask, i)
        # The copy is done before the next fill: `advance` reads the sampled ids, which waits for it.
        words = self.bitmask.to(logits.device, non_blocking=True)
        byte_values = words.view(torch.uint8).view(-1).long()  # little-endian: byte k holds tokens 8k..8k+7
        bias = self.byte_bias.index_select(0, byte_values).view(len(self.rows), -1)[:, : logits.shape[-1]]
        return logits.index_add_(0, self.index, bias)

    def advance(self, tokens: torch.Tensor) -> None:
        """Feed each constrained row's sampled token to its matcher (one host read of those rows)."""
        for matcher, token in zip(self.matchers, tokens[self.index].tolist()):
            if not matcher.is_stopped():  # past EOS inside a round: the row's later tokens are dropped anyway
                matcher.consume_token(token)
