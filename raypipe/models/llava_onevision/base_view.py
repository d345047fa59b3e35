"""The base view of an image that is not tiled: transformers' `pad_to_square` then `resize`, without the square.

`LlavaOnevisionImageProcessorPil._preprocess` pads such an image to a `max(h, w)` square in the mean
colour, then resizes it to the tower's square with Pillow. Building that square costs `max(h, w)²`
pixels: an image the limits accept (200:1, 40 MP) would need tens of GB. Pillow resamples in two
passes, each row horizontally, then each column vertically, on a uint8 image in between; rows are
independent in the first pass, so this builds the square's image rows a band at a time, resizes each
band horizontally (the padding rows above and below all come out as one), and runs the vertical
pass on the stacked `(max(h, w), side)` result: the same bytes as resizing the whole square, in
memory that grows with `max(h, w)`, not its square (a tall image's padded rows still cost their time).
"""

from __future__ import annotations

import numpy as np
from PIL import Image

BAND_BYTES = 1 << 24  # the square's rows built at a time


def base_view(pixels: np.ndarray, side: int, color: tuple[int, int, int], resample) -> np.ndarray:
    """`(h, w, 3)` uint8 -> `(side, side, 3)` uint8: the image centred on a `color` square, resized to `side`."""
    height, width, _ = pixels.shape
    size = max(height, width)
    top, left = (size - height) // 2, (size - width) // 2  # `pad_to_square`'s offsets
    band = max(1, BAND_BYTES // (3 * size))

    def horizontal(first: int, last: int) -> np.ndarray:
        square = np.empty((last - first, size, 3), np.uint8)
        square[:] = color
        start, stop = max(first, top), min(last, top + height)  # the image's rows in this band
        if start < stop:
            square[start - first: stop - first, left: left + width] = pixels[start - top: stop - top]
        return np.asarray(Image.fromarray(square).resize((side, last - first), resample))

    # Every padding row above and below the image comes out the same; the last row is one when there are any.
    padding_row = horizontal(size - 1, size) if height < size else None
    rows = [np.broadcast_to(padding_row, (top, side, 3))] if top else []
    rows += [horizontal(first, min(first + band, top + height)) for first in range(top, top + height, band)]
    if size - top - height:
        rows.append(np.broadcast_to(padding_row, (size - top - height, side, 3)))
    return np.asarray(Image.fromarray(np.concatenate(rows)).resize((side, side), resample))
