"""vLLM's request fields that reshape a prompt's token ids: `add_special_tokens` and `truncate_prompt_tokens`.

`add_special_tokens` puts the tokens the tokenizer adds around a text (a BOS, for instance) around
the prompt's text ids; Qwen's tokenizers add none. `truncate_prompt_tokens` keeps the last N tokens
(vLLM truncates on the left; -1 means the model's context length), after the special tokens are
added. A truncation that would cut into an image's or a video's placeholder tokens is refused: the
kept tokens must begin before the first one, so every visual item stays whole with its opening marker.
"""

from __future__ import annotations

from collections.abc import Collection

from raypipe.errors import InvalidInput
from raypipe.models.prompt import token_runs

_PROBE = "a"  # any text: what the tokenizer adds around it is what it adds around every text


def special_tokens_around(tokenizer) -> tuple[list[int], list[int]]:
    """The ids `tokenizer` adds before and after a text when asked to add special tokens."""
    bare = list(tokenizer.encode(_PROBE, add_special_tokens=False))
    full = list(tokenizer.encode(_PROBE, add_special_tokens=True))
    for start in range(len(full) - len(bare) + 1):
        if full[start: start + len(bare)] == bare:
            return full[:start], full[start + len(bare):]
    raise ValueError(f"{type(tokenizer).__name__} changes a text's own tokens when adding special tokens")


def truncation_length(requested: int | None, max_model_len: int) -> int | None:
    """How many prompt tokens `truncate_prompt_tokens` keeps (None: all)."""
    if requested is None:
        return None
    if requested == -1:
        return max_model_len
    if requested < 1:
        raise InvalidInput(f"truncate_prompt_tokens must be -1 (the model's context length) or at least 1, got "
                           f"{requested}", item="truncate_prompt_tokens", code="invalid_value")
    if requested > max_model_len:
        raise InvalidInput(f"truncate_prompt_tokens={requested} is more than this model's maximum context length "
                           f"of {max_model_len} tokens", item="truncate_prompt_tokens", code="invalid_value")
    return requested


def truncate(ids: list[int], keep: int | None, placeholder_ids: Collection[int] = ()) -> list[int]:
    """The last `keep` of `ids`; refused where that would cut into a visual item's placeholder tokens."""
    if keep is None or len(ids) <= keep:
        return ids
    cut = len(ids) - keep
    runs = token_runs(ids, placeholder_ids) if placeholder_ids else []
    if runs and cut >= runs[0][0]:
        raise InvalidInput(f"truncate_prompt_tokens={keep} would cut into the prompt's image or video tokens: the "
                           f"prompt is {len(ids)} tokens and its first visual item begins at token {runs[0][0]}, so "
                           f"keep at least {len(ids) - runs[0][0] + 1}", item="truncate_prompt_tokens",
                           code="invalid_value")
    return ids[cut:]
