"""Qwen2.5-VL's 3-D rope positions (mrope), by the rule of the model's original implementation.

Walking the prompt: text tokens take consecutive positions, the same on all three axes (time, row,
column), starting one past the largest position so far (0 at the start). A visual item that starts
at position `s` puts each of its tokens at `s + (time, row, column)` over its merged grid, where the
time of an image is 0 and that of a video's temporal group `g` is `int(g * seconds_per_grid *
tokens_per_second)`. The text after the item so starts one past its largest position on any axis,
which for a long video is its last group's time. Decoding goes on the same way: cache index `i` is
at `i + rope_delta` with `rope_delta = largest position + 1 - prompt length`, so the first generated
token follows the prompt's largest position.

That is Qwen's original `get_rope_index` and vLLM's `Qwen2_5_VLForConditionalGeneration.
get_mrope_input_positions` (`st_idx = previous max + 1`). transformers 5.23's `get_rope_index`
differs: it starts the text after a visual item at `s + max(rows, columns)`, leaving out a video's
time, while its `rope_deltas` still count the largest position, so once a video's time passes its
spatial extent the text after it overlaps the video's positions and the first decoded token jumps
far past the prompt's last one. Images, and videos whose time stays within their spatial extent,
get the same positions under both.

EVS (`raypipe.models.evs`): a pruned video's kept tokens keep the positions they have in the whole
video, and the text after it starts one past the whole video's largest position, as if it were not
pruned: the prompt's positions are those of the unpruned prompt with the pruned columns removed. So
they follow from the geometry alone (not from which tokens the embeddings happened to keep), the
video keeps the time span it covers, and a rate near 0 gives the unpruned positions. vLLM's own EVS
path (`vllm/multimodal/evs.py`, `recompute_mrope_positions`) restarts the text at `s + columns`,
neither rule above, with the same jump at decode; it is not followed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from raypipe.models.base import VisualLayout


def visual_positions(layout: VisualLayout, merge: int, tokens_per_second: float) -> torch.Tensor:
    """`(3, tokens)` positions of one unpruned visual item starting at 0: (time, row, column) per
    token, in the tower's output order (group by group, each row by row)."""
    t, h, w = layout.grid
    if layout.kind == "video":
        # a float32 product truncated towards zero, as vLLM computes it (fractional seconds_per_grid count)
        time = (torch.arange(t) * layout.seconds_per_grid * tokens_per_second).long()
    else:
        time = torch.zeros(t, dtype=torch.long)
    grid = torch.meshgrid(time, torch.arange(h // merge), torch.arange(w // merge), indexing="ij")
    return torch.stack(grid).reshape(3, -1)


def mrope_positions(runs: Sequence[tuple[int, int]], length: int, layouts: Sequence[VisualLayout],
                    kept: Sequence[torch.Tensor | None], merge: int, tokens_per_second: float
                    ) -> tuple[torch.Tensor, int]:
    """`(positions (3, length), rope_delta)` of a prompt of `length` tokens whose visual items, in
    `layouts`, fill the placeholder `runs` (`(start, length)` each, in prompt order); `kept`: per item
    its EVS retention mask over the unpruned tokens, or None."""
    pieces, next_position, cursor = [], 0, 0
    for (start, run), layout, mask in zip(runs, layouts, kept, strict=True):
        pieces.append(torch.arange(start - cursor).expand(3, -1) + next_position)
        item = visual_positions(layout, merge, tokens_per_second) + next_position + (start - cursor)
        next_position = int(item.max()) + 1  # of the whole item, kept or not
        if mask is not None:
            item = item[:, mask]
        if item.shape[1] != run:
            raise ValueError(f"a {layout.kind} of grid {layout.grid} has {item.shape[1]} tokens, its run {run}")
        pieces.append(item)
        cursor = start + run
    pieces.append(torch.arange(length - cursor).expand(3, -1) + next_position)
    next_position += length - cursor
    return torch.cat(pieces, dim=1), next_position - length
