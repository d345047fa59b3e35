"""Qwen2.5-VL vision side: geometry, cost models and the vision tower alone, over transformers.

The tower is transformers' `Qwen2_5_VisionTransformerPretrainedModel`; raypipe only feeds it packed
shards and splits `pooler_output` per image (`last_hidden_state` is window-permuted: never used).
"""

from __future__ import annotations

import pathlib

import numpy as np
import torch

from raypipe.inputs.media import DecodedVisual, pixel_hash
from raypipe.models.base import ADAPTER_COST_MODELS, VisionAdapter, VisionItem, VisionTower, check_cost_model
from raypipe.models.checkpoint import load_module_weights, load_tensors

VISION_PREFIXES = ("visual.", "model.visual.")


class Qwen2_5_VLVisionAdapter(VisionAdapter):
    def __init__(self, checkpoint: str | pathlib.Path):
        from transformers import AutoConfig, AutoImageProcessor

        self.checkpoint = pathlib.Path(checkpoint)
        self.config = AutoConfig.from_pretrained(self.checkpoint)
        self.vision_config = self.config.vision_config
        self.hidden_size = self.vision_config.out_hidden_size
        self.image_token_id = self.config.image_token_id
        self.processor = AutoImageProcessor.from_pretrained(self.checkpoint)
        self.merge = self.vision_config.spatial_merge_size
        self._flops = _attention_flops_model(self.vision_config)

    def make_item(self, image: DecodedVisual) -> VisionItem:
        grid = self.grid_for(image.height, image.width)
        num_tokens = grid[0] * grid[1] * grid[2] // (self.merge**2)
        return VisionItem(image.pixels, image.content_hash, grid, num_tokens)

    def grid_for(self, height: int, width: int) -> tuple[int, int, int]:
        h, w = self.tower_size(height, width)
        return (1, h // self.processor.patch_size, w // self.processor.patch_size)

    def tower_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) the image processor resizes an image to (`smart_resize`; idempotent)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = self.processor.patch_size * self.processor.merge_size
        return smart_resize(height, width, factor, min_pixels=self.processor.size["shortest_edge"],
                            max_pixels=self.processor.size["longest_edge"])

    def resize_for_tower(self, image: DecodedVisual) -> DecodedVisual:
        from transformers.image_transforms import resize
        from transformers.image_utils import ChannelDimension

        size = self.tower_size(image.height, image.width)
        if size == (image.height, image.width):
            return image
        # The very function (and resample filter) the processor resizes with: identical uint8 pixels.
        pixels = np.ascontiguousarray(resize(image.pixels, size, resample=self.processor.resample,
                                             data_format=ChannelDimension.LAST,
                                             input_data_format=ChannelDimension.LAST))
        return DecodedVisual(pixels, pixel_hash(pixels))

    def cost(self, item: VisionItem, cost_model: str = "patches") -> float:
        check_cost_model(cost_model, ADAPTER_COST_MODELS)
        if cost_model == "attention":
            return self._flops(item.grid)
        return float(item.grid[0] * item.grid[1] * item.grid[2])  # patches

    def load_tower(self, device: torch.device, dtype: torch.dtype) -> "Qwen2_5_VLVisionTower":
        return Qwen2_5_VLVisionTower(self, device, dtype)


def _attention_flops_model(vc):
    """FLOPs of one image through the tower, from the config, counting what grows with image size.

    Linear layers cost O(N) per block. Window-attention blocks attend within windows of at most
    (window_size / patch_size)^2 patches: also O(N). The `fullatt_block_indexes` blocks attend over
    all N patches of the image: O(N^2). That quadratic term is what a patch count misses, and it is
    why one 4K screenshot can cost more than many thumbnails with the same total patch count.
    """
    d, m = vc.hidden_size, vc.intermediate_size
    full_blocks = len(vc.fullatt_block_indexes)
    window_blocks = vc.depth - full_blocks
    window_patches = (vc.window_size // vc.patch_size) ** 2
    patch_in = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    merge_unit = vc.spatial_merge_size**2

    def flops(grid: tuple[int, int, int]) -> float:
        t, h, w = grid
        n = t * h * w
        linear = 2 * n * (4 * d * d + 3 * d * m) * vc.depth  # qkv + proj, gated MLP
        window_attn = 4 * n * min(n, window_patches) * d * window_blocks  # QK^T and AV
        full_attn = 4 * n * n * d * full_blocks
        embed = 2 * n * patch_in * d
        merger = 2 * (n // merge_unit) * (d * merge_unit) * (d * merge_unit + vc.out_hidden_size)
        return float(linear + window_attn + full_attn + embed + merger)

    return flops


class Qwen2_5_VLVisionTower(VisionTower):
    def __init__(self, adapter: Qwen2_5_VLVisionAdapter, device: torch.device, dtype: torch.dtype):
        from transformers.initialization import no_init_weights
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        self.adapter = adapter
        self.device = torch.device(device)
        with no_init_weights():  # weights come from the checkpoint; skip the random init
            model = Qwen2_5_VisionTransformerPretrainedModel._from_config(adapter.vision_config, dtype=dtype)
        state = load_tensors(adapter.checkpoint, VISION_PREFIXES, dtype=dtype)
        load_module_weights(model, state, what=f"{adapter.checkpoint} vision tower")
        self.model = model.to(self.device).eval()
        self.dtype = dtype

    @torch.inference_mode()
    def encode(self, items: list[VisionItem]) -> list[torch.Tensor]:
        if not items:
            return []
        processed = self.adapter.processor(images=[item.pixels for item in items], return_tensors="pt")
        grid_thw = processed["image_grid_thw"]
        expected = torch.tensor([item.grid for item in items], dtype=grid_thw.dtype)
        if not torch.equal(grid_thw, expected):
            raise RuntimeError(f"image processor produced grids {grid_thw.tolist()}, predicted {expected.tolist()}")
        pixel_values = processed["pixel_values"].to(self.device, self.dtype)
        embeddings = self.model(pixel_values, grid_thw=grid_thw.to(self.device)).pooler_output
        sizes = [item.num_tokens for item in items]
        return [chunk.cpu() for chunk in torch.split(embeddings, sizes)]
