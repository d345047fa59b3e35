"""LLaVA-OneVision vision side: the base view and each AnyRes tile are units of equal cost.

Every unit is one fixed-size SigLIP input (`vision_config.image_size` square), so every unit costs
the same and the coordinator splits a batch's units evenly (`raypipe.encode.partition`): tiles of
one image may run on several workers. `units` cuts an image into the base view and its tiles
with the checkpoint's own Pillow image processor (`LlavaOnevisionImageProcessorPil`: resize, pad,
`divide_to_patches`), still uint8, so workers only rescale, normalize and run the tower.

A worker runs the tower up to the deepest selected layer, selects features (`vision_features`) and
projects them (`multi_modal_projector`). The base view's rows end with the `image_newline`
vector, so the per-image assembly (`join_units` -> `anyres.pack`: tiles side by side, unpadded,
shrunk past `anyres_max_N`, newline per row, base first) needs no weights where it runs.

How an image is cut depends on its prompt (`prompt_visuals`), as in transformers' processor
(`batch_num_images`) and the model's multi-image recipe: an image alone in its prompt gets its AnyRes
tiles; each image of a prompt with several gets only its base view, padded to a square in the
processor's mean colour and resized to the tower's size where the prompt is built (`base_view.py`; grid
`(0, 0, side, side)`: no tiles; one unit with its newline row). `tile_every_image` keeps the tiles for
every image, as the processor does when handed a flat image list.

A video (`video.py`) is its sampled frames, each a unit of the same size and cost as a tile; a
worker pools each frame's features 2x2, and frame 0 carries the video's one newline row, which
`join_units` moves to the end. A video item's grid is `(frames,)`.
"""

from __future__ import annotations

import pathlib

import numpy as np
import torch

from raypipe.errors import InvalidInput
from raypipe.inputs.media import DecodedVisual, pixel_hash
from raypipe.inputs.video import PlanFrames, VideoSampling
from raypipe.models.base import VisionAdapter, VisionItem, VisionTower, VisualLayout, check_cost_model
from raypipe.models.checkpoint import load_module_weights, load_tensors
from raypipe.models.llava_onevision import video
from raypipe.models.llava_onevision.anyres import AnyRes
from raypipe.models.llava_onevision.base_view import base_view
from raypipe.models.vision_features import FeatureSelection

# Both layouts occur: transformers saves the legacy one (`vision_tower.`, `image_newline`), loads either;
# SigLIP towers of older saves keep a `vision_model.` level. Longest prefix first.
TOWER_PREFIXES = ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.",
                  "vision_tower.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
NEWLINE_KEYS = ("model.image_newline", "image_newline")
BASE_VIEW = "base_view"  # `DecodedVisual.variant` of an image that is its base view alone


def load_image_processor(checkpoint: pathlib.Path):
    # The Pillow backend: the default (torchvision) backend does not import without torchvision.
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    return LlavaOnevisionImageProcessorPil.from_pretrained(checkpoint)


class LlavaOnevisionVisionAdapter(VisionAdapter):
    split_units = True  # tiles of one image are balanced (and may run) on different workers

    def __init__(self, checkpoint: str | pathlib.Path):
        from transformers import AutoConfig

        self.checkpoint = pathlib.Path(checkpoint)
        self.config = AutoConfig.from_pretrained(self.checkpoint)
        self.vision_config = self.config.vision_config
        self.hidden_size = self.config.text_config.hidden_size
        self.image_token_id = self.config.image_token_id
        self.video_token_id = self.config.video_token_id
        self.selection = FeatureSelection.from_config(self.config)
        self.anyres = AnyRes.from_config(self.config)
        self.tile_tokens = self.selection.tokens_per_image(self.vision_config)
        if self.tile_tokens != self.anyres.side**2:
            raise ValueError(f"{checkpoint}: AnyRes tiles need every patch token (strategy 'full'), "
                             f"not {self.selection.strategy!r}")  # transformers' packing raises too
        self.processor = load_image_processor(self.checkpoint)
        self.video_processor = video.load_processor(self.checkpoint)
        if (self.video_processor.size.height, self.video_processor.size.width) != (self.anyres.tile,) * 2:
            raise ValueError(f"{checkpoint}: the video processor's size {self.video_processor.size} is not the "
                             f"tower's {self.anyres.tile} px square")  # `apply_pooling` assumes it

    def make_item(self, image: DecodedVisual) -> VisionItem:
        if image.kind == "video":
            grid = (image.num_frames,)
        elif image.variant == BASE_VIEW:
            grid = (0, 0, image.height, image.width)
        else:
            grid = self.anyres.grid(image.height, image.width)
        return VisionItem(image.pixels, image.content_hash, grid, self.token_runs(grid)[0], kind=image.kind)

    def prompt_visuals(self, visuals: list[DecodedVisual], tile_every_image: bool) -> list[DecodedVisual]:
        """Each image of a prompt with several images as its base view alone, unless `tile_every_image`."""
        if tile_every_image or sum(visual.kind == "image" for visual in visuals) < 2:
            return visuals
        return [self.as_base_view(visual) if visual.kind == "image" and visual.variant is None else visual
                for visual in visuals]

    def as_base_view(self, image: DecodedVisual) -> DecodedVisual:
        """The image padded to a square in the processor's mean colour and resized to the tower's size, as the
        processor's `_preprocess` does to an image it does not tile."""
        p = self.processor
        pixels = base_view(image.pixels, self.anyres.tile, tuple(int(x * 255) for x in p.image_mean), p.resample)
        # Keyed by its own pixels and variant: never the tiled image's embedding, nor a tower-size image's.
        return DecodedVisual(pixels, f"{pixel_hash(pixels)}:{BASE_VIEW}", "image", variant=BASE_VIEW)

    def token_runs(self, grid) -> list[int]:
        if len(grid) == 1:  # a video's frames
            return [video.num_tokens(grid[0], self.anyres.side)]
        return [self.anyres.num_tokens(tuple(grid), self.tile_tokens)]

    def plan_frames(self, sampling: VideoSampling) -> PlanFrames:
        return video.frame_planner(self.video_processor, sampling)

    def layout(self, visual: DecodedVisual, item: VisionItem, pruning_rate: float = 0.0) -> VisualLayout:
        if item.kind == "video" and pruning_rate > 0:
            raise InvalidInput("EVS (video_pruning_rate) is not supported for LLaVA-OneVision videos",
                               item="video_pruning_rate", code="invalid_video_pruning_rate")
        return VisualLayout(item.kind, tuple(item.grid))

    def units(self, item: VisionItem) -> list[VisionItem]:
        """The base view (unit 0: its rows plus the newline row), then the tiles row by row; a video's frames
        (frame 0 also carries the newline row)."""
        if item.kind == "video":
            pooled = video.pooled_side(self.anyres.side) ** 2
            return [VisionItem(frame, f"{item.content_hash}:{k}", item.grid, pooled + (k == 0), k, kind="video")
                    for k, frame in enumerate(item.pixels)]
        rows, cols, *_ = item.grid
        if not rows:  # the base view alone, already at the tower's size
            return [VisionItem(item.pixels, f"{item.content_hash}:0", item.grid, self.tile_tokens + 1, 0)]
        views = self.processor.get_image_patches(np.ascontiguousarray(np.moveaxis(item.pixels, -1, 0)),
                                                 [list(p) for p in self.anyres.pinpoints],
                                                 size=(self.anyres.tile, self.anyres.tile), patch_size=self.anyres.tile,
                                                 resample=self.processor.resample)
        if len(views) != 1 + rows * cols:
            raise RuntimeError(f"image processor made {len(views) - 1} tiles, planned {rows * cols}")
        return [VisionItem(np.ascontiguousarray(np.moveaxis(view, 0, -1)), f"{item.content_hash}:{k}", item.grid,
                           self.tile_tokens + (k == 0), k)
                for k, view in enumerate(views)]

    def join_units(self, item: VisionItem, parts: list[torch.Tensor]) -> torch.Tensor:
        if item.kind == "video":  # frames back to back, then the one newline row
            return torch.cat((parts[0][:-1], *parts[1:], parts[0][-1:]))
        base, newline = parts[0][:-1], parts[0][-1]
        return self.anyres.pack(item.grid, base, parts[1:], newline)

    def cost(self, item: VisionItem, cost_model: str = "patches") -> float:
        """Every unit is one tower input of the same size: the same cost, whichever unit."""
        check_cost_model(cost_model)
        patches = self.anyres.side**2
        if cost_model == "attention":
            layers = self.selection.layers_to_run(self.vision_config.num_hidden_layers)
            return _vit_flops(self.vision_config, patches, layers)
        return float(patches)

    def load_tower(self, device: torch.device, dtype: torch.dtype) -> "LlavaOnevisionVisionTower":
        return LlavaOnevisionVisionTower(self, device, dtype)


def _vit_flops(vc, n: int, layers: int) -> float:
    """FLOPs of one tower input: each layer's projections and MLP (O(n)) and attention (O(n^2))."""
    d, m = vc.hidden_size, vc.intermediate_size
    embed = 2 * n * vc.num_channels * vc.patch_size**2 * d
    return float(layers * (2 * n * (4 * d * d + 2 * d * m) + 4 * n * n * d) + embed)


class LlavaOnevisionVisionTower(VisionTower):
    def __init__(self, adapter: LlavaOnevisionVisionAdapter, device: torch.device, dtype: torch.dtype):
        from transformers import AutoModel
        from transformers.initialization import no_init_weights
        from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionMultiModalProjector

        self.adapter = adapter
        self.device = torch.device(device)
        self.dtype = dtype
        vc = adapter.vision_config
        self.num_layers = vc.num_hidden_layers
        run = adapter.selection.layers_to_run(self.num_layers)
        truncated = vc.__class__(**{**vc.to_dict(), "num_hidden_layers": run})
        skipped = tuple(f"{prefix}encoder.layers.{i}." for prefix in TOWER_PREFIXES
                        for i in range(run, self.num_layers))  # never run: never read
        with no_init_weights():  # weights come from the checkpoint; skip the random init
            tower = AutoModel.from_config(truncated, dtype=dtype)
            projector = LlavaOnevisionMultiModalProjector(adapter.config).to(dtype)
        load_module_weights(tower, load_tensors(adapter.checkpoint, TOWER_PREFIXES, dtype=dtype, exclude=skipped),
                            what=f"{adapter.checkpoint} vision tower")
        load_module_weights(projector, load_tensors(adapter.checkpoint, PROJECTOR_PREFIXES, dtype=dtype),
                            what=f"{adapter.checkpoint} multi_modal_projector")
        self.newline = next(iter(load_tensors(adapter.checkpoint, NEWLINE_KEYS, dtype=dtype).values())).to(self.device)
        self.tower = tower.to(self.device).eval()
        self.projector = projector.to(self.device).eval()

    @property
    def lora_root(self) -> torch.nn.Module:
        return torch.nn.ModuleDict({"vision_tower": self.tower, "multi_modal_projector": self.projector})

    def pixel_values(self, units: list[VisionItem]) -> torch.Tensor:
        """The processors' own rescale and normalize, on views and frames they already resized (and cut)."""
        p = self.adapter.processor
        out = torch.empty(len(units), 3, self.adapter.anyres.tile, self.adapter.anyres.tile)
        frames = [k for k, u in enumerate(units) if u.kind == "video"]
        views = [k for k, u in enumerate(units) if u.kind != "video"]
        if frames:
            out[frames] = video.pixel_values([units[k].pixels for k in frames], self.adapter.video_processor)
        if views:
            out[views] = torch.from_numpy(np.stack([
                p.normalize(p.rescale(np.moveaxis(units[k].pixels, -1, 0), p.rescale_factor), p.image_mean,
                            p.image_std) for k in views]))
        return out

    @torch.inference_mode()
    def encode(self, items: list[VisionItem]) -> list[torch.Tensor]:
        """One tensor per unit: a tile's projected features, a frame's pooled 2x2; the base view's and frame 0's,
        then the newline row."""
        if not items:
            return []
        pixels = self.pixel_values(items).to(self.device, self.dtype)
        hidden = self.tower(pixels, output_hidden_states=True).hidden_states
        features = list(self.projector(self.adapter.selection.select(hidden, self.num_layers)))
        frames = [k for k, u in enumerate(items) if u.kind == "video"]
        if frames:
            pooled = video.pool(torch.stack([features[k] for k in frames]), self.adapter.anyres.side)
            for k, f in zip(frames, pooled):
                features[k] = f
        return [torch.cat((f, self.newline[None])).cpu() if unit.unit_index == 0 else f.cpu()
                for f, unit in zip(features, items)]
