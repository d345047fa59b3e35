"""Qwen3-VL's vision tower split in two: geometry-dependent metadata on the CPU, then the tower's own forward.

`Qwen3VLVisionModel.forward` derives from `grid_thw` the position-embedding interpolation (indices and
weights into the learned grid), the rotary positions and `cu_seqlens` (one run per image or temporal
group), each through a transformers `vision_utils` helper that takes the tensor precomputed from its
kwargs instead. `prepare` computes them up front with those same helpers, optionally for a forward padded
to a token budget; `forward` hands them to the model's forward, which then does tensor work only.

Padding patches sit after the real ones in one run of their own in `cu_seqlens` (the tower attends over
whole runs, no windows), with zero pixels, zero interpolation weights and rotary position 0: no real patch
attends to them and the real rows are exactly the eager tower's. For a CUDA graph (`static`) the
boundaries are padded with zero-length runs to one entry per merge unit and the longest run set to the
budget, as for Qwen2.5-VL.
"""

from __future__ import annotations

import torch
from transformers.utils.generic import is_flash_attention_requested
from transformers.vision_utils import (
    get_vision_cu_seqlens,
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
)

TENSORS = ("pixel_values", "interp_indices", "interp_weights", "position_ids", "cu_seqlens")


def prepare(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor, budget: int, static: bool = False
            ) -> tuple[dict[str, torch.Tensor], dict[str, int | None]]:
    """`(tensors, scalars)` of one forward over `pixel_values` (rows of the units in `grid_thw`, in order),
    padded with zero patches to `budget` patches (a multiple of the merge unit)."""
    vc = model.config
    merge_unit = vc.spatial_merge_size**2
    patches = pixel_values.shape[0]
    pad = budget - patches
    if pad < 0 or pad % merge_unit:
        raise ValueError(f"budget {budget} cannot hold {patches} patches in merge units of {merge_unit}")
    if len(grid_thw):
        indices, weights = get_vision_interpolation_indices_and_weights(
            grid_thw, num_grid_per_side=model.num_grid_per_side, mode=model.interpolation_mode,
            align_corners=model.interpolation_align_corners, spatial_merge_size=vc.spatial_merge_size)
        position_ids = get_vision_position_ids(grid_thw, vc.spatial_merge_size)
        cu_seqlens = get_vision_cu_seqlens(grid_thw).to(torch.int32)
    else:  # padding only: what a CUDA graph is captured on
        taps = 4 if model.interpolation_mode == "bilinear" else 16
        indices, weights = torch.zeros(0, taps, dtype=torch.long), torch.zeros(0, taps)
        position_ids, cu_seqlens = torch.zeros(0, 2, dtype=torch.long), torch.zeros(1, dtype=torch.int32)
    if pad:
        indices = torch.cat((indices, indices.new_zeros(pad, indices.shape[1])))
        weights = torch.cat((weights, weights.new_zeros(pad, weights.shape[1])))
        position_ids = torch.cat((position_ids, position_ids.new_zeros(pad, 2)))
        cu_seqlens = torch.cat((cu_seqlens, torch.tensor([budget], dtype=torch.int32)))
        pixel_values = torch.cat((pixel_values, pixel_values.new_zeros(pad, pixel_values.shape[1])))
    # Only variable-length flash attention reads the longest run; None keeps sdpa's forward free of it.
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if is_flash_attention_requested(vc) else None
    if static:
        slots = budget // merge_unit + 1  # more runs than merge units cannot occur
        cu_seqlens = torch.cat((cu_seqlens, cu_seqlens[-1:].expand(slots - len(cu_seqlens))))
        max_seqlen = budget if max_seqlen is not None else None
    tensors = dict(pixel_values=pixel_values, interp_indices=indices, interp_weights=weights,
                   position_ids=position_ids, cu_seqlens=cu_seqlens)
    return tensors, {"max_seqlen": max_seqlen}


def forward(model, pixel_values: torch.Tensor, max_seqlen: int | None, **precomputed: torch.Tensor) -> torch.Tensor:
    """The tower's forward on prepared metadata: every row (padding's last), the merger's output then each
    deepstack level on the columns."""
    return with_levels(model(pixel_values, grid_thw=None, max_seqlen=max_seqlen, **precomputed))


def with_levels(out) -> torch.Tensor:
    """The merger's rows with each deepstack level (none for a tower without deepstack) on the next columns."""
    return torch.cat([out.pooler_output, *(getattr(out, "deepstack_features", None) or ())], dim=-1)
