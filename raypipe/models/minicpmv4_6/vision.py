"""MiniCPM-V 4.6 vision side: an image is an overview plus up to `max_slice_nums` slices, each a unit.

Geometry comes from transformers' own `MiniCPMV4_6ImageProcessorPil` methods (`get_sliced_grid`,
`find_best_resize`, `get_refine_size`), so token counts match its processor. An image item's `grid`
is `(rows, cols, overview_h, overview_w, slice_h, slice_w)` in patches (rows = cols = 0: no slices).

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

from raypipe.inputs.media import DecodedVisual
from raypipe.models.base import VisionAdapter, VisionItem, VisionTower, check_cost_model
from raypipe.models.checkpoint import load_module_weights, load_tensors

TOWER_PREFIXES = ("model.vision_tower.",)
MERGER_PREFIXES = ("model.merger.",)


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
        self.processor = MiniCPMV4_6ImageProcessorPil.from_pretrained(self.checkpoint)
        p = self.processor
        self.patch = p.patch_size
        self.divisor = 4 if p.downsample_mode == "4x" else 16  # patches per embedding row
        self._flops = _flops_model(self.config)

    # ---- geometry (no pixels touched) ----

    def grid_for(self, height: int, width: int) -> tuple[int, int, int, int, int, int]:
        p = self.processor
        best = p.get_sliced_grid((height, width), p.max_slice_nums, p.scale_resolution) if p.slice_mode else None
        oh, ow = p.find_best_resize((height, width), p.scale_resolution, self.patch, p.downsample_mode,
                                    allow_upscale=best is None)
        if best is None:
            return (0, 0, oh // self.patch, ow // self.patch, 0, 0)
        rh, rw = p.get_refine_size((height, width), best, p.scale_resolution, self.patch, p.downsample_mode,
                                   allow_upscale=True)
        rows, cols = best
        return (rows, cols, oh // self.patch, ow // self.patch, rh // rows // self.patch, rw // cols // self.patch)

    def unit_grids(self, grid) -> list[tuple[int, int]]:
        rows, cols, oh, ow, sh, sw = grid
        return [(oh, ow)] + [(sh, sw)] * (rows * cols)

    def token_runs(self, grid) -> list[int]:
        """Image-token run lengths of one image in the prompt: overview, then each slice."""
        return [h * w // self.divisor for h, w in self.unit_grids(grid)]

    def placeholder_ids(self, item: VisionItem, index: int, tokenizer) -> list[int]:
        """What `MiniCPMV4_6Processor` puts for the `index`-th image of a prompt: `<image_id>index</image_id>`
        (if the processor uses image ids), `<image>` overview `</image>`, then one `<slice>...</slice>`
        per slice, rows separated by a newline. Special tokens delimit every piece, so tokenizing it
        alone gives the same ids as the processor's tokenizing of the whole prompt."""
        t = tokenizer
        runs = self.token_runs(item.grid)
        rows, cols = item.grid[:2]
        text = f"{t.image_id_start_token}{index}{t.image_id_end_token}" if self.processor.use_image_id else ""
        text += t.image_start_token + t.image_token * runs[0] + t.image_end_token
        slices = [t.slice_start_token + t.image_token * n + t.slice_end_token for n in runs[1:]]
        text += "\n".join("".join(slices[r * cols:(r + 1) * cols]) for r in range(rows))
        return t.encode(text, add_special_tokens=False)

    def make_item(self, image: DecodedVisual) -> VisionItem:
        grid = self.grid_for(image.height, image.width)
        return VisionItem(image.pixels, image.content_hash, grid, sum(self.token_runs(grid)))

    def units(self, item: VisionItem) -> list[VisionItem]:
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

    def cost(self, item: VisionItem, cost_model: str = "patches") -> float:
        """Cost of an image (6-field grid) or of one unit (2-field grid)."""
        check_cost_model(cost_model)
        grids = self.unit_grids(item.grid) if len(item.grid) == 6 else [item.grid]
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

    def pack(self, units: list[VisionItem]) -> _Packed:
        """The processor's own rescale, normalize and patch layout, on already resized units."""
        p = self.adapter.processor
        pieces = []
        for unit in units:
            x = p.rescale(np.moveaxis(unit.pixels, -1, 0), p.rescale_factor)
            pieces.append(p.reshape_by_patch(p.normalize(x, p.image_mean, p.image_std), p.patch_size))
        pixel_values = torch.from_numpy(np.concatenate(pieces, axis=-1)[None])
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
