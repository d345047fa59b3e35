"""Checks a request must pass before the engine queues it; each failure is an `InvalidInput`.

They run in the caller's task, not the engine thread, so a bad request fails alone and early
while the batch keeps running.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from raypipe.errors import InvalidInput
from raypipe.inputs.sampling import SamplingParams
from raypipe.models import evs
from raypipe.models.base import VisualLayout
from raypipe.models.prompt import PreparedPrompt, token_runs


def check_request(prompt, params, *, language_adapter, max_model_len: int) -> tuple[list[int], list[VisualLayout]]:
    """`(prompt_token_ids, visual_layouts)` of a `PreparedPrompt` or a plain list of token ids.

    Any request `max_model_len` admits fits the paged KV cache: the engine refuses to start with a pool
    that cannot hold one `max_model_len` sequence (`kv_pool_size.py`)."""
    if not isinstance(params, SamplingParams):
        raise InvalidInput(f"expected SamplingParams, got {type(params).__name__}", item="sampling_params")
    if isinstance(prompt, PreparedPrompt):
        ids, layouts = list(prompt.prompt_token_ids), list(prompt.visual_layouts)
    elif isinstance(prompt, (list, tuple)):
        ids, layouts = list(prompt), []
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
    for field, tokens in (("stop_token_ids", params.stop_token_ids or ()), ("logit_bias", params.logit_bias or {}),
                          ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("bad_words_token_ids", [t for ids in params.bad_words_token_ids or () for t in ids])):
        for t in tokens:
            if t >= vocab:
                raise InvalidInput(f"token id {t} is outside the vocabulary (size {vocab})",
                                   item=f"sampling_params.{field}", code="invalid_sampling_params")
    _check_placeholder_runs(ids, layouts, language_adapter)
    return ids, layouts


def _check_placeholder_runs(ids: list[int], layouts: list[VisualLayout], adapter) -> None:
    """The runs of placeholder tokens must be the visual items' runs (one per image, or one per slice), in order."""
    runs = [length for _, length in token_runs(ids, adapter.placeholder_token_ids.values())]
    want = [n for layout in layouts for n in adapter.prompt_runs(layout)]
    if runs != want:
        raise InvalidInput(f"image token runs {runs} do not match the images' token counts {want}",
                           item="images", code="image_count_mismatch")


def visual_rows(embeds: Sequence[torch.Tensor], layouts: list[VisualLayout], adapter
                ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """`(rows, kept)`: the visual items' embedding rows that fill the prompt's placeholders, in prompt
    order (None for text only), and per item its EVS retention mask over its encoded rows (None: all kept).

    Each embedding must be one `(tokens, hidden)` tensor per visual item, as the encoder made it."""
    if len(embeds) != len(layouts):
        raise InvalidInput(f"{len(embeds)} image embeddings for {len(layouts)} images", item="images",
                           code="image_count_mismatch")
    rows, kept = [], []
    for i, (embed, layout) in enumerate(zip(embeds, layouts)):
        want = (adapter.tokens_per_image(layout.grid), adapter.embedding_width)
        if not isinstance(embed, torch.Tensor) or tuple(embed.shape) != want:
            got = tuple(embed.shape) if isinstance(embed, torch.Tensor) else type(embed).__name__
            raise InvalidInput(f"embedding is {got}, expected {want}", item=f"images[{i}]",
                               code="image_count_mismatch")
        mask = evs.retention_mask(embed, layout.grid[0], layout.pruning_rate) if layout.pruning_rate > 0 else None
        rows.append(embed if mask is None else embed[mask])
        kept.append(mask)
    return (torch.cat(rows) if rows else None), kept
