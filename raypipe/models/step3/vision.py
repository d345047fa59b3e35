"""Step3 (transformers `step3p7`) vision side: each view of an image is its own unit of work.

An image is a global view plus sliding-window crops (`geometry.py`). Every view costs a
full ViT forward of a fixed size, so one large image is many units: the coordinator balances
views, not images, and an image's crops may be encoded on several workers at once. `units`
lists the units in the order the language model reads them (crops row-major, then the global
view); the coordinator concatenates their embeddings back into the image's.

A worker runs the checkpoint's own image processor (`Step3p7ImageProcessor`, torch kernels) on each
image it holds units of, keeps the views it was sent, and runs transformers' `Step3p7VisionModel`
plus the `multi_modal_projector` on all of its global views as one batch and all of its crops as
another (views of one kind share a shape; the tower's output per view does not depend on the batch).
"""

from __future__ import annotations

import dataclasses
import pathlib

import torch

from raypipe.inputs.media import DecodedVisual
from raypipe.models.base import VisionAdapter, VisionItem, VisionTower, check_cost_model
from raypipe.models.step3.geometry import Step3Geometry
from raypipe.models.step3.image_processor import load_image_processor
from raypipe.models.step3.loading import load_step3_model


class Step3VisionAdapter(VisionAdapter):
    split_units = True  # views of one image are balanced (and may run) on different workers

    def __init__(self, checkpoint: str | pathlib.Path):
        from transformers import AutoConfig

        self.checkpoint = pathlib.Path(checkpoint)
        self.config = AutoConfig.from_pretrained(self.checkpoint)
        self.vision_config = self.config.vision_config
        self.hidden_size = self.config.text_config.hidden_size
        self.image_token_id = self.config.image_token_id
        self.processor = load_image_processor(self.checkpoint)
        self.geometry = Step3Geometry(self.processor)

    def make_item(self, image: DecodedVisual) -> VisionItem:
        """The whole image: `grid` is its crop grid `(nx, ny)`."""
        grid = self.geometry.crop_grid(image.height, image.width)
        return VisionItem(image.pixels, image.content_hash, grid, self.geometry.num_tokens(grid))

    def units(self, item: VisionItem) -> list[VisionItem]:
        """One unit per view, `unit_index` the view: `0..nx*ny-1` are crops, `nx*ny` the global view.

        A unit keeps its image's pixels, content hash and crop grid: a worker processes each image once,
        whatever number of its views it holds."""
        nx, ny = item.grid
        crops = nx * ny
        return [VisionItem(item.pixels, item.content_hash, item.grid,
                           self.geometry.crop_tokens if view < crops else self.geometry.global_tokens, view)
                for view in range(crops + 1)]

    def is_global_view(self, unit: VisionItem) -> bool:
        nx, ny = unit.grid
        return unit.unit_index == nx * ny

    def placeholder_ids(self, item: VisionItem, index: int, tokenizer) -> list[int]:
        return self.geometry.placeholder_ids(item.grid, tokenizer.convert_tokens_to_ids)

    def view_side(self, unit: VisionItem) -> int:
        return self.geometry.global_size if self.is_global_view(unit) else self.geometry.crop_size

    def cost(self, item: VisionItem, cost_model: str = "patches") -> float:
        check_cost_model(cost_model)
        patches = (self.view_side(item) // self.vision_config.patch_size) ** 2
        if cost_model == "attention":
            return _vit_flops(self.vision_config, patches)
        return float(patches)

    def load_tower(self, device: torch.device, dtype: torch.dtype) -> "Step3VisionTower":
        return Step3VisionTower(self, device, dtype)


def _vit_flops(vc, n: int) -> float:
    """FLOPs of one view: every layer attends over all `n` patches (O(n^2)) plus O(n) linear work."""
    d, m = vc.hidden_size, vc.intermediate_size
    per_layer = 2 * n * (4 * d * d + 2 * d * m) + 4 * n * n * d
    embed = 2 * n * vc.num_channels * vc.patch_size**2 * d
    downsample = 2 * (n // 4) * 9 * d * 2 * d + 2 * (n // 16) * 9 * 2 * d * 4 * d
    return float(per_layer * vc.num_hidden_layers + embed + downsample)


@dataclasses.dataclass(slots=True)
class _Views:
    """One image's processed views: the global view `(3, S, S)` and its crops `(k, 3, P, P)`."""

    global_view: torch.Tensor
    crops: torch.Tensor | None


class Step3VisionTower(VisionTower):
    def __init__(self, adapter: Step3VisionAdapter, device: torch.device, dtype: torch.dtype):
        model = load_step3_model(adapter.checkpoint, dtype)
        self.adapter = adapter
        self.device = torch.device(device)
        self.dtype = dtype
        self.vision = model.model.vision_model.to(self.device).eval()
        self.projector = model.model.multi_modal_projector.to(self.device).eval()

    @property
    def lora_root(self) -> torch.nn.Module:
        return torch.nn.ModuleDict({"vision_model": self.vision, "multi_modal_projector": self.projector})

    def _process(self, unit: VisionItem) -> _Views:
        processed = self.adapter.processor(images=[unit.pixels], return_tensors="pt")
        nx, ny = unit.grid
        crops = processed.get("pixel_values_local")
        if int(processed["num_local_patches"][0]) != nx * ny:
            raise RuntimeError(f"image processor made {int(processed['num_local_patches'][0])} crops, planned {nx * ny}")
        return _Views(processed["pixel_values"][0], crops)

    @torch.inference_mode()
    def encode(self, items: list[VisionItem]) -> list[torch.Tensor]:
        if not items:
            return []
        views: dict[str, _Views] = {}
        for unit in items:  # the processor runs once per image, whatever number of its views we hold
            if unit.content_hash not in views:
                views[unit.content_hash] = self._process(unit)
        out: list[torch.Tensor | None] = [None] * len(items)
        for is_global in (True, False):
            picked = [i for i, unit in enumerate(items) if self.adapter.is_global_view(unit) == is_global]
            if not picked:
                continue
            pixels = torch.stack([views[items[i].content_hash].global_view if is_global
                                  else views[items[i].content_hash].crops[items[i].unit_index] for i in picked])
            hidden = self.vision(pixels.to(self.device, self.dtype)).last_hidden_state
            embeds = self.projector(hidden)
            for row, i in enumerate(picked):
                out[i] = embeds[row].reshape(-1, embeds.shape[-1]).cpu()
        return out
