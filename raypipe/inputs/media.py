"""Visual items: what the generic layers (prompt, encoders, decoder, limits, batch rows) carry, whatever their kind.

A visual item is validated pixels plus a hash of them (the embedding-cache key), tagged with its
`kind`. Only `image` exists now: `(H, W, 3)` uint8, decoded by `raypipe.inputs.images`. Another kind
(video: `(T, H, W, 3)` frames) adds itself to `VisualKind`/`VISUAL_KINDS`, a decoder beside
images.py, its content-part types (`raypipe.models.prompt.VISUAL_PART_KINDS`), its placeholder token
(`placeholder_token_ids` of the family adapters) and its limits -- not a parallel path.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Literal

import numpy as np

VisualKind = Literal["image"]
VISUAL_KINDS: tuple[VisualKind, ...] = ("image",)


@dataclasses.dataclass(slots=True)
class DecodedVisual:
    """A visual item that passed validation, with a hash of its pixels (the embedding-cache key)."""

    pixels: np.ndarray  # image: (H, W, 3) uint8, C-contiguous
    content_hash: str
    kind: VisualKind = "image"

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
