"""`SamplingParams`: how one request wants its tokens chosen and when it wants them to stop.

Validated on construction so that a nonsense value fails the request that carries it, with an
`InvalidInput` naming the field, before any work is queued.
"""

from __future__ import annotations

import dataclasses
import math

from raypipe.errors import InvalidInput
from raypipe.inputs.structured import StructuredOutput

MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # top log-probabilities per token (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 300  # entries in logit_bias (OpenAI's limit)
MAX_BAD_WORDS = 100  # words per request (vLLM's `bad_words`); each is up to two token sequences
MAX_BAD_WORD_TOKENS = 32  # tokens per banned sequence: every step compares each row's last tokens with it
GREEDY_TEMPERATURE = 1e-5  # temperatures below this are greedy: logits / T would overflow float32


@dataclasses.dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None  # own torch.Generator: same tokens whatever else is in the batch
    stop: list[str] | None = None  # text stops; the returned text ends before the stop string
    stop_token_ids: list[int] | None = None  # honoured even with ignore_eos
    ignore_eos: bool = False
    min_p: float = 0.0  # drop tokens below min_p x the best token's probability; 0 = off
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or output (CTRL); 1 = off
    presence_penalty: float = 0.0  # subtracted once from tokens already in the output (OpenAI); 0 = off
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output (OpenAI); 0 = off
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before anything else
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens are out
    logprobs: int | None = None  # None: none; 0: the sampled token's log-probability; k: also the top k
    # Per prompt token after the first, its log-probability given the tokens before it (vLLM's field; with the
    # top k): None: none. Such a prompt is computed whole: it takes nothing from the prefix cache.
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None  # JSON schema / regex / choice / grammar the output must follow
    allowed_token_ids: list[int] | None = None  # sample only among these ids (vLLM's field); None = all
    skip_special_tokens: bool = True  # False: special tokens' text stays in the output text (vLLM's field)
    include_stop_str_in_output: bool = False  # True: the text ends after the stop string, not before it
    # Banned token sequences (vLLM's `bad_words`, tokenized): a sequence's last token is masked at a step where
    # the output so far ends with its other tokens (a one-token sequence: at every step).
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self):
        self.max_tokens = _int(self.max_tokens, "max_tokens", minimum=1)
        self.temperature = _float(self.temperature, "temperature")
        if self.temperature < 0:
            _fail("temperature", f"must be >= 0, got {self.temperature}")
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0  # a tiny T is greedy in the limit; dividing by it gives inf/NaN
        self.top_p = _float(self.top_p, "top_p")
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", f"must be in (0, 1], got {self.top_p}")
        self.top_k = _int(self.top_k, "top_k", minimum=0)
        if self.seed is not None:
            self.seed = _int(self.seed, "seed", minimum=0)
            if self.seed > MAX_SEED:
                _fail("seed", f"must be < 2**63, got {self.seed}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
                _fail("stop", "must be a non-empty string or a list of non-empty strings")
            if len(self.stop) > MAX_STOP_STRINGS:
                _fail("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
            self.stop = list(self.stop)
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                _fail("stop_token_ids", "must be a list of token ids")
            self.stop_token_ids = [_int(t, "stop_token_ids", minimum=0) for t in self.stop_token_ids]
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", f"must be a boolean, got {type(self.ignore_eos).__name__}")
        self.min_p = _float(self.min_p, "min_p")
        if not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", f"must be in [0, 1], got {self.min_p}")
        self.repetition_penalty = _float(self.repetition_penalty, "repetition_penalty")
        if self.repetition_penalty <= 0:
            _fail("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(getattr(self, name), name)
            if not -2.0 <= value <= 2.0:
                _fail(name, f"must be in [-2, 2], got {value}")
            setattr(self, name, value)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                _fail("logit_bias", "must be a mapping of token id to bias")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                _fail("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
            bias = {}
            for token, value in self.logit_bias.items():
                if isinstance(token, str) and token.isdigit():  # JSON object keys are strings
                    token = int(token)
                value = _float(value, "logit_bias")
                if not -100.0 <= value <= 100.0:
                    _fail("logit_bias", f"biases must be in [-100, 100], got {value}")
                bias[_int(token, "logit_bias", minimum=0)] = value
            self.logit_bias = bias or None
        self.min_tokens = _int(self.min_tokens, "min_tokens", minimum=0)
        if self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, _int(getattr(self, name), name, minimum=0))
                if getattr(self, name) > MAX_LOGPROBS:
                    _fail(name, f"must be <= {MAX_LOGPROBS}, got {getattr(self, name)}")
        if self.structured is not None:
            self.structured = StructuredOutput.of(self.structured)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                _fail("allowed_token_ids", "must be a non-empty list of token ids")
            self.allowed_token_ids = sorted({_int(t, "allowed_token_ids", minimum=0) for t in self.allowed_token_ids})
        if self.bad_words_token_ids is not None:
            self.bad_words_token_ids = _bad_words(self.bad_words_token_ids) or None
        for name in ("skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, f"must be a boolean, got {type(getattr(self, name)).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _bad_words(sequences) -> list[list[int]]:
    if not isinstance(sequences, (list, tuple)) or len(sequences) > 2 * MAX_BAD_WORDS:
        _fail("bad_words_token_ids", f"must be a list of at most {2 * MAX_BAD_WORDS} token id lists")
    out = []
    for ids in sequences:
        if not isinstance(ids, (list, tuple)) or not 1 <= len(ids) <= MAX_BAD_WORD_TOKENS:
            _fail("bad_words_token_ids", f"each banned sequence is a list of 1 to {MAX_BAD_WORD_TOKENS} token ids")
        out.append([_int(t, "bad_words_token_ids", minimum=0) for t in ids])
    return out


def _fail(field: str, message: str):
    raise InvalidInput(message, item=f"sampling_params.{field}", code="invalid_sampling_params")


def _int(value, field: str, *, minimum: int) -> int:
    # bool is an int subclass; `max_tokens=True` is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            _fail(field, f"must be an integer, got {value!r}")
    if value < minimum:
        _fail(field, f"must be >= {minimum}, got {value}")
    return value


def _float(value, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(field, f"must be a number, got {value!r}")
    if not math.isfinite(value):
        _fail(field, f"must be finite, got {value}")
    return float(value)
