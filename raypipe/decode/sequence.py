"""What a request is inside the engine (`Sequence`) and what callers get back (deltas, outputs)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from raypipe.inputs.sampling import SamplingParams


@dataclasses.dataclass(slots=True)
class TokenLogprob:
    """Log-probability of one sampled token, and of the `SamplingParams.logprobs` most likely ones.

    Log-probabilities are the model's own: log-softmax of the raw logits, before logit_bias,
    penalties, temperature and truncation (vLLM's default "raw_logprobs"), so they do not depend on
    how the token was chosen.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), highest first; empty when logprobs=0
    rank: int | None = None  # of the token among the vocabulary (1: the most likely); prompt tokens only


@dataclasses.dataclass(slots=True)
class RequestDelta:
    """New since the previous delta of the same request; `finish_reason` is set on the last one only."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id when SamplingParams.logprobs is set
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache (OpenAI usage's `cached_tokens`)
    # With SamplingParams.prompt_logprobs, on the first delta: None for the first prompt token, then one per token
    prompt_logprobs: list[TokenLogprob | None] | None = None
    replica: str | None = None  # the Serve Decoder replica that runs the request (set on its first delta there)


@dataclasses.dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_image_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token id when SamplingParams.logprobs is set
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with SamplingParams.prompt_logprobs

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
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)


@dataclasses.dataclass(slots=True, eq=False)
class Sequence:
    """One request's engine-side state. Only the engine thread mutates it after submission."""

    request_id: str
    prompt_ids: list[int]
    positions: torch.Tensor  # (3, prompt_len) mrope positions
    rope_delta: int  # decode position of cache index i is i + rope_delta (all three axes)
    visual_embeds: torch.Tensor | None  # (num_image_tokens, hidden), rows in prompt order
    params: SamplingParams
    deliver: Callable[[object], None]  # hands a RequestDelta or an exception to the caller's loop
    generator: torch.Generator | None = None
    matcher: object | None = None  # llguidance matcher of SamplingParams.structured (raypipe.decode.grammar)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    row: int | None = None  # row of the bounded cache kinds while running
    arrival: int = 0  # submission order (the scheduler preempts the newest first)
    # Paged KV: the blocks holding this sequence's tokens, and how many tokens have K/V there. A
    # preempted sequence gives its blocks back and is recomputed from `token_ids` when it runs again.
    block_table: list[int] = dataclasses.field(default_factory=list)
    # Sliding-window layers' blocks (window_tables.py), one entry per block of tokens like `block_table`;
    # the null block where a block has left the window
    window_table: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    chunk_len: int = 0  # tokens its prefill computes in the current round
    # Prefix caching (prefix_hash.py): placeholder runs with their items' digests, the hash of each
    # full block so far, how many of its blocks are registered in the pool's cache
    placeholder_runs: tuple = ()
    prefix_root: bytes = b""  # what its first block's hash chains from: its LoRA adapter's and cache salt's key (prefix_hash.py)
    # Its LoRA adapter (`models.lora.LoraWeights`, held so an unload cannot take it away) and, while it runs, the
    # model's slot holding it (lora_pool.py; set at each admission); None / 0: the base model
    lora: object | None = None
    lora_slot: int = 0
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)
    num_registered: int = 0
    # State snapshots (snapshot_pool.py; models with row-state layers): `(position, slot)` fills this round
    # (prefill chunk ends and splits, or a decode step crossing a block boundary), the latest block boundary
    # its decode crossed (registered when it leaves: where the next turn of a chat continues), and the
    # snapshot to restore into its row before its first chunk
    snapshot_saves: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    boundary: tuple[int, int] | None = None
    restore_slot: int | None = None
    # Block boundaries where another prompt leaves this one, so its prefill keeps a state there: where its
    # cached run of blocks ended past its last snapshot, and where a prompt waiting for its blocks diverges
    branch_points: set[int] = dataclasses.field(default_factory=set)
    # With SamplingParams.prompt_logprobs: prompt position -> its token's log-probability, filled by the prefill
    prompt_logprobs: dict[int, TokenLogprob] | None = None
    # Prompt tokens its first admission took from the prefix cache (what usage reports; not a resume's), None before
    num_cached_tokens: int | None = None
    finish_reason: str | None = None
    # For penalties (sampler.py), made on first use: (vocab,) int32 output token counts, (vocab,) bool prompt tokens
    token_counts: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    # Incremental detokenization (see output.py): output_ids[prefix_offset:read_offset] decode to the
    # last `prefix_chars` characters of `text`, which holds every complete character decoded so far.
    prefix_offset: int = 0
    read_offset: int = 0
    prefix_chars: int = 0
    text: str = ""
    checked_chars: int = 0  # text[:checked_chars] has been searched for stop strings
    emitted_chars: int = 0  # text[:emitted_chars] has been sent to the caller

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def cache_len(self) -> int:
        """Tokens whose K/V are cached: the prompt plus every output token but the newest."""
        return self.prompt_len + max(len(self.output_ids) - 1, 0)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def positions_between(self, start: int, end: int) -> torch.Tensor:
        """`(3, end - start)` positions of cache indices `start..end-1` (past the prompt: index + rope_delta)."""
        prompt = self.positions[:, start:end]
        if end <= self.prompt_len:
            return prompt
        generated = torch.arange(max(start, self.prompt_len), end) + self.rope_delta
        return torch.cat([prompt, generated.expand(3, -1)], dim=1)

    @property
    def decoding(self) -> bool:
        """Prefilled (its first token sampled, or recomputed after a preemption): it takes decode steps."""
        return bool(self.output_ids) and self.num_computed == self.cache_len

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Asked for prompt log-probabilities and not sent them yet (they go with the first output token). A
        tensor-parallel rank's mirror has no params: logits are rank 0's."""
        return self.params is not None and self.params.prompt_logprobs is not None and not self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
