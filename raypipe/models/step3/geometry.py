"""Step3's crop plan and placeholder layout, from the checkpoint's image processor settings alone.

An image becomes a global view (`size` px square) plus `nx * ny` sliding-window crops
(`patch_size` px after resizing), decided by transformers' `Step3p7ImageProcessor._plan_patches`
(extreme aspect ratios squared by padding, oversized images scaled down, window chosen by aspect
ratio, sides snapped to the window). The ViT downsamples by `vision_patch_size * downsampler_stride`,
so a crop yields `(patch_size // stride)^2` embedding rows and the global view `(size // stride)^2`.

The prompt lays an image out crops first, row-major, then the global view — the order
`Step3p7Model.get_image_features` concatenates them in:

    <patch_start> crop0 <patch_end> <patch_start> crop1 <patch_end> <patch_newline> ... <im_start> global <im_end>

(`<patch_newline>` after the last crop of every crop row but the last.) `Step3Grid` is what travels
with a prompt: the crop grid `(nx, ny)`, `(0, 0)` for an image without crops.
"""

from __future__ import annotations

import dataclasses

IMAGE_TOKEN = "<im_patch>"
PATCH_START, PATCH_END, PATCH_NEWLINE = "<patch_start>", "<patch_end>", "<patch_newline>"
IMAGE_START, IMAGE_END = "<im_start>", "<im_end>"
LAYOUT_TOKENS = (IMAGE_TOKEN, PATCH_START, PATCH_END, PATCH_NEWLINE, IMAGE_START, IMAGE_END)


@dataclasses.dataclass(frozen=True, slots=True)
class Step3Geometry:
    processor: object  # a Step3p7ImageProcessor (settings and `_plan_patches` only)

    @property
    def global_size(self) -> int:
        return self.processor.size["height"]

    @property
    def crop_size(self) -> int:
        return self.processor.patch_size

    @property
    def stride(self) -> int:
        return self.processor.vision_patch_size * self.processor.downsampler_stride

    @property
    def global_tokens(self) -> int:
        return (self.global_size // self.stride) ** 2

    @property
    def crop_tokens(self) -> int:
        return (self.crop_size // self.stride) ** 2

    def crop_grid(self, height: int, width: int) -> tuple[int, int]:
        """`(nx, ny)` crops of an image, `(0, 0)` when it is only the global view."""
        *_, window, nx, ny, _ = self.processor._plan_patches(width, height, self.global_size, self.crop_size)
        return (nx, ny) if window else (0, 0)

    def num_tokens(self, grid: tuple[int, int]) -> int:
        """Embedding rows of one image (= `<im_patch>` tokens in its placeholder)."""
        return grid[0] * grid[1] * self.crop_tokens + self.global_tokens

    def token_runs(self, grid: tuple[int, int]) -> list[int]:
        """Lengths of the image's runs of `<im_patch>`, in prompt order (crops, then the global view)."""
        return [self.crop_tokens] * (grid[0] * grid[1]) + [self.global_tokens]

    def placeholder_ids(self, grid: tuple[int, int], token_id) -> list[int]:
        """The image's token ids, given `token_id(token string) -> id`."""
        nx, ny = grid
        pad, start, end, newline = (token_id(t) for t in (IMAGE_TOKEN, PATCH_START, PATCH_END, PATCH_NEWLINE))
        ids: list[int] = []
        for row in range(ny):
            for col in range(nx):
                ids += [start] + [pad] * self.crop_tokens + [end]
                if col == nx - 1 and row < ny - 1:
                    ids.append(newline)
        return ids + [token_id(IMAGE_START)] + [pad] * self.global_tokens + [token_id(IMAGE_END)]
