"""Qwen2.5-VL vision side: geometry, cost models and the vision tower alone, over transformers.

The tower is transformers' `Qwen2_5_VisionTransformerPretrainedModel`; raypipe only feeds it packed
shards and splits `pooler_output` per item (`last_hidden_state` is window-permuted: never used).

A video's units are chunks of consecutive temporal groups. Every temporal group attends only within
itself in this tower (full-attention blocks get one `cu_seqlens` run per group, windows are built per
group), so chunks encode to exactly the rows of the whole video, t-major, and one long video spreads
over every worker. An image is one unit, so balancing units (`split_units`) keeps images whole.
"""

from __future__ import annotations

import pathlib

import numpy as np
import torch

from raypipe.inputs.media import DecodedVisual, pixel_hash
from raypipe.inputs.video import PlanFrames, VideoSampling
from raypipe.models.base import (
    ADAPTER_COST_MODELS,
    PreparedForward,
    VisionAdapter,
    VisionItem,
    VisionTower,
    VisualLayout,
    check_cost_model,
)
from raypipe.models.checkpoint import load_module_weights, load_tensors
from raypipe.models.qwen2_5_vl import tower_metadata
from raypipe.models.qwen2_5_vl.video import QwenVideoConfig, frame_planner, process_video

VISION_PREFIXES = ("visual.", "model.visual.")
# Patches per video chunk, the unit the coordinator balances: set here only (tests lower the adapter's
# attribute). 4096 patches is 1024 tokens, a mid-size image's worth of work: a long video then cuts into
# enough chunks to spread over several workers, each chunk still one efficient forward.
VIDEO_CHUNK_PATCHES = 4096


class Qwen2_5_VLVisionAdapter(VisionAdapter):
    split_units = True  # a video's chunks go to different workers; an image is a single unit anyway
    video_chunk_patches = VIDEO_CHUNK_PATCHES

    def __init__(self, checkpoint: str | pathlib.Path):
        from transformers import AutoConfig, AutoImageProcessor

        self.checkpoint = pathlib.Path(checkpoint)
        self.config = AutoConfig.from_pretrained(self.checkpoint)
        self.vision_config = self.config.vision_config
        self.hidden_size = self.vision_config.out_hidden_size
        self.image_token_id = self.config.image_token_id
        self.video_token_id = self.config.video_token_id
        self.processor = AutoImageProcessor.from_pretrained(self.checkpoint)
        self.video_config = QwenVideoConfig.from_checkpoint(self.checkpoint)
        self.merge = self.vision_config.spatial_merge_size
        self._flops = self.flops_model()

    def flops_model(self):
        """`grid -> FLOPs` of this tower (the `attention` cost model)."""
        return _attention_flops_model(self.vision_config)

    def make_item(self, image: DecodedVisual) -> VisionItem:
        grid = self.video_grid(image) if image.kind == "video" else self.grid_for(image.height, image.width)
        return VisionItem(image.pixels, image.content_hash, grid, self._tokens(grid), kind=image.kind)

    def _tokens(self, grid: tuple[int, int, int]) -> int:
        return grid[0] * grid[1] * grid[2] // (self.merge**2)

    def video_grid(self, video: DecodedVisual) -> tuple[int, int, int]:
        """(t, h, w) in patches of sampled frames already at tower size (the frame plan resized them)."""
        vc = self.video_config
        if video.height % vc.factor or video.width % vc.factor:
            raise ValueError(f"video frames are {video.height}x{video.width}; the tower needs multiples of "
                             f"{vc.factor}: resize them with the frame plan (`video.frame_planner`)")
        t = -(-video.num_frames // vc.temporal_patch_size)  # a trailing odd frame is padded to a group
        return (t, video.height // vc.patch_size, video.width // vc.patch_size)

    def seconds_per_grid(self, video: DecodedVisual) -> float:
        """Seconds between temporal groups (the processor's `second_per_grid_ts`): tp / sampled fps."""
        return self.video_config.temporal_patch_size / video.fps

    def plan_frames(self, sampling: VideoSampling) -> PlanFrames:
        return frame_planner(self.video_config, sampling)

    def layout(self, visual: DecodedVisual, item: VisionItem, pruning_rate: float = 0.0) -> VisualLayout:
        if item.kind != "video":
            return super().layout(visual, item)
        return VisualLayout("video", tuple(item.grid), self.seconds_per_grid(visual), pruning_rate)

    def units(self, item: VisionItem) -> list[VisionItem]:
        """An image whole; a video as chunks of consecutive temporal groups of about `video_chunk_patches`."""
        if item.kind != "video":
            return [item]
        t, h, w = item.grid
        per_chunk = max(1, self.video_chunk_patches // (h * w))  # temporal groups per chunk
        frames_per_group = self.video_config.temporal_patch_size
        units = []
        for k, start in enumerate(range(0, t, per_chunk)):
            groups = min(per_chunk, t - start)
            grid = (groups, h, w)
            frames = item.pixels[start * frames_per_group:(start + groups) * frames_per_group]
            units.append(VisionItem(frames, item.content_hash, grid, self._tokens(grid), unit_index=k,
                                    kind="video"))
        return units

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
        if image.kind == "video":  # its frame plan resized it as it was decoded
            return image
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
    """FLOPs of one unit through the tower, from the config, counting what grows with image size.

    Linear layers cost O(N) per block. Window-attention blocks attend within windows of at most
    (window_size / patch_size)^2 patches: also O(N). The `fullatt_block_indexes` blocks attend over
    all N patches of the image: O(N^2). That quadratic term is what a patch count misses, and it is
    why one 4K screenshot can cost more than many thumbnails with the same total patch count.
    A video's temporal groups attend only within themselves: t groups of h*w patches cost t * (h*w)^2.
    """
    d, m = vc.hidden_size, vc.intermediate_size
    full_blocks = len(vc.fullatt_block_indexes)
    window_blocks = vc.depth - full_blocks
    window_patches = (vc.window_size // vc.patch_size) ** 2
    patch_in = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    merge_unit = vc.spatial_merge_size**2

    def flops(grid: tuple[int, int, int]) -> float:
        t, h, w = grid
        n, group = t * h * w, h * w
        linear = 2 * n * (4 * d * d + 3 * d * m) * vc.depth  # qkv + proj, gated MLP
        window_attn = 4 * n * min(group, window_patches) * d * window_blocks  # QK^T and AV
        full_attn = 4 * n * group * d * full_blocks  # per temporal group
        embed = 2 * n * patch_in * d
        merger = 2 * (n // merge_unit) * (d * merge_unit) * (d * merge_unit + vc.out_hidden_size)
        return float(linear + window_attn + full_attn + embed + merger)

    return flops


class Qwen2_5_VLVisionTower(VisionTower):
    packs_to_budgets = True  # metadata outside the forward: `tower_metadata.py`

    def __init__(self, adapter: Qwen2_5_VLVisionAdapter, device: torch.device, dtype: torch.dtype):
        from transformers.initialization import no_init_weights
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
        from transformers.utils import is_flash_attn_2_available

        self.adapter = adapter
        self.device = torch.device(device)
        # Variable-length flash attention reads the run boundaries from device memory, so a CUDA graph
        # replays for any geometry; sdpa splits the runs on the host and cannot be captured.
        flash = (self.device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
                 and is_flash_attn_2_available())
        attention = "flash_attention_2" if flash else "sdpa"
        self.graph_capturable = attention == "flash_attention_2"
        with no_init_weights():  # weights come from the checkpoint; skip the random init
            model = Qwen2_5_VisionTransformerPretrainedModel._from_config(adapter.vision_config, dtype=dtype,
                                                                          attn_implementation=attention)
        state = load_tensors(adapter.checkpoint, VISION_PREFIXES, dtype=dtype)
        load_module_weights(model, state, what=f"{adapter.checkpoint} vision tower")
        self.model = model.to(self.device).eval()
        self.dtype = dtype

    @property
    def lora_root(self) -> torch.nn.Module:
        return self.model

    @torch.inference_mode()
    def encode(self, items: list[VisionItem]) -> list[torch.Tensor]:
        """One forward over a shard mixing images and video chunks: pixel rows and grids in shard order."""
        if not items:
            return []
        pixel_values, grid_thw = tower_inputs(self.adapter, items)
        embeddings = self.model(pixel_values.to(self.device, self.dtype),
                                grid_thw=grid_thw.to(self.device)).pooler_output
        sizes = [item.num_tokens for item in items]
        return [chunk.cpu() for chunk in torch.split(embeddings, sizes)]

    def budget_tokens(self, item: VisionItem) -> int:
        """Patches through the tower: t * h * w."""
        t, h, w = item.grid
        return t * h * w

    def prepare(self, items: list[VisionItem], budget: int, static: bool = False) -> PreparedForward:
        pixel_values, grid_thw = tower_inputs(self.adapter, items)
        meta = tower_metadata.prepare(self.model, pixel_values, grid_thw, budget, static)
        return PreparedForward(budget, meta.tensors(), {"max_seqlen": meta.max_seqlen,
                                                        "max_window_seqlen": meta.max_window_seqlen},
                               [item.num_tokens for item in items])

    def forward_prepared(self, tensors: dict[str, torch.Tensor], scalars: dict[str, int]) -> torch.Tensor:
        return tower_metadata.forward(self.model, **tensors, **scalars)


def tower_inputs(adapter: Qwen2_5_VLVisionAdapter, items: list[VisionItem]) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel rows, grid_thw) of images and video chunks, in the order given, on the CPU: images through the
    checkpoint's own image processor, videos through `process_video` (shared by the Qwen towers)."""
    rows, grids = [], []
    image_parts = iter(_process_images(adapter.processor, [item.pixels for item in items if item.kind != "video"]))
    for item in items:
        pixels, grid = (process_video(item.pixels, adapter.video_config) if item.kind == "video"
                        else next(image_parts))
        if tuple(grid) != tuple(item.grid):
            raise RuntimeError(f"{item.kind} processor produced grid {grid}, predicted {item.grid}")
        rows.append(pixels)
        grids.append(grid)
    vc = adapter.vision_config
    pixel_values = torch.cat(rows) if rows else torch.zeros(0, vc.in_channels * vc.temporal_patch_size * vc.patch_size**2)
    return pixel_values, torch.tensor(grids, dtype=torch.long).reshape(-1, 3)


def _process_images(processor, images: list[np.ndarray]) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """(pixel rows, grid) per image, through the checkpoint's own image processor."""
    if not images:
        return []
    processed = processor(images=images, return_tensors="pt")
    grids = processed["image_grid_thw"]
    return list(zip(torch.split(processed["pixel_values"], grids.prod(-1).tolist()),
                    [tuple(g) for g in grids.tolist()]))
