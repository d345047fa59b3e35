"""What a request is inside the engine (`Sequence`) and what callers get back (deltas, outputs)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from raypipe.sampling import SamplingParams

@dataclasses.dataclass(slots=True)
class RequestDelta:
    """New since the previous delta of the same request; `finish_reason` is set on the last one only."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None


@dataclasses.dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_image_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:  # image tokens included (OpenAI usage counts them)
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def add(self, delta: RequestDelta) -> None:
        self.token_ids.extend(delta.token_ids)
        self.text += delta.text
        self.finish_reason = delta.finish_reason


@dataclasses.dataclass(slots=True, eq=False)
class Sequence:
    """One request's engine-side state. Only the engine thread mutates it after submission."""

    request_id: str
    prompt_ids: list[int]
    positions: torch.Tensor  # (3, prompt_len) mrope positions
    rope_delta: int  # decode position of cache index i is i + rope_delta (all three axes)
    image_embeds: torch.Tensor | None  # (num_image_tokens, hidden), rows in prompt order
    params: SamplingParams
    deliver: Callable[[object], None]  # hands a RequestDelta or an exception to the caller's loop
    generator: torch.Generator | None = None
    output_ids: list[int] = dataclasses.field(default_factory=list)
    row: int | None = None  # KV cache row while running
    finish_reason: str | None = None
    # Incremental text state (see output.py).
    text: str = ""
    checked_chars: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def cache_len(self) -> int:
        """Tokens whose K/V are cached: the prompt plus every output token but the newest."""
        return self.prompt_len + max(len(self.output_ids) - 1, 0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
