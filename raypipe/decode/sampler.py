"""Vectorized sampling over a batch whose rows each have their own parameters.

One `SamplingBatch` is built per round (the batch does not change inside a round) and reused for
every step. Greedy rows take the argmax of the raw logits. Other rows are scaled by temperature,
cut by top-k and top-p in one sort, and sampled with the exponential-race trick
(argmax(p / E), E ~ Exp(1)), which needs no host sync. A row with a seed draws its noise from its
own `torch.Generator`, so its tokens depend only on its own logits and seed, not on the batch.
"""

from __future__ import annotations

import dataclasses

import torch

from raypipe.sampling import SamplingParams


@dataclasses.dataclass(slots=True)
class SamplingBatch:
    all_greedy: bool
    greedy: torch.Tensor | None  # (B,) bool
    temperature: torch.Tensor | None  # (B, 1), 1.0 on greedy rows (their scaled logits are unused)
    top_k: torch.Tensor | None  # (B, 1) long, vocab size where off; None when no row uses it
    top_p: torch.Tensor | None  # (B, 1); None when no row uses it
    seeded: list[tuple[int, torch.Generator]]  # (row, generator) for rows with a seed

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator | None], vocab_size: int,
              device: torch.device) -> "SamplingBatch":
        if all(p.greedy for p in params):
            return cls(True, None, None, None, None, [])
        greedy = torch.tensor([p.greedy for p in params], device=device)
        temperature = torch.tensor([[p.temperature or 1.0] for p in params], device=device)
        top_k = top_p = None
        if any(p.top_k for p in params):
            top_k = torch.tensor([[min(p.top_k, vocab_size) or vocab_size] for p in params], device=device)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([[p.top_p] for p in params], device=device)
        seeded = [(row, g) for row, (p, g) in enumerate(zip(params, generators)) if g is not None and not p.greedy]
        return cls(False, greedy, temperature, top_k, top_p, seeded)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """`(B,)` token ids from `(B, V)` float32 logits."""
    greedy_ids = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_ids
    scaled = logits / batch.temperature
    if batch.top_k is not None or batch.top_p is not None:
        scaled = _top_k_top_p(scaled, batch.top_k, batch.top_p)
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for row, generator in batch.seeded:
        noise[row].exponential_(generator=generator)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(batch.greedy, greedy_ids, sampled)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Logits outside each row's top-k / nucleus set to -inf (the best token always survives)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        drop |= ranks[None, :] >= top_k
    if top_p is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of all better tokens
        drop |= mass_before >= top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
