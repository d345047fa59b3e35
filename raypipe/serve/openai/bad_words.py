"""vLLM's `bad_words` (strings) as the token sequences the sampler bans (`SamplingParams.bad_words_token_ids`).

As vLLM does it: each word (leading whitespace stripped) is tokenized as it would start a text and
as it would follow a space; the spaced form is banned too when it begins with a different token and
has as many tokens (a tokenizer that writes a word's space into its first token). The words are plain
text, as prompts are here: `"<|im_end|>"` is its characters, never the control token (ban that one
with `logit_bias`).
"""

from __future__ import annotations

from raypipe.errors import InvalidInput
from raypipe.inputs.sampling import MAX_BAD_WORD_TOKENS
from raypipe.models.prompt import plain_text_ids


def bad_words_token_ids(tokenizer, words: list[str] | None, chars_per_token: int) -> list[list[int]] | None:
    """`chars_per_token` (`models.prompt.max_chars_per_token`): a word too long to be `MAX_BAD_WORD_TOKENS`
    tokens is refused before it is tokenized."""
    if not words:
        return None
    sequences = []
    for i, word in enumerate(words):
        word = word.lstrip()
        if not word:
            raise InvalidInput(f"bad_words[{i}] is empty (or only whitespace)", item=f"bad_words[{i}]",
                               code="invalid_value")
        bare = plain_text_ids(tokenizer, word) if len(word) <= MAX_BAD_WORD_TOKENS * chars_per_token else []
        if not 1 <= len(bare) <= MAX_BAD_WORD_TOKENS:
            raise InvalidInput(f"bad_words[{i}] is more than {MAX_BAD_WORD_TOKENS} tokens", item=f"bad_words[{i}]",
                               code="invalid_value")
        sequences.append(bare)
        spaced = plain_text_ids(tokenizer, " " + word)
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    return sequences
