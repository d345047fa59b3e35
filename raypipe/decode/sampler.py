"""Vectorized sampling over a batch whose rows each have their own parameters.

One `SamplingBatch` is built per round (the batch does not change inside a round) and reused for
every step; per-row state that changes per step (output token counts, output lengths) lives in
device tensors updated in place, so the step loop has no per-row Python. Each step:

    raw logits -> log-probabilities (when asked; of the raw logits, vLLM's default)
    -> allowed_token_ids mask -> logit_bias -> repetition penalty -> presence/frequency penalties
    -> grammar mask (constrained rows only, `raypipe.decode.grammar`)
    -> banned sequences (`bad_words`, `raypipe.decode.bad_words`) -> min_tokens mask
    -> greedy rows: argmax | other rows: temperature -> top-k -> top-p -> min-p -> sample

The constraint always wins over `min_tokens`: where the grammar allows nothing but a stop token
(the output is complete) before `min_tokens`, the stop stays allowed and the row finishes as the
grammar says. Otherwise every logit of the row would be -inf and argmax would pick token 0.

transformers' order (SequenceBias, RepetitionPenalty, MinNewTokens, then the warpers), so greedy
with any of these equals `generate()` with its processors. Rows are sampled with the
exponential-race trick (argmax(p / E), E ~ Exp(1)), which needs no host sync. A row with a seed
draws its noise from its own `torch.Generator`, so its tokens depend only on its own logits and
seed, not on the batch. A constrained row's matcher advances inside `sample`, once per step, so
its mask depends only on its own tokens, whatever K or the batch.

Output token counts are kept per sequence as a `(vocab,)` int32 tensor (`Sequence.token_counts`),
built once; each round stacks them into one `(rows, vocab)` tensor and hands every sequence a view
of its row, so the step's scatter-add updates them all without a copy back.
"""

from __future__ import annotations

import dataclasses

import torch

from raypipe.decode.bad_words import BadWordRows
from raypipe.decode.grammar import GrammarRows
from raypipe.decode.sequence import Sequence, TokenLogprob


@dataclasses.dataclass(slots=True)
class SamplingBatch:
    all_greedy: bool
    greedy: torch.Tensor | None  # (B,) bool
    temperature: torch.Tensor | None  # (B, 1), 1.0 on greedy rows (their scaled logits are unused)
    top_k: torch.Tensor | None  # (B, 1) long, vocab size where off; None when no row uses it
    top_p: torch.Tensor | None  # (B, 1); None when no row uses it
    min_p: torch.Tensor | None  # (B, 1); None when no row uses it
    seeded: list[tuple[int, torch.Generator]]  # (row, generator) for rows with a seed
    # (rows, token ids, biases) of every logit_bias entry; None when no row has one
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    counts: torch.Tensor | None = None  # (B, V) int32 output token counts; None when no row has penalties
    prompt_seen: torch.Tensor | None = None  # (B, V) bool, token in the prompt (repetition penalty)
    repetition: torch.Tensor | None = None  # (B, 1), 1.0 where off
    presence: torch.Tensor | None = None  # (B, 1)
    frequency: torch.Tensor | None = None  # (B, 1)
    # (rows, token ids, min_tokens per entry) of every stop id masked until the row has min_tokens
    min_tokens: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    num_output: torch.Tensor | None = None  # (B,) tokens already out, advanced every step
    logprobs: int | None = None  # top-k width to record (max over rows); None: no row asked
    # per step: (sampled logprob (B,), top ids (B, k), top logprobs (B, k), sampled ids (B,)), on the device
    recorded: list[tuple[torch.Tensor, ...]] = dataclasses.field(default_factory=list)
    grammar: GrammarRows | None = None  # rows with a structured-output constraint; None when no row has one
    allowed: torch.Tensor | None = None  # (B, V) bool, True where a row may sample the id; None when no row limits it
    bad_words: BadWordRows | None = None  # rows with banned sequences; None when no row has one

    @classmethod
    def build(cls, seqs: list[Sequence], stop_ids: list[frozenset[int]], vocab_size: int,
              device: torch.device) -> "SamplingBatch":
        """`stop_ids[i]`: the ids that end `seqs[i]` (masked until it has `min_tokens` tokens)."""
        params = [s.params for s in seqs]
        batch = cls(True, None, None, None, None, None, [])
        if not all(p.greedy for p in params):
            batch.all_greedy = False
            batch.greedy = torch.tensor([p.greedy for p in params], device=device)
            batch.temperature = torch.tensor([[p.temperature or 1.0] for p in params], device=device)
            if any(p.top_k for p in params):
                batch.top_k = torch.tensor([[min(p.top_k, vocab_size) or vocab_size] for p in params], device=device)
            if any(p.top_p < 1.0 for p in params):
                batch.top_p = torch.tensor([[p.top_p] for p in params], device=device)
            if any(p.min_p > 0.0 for p in params):
                batch.min_p = torch.tensor([[p.min_p] for p in params], device=device)
            batch.seeded = [(row, s.generator) for row, s in enumerate(seqs)
                            if s.generator is not None and not s.params.greedy]
        if any(p.allowed_token_ids for p in params):
            batch.allowed = torch.ones(len(params), vocab_size, dtype=torch.bool, device=device)
            for row, p in enumerate(params):
                if p.allowed_token_ids:
                    batch.allowed[row] = False
                    batch.allowed[row, torch.tensor(p.allowed_token_ids, device=device)] = True
        if any(p.logit_bias for p in params):
            entries = [(row, token, bias) for row, p in enumerate(params) for token, bias in (p.logit_bias or {}).items()]
            rows, tokens, biases = zip(*entries)
            batch.bias = (torch.tensor(rows, device=device), torch.tensor(tokens, device=device),
                          torch.tensor(biases, device=device))
        if any(_penalized(p) for p in params):
            for seq in seqs:
                if seq.token_counts is None:
                    seq.token_counts = _token_counts(seq, vocab_size, device)
            batch.counts = torch.stack([s.token_counts for s in seqs])
            for row, seq in enumerate(seqs):
                seq.token_counts = batch.counts[row]  # a view: the step's scatter-add updates it too
            batch.repetition = torch.tensor([[p.repetition_penalty] for p in params], device=device)
            if any(p.repetition_penalty != 1.0 for p in params):
                for seq in seqs:
                    if seq.prompt_mask is None:
                        seq.prompt_mask = _prompt_mask(seq, vocab_size, device)
                batch.prompt_seen = torch.stack([s.prompt_mask for s in seqs])
            batch.presence = torch.tensor([[p.presence_penalty] for p in params], device=device)
            batch.frequency = torch.tensor([[p.frequency_penalty] for p in params], device=device)
        if any(p.min_tokens > len(s.output_ids) for p, s in zip(params, seqs)):
            entries = [(row, token, p.min_tokens) for row, (p, ids) in enumerate(zip(params, stop_ids))
                       if p.min_tokens > len(seqs[row].output_ids) for token in ids if token < vocab_size]
            if entries:
                rows, tokens, minimum = zip(*entries)
                batch.min_tokens = (torch.tensor(rows, device=device), torch.tensor(tokens, device=device),
                                    torch.tensor(minimum, device=device))
                batch.num_output = torch.tensor([len(s.output_ids) for s in seqs], device=device)
        if any(p.logprobs is not None for p in params):
            batch.logprobs = max(p.logprobs or 0 for p in params)
        batch.bad_words = BadWordRows.build(seqs, device)
        constrained = [row for row, s in enumerate(seqs) if s.matcher is not None]
        if constrained:
            batch.grammar = GrammarRows(constrained, [seqs[row].matcher for row in constrained], vocab_size, device)
        return batch

    def take_logprobs(self, seqs: list[Sequence]) -> list[list[TokenLogprob] | None]:
        """Per row: a `TokenLogprob` per step recorded since the last call (None where not asked)."""
        recorded, self.recorded = self.recorded, []
        if not recorded:
            return [None] * len(seqs)
        sampled = torch.stack([r[0] for r in recorded], dim=1).tolist()  # (B, steps), one host sync
        top_ids = torch.stack([r[1] for r in recorded], dim=1).tolist()  # (B, steps, k)
        top_lps = torch.stack([r[2] for r in recorded], dim=1).tolist()
        tokens = torch.stack([r[3] for r in recorded], dim=1).tolist()
        out: list[list[TokenLogprob] | None] = []
        for row, seq in enumerate(seqs):
            k = seq.params.logprobs
            if k is None:
                out.append(None)
                continue
            out.append([TokenLogprob(tokens[row][s], sampled[row][s], list(zip(top_ids[row][s][:k], top_lps[row][s][:k])))
                        for s in range(len(recorded))])
        return out


def _penalized(p) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _token_counts(seq: Sequence, vocab_size: int, device: torch.device) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
    if seq.output_ids:
        ids = torch.tensor(seq.output_ids, device=device)
        counts.scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts


def _prompt_mask(seq: Sequence, vocab_size: int, device: torch.device) -> torch.Tensor:
    seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    seen[torch.tensor(seq.prompt_ids, device=device)] = True
    return seen


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """`(B,)` token ids from `(B, V)` float32 logits; advances the batch's per-step state."""
    if batch.logprobs is not None:
        logprobs = logits.log_softmax(dim=-1)
    logits = process(logits, batch)
    tokens = logits.argmax(dim=-1)
    if not batch.all_greedy:
        tokens = torch.where(batch.greedy, tokens, _sample(logits, batch))
    if batch.logprobs is not None:
        top = logprobs.topk(batch.logprobs, dim=-1) if batch.logprobs else None
        empty = logprobs[:, :0]
        batch.recorded.append((logprobs.gather(-1, tokens[:, None])[:, 0],
                               top.indices if top is not None else empty.long(),
                               top.values if top is not None else empty, tokens))
    if batch.counts is not None:
        batch.counts.scatter_add_(1, tokens[:, None], torch.ones_like(tokens[:, None], dtype=torch.int32))
    if batch.num_output is not None:
        batch.num_output += 1
    if batch.grammar is not None:
        batch.grammar.advance(tokens, logits)
    if batch.bad_words is not None:
        batch.bad_words.advance(tokens)
    return tokens


def process(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The allowed-ids mask, logit bias, penalties, the grammar mask, banned sequences and the min_tokens mask
    (what greedy rows take the argmax of)."""
    if batch.bias is None and batch.counts is None and batch.min_tokens is None and batch.grammar is None \
            and batch.allowed is None and batch.bad_words is None:
        return logits
    logits = logits.clone()
    if batch.allowed is not None:
        logits.masked_fill_(~batch.allowed, float("-inf"))
    if batch.bias is not None:
        rows, tokens, biases = batch.bias
        logits.index_put_((rows, tokens), biases, accumulate=True)
    if batch.counts is not None:
        if batch.prompt_seen is not None:
            seen = batch.prompt_seen | (batch.counts > 0)
            penalized = torch.where(logits > 0, logits / batch.repetition, logits * batch.repetition)
            logits = torch.where(seen, penalized, logits)
        counts = batch.counts.to(logits.dtype)
        logits = logits - batch.frequency * counts - batch.presence * (counts > 0).to(logits.dtype)
    if batch.grammar is not None:
        logits = batch.grammar.apply(logits)
    if batch.bad_words is not None:
        logits = batch.bad_words.apply(logits)
    if batch.min_tokens is not None:
        rows, tokens, minimum = batch.min_tokens
        masked = batch.num_output[rows] < minimum
        if batch.grammar is not None:  # the grammar wins: keep the stop tokens of a row that has nothing else
            others = logits.index_put((rows, tokens), torch.tensor(float("-inf"), device=logits.device))
            masked &= torch.isfinite(others).any(dim=-1)[rows]
        logits[rows, tokens] = torch.where(masked, float("-inf"), logits[rows, tokens])
    return logits


def _sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    probs = warp(logits, batch)
    noise = torch.empty_like(probs).exponential_()
    for row, generator in batch.seeded:
        noise[row].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def warp(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Unnormalized probabilities that sampled rows draw from: temperature, top-k, top-p, min-p."""
    scaled = logits / batch.temperature
    if batch.top_k is not None or batch.top_p is not None:
        scaled = _top_k_top_p(scaled, batch.top_k, batch.top_p)
    probs = scaled.softmax(dim=-1)
    if batch.min_p is not None:  # relative to the best token, so unaffected by top-k/top-p renormalizing
        probs = probs.masked_fill(probs < batch.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


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
