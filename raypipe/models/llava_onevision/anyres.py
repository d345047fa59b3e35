"""LLaVA-OneVision's AnyRes layout: an image is a base view plus a grid of tiles, all of the tower's size.

The image processor picks the grid pinpoint (`select_best_resolution`) that fits the image best,
resizes the image into it keeping its aspect ratio, pads the rest, and cuts it into `rows x cols`
tiles; the base view is the whole image squashed to one tile. The model then puts the tiles'
feature maps side by side into one `(rows*side, cols*side)` map, crops the padding back off
(`unpad_image`), shrinks the map bilinearly when it holds more than `anyres_max_N` tiles' worth of
features (by more than 1.1x in area ratio), appends the `image_newline` row embedding after every
map row, and puts the base view's features first.

An image among several in one prompt gets its base view alone (see `vision.py`): a grid of 0 x 0 tiles,
whose rows are the base view's and one newline row (`pack_image_features` on an image of one view).

`num_tokens` mirrors `LlavaOnevisionProcessor._get_number_of_features` (and `replace_image_token`'s
`num_image_tokens + 1` for a base view alone); `pack` mirrors `LlavaOnevisionModel.pack_image_features`
for one image, on features that arrive per tile (tiles may be encoded on different workers). Grid:
`(rows, cols, height, width)`, the tile grid and the image's size.
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True, slots=True)
class AnyRes:
    tile: int  # tower input side in pixels (vision_config.image_size)
    side: int  # feature-map side of one tile (image_size // patch_size)
    pinpoints: tuple[tuple[int, int], ...]  # (height, width) of the possible resized images
    max_tiles: int  # anyres_max_N: the packed map is shrunk to about N tiles' worth of features

    @classmethod
    def from_config(cls, config) -> "AnyRes":
        vc = config.vision_config
        ratio = config.vision_aspect_ratio
        if not ratio.startswith("anyres_max_"):
            raise ValueError(f"vision_aspect_ratio {ratio!r}: only 'anyres_max_N' is supported")
        return cls(vc.image_size, vc.image_size // vc.patch_size,
                   tuple((int(h), int(w)) for h, w in config.image_grid_pinpoints), int(ratio[len("anyres_max_"):]))

    def grid(self, height: int, width: int) -> tuple[int, int, int, int]:
        from transformers.image_processing_utils import select_best_resolution

        best_h, best_w = select_best_resolution((height, width), [list(p) for p in self.pinpoints])
        return best_h // self.tile, best_w // self.tile, height, width

    def map_shape(self, grid) -> tuple[int, int, float]:
        """`(height, width, ratio)` of the tiles' feature map after unpadding; ratio > 1.1 means it is shrunk."""
        rows, cols, height, width = grid
        map_h, map_w = rows * self.side, cols * self.side
        if width / height > map_w / map_h:
            map_h -= (map_h - int(round(height * (map_w / width), 7))) // 2 * 2
        else:
            map_w -= (map_w - int(round(width * (map_h / height), 7))) // 2 * 2
        return map_h, map_w, math.sqrt(map_h * map_w / (self.max_tiles * self.side**2))

    def num_tokens(self, grid, base_tokens: int) -> int:
        """Rows of one image: the base view's, then the (maybe shrunk) tile map with one newline per row."""
        if not grid[0]:  # the base view alone: its rows, then one newline row
            return base_tokens + 1
        map_h, map_w, ratio = self.map_shape(grid)
        if ratio > 1.1:
            map_h, map_w = int(map_h // ratio), int(map_w // ratio)
        return base_tokens + map_h * (map_w + 1)

    def pack(self, grid, base: torch.Tensor, tiles: list[torch.Tensor], newline: torch.Tensor) -> torch.Tensor:
        """One image's embedding from its base view's rows `(side², D)`, its tiles' rows in row-major order
        and the `image_newline` vector `(D,)`."""
        rows, cols, height, width = grid
        if not rows:
            return torch.cat((base, newline[None].to(base.dtype)))
        side = self.side
        features = torch.stack(tiles).view(rows, cols, side, side, -1)
        features = features.permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)  # (D, rows*side, cols*side)
        map_h, map_w, ratio = self.map_shape(grid)
        top, left = (features.shape[1] - map_h) // 2, (features.shape[2] - map_w) // 2
        features = features[:, top: top + map_h, left: left + map_w]
        if ratio > 1.1:
            features = torch.nn.functional.interpolate(features[None], [int(map_h // ratio), int(map_w // ratio)],
                                                       mode="bilinear")[0]
        newlines = newline[:, None, None].expand(*features.shape[:-1], 1).to(features.dtype)
        features = torch.cat((features, newlines), dim=-1).flatten(1, 2).transpose(0, 1)
        return torch.cat((base, features))
