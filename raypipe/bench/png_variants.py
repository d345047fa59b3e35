"""Many distinct large PNGs, cheaply: one image whose first rows differ per copy.

Benchmarks that send hundreds of distinct 4096x4096 PNGs (distinct, so no embedding-cache hits)
spent minutes in Pillow's encoder, one full compression per image. Here the rows all copies share
are filtered and compressed once: a zlib stream may continue, after a full flush, with deflate
blocks compressed on their own, so each copy is its own few header rows, flushed, then the shared
blocks, then the checksum of the whole (a pass of `zlib.adler32`, not a compression).
"""

from __future__ import annotations

import struct
import zlib

import numpy as np


def _sub_filtered(rows: np.ndarray) -> bytes:
    """PNG filter 1 ("Sub": each byte minus the byte one pixel to the left), one filter byte per row."""
    flat = rows.reshape(rows.shape[0], -1)
    filtered = flat.copy()
    filtered[:, 3:] -= flat[:, :-3]  # uint8 arithmetic wraps modulo 256, as PNG specifies
    return np.concatenate([np.ones((flat.shape[0], 1), np.uint8), filtered], axis=1).tobytes()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def distinct_pngs(base: np.ndarray, heads: list[np.ndarray]) -> list[bytes]:
    """One RGB PNG per entry of `heads`: `base` (H, W, 3 uint8) with its first rows replaced by that head."""
    height, width, _ = base.shape
    shared_rows = heads[0].shape[0]
    tail = _sub_filtered(base[shared_rows:])
    compressor = zlib.compressobj(1, zlib.DEFLATED, -15)  # raw deflate: no header, no checksum
    tail_blocks = compressor.compress(tail) + compressor.flush()
    header = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    pngs = []
    for head in heads:
        head_raw = _sub_filtered(head)
        compressor = zlib.compressobj(1, zlib.DEFLATED, -15)
        head_blocks = compressor.compress(head_raw) + compressor.flush(zlib.Z_FULL_FLUSH)  # byte-aligned, not final
        checksum = zlib.adler32(tail, zlib.adler32(head_raw))
        idat = b"\x78\x01" + head_blocks + tail_blocks + struct.pack(">I", checksum)
        pngs.append(header + _chunk(b"IDAT", idat) + _chunk(b"IEND", b""))
    return pngs
