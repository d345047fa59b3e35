"""Grammar-constrained decoding: compile a request's `StructuredOutput` once, mask its rows every step.

Engine: llguidance (a 3 MB abi3 wheel without dependencies). Measured on this engine's tokenizers
(`python -m raypipe.bench.grammar_engines`): a JSON schema compiles in ~1 ms on a 64k-token
Qwen2-shaped BPE where outlines-core's DFA index took ~135 ms (and grows with the schema and the
vocabulary), and a mask fill costs ~0.01-0.1 ms per row and step (outlines-core ~0.01 ms; up to
~0.15 ms per row on the 64k vocabulary when every step reaches a new lexer state), small against a
decode step of a real model. llguidance also takes what outlines-core
cannot (Lark grammars, recursive schemas), and its matcher can be copied, which makes the compile
cache cheap. xgrammar was not taken: it needs triton and apache-tvm-ffi for the same job. It can
serialize a compiled grammar (`CompiledGrammar.serialize_json`), which would spare the decoder the
rebuild described below; llguidance cannot (neither `LLMatcher` nor `LLTokenizer` pickles, and
there is no serialized form), but its rebuild costs ~1 ms for a normal schema, against the Lark
dialect (tool calls use `%json`) and the transformers-checked masks an engine swap would give up.

JSON is compiled compact (no free whitespace, separators "," and ":"): with flexible whitespace a
weak model can emit whitespace until `max_tokens`. A finished grammar allows only EOS, a stopped or
failed matcher too, so a row that overran its stop inside a K-step round keeps a valid mask.

A constraint is a stranger's program, so `GrammarCompiler.matcher` admits it in three steps, each
result cached per distinct constraint (a refusal too, so resending a bomb costs a dict lookup):
static limits (`raypipe.inputs.structured_limits`: bytes, nesting, `$ref` chains, Lark rules), a
trial compile in a warm, killable worker process (`grammar_pool`, `grammar_worker`: a segfault or an
overrun there is this request's 400, never the decoder's crash), then the decoder's own matcher
built from the grammar text the worker returned (llguidance cannot serialize a compiled matcher)
on a thread with four times the worker's stack, so what compiled there cannot overflow here. Each
request gets a deep copy of the cached matcher. Two requests with the same new constraint share one
compile. `LLMEngine.generate` calls it from a worker thread, never the engine thread.

Per step, `GrammarRows` fills the bitmask of the constrained rows only, applies it to their logits
as one vectorized `where`, and after sampling advances each row's matcher by its token. That needs
the sampled ids of those rows on the host every step; on the CPU they are there anyway, on CUDA it is
one small sync per step in rounds that hold a constrained row. A matcher that enters an error state
(llguidance's limits hit mid-output) keeps allowing only EOS; the engine sees `is_error()` and ends
that request with an error (`grammar_failed`), never with "stop". A sampled token whose logit was -inf (a token the
constraint forbids) raises `MaskedTokenSampled`.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import threading

import llguidance
import llguidance.hf
import llguidance.numpy  # not llguidance.torch: importing it runs a torch.compile decorator (~4 s per process start)
import torch

from raypipe.decode.grammar_pool import CompileRefused, CompilerPool, WorkerSetup
from raypipe.decode.grammar_worker import readable_error
from raypipe.errors import InvalidInput
from raypipe.inputs.structured import StructuredOutput
from raypipe.inputs.structured_limits import check_limits

CACHE_SIZE = 256  # distinct constraints (compiled matchers and refusals) kept
STACK_RATIO = 4  # the decoder builds a matcher with this many times the worker's stack


@dataclasses.dataclass(frozen=True, slots=True)
class GrammarLimits:
    """`EngineConfig`'s grammar_* values (documented there)."""

    timeout_s: float
    workers: int
    memory_bytes: int
    stack_bytes: int
    max_bytes: int
    max_depth: int
    max_ref_depth: int
    max_rules: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Refusal:
    """A cached refusal; the `InvalidInput` is rebuilt per request so it names that request's field."""

    message: str
    code: str
    part: int | None = None  # index into `StructuredOutput.parts` of the embedded constraint at fault

    def error(self, structured: StructuredOutput) -> InvalidInput:
        item = structured.parts[self.part].field if self.part is not None else structured.field
        return InvalidInput(self.message, item=item, code=self.code)


class MaskedTokenSampled(AssertionError):
    """A constrained row sampled a token its mask had at -inf: a bug in the sampler, never the caller's fault."""


class GrammarCompiler:
    """Compiled constraints for one tokenizer; thread-safe. `close()` stops its worker processes."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], limits: GrammarLimits):
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.limits = limits
        self.pool = CompilerPool(WorkerSetup(_tokenizer_json(tokenizer), vocab_size, tuple(eos_token_ids),
                                             limits.memory_bytes, limits.stack_bytes),
                                 workers=limits.workers, timeout_s=limits.timeout_s)
        # A compiled matcher or a `_Refusal` per constraint (least recently used first).
        self._cache: dict[StructuredOutput, llguidance.LLMatcher | _Refusal] = {}
        self._pending: dict[StructuredOutput, concurrent.futures.Future] = {}  # compiles under way
        self._lock = threading.Lock()
        self.compiles = 0  # constraints compiled (trial + build), for tests and stats

    def matcher(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for `structured`; `InvalidInput` naming the problem and the request's field if refused."""
        with self._lock:
            compiled = self._cache.pop(structured, None)
            if compiled is not None:
                self._cache[structured] = compiled  # now the most recently used
                pending, owner = None, False
            else:
                pending = self._pending.get(structured)
                owner = pending is None
                if owner:
                    pending = self._pending[structured] = concurrent.futures.Future()
        if pending is not None:
            if owner:
                try:
                    compiled = self._compile(structured)
                except BaseException as exc:  # not the constraint's fault (e.g. every compiler busy): not cached
                    with self._lock:
                        del self._pending[structured]
                    pending.set_exception(exc)
                    raise
                with self._lock:
                    self._cache[structured] = compiled
                    while len(self._cache) > CACHE_SIZE:
                        del self._cache[next(iter(self._cache))]
                    del self._pending[structured]
                pending.set_result(compiled)
            else:
                compiled = pending.result()
        if isinstance(compiled, _Refusal):
            raise compiled.error(structured)
        return compiled.deep_copy()

    def close(self) -> None:
        self.pool.close()

    def _compile(self, structured: StructuredOutput) -> llguidance.LLMatcher | _Refusal:
        try:
            check_limits(structured, max_bytes=self.limits.max_bytes, max_depth=self.limits.max_depth,
                         max_ref_depth=self.limits.max_ref_depth, max_rules=self.limits.max_rules)
            grammar = self.pool.compile(structured.kind, constraint_value(structured), structured.thinking_end)
        except InvalidInput as exc:
            return self._blame_part(structured) or _Refusal(exc.reason, exc.code)
        except CompileRefused as exc:
            return self._blame_part(structured) or _Refusal(_readable(exc.reason), exc.code)
        self.compiles += 1
        return self._build(grammar)

    def _blame_part(self, structured: StructuredOutput) -> _Refusal | None:
        """The refusal of the first embedded constraint refused on its own (each is cached like any other)."""
        for index, part in enumerate(structured.parts):
            try:
                self.matcher(part)
            except InvalidInput as exc:
                return _Refusal(exc.reason, exc.code, index)
        return None

    def _build(self, grammar: str) -> llguidance.LLMatcher:
        """The decoder's matcher for grammar text that compiled in a worker (on a thread with more stack)."""
        result: list = []
        stack = self.limits.stack_bytes * STACK_RATIO
        with _STACK_SIZE_LOCK:
            previous = threading.stack_size(stack)
            try:
                thread = threading.Thread(target=lambda: result.append(llguidance.LLMatcher(self.tokenizer, grammar)),
                                          name="raypipe-grammar-build")
                thread.start()
            finally:
                threading.stack_size(previous)
        thread.join()
        matcher = result[0]
        if matcher.is_error():  # it compiled in the worker; only a bug here could make it fail
            raise RuntimeError(f"grammar compiled in the worker but not in the decoder: {readable_error(matcher.get_error())}")
        return matcher


def constraint_value(structured: StructuredOutput):
    """What `grammar_worker.grammar_text` takes beside the kind."""
    return {"json": structured.json, "regex": structured.regex, "grammar": structured.grammar,
            "choice": structured.choice, "json_object": True}[structured.kind]


_STACK_SIZE_LOCK = threading.Lock()  # threading.stack_size is process-wide: set and reset around one start


def _tokenizer_json(tokenizer) -> str:
    """The fast tokenizer serialized as llguidance's `LLTokenizer` reads it (as `llguidance.hf` does)."""
    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


def _readable(reason: str) -> str:
    """llguidance's reason, minus advice about options this API does not expose."""
    if "coerce_one_of" in reason:
        return ("does not compile: its oneOf branches can match the same value, which oneOf forbids; make them "
                "exclusive (e.g. a distinct \"const\" per branch) or use anyOf")
    if reason.startswith(("did not compile", "could not be compiled", "it ")):
        return reason
    return f"does not compile: {reason}"


class GrammarRows:
    """The constrained rows of one sampling batch and their matchers (row order as in the batch)."""

    def __init__(self, rows: list[int], matchers: list[llguidance.LLMatcher], vocab_size: int,
                 device: torch.device):
        self.rows = rows
        self.index = torch.tensor(rows, device=device)
        self.matchers = matchers
        self.vocab_size = vocab_size
        self.bitmask = llguidance.numpy.allocate_token_bitmask(len(rows), vocab_size)
        # Byte value -> its 8 bits as additive biases (0 allowed, -inf forbidden). One gather and one add
        # measured ~10x faster than shifting the words into a bool mask and a masked_fill / where.
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        self.byte_bias = torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf")).to(device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (B, V) float32 with every token the grammar forbids at -inf on the constrained rows (in place)."""
        for i, matcher in enumerate(self.matchers):
            llguidance.numpy.fill_next_token_bitmask(matcher, self.bitmask, i)
        # The copy is done before the next fill: `advance` reads the sampled ids, which waits for it.
        words = torch.from_numpy(self.bitmask).to(logits.device, non_blocking=True)
        byte_values = words.view(torch.uint8).view(-1).long()  # little-endian: byte k holds tokens 8k..8k+7
        bias = self.byte_bias.index_select(0, byte_values).view(len(self.rows), -1)[:, : logits.shape[-1]]
        return logits.index_add_(0, self.index, bias)

    def advance(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """Feed each constrained row's sampled token to its matcher (one host read of those rows).

        `logits`: what the tokens were sampled from (masked); a token it had at -inf raises `MaskedTokenSampled`."""
        chosen = tokens[self.index]
        picked = logits[self.index, chosen]
        read = torch.stack((chosen.to(torch.float64), picked.to(torch.float64))).tolist()
        for row, matcher, token, logit in zip(self.rows, self.matchers, *read):
            if logit == float("-inf"):
                raise MaskedTokenSampled(f"row {row} sampled token {int(token)}, which its constraint forbids")
            if not matcher.is_stopped():  # past EOS inside a round: the row's later tokens are dropped anyway
                matcher.consume_token(int(token))
