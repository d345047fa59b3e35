"""Token budgets: a worker's shard packed into tower forwards of a few fixed sizes.

A forward whose shapes repeat can be compiled (CPU) or captured as a CUDA graph (GPU) once and then
replayed; shard-sized forwards never repeat. So a worker packs its shard's units, smallest first, into
forwards of power-of-two token budgets between `min_tokens` and `max_tokens` (tokens: the sequence
length a unit takes in the tower, `VisionTower.budget_tokens`), pads each forward to its budget, and
cuts every unit's embedding back out; a unit larger than `max_tokens` runs eagerly alone. This is
inside one worker's shard: the coordinator's balancer still balances the units' real cost.

`TokenBudgets` is the one configuration of it (`ModelConfig.encoder_budgets`): `enabled` is the one
switch that turns packing, compiled forwards and CUDA graphs off together (by default: on with CUDA only).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True, slots=True)
class TokenBudgets:
    # The one switch. False: each shard runs eagerly, with no packing, compiled forwards or graphs. None: on
    # with CUDA (graphs), off on CPU, where padding to a budget cost more than it saved (`raypipe bench encode
    # --budgets`, small preset: packed 0.75x eager's speed at 1 image per request, 1.11x at 8; docs/python.md, "Token budgets").
    enabled: bool | None = None
    min_tokens: int = 64  # the smallest budget (tokens through the tower; Qwen2.5-VL: patches)
    max_tokens: int = 8192  # the largest: units above it run eagerly, one forward each
    # torch.compile per budget on CPU. Off: measured on the tiny and small presets, it did not pay
    # (`raypipe bench encode --budgets`; docs/python.md). CUDA graphs on GPU need no switch but `enabled`.
    compile_cpu: bool = False

    def __post_init__(self):
        for name in ("min_tokens", "max_tokens"):
            value = getattr(self, name)
            if value < 4 or value & (value - 1):
                raise ValueError(f"encoder_budgets.{name} must be a power of two >= 4, got {value}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"encoder_budgets.min_tokens ({self.min_tokens}) > max_tokens ({self.max_tokens})")

    def on_for(self, device: torch.device) -> bool:
        """Whether a worker on `device` packs its shards."""
        return self.enabled if self.enabled is not None else device.type == "cuda"

    @property
    def sizes(self) -> list[int]:
        """Every budget, smallest first."""
        sizes, size = [], self.min_tokens
        while size <= self.max_tokens:
            sizes.append(size)
            size *= 2
        return sizes

    def fit(self, tokens: int) -> int:
        """The smallest budget that holds `tokens` (at most `max_tokens`)."""
        return next(size for size in self.sizes if size >= tokens)


@dataclasses.dataclass(frozen=True, slots=True)
class Forward:
    units: list[int]  # indices into the shard, smallest first
    budget: int | None  # None: one unit above the largest budget, run eagerly


def pack(tokens: list[int], budgets: TokenBudgets) -> list[Forward]:
    """The forwards of a shard whose units take `tokens` each: smallest first, each forward filled up to
    `max_tokens` then padded to the smallest budget that holds it; then units above `max_tokens`, alone."""
    order = sorted(range(len(tokens)), key=lambda i: tokens[i])
    eager = [Forward([i], None) for i in order if tokens[i] > budgets.max_tokens]
    forwards: list[Forward] = []
    current: list[int] = []
    used = 0
    for i in order[:len(order) - len(eager)]:
        if used + tokens[i] > budgets.max_tokens:
            forwards.append(Forward(current, budgets.fit(used)))
            current, used = [], 0
        current.append(i)
        used += tokens[i]
    if current:
        forwards.append(Forward(current, budgets.fit(used)))
    return forwards + eager
