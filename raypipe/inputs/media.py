"""Visual items: what the generic layers (prompt, encoders, decoder, limits, batch rows) carry, whatever their kind.

A visual item is validated pixels plus a hash of them (the embedding-cache key), tagged with its
`kind`: an `image` is `(H, W, 3)` uint8, decoded by `raypipe.inputs.images`; a `video` is its sampled
frames, `(T, H, W, 3)` uint8, decoded by `raypipe.inputs.video`, with the rate of those frames. Each
kind has its decoder, its content-part types (`raypipe.models.prompt.VISUAL_PART_KINDS`), its
placeholder token (`placeholder_token_ids` of the family adapters) and its limits -- not a parallel path.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Literal

import numpy as np

VisualKind = Literal["image", "video"]
VISUAL_KINDS: tuple[VisualKind, ...] = ("image", "video")


@dataclasses.dataclass(slots=True)
class DecodedVisual:
    """A visual item that passed validation, with a hash of its pixels (the embedding-cache key)."""

    pixels: np.ndarray  # image: (H, W, 3) uint8; video: (T, H, W, 3) uint8 sampled frames; C-contiguous
    content_hash: str
    kind: VisualKind = "image"
    fps: float | None = None  # video: frames per second of the sampled frames (time between them)
    # video: the source's length as frames / rate (as transformers' decoders count it); a family whose frame
    # plan groups frames by second of video (MiniCPM-V's canvases) reads it again to rebuild that grouping
    duration_s: float | None = None
    # a family's processing of the item chosen per prompt (`VisionAdapter.prompt_visuals`; LLaVA-OneVision's
    # "base_view"), already in `pixels` and `content_hash`; None: the family's default
    variant: str | None = None
    # video: each kept frame's time in the source (its index / the source's rate), in `pixels` order; a family that
    # writes times in the prompt (Qwen3-VL's timestamps) reads them
    frame_times_s: tuple[float, ...] | None = None

    @property
    def num_frames(self) -> int:
        return self.pixels.shape[0] if self.kind == "video" else 1

    @property
    def height(self) -> int:
        return self.pixels.shape[-3]

    @property
    def width(self) -> int:
        return self.pixels.shape[-2]


def pixel_hash(pixels: np.ndarray) -> str:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr(pixels.shape).encode())
    digest.update(memoryview(np.ascontiguousarray(pixels)).cast("B"))
    return digest.hexdigest()
