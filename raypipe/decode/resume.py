"""A request continued on another engine after the one running it died (`LLMEngine.generate(resume=...)`).

The caller (the Serve ingress) knows the output tokens the dead engine streamed and how much of their
text it sent. The new sequence starts where a preempted one restarts: its prompt, those tokens as its
output so far, nothing computed (the scheduler recomputes all but the newest, which is the next
decode input; the prefix cache makes that cheap where the blocks are cached). Everything that
depends on the output so far is brought to that point here, so the continuation is what the dead
engine would have produced:

- the token budget, stop checks and penalties read `output_ids`;
- the text: the tokens are detokenized at once (equal to the incremental text, see output.py) and
  searched for stop strings already, and the characters the caller has are marked sent, so the next
  delta carries exactly the text after them (including a tail held back for stop strings);
- a structured-output matcher consumes the tokens (one it refuses is the caller's mistake);
- a seeded sampler's generator is advanced by one draw per token (sampler.py draws one noise row per
  sampled token, the first included), so seeded output continues as it would have.
"""

from __future__ import annotations

import dataclasses

import torch

from raypipe.decode.output import OutputProcessor
from raypipe.decode.sequence import Sequence
from raypipe.errors import InvalidInput


@dataclasses.dataclass(frozen=True, slots=True)
class Resume:
    output_ids: tuple[int, ...]  # every output token the caller received, in order
    sent_chars: int  # characters of their text the caller received


def resume_sequence(seq: Sequence, resume: Resume, output: OutputProcessor, vocab_size: int) -> None:
    """Bring the fresh `seq` to the state its request was in after `resume.output_ids`."""
    ids = list(resume.output_ids)
    if not ids:
        raise InvalidInput("a resume needs at least one output token", item="resume", code="invalid_value")
    if any(not 0 <= token < vocab_size for token in ids):
        raise InvalidInput(f"resumed output ids must be in [0, {vocab_size})", item="resume", code="invalid_value")
    if len(ids) >= min(seq.params.max_tokens, output.max_model_len - seq.prompt_len):
        raise InvalidInput("the resumed output leaves no token to generate", item="resume", code="invalid_value")
    if output.stop_ids(seq) & set(ids):
        raise InvalidInput("the resumed output already holds a stop token", item="resume", code="invalid_value")
    if seq.matcher is not None and not seq.matcher.consume_tokens(ids):
        raise InvalidInput("the resumed output does not follow the request's constraint", item="resume",
                           code="invalid_value")
    output.restore(seq, ids, resume.sent_chars)
    if seq.generator is not None:
        row = torch.empty(vocab_size, dtype=torch.float32, device=seq.generator.device)
        for _ in ids:  # the draws of the tokens already sampled (sampler._sample)
            row.exponential_(generator=seq.generator)
