"""`SamplingParams`: how one request wants its tokens chosen and when it wants them to stop.

Validated on construction so that a nonsense value fails the request that carries it, with an
`InvalidInput` naming the field, before any work is queued.
"""

from __future__ import annotations

import dataclasses
import math

from raypipe.errors import InvalidInput

MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1


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

    def __post_init__(self):
        self.max_tokens = _int(self.max_tokens, "max_tokens", minimum=1)
        self.temperature = _float(self.temperature, "temperature")
        if self.temperature < 0:
            _fail("temperature", f"must be >= 0, got {self.temperature}")
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
