"""The benchmarks' cheap distinct PNGs decode, with Pillow, to exactly the pixels they were made from."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from raypipe.bench.png_variants import distinct_pngs


def test_distinct_pngs_decode_to_their_pixels():
    base = np.random.default_rng(0).integers(0, 256, (301, 77, 3), dtype=np.uint8)
    heads = [np.full((5, 77, 3), value, np.uint8) for value in (0, 7, 255)]
    pngs = distinct_pngs(base, heads)
    assert len(set(pngs)) == 3
    for head, png in zip(heads, pngs):
        expected = base.copy()
        expected[:5] = head
        np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(png)).convert("RGB")), expected)
