"""MiniCPM-V 4.6 vision side: an image is an overview plus up to `max_slice_nums` slices, each a unit.

Geometry comes from transformers' own `MiniCPMV4_6ImageProcessorPil` methods (`get_sliced_grid`,
`find_best_resize`, `get_refine_size`), so token counts match its processor. An image item's `grid`
is `(rows, cols, overview_h, overview_w, slice_h, slice_w)` in patches (rows = cols = 0: no slices).

A video (`video.py`: transformers' `MiniCPMV4_6VideoProcessor`) is a sequence of visual units, main
frames and per-second canvases of sub-second frames, each resized and sliced like an image by the video
processor. Its `grid` is 7 fields per visual unit: the sub-second frames it holds (0: a main frame),
then the unit's 6 image fields. Its work units are every visual unit's overview and slices, so one
video's frames spread over all workers next to the images of the batch.

`units` cuts an image into its overview and its slices (resized and cropped with the processor's
own resize and `divide_to_patches`, still uint8), in the order the language model reads them:
overview, then slices row by row. The tower encodes any set of units as one NaViT-packed batch
(attention is per unit), so slices of one image may go to different workers; the coordinator
concatenates the units' embeddings back in that order. Each unit's rows are what transformers'
`get_image_features(...).pooler_output` gives for it.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import torch

from raypipe.errors import InvalidInput
from raypipe.inputs.media import DecodedVisual
from raypipe.inputs.video import PlanFrames, VideoSampling
from raypipe.models.base import PreparedForward, VisionAdapter, VisionItem, VisionTower, VisualLayout, check_cost_model
from raypipe.models.checkpoint import load_module_weights, load_tensors
from raypipe.models.minicpmv4_6 import tower_metadata, video

TOWER_PREFIXES = ("model.vision_tower.",)
MERGER_PREFIXES = ("model.merger.",)
IMAGE_FIELDS = 6  # (rows, cols, overview_h, overview_w, slice_h, slice_w) of an image or a video's visual unit


class MiniCPMV4_6VisionAdapter(VisionAdapter):
    # Balance slices, not whole images: an image is up to 10 units, so whole images cap the balance
    # at its largest image. Measured (per-unit times, 24 heavy-tailed images, tiny preset, shared
    # CPU): makespan / lower bound at n=4 and 8 was 1.19 / 1.26 over units vs 1.33 / 1.56 over images
    # (`raypipe bench encode --model tiny-minicpmv`).
    split_units = True

    def __init__(self, checkpoint: str | pathlib.Path):
        from transformers import AutoConfig
        from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import MiniCPMV4_6ImageProcessorPil

        self.checkpoint = pathlib.Path(checkpoint)
        self.config = AutoConfig.from_pretrained(self.checkpoint)
        self.hidden_size = self.config.text_config.hidden_size
        self.image_token_id = self.config.image_token_id
        self.video_token_id = self.config.video_token_id
        self.processor = MiniCPMV4_6ImageProcessorPil.from_pretrained(self.checkpoint)
        self.video_processor = video.load_processor(self.checkpoint)
        p = self.processor
        self.patch = p.patch_size
        # Token counts follow from a grid alone, whatever its kind: both processors must merge alike.
        if (self.video_processor.downsample_mode, self.video_processor.patch_size) != (p.downsample_mode, p.patch_size):
            raise ValueError(f"{self.checkpoint}: image and video processors differ in downsample_mode/patch_size")
        self.divisor = 4 if p.downsample_mode == "4x" else 16  # patches per embedding row
        self._flops = _flops_model(self.config)
        self._canvas_sizes: dict[tuple[int, int, int], tuple[int, int]] = {}

    # ---- geometry (no pixels touched) ----

    def grid_for(self, height: int, width: int, processor=None) -> tuple[int, int, int, int, int, int]:
        """The 6 image fields of an image (or, with the video processor, a video's visual unit) of this size."""
        p = processor or self.processor
        best = p.get_sliced_grid((height, width), p.max_slice_nums, p.scale_resolution) if p.slice_mode else None
        # Keywords: the image and video processors order these parameters differently.
        oh, ow = p.find_best_resize((height, width), scale_resolution=p.scale_resolution, patch_size=self.patch,
                                    downsample_mode=p.downsample_mode, allow_upscale=best is None)
        if best is None:
            return (0, 0, oh // self.patch, ow // self.patch, 0, 0)
        rh, rw = p.get_refine_size((height, width), best, scale_resolution=p.scale_resolution, patch_size=self.patch,
                                   downsample_mode=p.downsample_mode, allow_upscale=True)
        rows, cols = best
        return (rows, cols, oh // self.patch, ow // self.patch, rh // rows // self.patch, rw // cols // self.patch)

    def image_grids(self, grid) -> list[tuple[int, ...]]:
        """The 6 image fields of an image's grid, or of each visual unit of a video's grid."""
        if len(grid) == IMAGE_FIELDS:
            return [tuple(grid)]
        step = IMAGE_FIELDS + 1
        return [tuple(grid[k + 1:k + step]) for k in range(0, len(grid), step)]

    def unit_grids(self, grid) -> list[tuple[int, int]]:
        out = []
        for rows, cols, oh, ow, sh, sw in self.image_grids(grid):
            out += [(oh, ow)] + [(sh, sw)] * (rows * cols)
        return out

    def token_runs(self, grid) -> list[int]:
        """Placeholder run lengths of one image or video in the prompt: overview, then each slice (per visual unit)."""
        return [h * w // self.divisor for h, w in self.unit_grids(grid)]

    # ---- videos ----

    def plan_frames(self, sampling: VideoSampling) -> PlanFrames:
        return video.frame_planner(self.video_processor, sampling)

    def video_grid(self, visual: DecodedVisual) -> tuple[int, ...]:
        """7 fields per visual unit: its sub-second frames (0: a main frame), then its 6 image fields."""
        grid: tuple[int, ...] = ()
        for subs in video.visual_units(visual.num_frames, visual.duration_s, self.video_processor):
            key = (max(subs, 1), visual.height, visual.width)
            if key not in self._canvas_sizes:
                self._canvas_sizes[key] = video.canvas_size(self.video_processor, *key)
            grid += (subs, *self.grid_for(*self._canvas_sizes[key], self.video_processor))
        return grid

    def layout(self, visual: DecodedVisual, item: VisionItem, pruning_rate: float = 0.0) -> VisualLayout:
        if item.kind == "video" and pruning_rate > 0:
            raise InvalidInput("EVS (video_pruning_rate) is not supported for MiniCPM-V videos",
                               item="video_pruning_rate", code="invalid_video_pruning_rate")
        return VisualLayout(item.kind, tuple(item.grid))

    def placeholder_ids(self, item: VisionItem, index: int, tokenizer) -> list[int]:
        """What `MiniCPMV4_6Processor` puts for the `index`-th image (or video) of a prompt:
        `<image_id>index</image_id>` (if the processor uses image ids), `<image>` overview `</image>`, then
        one `<slice>...</slice>` per slice, rows separated by a newline -- for a video, that per visual unit,
        with `<|video_pad|>`. Special tokens delimit every piece, so tokenizing it alone gives the same ids
        as the processor's tokenizing of the whole prompt."""
        t = tokenizer
        text = f"{t.image_id_start_token}{index}{t.image_id_end_token}" if self.processor.use_image_id else ""
        if item.kind != "video":
            return t.encode(text + self._unit_text(item.grid, t.image_token, t), add_special_tokens=False)
        # A video: its id once, then each visual unit's overview and slices back to back (`replace_video_token`).
        return t.encode(text + "".join(self._unit_text(g, t.video_token, t) for g in self.image_grids(item.grid)),
                        add_special_tokens=False)

    def _unit_text(self, grid, pad: str, t) -> str:
        runs = self.token_runs(grid)
        rows, cols = grid[:2]
        text = t.image_start_token + pad * runs[0] + t.image_end_token
        slices = [t.slice_start_token + pad * n + t.slice_end_token for n in runs[1:]]
        return text + "\n".join("".join(slices[r * cols:(r + 1) * cols]) for r in range(rows))

    def make_item(self, image: DecodedVisual) -> VisionItem:
        grid = self.video_grid(image) if image.kind == "video" else self.grid_for(image.height, image.width)
        return VisionItem(image.pixels, image.content_hash, grid, sum(self.token_runs(grid)), kind=image.kind)

    def units(self, item: VisionItem) -> list[VisionItem]:
        if item.kind == "video":
            return self._video_units(item)
        from transformers.image_transforms import divide_to_patches
        from transformers.image_utils import SizeDict

        p = self.processor
        rows, cols, oh, ow, sh, sw = item.grid
        chw = np.ascontiguousarray(np.moveaxis(item.pixels, -1, 0))

        def resized(h: int, w: int) -> np.ndarray:
            return p.resize(chw, size=SizeDict(height=h * self.patch, width=w * self.patch), resample=p.resample)

        pieces = [resized(oh, ow)]
        if rows:
            pieces += divide_to_patches(resized(sh * rows, sw * cols), (sh * self.patch, sw * self.patch))
        return [VisionItem(np.ascontiguousarray(np.moveaxis(piece, 0, -1)), f"{item.content_hash}:{k}",
                           (piece.shape[1] // self.patch, piece.shape[2] // self.patch),
                           piece.shape[1] * piece.shape[2] // self.patch**2 // self.divisor)
                for k, piece in enumerate(pieces)]

    def _video_units(self, item: VisionItem) -> list[VisionItem]:
        """Each visual unit (a main frame, or a canvas built from full-size sub-second frames) cut into its
        overview and slices by the video processor, in the order `get_video_features` returns their rows."""
        frames = torch.from_numpy(item.pixels).permute(0, 3, 1, 2)  # (T, C, H, W) view
        grids = self.image_grids(item.grid)
        subs = item.grid[::IMAGE_FIELDS + 1]
        next_main, next_sub = 0, subs.count(0)  # main frames first, then sub-second frames in time order
        out = []
        for count, grid in zip(subs, grids):
            if count == 0:
                pixels, next_main = frames[next_main:next_main + 1], next_main + 1
            else:
                pixels = self.video_processor.concat_frames_as_image(frames[next_sub:next_sub + count])
                next_sub += count
            pieces = video.pieces(pixels, self.video_processor)
            want = [(h * self.patch, w * self.patch) for h, w in self.unit_grids(grid)]
            if [tuple(piece.shape[-2:]) for piece in pieces] != want:
                raise RuntimeError(f"video processor made pieces {[tuple(x.shape) for x in pieces]}, predicted {want}")
            for piece in pieces:
                h, w = piece.shape[-2] // self.patch, piece.shape[-1] // self.patch
                out.append(VisionItem(np.ascontiguousarray(piece.permute(1, 2, 0).numpy()),
                                      f"{item.content_hash}:{len(out)}", (h, w), h * w // self.divisor,
                                      unit_index=len(out), kind="video"))
        return out

    def cost(self, item: VisionItem, cost_model: str = "patches") -> float:
        """Cost of an image or video (6- or 7k-field grid) or of one unit (2-field grid)."""
        check_cost_model(cost_model)
        grids = [item.grid] if len(item.grid) == 2 else self.unit_grids(item.grid)
        if cost_model == "attention":
            return sum(self._flops(h * w) for h, w in grids)
        return float(sum(h * w for h, w in grids))

    def load_tower(self, device: torch.device, dtype: torch.dtype) -> "MiniCPMV4_6VisionTower":
        return MiniCPMV4_6VisionTower(self, device, dtype)


def _flops_model(config):
    """FLOPs of one unit of `n` patches through tower and mergers, counting what grows with its size.

    Every SigLIP layer attends over the whole unit (O(n^2)); layers after the window merger see n/4
    patches. The window merger attends within 2x2 windows and runs its MLP on n/4 windows; the
    downsample MLP runs on n/16 rows. Slices are at most `scale_resolution` square, so the quadratic
    term is bounded per unit: cutting an image into units is what lets a balancer spread it.
    """
    vc = config.vision_config
    d, m, depth, out = vc.hidden_size, vc.intermediate_size, vc.num_hidden_layers, config.text_config.hidden_size
    before = vc.insert_layer_id + 1

    def layer(k: float) -> float:
        return 2 * k * (4 * d * d + 2 * d * m) + 4 * k * k * d  # projections + MLP, then QK^T and AV

    def flops(n: int) -> float:
        window_merger = 2 * n * 4 * d * d + 4 * n * 4 * d + 2 * (n / 4) * (4 * d * 4 * m + 4 * m * d)
        downsample = 2 * (n / 16) * (4 * d * 4 * d + 4 * d * out)
        return float(before * layer(n) + (depth - before) * layer(n / 4) + window_merger + downsample)

    return flops


@dataclasses.dataclass(slots=True)
class _Packed:
    pixel_values: torch.Tensor  # (1, C, patch, sum of patches * patch): NaViT-packed
    target_sizes: torch.Tensor  # (units, 2) in patches


class MiniCPMV4_6VisionTower(VisionTower):
    packs_to_budgets = True  # metadata outside the forward: `tower_metadata.py` (sdpa: no CUDA graphs)

    def __init__(self, adapter: MiniCPMV4_6VisionAdapter, device: torch.device, dtype: torch.dtype):
        from transformers.initialization import no_init_weights
        from transformers.models.minicpmv4_6.modeling_minicpmv4_6 import MiniCPMV4_6Merger, MiniCPMV4_6VisionModel

        self.adapter = adapter
        self.device = torch.device(device)
        self.dtype = dtype
        with no_init_weights():  # weights come from the checkpoint; skip the random init
            tower = MiniCPMV4_6VisionModel._from_config(adapter.config.vision_config, dtype=dtype)
            merger = MiniCPMV4_6Merger(adapter.config).to(dtype)
        load_module_weights(tower, load_tensors(adapter.checkpoint, TOWER_PREFIXES, dtype=dtype),
                            what=f"{adapter.checkpoint} vision tower")
        load_module_weights(merger, load_tensors(adapter.checkpoint, MERGER_PREFIXES, dtype=dtype),
                            what=f"{adapter.checkpoint} merger")
        self.tower = tower.to(self.device).eval()
        self.merger = merger.to(self.device).eval()
        self.use_vit_merger = adapter.config.downsample_mode != "4x"

    @property
    def lora_root(self) -> torch.nn.Module:
        return torch.nn.ModuleDict({"vision_tower": self.tower, "merger": self.merger})

    def pack(self, units: list[VisionItem]) -> _Packed:
        """The processor's own rescale, normalize and patch layout, on already resized units."""
        p = self.adapter.processor
        pieces = []
        for unit in units:
            if unit.kind == "video":  # the video processor's own (fused, torch) rescale and normalize
                pieces.append(video.pack_piece(unit.pixels, self.adapter.video_processor))
                continue
            x = p.rescale(np.moveaxis(unit.pixels, -1, 0), p.rescale_factor)
            pieces.append(torch.from_numpy(p.reshape_by_patch(p.normalize(x, p.image_mean, p.image_std), p.patch_size)))
        pixel_values = torch.cat(pieces, dim=-1)[None]
        return _Packed(pixel_values, torch.tensor([u.grid for u in units], dtype=torch.int32))

    @torch.inference_mode()
    def encode(self, items: list[VisionItem]) -> list[torch.Tensor]:
        """One `(tokens, hidden)` tensor per unit (items here are units: see the adapter's `units`)."""
        if not items:
            return []
        packed = self.pack(items)
        sizes = packed.target_sizes.to(self.device)
        hidden = self.tower(packed.pixel_values.to(self.device, self.dtype), target_sizes=sizes,
                            use_vit_merger=self.use_vit_merger).last_hidden_state
        features = self.merger(hidden, sizes // 2 if self.use_vit_merger else sizes)
        return [f.cpu() for f in features]

    def budget_tokens(self, item: VisionItem) -> int:
        """Patches through the tower: a unit's h * w."""
        h, w = item.grid
        return h * w

    def prepare(self, items: list[VisionItem], budget: int, static: bool = False) -> PreparedForward:
        packed = self.pack(items)
        meta = tower_metadata.prepare(self.tower, self.merger, packed.pixel_values, packed.target_sizes,
                                      self.use_vit_merger, budget)
        return PreparedForward(budget, meta.tensors(), {"max_seqlen": meta.max_seqlen,
                                                        "max_merged_seqlen": meta.max_merged_seqlen},
                               [item.num_tokens for item in items])

    def forward_prepared(self, tensors: dict[str, torch.Tensor], scalars: dict[str, int]) -> torch.Tensor:
        return tower_metadata.forward(self.tower, self.merger, self.use_vit_merger, tensors, **scalars)
