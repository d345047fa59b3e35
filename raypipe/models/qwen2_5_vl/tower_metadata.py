"""Qwen2.5-VL's vision tower split in two: geometry-dependent metadata, then tensor work only.

transformers' `Qwen2_5_VisionTransformerPretrainedModel.forward` derives, from `grid_thw`, the rotary
cos/sin, the window index and its inverse, `cu_seqlens` (one run per temporal group) and
`cu_window_seqlens`, with host loops, `.tolist()` and `argsort`. `prepare` computes all of it up
front on the CPU (with transformers' own `vision_utils` helpers), optionally for a forward padded to
a token budget; `forward` then drives the tower's own modules (patch embed, blocks, merger) with it.
That is what lets one compiled forward or CUDA graph per budget be replayed for any mix of images.

Padding patches sit after the real ones, in runs of their own in both `cu_seqlens` and
`cu_window_seqlens` (at most one window each), so no real patch attends to a padding patch and the
real rows are exactly the eager tower's; their rotary angles are 0 (cos 1, sin 0).

For a CUDA graph the segment boundaries must have a fixed length: `static=True` pads them with
zero-length runs (the last boundary repeated) to one entry per merge unit, and sets the maximum run
lengths to the budget (an upper bound, which variable-length attention kernels accept).
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.utils.generic import is_flash_attention_requested
from transformers.vision_utils import get_vision_attention_seqlens, get_vision_position_ids, get_vision_window_index

TENSORS = ("pixel_values", "cos", "sin", "window_index", "reverse_index", "cu_seqlens", "cu_window_seqlens")


@dataclasses.dataclass(slots=True)
class TowerMetadata:
    """Everything `forward` needs besides the weights (on the CPU)."""

    pixel_values: torch.Tensor  # (patches, C * tp * p * p), padding rows zero
    cos: torch.Tensor  # (patches, head_dim), already in window order
    sin: torch.Tensor
    window_index: torch.Tensor  # (merge units,) patch-embed order -> window order
    reverse_index: torch.Tensor  # its inverse: merger output rows back to input order
    cu_seqlens: torch.Tensor  # int32 run boundaries of full-attention blocks (one run per temporal group)
    cu_window_seqlens: torch.Tensor  # int32 run boundaries of window-attention blocks
    max_seqlen: int | None  # longest runs: read by flash attention only (None under sdpa)
    max_window_seqlen: int | None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in TENSORS}


def prepare(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor, budget: int | None = None,
            static: bool = False) -> TowerMetadata:
    """Metadata of one forward over `pixel_values` (rows of the units in `grid_thw`, in order), padded
    with zero patches to `budget` patches when given (`budget` a multiple of the merge unit)."""
    vc = model.config
    merge_unit = vc.spatial_merge_size**2
    patches = pixel_values.shape[0]
    budget = patches if budget is None else budget
    pad = budget - patches
    if pad < 0 or pad % merge_unit:
        raise ValueError(f"budget {budget} cannot hold {patches} patches in merge units of {merge_unit}")
    if len(grid_thw):
        window_index, cu_window = get_vision_window_index(grid_thw, spatial_merge_size=vc.spatial_merge_size,
                                                          window_size=vc.window_size, patch_size=vc.patch_size)
        cu_seqlens, _ = get_vision_attention_seqlens(grid_thw, vc)
        position_ids = get_vision_position_ids(grid_thw, vc.spatial_merge_size)
    else:  # padding only: what a CUDA graph is captured on
        window_index, position_ids = torch.zeros(0, dtype=torch.long), torch.zeros(0, 2, dtype=torch.long)
        cu_window = cu_seqlens = torch.zeros(1, dtype=torch.int32)
    if pad:
        window_patches = (vc.window_size // vc.patch_size) ** 2  # a padding run is at most one window
        tail = torch.tensor([*range(patches + window_patches, budget, window_patches), budget], dtype=torch.int32)
        cu_window = torch.cat((cu_window, tail))
        cu_seqlens = torch.cat((cu_seqlens.to(torch.int32), tail))
        window_index = torch.cat((window_index, torch.arange(patches // merge_unit, budget // merge_unit)))
        position_ids = torch.cat((position_ids, position_ids.new_zeros(pad, 2)))
        pixel_values = torch.cat((pixel_values, pixel_values.new_zeros(pad, pixel_values.shape[1])))
    cos, sin = model.rotary_pos_emb(pixel_values, position_ids)
    cos, sin = (model.permute_input_for_window_attn(f, window_index, seq_len=budget) for f in (cos, sin))
    # Only variable-length flash attention reads the longest run; None keeps sdpa's forward free of it.
    max_seqlen = max_window = None
    if is_flash_attention_requested(vc):
        max_seqlen, max_window = (int((cu[1:] - cu[:-1]).max()) for cu in (cu_seqlens, cu_window))
    if static:  # a CUDA graph's buffers
        slots = budget // merge_unit + 1  # more runs than merge units cannot occur
        cu_seqlens, cu_window = (torch.cat((cu, cu[-1:].expand(slots - len(cu)))) for cu in (cu_seqlens, cu_window))
        max_seqlen = max_window = budget if max_seqlen is not None else None
    return TowerMetadata(pixel_values, cos, sin, window_index, torch.argsort(window_index),
                         cu_seqlens.to(torch.int32), cu_window.to(torch.int32), max_seqlen, max_window)


def forward(model, pixel_values: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, window_index: torch.Tensor,
            reverse_index: torch.Tensor, cu_seqlens: torch.Tensor, cu_window_seqlens: torch.Tensor,
            max_seqlen: int | None, max_window_seqlen: int | None) -> torch.Tensor:
    """The tower's tensor work on prepared metadata: merged rows of every patch (padding's last), in input order."""
    hidden = model.patch_embed(pixel_values)
    hidden = model.permute_input_for_window_attn(hidden, window_index, seq_len=hidden.shape[0])
    for layer, block in enumerate(model.blocks):
        full = layer in model.fullatt_block_indexes
        hidden = block(hidden, cu_seqlens=cu_seqlens if full else cu_window_seqlens,
                       max_seqlen=max_seqlen if full else max_window_seqlen, position_embeddings=(cos, sin))
    return model.merger(hidden)[reverse_index]
