"""Banned token sequences (vLLM's `bad_words`, `SamplingParams.bad_words_token_ids`) as a per-step mask.

A one-token sequence bans its token at every step. A longer one bans its last token at a step where
the row's output so far ends with the sequence's other tokens; as in vLLM, only the output counts,
not the prompt. Each row's last `width` output tokens live in one `(rows, width)` device tensor that
`advance` shifts every step, so matching is one comparison of every entry's left-padded prefix with
its row's tail: no host sync, no per-row Python in the step loop.

A ban never leaves a row with nothing to sample: where every token the grammar or
`allowed_token_ids` left is banned, the row keeps them (otherwise argmax of all -inf picks token 0).
"""

from __future__ import annotations

import dataclasses

import torch

from raypipe.decode.sequence import Sequence

_NO_TOKEN = -1  # a tail slot before the row's first output token: equals no token id
_ANY = -2  # a prefix slot left of a short prefix: matches whatever the tail holds


@dataclasses.dataclass(slots=True)
class BadWordRows:
    always: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) banned at every step
    # Multi-token entries: row (E,), the tokens before the last (E, width) left-padded with _ANY, the last (E,).
    rows: torch.Tensor | None
    prefixes: torch.Tensor | None
    last: torch.Tensor | None
    tail: torch.Tensor | None  # (B, width) each row's last output tokens, _NO_TOKEN before its first

    @classmethod
    def build(cls, seqs: list[Sequence], device: torch.device) -> "BadWordRows | None":
        """None when no row bans anything."""
        single, multi = [], []
        for row, seq in enumerate(seqs):
            for ids in seq.params.bad_words_token_ids or ():
                (single if len(ids) == 1 else multi).append((row, ids))
        if not single and not multi:
            return None
        always = None
        if single:
            always = (torch.tensor([row for row, _ in single], device=device),
                      torch.tensor([ids[0] for _, ids in single], device=device))
        if not multi:
            return cls(always, None, None, None, None)
        width = max(len(ids) for _, ids in multi) - 1
        prefixes = [[_ANY] * (width + 1 - len(ids)) + ids[:-1] for _, ids in multi]
        tails = [([_NO_TOKEN] * width + seq.output_ids)[len(seq.output_ids):] for seq in seqs]
        return cls(always, torch.tensor([row for row, _ in multi], device=device),
                   torch.tensor(prefixes, device=device), torch.tensor([ids[-1] for _, ids in multi], device=device),
                   torch.tensor(tails, device=device))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with this step's banned tokens at -inf (except on rows where nothing else is left)."""
        banned = logits.clone()
        if self.always is not None:
            banned[self.always] = float("-inf")
        if self.rows is not None:
            hit = ((self.tail[self.rows] == self.prefixes) | (self.prefixes == _ANY)).all(dim=-1)
            # Adding -inf bans, adding 0 leaves the logit; accumulate keeps entries sharing (row, token) exact.
            penalty = torch.zeros_like(hit, dtype=logits.dtype).masked_fill(hit, float("-inf"))
            banned.index_put_((self.rows, self.last), penalty, accumulate=True)
        left = torch.isfinite(banned).any(dim=-1, keepdim=True)
        return torch.where(left, banned, logits)

    def advance(self, tokens: torch.Tensor) -> None:
        """Append each row's sampled token to its tail."""
        if self.tail is not None:
            self.tail = torch.cat([self.tail[:, 1:], tokens[:, None].to(self.tail.dtype)], dim=1)
