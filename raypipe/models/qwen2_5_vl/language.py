"""Qwen2.5-VL language side: tokenizer facts, 3-D mrope positions, and the language model alone.

The decode engine never holds the vision tower: it loads transformers' `Qwen2_5_VLTextModel` plus
`lm_head` alone (`text_decoder.TextDecoder`) and drives it with explicit 3-D `position_ids`.

Positions come from transformers' own `get_rope_index`, bound to a config-only object so that no
vision weights are needed; it is pure CPU work done once per request.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import torch

from raypipe.models.base import LanguageAdapter, VisualLayout
from raypipe.models.prompt import token_runs
from raypipe.models.text_decoder import TextDecoder

MM_TOKEN_TYPES = {"image": 1, "video": 2}  # transformers' `mm_token_type_ids` values (0: text)
# Both layouts occur: the original release (`model.layers...`) and newer transformers saves.
LANGUAGE_PREFIXES = ("model.language_model.", "model.")
VISION_EXCLUDE = ("visual.", "model.visual.")


class _RopeIndex:
    """transformers' mrope position code, without the model it normally lives on."""

    def __init__(self, config):
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

        self.config = config
        # Plain functions taken from the class: they only read `self.config` and each other.
        self._get_rope_index = Qwen2_5_VLModel.get_rope_index
        self.get_vision_position_ids = Qwen2_5_VLModel.get_vision_position_ids.__get__(self)

    def __call__(self, input_ids, mm_token_type_ids, **grids):
        """`grids`: `image_grid_thw`, `video_grid_thw`, `second_per_grid_ts` (each optional)."""
        return self._get_rope_index(self, input_ids, mm_token_type_ids, **grids)


class Qwen2_5_VLLanguageAdapter(LanguageAdapter):
    def __init__(self, checkpoint: str | pathlib.Path):
        super().__init__(checkpoint)
        self.vision_start_token_id = self.config.vision_start_token_id
        self.vision_end_token_id = self.config.vision_end_token_id
        self.video_token_id = self.config.video_token_id
        self.merge = self.config.vision_config.spatial_merge_size
        self._rope_index = _RopeIndex(self.config)

    def token_runs(self, grid: Sequence[int]) -> list[int]:
        t, h, w = grid
        return [t * h * w // self.merge**2]  # one run per image

    def positions(self, token_ids: Sequence[int], layouts: Sequence[VisualLayout],
                  kept: Sequence[torch.Tensor | None] = ()) -> tuple[torch.Tensor, int]:
        """`(position_ids (3, L), rope_delta)` of one prompt; decode position = index + rope_delta.

        A video pruned by EVS keeps its tokens' original positions: rope runs over the prompt as if
        the video were whole, then the pruned columns are dropped."""
        if not layouts:  # text only: plain 1-D positions on all three axes
            return super().positions(token_ids, layouts)
        masks = list(kept) or [None] * len(layouts)
        types = {token: MM_TOKEN_TYPES[kind] for kind, token in self.placeholder_token_ids.items()}
        pieces, keep, cursor = [], [], 0
        for (start, length), mask in zip(token_runs(token_ids, tuple(types)), masks):
            pieces += [torch.zeros(start - cursor, dtype=torch.int), torch.full(
                (length if mask is None else len(mask),), types[token_ids[start]], dtype=torch.int)]
            keep += [torch.ones(start - cursor + length, dtype=torch.bool) if mask is None else
                     torch.cat([torch.ones(start - cursor, dtype=torch.bool), mask])]
            cursor = start + length
        pieces.append(torch.zeros(len(token_ids) - cursor, dtype=torch.int))
        keep.append(torch.ones(len(token_ids) - cursor, dtype=torch.bool))
        mm_token_type_ids = torch.cat(pieces)[None]
        images = [list(layout.grid) for layout in layouts if layout.kind == "image"]
        videos = [layout for layout in layouts if layout.kind == "video"]
        position_ids, rope_deltas = self._rope_index(
            torch.zeros_like(mm_token_type_ids, dtype=torch.long), mm_token_type_ids,
            image_grid_thw=torch.tensor(images, dtype=torch.long) if images else None,
            video_grid_thw=torch.tensor([list(v.grid) for v in videos], dtype=torch.long) if videos else None,
            # float32, as the processor hands it to the model: the temporal positions are truncated products
            second_per_grid_ts=torch.tensor([v.seconds_per_grid for v in videos], dtype=torch.float32)
            if videos else None)
        pruned = mm_token_type_ids.shape[1] - len(token_ids)
        return position_ids[:, 0][:, torch.cat(keep)], int(rope_deltas[0, 0]) + pruned

    def load_model(self, device: torch.device, dtype: torch.dtype) -> TextDecoder:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel

        return TextDecoder.from_checkpoint(self, Qwen2_5_VLTextModel, device, dtype, prefixes=LANGUAGE_PREFIXES,
                           exclude=VISION_EXCLUDE)
