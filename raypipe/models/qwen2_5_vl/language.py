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

    def positions(self, token_ids: Sequence[int], layouts: Sequence[VisualLayout | Sequence[int]]
                  ) -> tuple[torch.Tensor, int]:
        """`(position_ids (3, L), rope_delta)` of one prompt; decode position = index + rope_delta.

        `layouts`: one `VisualLayout` per visual item in prompt order (a bare grid tuple is an image)."""
        if not layouts:  # text only: plain 1-D positions on all three axes
            return super().positions(token_ids, layouts)
        position_ids, rope_deltas = self._rope_index(**self._rope_inputs(token_ids, layouts))
        return position_ids[:, 0], int(rope_deltas[0, 0])

    def _rope_inputs(self, token_ids: Sequence[int], layouts: Sequence[VisualLayout | Sequence[int]]) -> dict:
        """`get_rope_index`'s arguments for one prompt: token types, per-kind grids, videos' seconds per grid."""
        layouts = [x if isinstance(x, VisualLayout) else VisualLayout("image", tuple(x)) for x in layouts]
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        types = torch.zeros_like(ids, dtype=torch.int)
        for kind, token_id in self.placeholder_token_ids.items():
            types[ids == token_id] = MM_TOKEN_TYPES[kind]
        inputs = {"input_ids": ids, "mm_token_type_ids": types}
        images = [x.grid for x in layouts if x.kind == "image"]
        videos = [x for x in layouts if x.kind == "video"]
        if images:
            inputs["image_grid_thw"] = torch.tensor(images, dtype=torch.long)
        if videos:
            if any(x.seconds_per_grid is None or x.pruning_rate for x in videos):
                raise ValueError("a Qwen2.5-VL video layout needs seconds_per_grid, and EVS pruning is not supported")
            inputs["video_grid_thw"] = torch.tensor([x.grid for x in videos], dtype=torch.long)
            inputs["second_per_grid_ts"] = torch.tensor([x.seconds_per_grid for x in videos])
        return inputs

    def load_model(self, device: torch.device, dtype: torch.dtype) -> TextDecoder:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel

        return TextDecoder.from_checkpoint(self, Qwen2_5_VLTextModel, device, dtype, prefixes=LANGUAGE_PREFIXES,
                           exclude=VISION_EXCLUDE)
