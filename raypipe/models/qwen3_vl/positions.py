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

EVS (`raypipe.models.evs`): a pruned video's group runs hold the counts planned for them
(`evs.run_counts`), and a run of `k` tokens takes the first `k` cells of its group's grid in row-major
order (`s + (0, row, column)`), the text after it one past the largest of those; a run planned empty
adds no positions. That is vLLM's Qwen3-VL EVS branch of `get_mrope_input_positions` (the grid's cells
`[:, :k]`), so positions follow from the geometry and the rate, not from which rows the embeddings kept
(the kept rows fill the runs in order, whichever groups they came from). vLLM differs in two places,
not followed: its runner then applies the generic `recompute_mrope_positions` (vllm/multimodal/evs.py),
which writes the kept rows' whole-video positions over one contiguous span after the first
`<|vision_start|>` -- Qwen2.5-VL's one-run layout, across Qwen3-VL's timestamps and vision start/end
tokens; and a run planned empty fails there (the maximum of an empty group).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from raypipe.models import evs
from raypipe.models.base import VisualLayout
from raypipe.models.qwen2_5_vl.mrope import visual_positions


def run_cells(layouts: Sequence[VisualLayout], merge: int) -> Iterator[torch.Tensor]:
    """`(3, tokens)` positions from 0 of each placeholder run the visual items of `layouts` put in the prompt:
    an image's grid; per temporal group of a video, its `(1, h, w)` grid's first cells as EVS plans them."""
    for layout in layouts:
        t, h, w = layout.grid
        cells = visual_positions(VisualLayout("image", (1, h, w)), merge, tokens_per_second=0.0)
        if layout.kind != "video":
            yield cells
            continue
        counts = [cells.shape[1]] * t
        if layout.pruning_rate > 0:
            counts = evs.run_counts(counts, t, layout.pruning_rate)
        yield from (cells[:, :count] for count in counts if count)


def qwen3_positions(runs: Sequence[tuple[int, int]], length: int, layouts: Sequence[VisualLayout], merge: int
                    ) -> tuple[torch.Tensor, int]:
    """`(positions (3, length), rope_delta)` of a prompt whose placeholder `runs` (`(start, length)`, one per
    image and one per video temporal group that keeps tokens, in prompt order) hold the visual items of
    `layouts`."""
    pieces, next_position, cursor = [], 0, 0
    for (start, run), cells in zip(runs, run_cells(layouts, merge), strict=True):
        if cells.shape[1] != run:
            raise ValueError(f"a placeholder run of {run} tokens where {cells.shape[1]} were planned")
        pieces.append(torch.arange(start - cursor).expand(3, -1) + next_position)
        item = cells + next_position + (start - cursor)
        pieces.append(item)
        next_position, cursor = int(item.max()) + 1, start + run
    pieces.append(torch.arange(length - cursor).expand(3, -1) + next_position)
    return torch.cat(pieces, dim=1), next_position + (length - cursor) - length
