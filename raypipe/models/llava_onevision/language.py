"""LLaVA-OneVision language side: tokenizer facts, plain 1-D positions, and the Qwen2 text model alone.

transformers' `LlavaOnevisionForConditionalGeneration` runs its language model (`qwen2`: every
layer full attention) on `inputs_embeds` with the image rows scattered over the `<image>` tokens
and positions 0..L-1, whatever the images: the base adapter's `positions`, decode position =
cache index. An image is one run of `<image>` tokens (base view, then the tile map with its
newline rows), its length from the vision adapter's AnyRes geometry; a video is one run of `<video>`
tokens (pooled frames, one newline row).
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import torch

from raypipe.models.base import LanguageAdapter
from raypipe.models.llava_onevision.vision import LlavaOnevisionVisionAdapter
from raypipe.models.text_decoder import TextDecoder

# transformers saves the legacy layout (`language_model.model.`, `language_model.lm_head.`) and loads both.
LANGUAGE_PREFIXES = ("model.language_model.", "language_model.model.")
HEAD_PREFIXES = ("lm_head.", "language_model.lm_head.")


class LlavaOnevisionLanguageAdapter(LanguageAdapter):
    def __init__(self, checkpoint: str | pathlib.Path):
        super().__init__(checkpoint)
        self.video_token_id = self.config.video_token_id
        self.vision = LlavaOnevisionVisionAdapter(self.checkpoint)

    def token_runs(self, grid: Sequence[int]) -> list[int]:
        return self.vision.token_runs(grid)

    def load_model(self, device: torch.device, dtype: torch.dtype, shard=None) -> "LlavaOnevisionLanguageModel":
        return LlavaOnevisionLanguageModel.from_checkpoint(
            self, _text_model_class(self.text_config), device, dtype, prefixes=LANGUAGE_PREFIXES,
            exclude=(), head_prefixes=HEAD_PREFIXES, shard=shard)


def _text_model_class(text_config):
    """The text model class `text_config` names (Qwen2 for the released checkpoints)."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    return MODEL_MAPPING[type(text_config)]


class LlavaOnevisionLanguageModel(TextDecoder):
    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, attention_mask: dict,
                cache) -> torch.Tensor:
        # The engine's positions are (3, B, L) rows of equal 1-D indices; Qwen2's rope takes one row.
        return super().forward(inputs_embeds, position_ids[0], attention_mask, cache)
