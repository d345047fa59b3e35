"""Qwen3-VL vision side: Qwen2.5-VL's image geometry, a tower with deepstack levels, over transformers.

The tower is transformers' `Qwen3VLVisionModel`: 16-pixel patches, learned position embeddings
interpolated to each grid plus 2-D rope, full attention within each image or temporal group (no
windows), then the spatial merger. Deepstack: after the blocks named in `deepstack_visual_indexes`
the hidden states also go through one merger each; the language model adds those levels to its
hidden states at the visual positions after its first layers.

An item's embedding stays ONE tensor: `(tokens, out_hidden * (1 + levels))`, the merger's output then
each deepstack level, side by side on the columns (vLLM's Qwen3-VL keeps them the same way: `visual_dim`
then `multiscale_dim`). Every path that moves embeddings by rows (the encode cache, ObjectRefs, joins
of units, batch rows, the engine's chunked prefill slicing a prompt's rows) then carries the levels
unchanged and in step with their tokens; only the language model splits the columns
(`language.DeepstackTextDecoder`). A tower without deepstack (Qwen3.5's) yields the main embedding alone.

Image geometry, resize and units (an image whole; a video as chunks of temporal groups, which attend
only within themselves here too) are Qwen2.5-VL's, with this checkpoint's patch size; videos are
sampled and sized by Qwen3-VL's own rules (`video.py`), and their placeholders carry each temporal
group's timestamp. EVS (`video_pruning_rate`) plans each group's run as vLLM's Qwen3-VL does
(`raypipe.models.evs.run_counts`), its timestamp kept before it even when the run is planned empty.
"""

from __future__ import annotations

import pathlib

import torch

from raypipe.inputs.media import DecodedVisual, VisualKind
from raypipe.inputs.video import PlanFrames, VideoSampling
from raypipe.models.base import PreparedForward, VisionItem, VisionTower
from raypipe.models.checkpoint import load_module_weights, load_tensors
from raypipe.models.qwen2_5_vl.vision import VISION_PREFIXES, Qwen2_5_VLVisionAdapter, tower_inputs
from raypipe.models.qwen3_vl import tower_metadata, video
from raypipe.models.qwen3_vl.video import Qwen3VideoConfig


def deepstack_levels(vision_config) -> int:
    """How many deepstack levels the tower yields besides its main embedding (0 without deepstack)."""
    return len(getattr(vision_config, "deepstack_visual_indexes", None) or ())


class Qwen3VLVisionAdapter(Qwen2_5_VLVisionAdapter):
    def __init__(self, checkpoint: str | pathlib.Path):
        super().__init__(checkpoint)
        self.video_config = Qwen3VideoConfig.from_checkpoint(self.checkpoint)
        self.levels = deepstack_levels(self.vision_config)
        self.hidden_size = self.vision_config.out_hidden_size * (1 + self.levels)  # the columns of every level
        self.vision_start_token_id = self.config.vision_start_token_id
        self.vision_end_token_id = self.config.vision_end_token_id

    def flops_model(self):
        return _attention_flops_model(self.vision_config, deepstack_levels(self.vision_config))

    def plan_frames(self, sampling: VideoSampling) -> PlanFrames:
        return video.frame_planner(self.video_config, sampling)

    def make_item(self, image: DecodedVisual) -> VisionItem:
        item = super().make_item(image)
        if item.kind == "video":
            # frames handed over already decoded carry no source times: their sampled rate stands in
            times = image.frame_times_s or tuple(i / image.fps for i in range(image.num_frames))
            item.group_times_s = video.group_times(times, self.video_config.temporal_patch_size)
        return item

    def replaced_around(self, kind: VisualKind) -> tuple[tuple[int, ...], tuple[int, ...]]:
        # The template wraps a video's placeholder in vision start/end, and every temporal group brings its own:
        # the model's original processor replaces the three tokens (transformers 5.23's keeps the outer pair).
        return ((self.vision_start_token_id,), (self.vision_end_token_id,)) if kind == "video" else ((), ())

    def placeholder_ids(self, item: VisionItem, index: int, tokenizer) -> list[int]:
        """An image's run of image tokens; a video's temporal groups, each as `<t seconds>`, vision start, its
        run of video tokens, vision end (`Qwen3VLProcessor.replace_video_token`)."""
        if item.kind != "video":
            return super().placeholder_ids(item, index, tokenizer)
        _, h, w = item.grid
        run = [self.vision_start_token_id, *[self.video_token_id] * (h * w // self.merge**2), self.vision_end_token_id]
        return [token for seconds in item.group_times_s
                for token in tokenizer.encode(video.timestamp_text(seconds), add_special_tokens=False) + run]

    def tower_class(self):
        """transformers' vision model this tower runs (Qwen3.5's shares everything here but its class)."""
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        return Qwen3VLVisionModel

    def load_tower(self, device: torch.device, dtype: torch.dtype) -> "Qwen3VLVisionTower":
        return Qwen3VLVisionTower(self, device, dtype)


def _attention_flops_model(vc, levels: int):
    """FLOPs of one unit through the tower: every block attends over its whole temporal group (O(N^2)
    per group), linear layers are O(N); the merger runs once plus once per deepstack level."""
    d, m = vc.hidden_size, vc.intermediate_size
    patch_in = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    merge_unit = vc.spatial_merge_size**2

    def flops(grid: tuple[int, int, int]) -> float:
        t, h, w = grid
        n, group = t * h * w, h * w
        linear = 2 * n * (4 * d * d + 2 * d * m) * vc.depth  # qkv + proj, two-layer MLP
        attention = 4 * n * group * d * vc.depth
        embed = 2 * n * patch_in * d
        merger = 2 * (n // merge_unit) * (d * merge_unit) * (d * merge_unit + vc.out_hidden_size) * (1 + levels)
        return float(linear + attention + embed + merger)

    return flops


class Qwen3VLVisionTower(VisionTower):
    packs_to_budgets = True  # metadata outside the forward: `tower_metadata.py`

    def __init__(self, adapter: Qwen3VLVisionAdapter, device: torch.device, dtype: torch.dtype):
        from transformers.initialization import no_init_weights

        self.adapter = adapter
        self.device = torch.device(device)
        self.dtype = dtype
        with no_init_weights():  # weights come from the checkpoint; skip the random init
            model = adapter.tower_class()._from_config(adapter.vision_config, dtype=dtype, attn_implementation="sdpa")
        state = load_tensors(adapter.checkpoint, VISION_PREFIXES, dtype=dtype)
        load_module_weights(model, state, what=f"{adapter.checkpoint} vision tower")
        self.model = model.to(self.device).eval()

    @property
    def lora_root(self) -> torch.nn.Module:
        return self.model

    @torch.inference_mode()
    def encode(self, items: list[VisionItem]) -> list[torch.Tensor]:
        """One forward over a shard; per item its rows with every deepstack level on the columns."""
        if not items:
            return []
        pixel_values, grid_thw = tower_inputs(self.adapter, items)
        out = self.model(pixel_values.to(self.device, self.dtype), grid_thw=grid_thw.to(self.device))
        embeddings = tower_metadata.with_levels(out)
        return [chunk.cpu() for chunk in torch.split(embeddings, [item.num_tokens for item in items])]

    def budget_tokens(self, item: VisionItem) -> int:
        """Patches through the tower: t * h * w."""
        t, h, w = item.grid
        return t * h * w

    def prepare(self, items: list[VisionItem], budget: int, static: bool = False) -> PreparedForward:
        pixel_values, grid_thw = tower_inputs(self.adapter, items)
        tensors, scalars = tower_metadata.prepare(self.model, pixel_values, grid_thw, budget, static)
        return PreparedForward(budget, tensors, scalars, [item.num_tokens for item in items])

    def forward_prepared(self, tensors: dict[str, torch.Tensor], scalars: dict[str, int]) -> torch.Tensor:
        return tower_metadata.forward(self.model, **tensors, **scalars)
