"""Which way up a video is shown: the display matrix a container carries (every phone writes one; MP4's
`tkhd` matrix, Matroska's projection), applied to decoded frames as players and OpenCV do.

FFmpeg's display matrix (`AV_FRAME_DATA_DISPLAYMATRIX`, nine 32-bit values, row-major) maps a source
pixel (x, y) to the shown pixel (x', y') = (a*x + c*y + tx, b*x + d*y + ty) with a, b, c, d its first
two entries of its first two rows. Only quarter turns and mirrors are applied -- their a, b, c, d are
signed unit values, a 2x2 signed permutation: 90, 180, 270 degrees, with or without a flip (a
negative determinant). Any other matrix (an odd angle, a skew: no camera writes one) is left as
decoded rather than resampled.
"""

from __future__ import annotations

import dataclasses
import struct

import av
import numpy as np
from av.sidedata.sidedata import Type as SideDataType

_MATRIX = struct.Struct("=9i")  # nine int32 in the machine's byte order, as FFmpeg stores them


@dataclasses.dataclass(frozen=True, slots=True)
class Orientation:
    """How a decoded (H, W, 3) frame becomes the upright one: transpose first, then mirror."""

    transpose: bool = False  # a quarter turn: the shown frame is W x H
    flip_rows: bool = False  # mirror top-bottom (after transposing)
    flip_cols: bool = False  # mirror left-right (after transposing)

    @classmethod
    def of_frame(cls, frame: av.VideoFrame) -> "Orientation":
        """The orientation a decoded frame's display matrix asks for (upright without one)."""
        side_data = frame.side_data.get(SideDataType.DISPLAYMATRIX)
        if side_data is None or side_data.buffer_size != _MATRIX.size:
            return cls()
        return cls.from_display_matrix(_MATRIX.unpack(bytes(side_data)))

    @classmethod
    def from_display_matrix(cls, matrix) -> "Orientation":
        a, b, _, c, d = matrix[:5]
        if a == 0 and d == 0 and b != 0 and c != 0:  # x' follows y and y' follows x: a quarter turn
            return cls(transpose=True, flip_rows=b < 0, flip_cols=c < 0)
        if b == 0 and c == 0 and a != 0 and d != 0:
            return cls(flip_rows=d < 0, flip_cols=a < 0)
        return cls()

    def size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) of the shown frame, for a decoded frame of `width` x `height`."""
        return (height, width) if self.transpose else (width, height)

    def apply(self, pixels: np.ndarray) -> np.ndarray:
        """The shown (upright) view of a decoded (H, W, 3) frame (a numpy view: nothing is copied)."""
        if self.transpose:
            pixels = pixels.transpose(1, 0, 2)
        if self.flip_rows:
            pixels = pixels[::-1]
        if self.flip_cols:
            pixels = pixels[:, ::-1]
        return pixels
