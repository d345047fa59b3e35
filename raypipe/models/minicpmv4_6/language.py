"""MiniCPM-V 4.6 language side: tokenizer facts, plain positions, and the hybrid Qwen3.5 text model.

transformers' `MiniCPMV4_6ForConditionalGeneration` runs its language model (`qwen3_5_text`:
gated-delta-net and full-attention layers, `layer_types`) with 1-D positions 0..L-1 on every rope
axis, whatever the images: the base adapter's `positions`, and decode position = cache index.
Image geometry (and so the image-token runs) comes from the vision adapter, which reads the same
checkpoint's image processor.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import torch

from raypipe.models.base import LanguageAdapter
from raypipe.models.minicpmv4_6.vision import MiniCPMV4_6VisionAdapter
from raypipe.models.text_decoder import TextDecoder

LANGUAGE_PREFIXES = ("model.language_model.",)
VISION_EXCLUDE = ("model.vision_tower.", "model.merger.")


class MiniCPMV4_6LanguageAdapter(LanguageAdapter):
    def __init__(self, checkpoint: str | pathlib.Path):
        super().__init__(checkpoint)
        self.vision = MiniCPMV4_6VisionAdapter(self.checkpoint)
        self.video_token_id = self.config.video_token_id

    def token_runs(self, grid: Sequence[int]) -> list[int]:
        return self.vision.token_runs(grid)

    def load_model(self, device: torch.device, dtype: torch.dtype, shard=None) -> TextDecoder:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

        return TextDecoder.from_checkpoint(self, Qwen3_5TextModel, device, dtype, prefixes=LANGUAGE_PREFIXES, exclude=VISION_EXCLUDE, shard=shard)
