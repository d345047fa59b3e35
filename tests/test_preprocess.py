"""Every accepted input kind decodes to the same pixels; every bad one is an InvalidInput naming it."""

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from raypipe.errors import InvalidInput
from raypipe.preprocess import ImageLimits, load_image, load_images


def png_bytes(array: np.ndarray, mode=None) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array, mode).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def bomb_png(width: int, height: int) -> bytes:
    """A valid PNG header claiming huge dimensions, with a tiny (and too short) payload."""
    def chunk(kind, payload):
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")


RGB = np.random.default_rng(0).integers(0, 256, (40, 60, 3), dtype=np.uint8)


@pytest.mark.parametrize("make", [
    lambda: RGB,
    lambda: Image.fromarray(RGB),
    lambda: png_bytes(RGB),
    lambda: data_url(png_bytes(RGB)),
])
def test_accepted_kinds_give_identical_pixels(make):
    decoded = load_image(make())
    assert decoded.pixels.shape == (40, 60, 3) and decoded.pixels.dtype == np.uint8
    np.testing.assert_array_equal(decoded.pixels, RGB)
    assert decoded.content_hash == load_image(RGB).content_hash


def test_grayscale_and_alpha_become_rgb():
    gray = load_image(RGB[..., 0])
    assert gray.pixels.shape == (40, 60, 3)
    rgba = np.concatenate([RGB, np.zeros((40, 60, 1), np.uint8)], axis=-1)  # fully transparent
    assert (load_image(rgba).pixels == 255).all()  # composited on white


def test_hash_depends_on_pixels():
    other = RGB.copy()
    other[0, 0, 0] ^= 1
    assert load_image(other).content_hash != load_image(RGB).content_hash


BAD = {
    "not_an_image": (b"hello, I am text", "not_an_image"),
    "empty_bytes": (b"", "not_an_image"),
    "truncated_png": (png_bytes(RGB)[:200], "corrupt_image"),
    "one_pixel": (png_bytes(np.zeros((1, 1, 3), np.uint8)), "image_too_small"),
    "zero_size_array": (np.zeros((0, 10, 3), np.uint8), "image_too_small"),
    "thin_strip": (np.zeros((5, 400, 3), np.uint8), "image_too_small"),
    "bomb": (bomb_png(100_000, 100_000), "image_too_large"),
    "float_array": (RGB.astype(np.float32), "unsupported_image_mode"),
    "wrong_shape": (np.zeros((4, 4, 4, 4), np.uint8), "not_an_image"),
    "sixteen_bit_mode": (Image.new("I;16", (32, 32)), "unsupported_image_mode"),
    "bad_base64": ("data:image/png;base64,@@@not-base64@@@", "invalid_base64"),
    "data_url_no_base64": ("data:image/png,rawdata", "invalid_image_url"),
    "http_url": ("https://example.com/cat.png", "url_not_allowed"),
    "file_url": ("file:///etc/passwd", "url_not_allowed"),
    "plain_string": ("cat.png", "invalid_image_url"),
    "wrong_type": (12345, "unsupported_image_type"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_inputs_are_named_and_coded(name):
    value, code = BAD[name]
    with pytest.raises(InvalidInput) as err:
        load_images([RGB, value])
    assert err.value.item == "images[1]"
    assert err.value.code == code, str(err.value)


def test_pixel_limit_is_configurable():
    with pytest.raises(InvalidInput, match="limit is 1000"):
        load_image(RGB, ImageLimits(max_pixels=1000, min_side=14))


def test_allowed_file_url_is_read(tmp_path):
    path = tmp_path / "img.png"
    path.write_bytes(png_bytes(RGB))
    limits = ImageLimits(allowed_url_prefixes=(f"file://{tmp_path}/",))
    np.testing.assert_array_equal(load_image(f"file://{path}", limits).pixels, RGB)
    with pytest.raises(InvalidInput, match="not allowed"):
        load_image("file:///etc/hostname", limits)


def test_invalid_input_survives_pickling():
    import pickle

    err = pickle.loads(pickle.dumps(InvalidInput("bad", item="images[3]", code="x")))
    assert (err.item, err.code, str(err)) == ("images[3]", "x", "images[3]: bad")


def test_allowed_http_url_is_fetched_from_loopback(tmp_path):
    import functools
    import http.server
    import threading

    (tmp_path / "img.png").write_bytes(png_bytes(RGB))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}/"
        limits = ImageLimits(allowed_url_prefixes=(base,))
        np.testing.assert_array_equal(load_image(base + "img.png", limits).pixels, RGB)
        with pytest.raises(InvalidInput) as err:
            load_image(base + "missing.png", limits)
        assert err.value.code == "image_fetch_failed"
    finally:
        server.shutdown()
