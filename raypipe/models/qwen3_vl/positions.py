"""Qwen3-VL's 3-D rope positions: Qwen2.5-VL's walk, with every video temporal group its own item.

A Qwen3-VL prompt puts a text timestamp (`<t seconds>`) before each temporal group's placeholder run,
so time is carried by text and each group is positioned as an image: its tokens at `s + (0, row,
column)` from the position `s` where it starts, the text after it one past its largest position
(`s + max(rows, columns)` in merged patches). That is Qwen3-VL's original rule (vLLM's
`Qwen3VLForConditionalGeneration.get_mrope_input_positions`: one `(1, h, w)` grid per image or frame
group, text from the largest position so far + 1), and transformers 5.23's `get_rope_index`, which
splits `video_grid_thw` into one `t = 1` grid per group, agrees (tests check both);
decode position = cache index + rope_delta as for Qwen2.5-VL. The language model interleaves the
three axes over the rotary frequencies (`mrope_interleaved`), which is its own business: positions
are the same either way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from raypipe.models.base import VisualLayout
from raypipe.models.qwen2_5_vl.mrope import mrope_positions


def group_layouts(layouts: Sequence[VisualLayout]) -> list[VisualLayout]:
    """Each visual item as the placeholder runs it puts in the prompt: an image as itself, a video as one
    image-like `(1, h, w)` item per temporal group."""
    out = []
    for layout in layouts:
        t, h, w = layout.grid
        out.extend([VisualLayout("image", (1, h, w))] * (t if layout.kind == "video" else 1))
    return out


def qwen3_positions(runs: Sequence[tuple[int, int]], length: int, layouts: Sequence[VisualLayout], merge: int
                    ) -> tuple[torch.Tensor, int]:
    """`(positions (3, length), rope_delta)` of a prompt whose placeholder `runs` (`(start, length)`, one per
    image and one per video temporal group, in prompt order) hold the visual items of `layouts`."""
    groups = group_layouts(layouts)
    return mrope_positions(runs, length, groups, [None] * len(groups), merge, tokens_per_second=0.0)
