"""MiniCPM-V 4.6's vision tower and merger split in two: geometry-dependent metadata, then tensor work only.

transformers' `MiniCPMV4_6VisionModel.forward` derives, from the NaViT-packed units' `target_sizes`,
the nearest-bucket position ids, `cu_seqlens` (one run per unit), the window merger's window index
and `cu_window_seqlens`, and the downsampled `cu_seqlens`; `MiniCPMV4_6Merger` then reshapes each
unit's rows in a Python loop over the units. `prepare` computes all of that on the CPU with
transformers' own helpers (the merger's per-unit reshapes become one gather index per merge round),
optionally for a forward padded to a token budget; `forward` drives the tower's own modules
(patch and position embeddings, encoder layers, window merger, post layer norm, the merger's MLPs).

Padding patches are extra units of their own (zero pixels, `PAD_WIDTH` patches wide at most), so they
are separate runs for every attention and separate windows for every merge: no real patch sees them.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from transformers.utils.generic import is_flash_attention_requested
from transformers.vision_utils import get_vision_nearest_position_ids

PAD_WIDTH = 64  # patches across one padding unit: its attention stays small, whatever the padding
TENSORS = ("pixel_values", "position_ids", "cu_seqlens", "window_index", "cu_window_seqlens", "cu_merged_seqlens",
           "target_sizes")


@dataclasses.dataclass(slots=True)
class TowerMetadata:
    """Everything `forward` needs besides the weights (on the CPU)."""

    pixel_values: torch.Tensor  # (1, C, patch, patches * patch): NaViT-packed, padding units last
    position_ids: torch.Tensor  # (patches,) into the position-embedding table
    cu_seqlens: torch.Tensor  # int32 run boundaries before the window merger (one run per unit)
    window_index: torch.Tensor  # the window merger's patch order
    cu_window_seqlens: torch.Tensor  # its windows
    cu_merged_seqlens: torch.Tensor  # run boundaries after the window merger
    target_sizes: torch.Tensor  # (units, 2) incl. padding units (the window merger names them in its checks)
    merge_index: list[torch.Tensor]  # per merge round: rows gathered so that every merge group is contiguous
    max_seqlen: int | None  # longest runs: read by flash attention only (None under sdpa)
    max_merged_seqlen: int | None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {**{name: getattr(self, name) for name in TENSORS},
                **{f"merge_index_{k}": index for k, index in enumerate(self.merge_index)}}


def _runs(sizes: torch.Tensor) -> torch.Tensor:
    return F.pad(torch.cumsum(sizes[:, 0] * sizes[:, 1], dim=0, dtype=torch.int32), (1, 0))


def _merge_index(sizes: torch.Tensor, kernel: tuple[int, int]) -> torch.Tensor:
    """Row order that makes each `kernel` group of every unit (row-major grids, packed) contiguous,
    as `MiniCPMV4_6Merger`'s view/permute/reshape does per unit."""
    kh, kw = kernel
    parts, start = [], 0
    for h, w in sizes.tolist():
        grid = torch.arange(start, start + h * w).view(h // kh, kh, w // kw, kw)
        parts.append(grid.permute(0, 2, 1, 3).reshape(-1))
        start += h * w
    return torch.cat(parts)


def prepare(tower, merger, pixel_values: torch.Tensor, target_sizes: torch.Tensor, use_vit_merger: bool,
            budget: int | None = None) -> TowerMetadata:
    """Metadata of one forward over NaViT-packed `pixel_values` of units `target_sizes` (in patches),
    padded with zero units to `budget` patches when given."""
    patch = tower.config.patch_size
    patches = pixel_values.shape[-1] // patch
    pad = (budget or patches) - patches
    side = 4 if use_vit_merger else 2  # a unit's grid divides by every 2x2 merge it goes through
    if pad < 0 or pad % (side * side):
        raise ValueError(f"budget {budget} cannot hold {patches} patches in units of {side}x{side}")
    sizes = target_sizes.to(torch.long)
    if pad:
        widths = [min(PAD_WIDTH, pad // side - done) for done in range(0, pad // side, PAD_WIDTH)]
        sizes = torch.cat((sizes, torch.tensor([[side, w] for w in widths])))
        pixel_values = torch.cat((pixel_values, pixel_values.new_zeros(*pixel_values.shape[:-1], pad * patch)), -1)
    position_ids = get_vision_nearest_position_ids(sizes, tower.embeddings.num_patches_per_side)
    cu_seqlens = _runs(sizes)
    merged = sizes // 2 if use_vit_merger else sizes
    window_index, cu_window, _ = tower.vit_merger.get_window_index(sizes)
    kernel = tuple(merger.merge_kernel_size)
    merge_index, grid = [], merged
    for _ in range(merger.merger_times):
        merge_index.append(_merge_index(grid, kernel))
        grid = grid // torch.tensor(kernel)
    flash = is_flash_attention_requested(tower.config)
    longest = (lambda cu: int((cu[1:] - cu[:-1]).max())) if flash else (lambda cu: None)
    return TowerMetadata(pixel_values, position_ids, cu_seqlens, window_index, cu_window, _runs(merged), sizes,
                         merge_index, longest(cu_seqlens), longest(_runs(merged)))


def forward(tower, merger, use_vit_merger: bool, tensors: dict[str, torch.Tensor],
            max_seqlen: int | None, max_merged_seqlen: int | None) -> torch.Tensor:
    """The tensor work on prepared metadata: every unit's embedding rows (padding's last), in unit order."""
    embeddings = tower.embeddings
    hidden = embeddings.patch_embedding(tensors["pixel_values"]).flatten(2).transpose(1, 2)
    hidden = hidden + embeddings.position_embedding(tensors["position_ids"])[None]
    cu_seqlens = tensors["cu_seqlens"]
    insert = tower.config.insert_layer_id if use_vit_merger else -1
    for layer_index, layer in enumerate(tower.encoder.layers):
        hidden = layer(hidden, None, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        if layer_index == insert:
            hidden = tower.vit_merger(hidden, tensors["target_sizes"], window_index=tensors["window_index"],
                                      cu_window_seqlens=tensors["cu_window_seqlens"])
            cu_seqlens, max_seqlen = tensors["cu_merged_seqlens"], max_merged_seqlen
    rows = tower.post_layernorm(hidden)[0]
    for k, mlp in enumerate(merger.mlp):
        index = tensors[f"merge_index_{k}"]
        rows = mlp(rows[index].reshape(-1, mlp.linear_1.in_features))
    return rows
