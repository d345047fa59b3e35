"""What the decode engine needs, whatever the family: config facts and a model to drive.

`LanguageAdapter` reads what every family has (config, tokenizer, sizes, the image token, EOS ids);
a family adds its positions, image-token runs and `load_model`. Each family's language model (a transformers text model plus `lm_head`, without the vision tower)
subclasses `DecoderLM` and sets `self.model`, `self.lm_head` and `self.image_token_id`; the engine
calls only these three methods.
"""

from __future__ import annotations

import pathlib

import torch


class LanguageAdapter:
    """Config-level knowledge of the language side (no weights)."""

    def __init__(self, checkpoint: str | pathlib.Path):
        from transformers import AutoConfig, AutoTokenizer

        self.checkpoint = pathlib.Path(checkpoint)
        self.config = AutoConfig.from_pretrained(self.checkpoint)
        self.text_config = self.config.text_config
        self.tokenizer = AutoTokenizer.from_pretrained(self.checkpoint)
        self.hidden_size = self.text_config.hidden_size
        self.vocab_size = self.text_config.vocab_size
        self.max_position_embeddings = self.text_config.max_position_embeddings
        self.image_token_id = self.config.image_token_id
        self.eos_token_ids = eos_ids(self.config, self.tokenizer)


class DecoderLM(torch.nn.Module):
    model: torch.nn.Module  # transformers' text model: embed_tokens, layers, norm
    lm_head: torch.nn.Module
    image_token_id: int

    def embed(self, input_ids: torch.Tensor, image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Text embeddings with image rows written over the image tokens, row-major over the batch."""
        embeds = self.model.embed_tokens(input_ids)
        if image_embeds is not None and image_embeds.numel():
            mask = (input_ids == self.image_token_id).unsqueeze(-1).expand_as(embeds)
            embeds = embeds.masked_scatter(mask, image_embeds.to(embeds.dtype))
        return embeds

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, attention_mask: dict, cache) -> torch.Tensor:
        """Final hidden states `(B, L, hidden)`; `attention_mask` maps each layer type to its mask (4-D
        additive for attention), which transformers passes to the layers as-is."""
        out = self.model(inputs_embeds=inputs_embeds, position_ids=self.model_positions(position_ids),
                         attention_mask=attention_mask, past_key_values=cache, use_cache=True)
        return out.last_hidden_state

    def model_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """The engine's `(3, B, L)` positions in the form the text model takes (mrope: as they are)."""
        return position_ids

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def eos_ids(config, tokenizer) -> tuple[int, ...]:
    """End-of-sequence ids from the text config, else the tokenizer's."""
    found = config.text_config.eos_token_id
    if found is None:
        found = tokenizer.eos_token_id
    ids = found if isinstance(found, (list, tuple)) else [found]
    return tuple(int(i) for i in ids if i is not None)
