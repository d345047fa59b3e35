"""Checks a request must pass before the engine queues it; each failure is an `InvalidInput`.

They run in the caller's task, not the engine thread, so a bad request fails alone and early
while the batch keeps running.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from raypipe.errors import InvalidInput
from raypipe.inputs.sampling import SamplingParams
from raypipe.models.prompt import PreparedPrompt, token_runs


def check_request(prompt, params, *, language_adapter, max_model_len: int) -> tuple[list[int], list[tuple]]:
    """`(prompt_token_ids, visual_grids)` of a `PreparedPrompt` or a plain list of token ids."""
    if not isinstance(params, SamplingParams):
        raise InvalidInput(f"expected SamplingParams, got {type(params).__name__}", item="sampling_params")
    if isinstance(prompt, PreparedPrompt):
        ids, grids = list(prompt.prompt_token_ids), [tuple(g) for g in prompt.visual_grids]
    elif isinstance(prompt, (list, tuple)):
        ids, grids = list(prompt), []
    else:
        raise InvalidInput(f"expected a PreparedPrompt or a list of token ids, got {type(prompt).__name__}",
                           item="prompt")
    vocab = language_adapter.vocab_size
    if not ids:
        raise InvalidInput("prompt is empty", item="prompt", code="empty_prompt")
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
        raise InvalidInput(f"prompt token ids must be integers in [0, {vocab})", item="prompt_token_ids")
    if len(ids) >= max_model_len:
        raise InvalidInput(f"prompt has {len(ids)} tokens (images included); max_model_len is {max_model_len}, "
                           "which must leave room for at least one generated token", item="prompt",
                           code="prompt_too_long")
    for field, tokens in (("stop_token_ids", params.stop_token_ids or ()), ("logit_bias", params.logit_bias or {})):
        for t in tokens:
            if t >= vocab:
                raise InvalidInput(f"token id {t} is outside the vocabulary (size {vocab})",
                                   item=f"sampling_params.{field}", code="invalid_sampling_params")
    _check_placeholder_runs(ids, grids, language_adapter)
    return ids, grids


def _check_placeholder_runs(ids: list[int], grids: list[tuple], adapter) -> None:
    """The runs of placeholder tokens must be the visual items' runs (one per image, or one per slice), in order."""
    runs = [length for _, length in token_runs(ids, adapter.placeholder_token_ids.values())]
    want = [n for g in grids for n in adapter.token_runs(g)]
    if runs != want:
        raise InvalidInput(f"image token runs {runs} do not match the images' token counts {want}",
                           item="images", code="image_count_mismatch")


def check_visual_embeds(embeds: Sequence[torch.Tensor], grids: list[tuple], adapter) -> torch.Tensor | None:
    """One `(tokens, hidden)` tensor per visual item, concatenated in prompt order (None for text only)."""
    if len(embeds) != len(grids):
        raise InvalidInput(f"{len(embeds)} image embeddings for {len(grids)} images", item="images",
                           code="image_count_mismatch")
    for i, (embed, grid) in enumerate(zip(embeds, grids)):
        want = (adapter.tokens_per_image(grid), adapter.hidden_size)
        if not isinstance(embed, torch.Tensor) or tuple(embed.shape) != want:
            got = tuple(embed.shape) if isinstance(embed, torch.Tensor) else type(embed).__name__
            raise InvalidInput(f"embedding is {got}, expected {want}", item=f"images[{i}]",
                               code="image_count_mismatch")
    return torch.cat(list(embeds)) if embeds else None
