"""Qwen2.5-VL language side: tokenizer facts, 3-D mrope positions, and the language model alone.

The decode engine never holds the vision tower: it loads transformers' `Qwen2_5_VLTextModel` plus
`lm_head` alone (`text_decoder.TextDecoder`) and drives it with explicit 3-D `position_ids`.

Positions follow the model's original rule (`mrope.py`; not transformers 5.23's `get_rope_index`,
which differs after long videos); pure CPU work done once per request.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import torch

from raypipe.models.base import LanguageAdapter, VisualLayout
from raypipe.models.prompt import token_runs
from raypipe.models.qwen2_5_vl.mrope import mrope_positions
from raypipe.models.text_decoder import TextDecoder

# Both layouts occur: the original release (`model.layers...`) and newer transformers saves.
LANGUAGE_PREFIXES = ("model.language_model.", "model.")
VISION_EXCLUDE = ("visual.", "model.visual.")


class Qwen2_5_VLLanguageAdapter(LanguageAdapter):
    def __init__(self, checkpoint: str | pathlib.Path):
        super().__init__(checkpoint)
        self.vision_start_token_id = self.config.vision_start_token_id
        self.vision_end_token_id = self.config.vision_end_token_id
        self.video_token_id = self.config.video_token_id
        self.merge = self.config.vision_config.spatial_merge_size

    @property
    def tokens_per_second(self) -> float:
        """Rope time steps per second of video (Qwen2.5-VL's; Qwen3-VL carries time in text instead)."""
        return self.config.vision_config.tokens_per_second

    def token_runs(self, grid: Sequence[int]) -> list[int]:
        t, h, w = grid
        return [t * h * w // self.merge**2]  # one run per image

    def positions(self, token_ids: Sequence[int], layouts: Sequence[VisualLayout],
                  kept: Sequence[torch.Tensor | None] = ()) -> tuple[torch.Tensor, int]:
        """`(position_ids (3, L), rope_delta)` of one prompt; decode position = index + rope_delta
        (`mrope.py`: the original implementation's rule; a video pruned by EVS keeps its tokens'
        original positions)."""
        runs = token_runs(token_ids, tuple(self.placeholder_token_ids.values()))
        return mrope_positions(runs, len(token_ids), layouts, list(kept) or [None] * len(layouts), self.merge,
                               self.tokens_per_second)

    def load_model(self, device: torch.device, dtype: torch.dtype, shard=None) -> TextDecoder:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel

        return TextDecoder.from_checkpoint(self, Qwen2_5_VLTextModel, device, dtype, prefixes=LANGUAGE_PREFIXES,
                           exclude=VISION_EXCLUDE, shard=shard)
