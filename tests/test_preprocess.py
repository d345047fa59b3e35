"""Every accepted input kind decodes to the same pixels; every bad one is an InvalidInput naming it."""

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from raypipe.errors import InvalidInput
from raypipe.inputs.images import ImageLimits, load_image, load_images


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
    "hsv_mode": (Image.new("HSV", (32, 32)), "unsupported_image_mode"),  # 16-bit is converted (issue 9)
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


# --- issue 9: orientation, encodings and bit depths real clients send ----------------------------

def _jpeg_with_orientation(array: np.ndarray, orientation: int) -> bytes:
    image = Image.fromarray(array)
    exif = image.getexif()
    exif[0x0112] = orientation  # Orientation
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=95, exif=exif.tobytes())
    return buf.getvalue()


def test_exif_orientation_is_applied():
    # A phone photo stored 200 wide x 100 high, to be shown rotated 90 degrees clockwise (Orientation=6).
    stored = np.zeros((100, 200, 3), np.uint8)
    stored[:, :100] = 255  # left half white in storage -> top half white when upright
    decoded = load_image(_jpeg_with_orientation(stored, 6)).pixels
    assert decoded.shape == (200, 100, 3)
    assert decoded[:90].mean() > 240 and decoded[110:].mean() < 15
    plain = load_image(_jpeg_with_orientation(stored, 1)).pixels  # Orientation=1: as stored
    assert plain.shape == (100, 200, 3)


def test_line_wrapped_base64_and_upper_case_scheme():
    data = png_bytes(RGB)
    for url in ("data:image/png;base64," + base64.encodebytes(data).decode(),  # newline every 76 chars
                "DATA:image/png;BASE64," + base64.b64encode(data).decode(),
                "data:image/png;base64,\r\n" + base64.encodebytes(data).decode().replace("\n", "\r\n")):
        np.testing.assert_array_equal(load_image(url).pixels, RGB)
    with pytest.raises(InvalidInput) as info:
        load_image("data:image/png;base64," + base64.b64encode(data).decode()[:40] + "!!" + "AAAA")
    assert info.value.code == "invalid_base64"


def test_sixteen_bit_grayscale_png_is_converted():
    gray16 = (np.arange(40 * 60, dtype=np.uint32).reshape(40, 60) * 27 % 65536).astype(np.uint16)
    buf = io.BytesIO()
    Image.fromarray(gray16).save(buf, format="PNG")
    pixels = load_image(buf.getvalue()).pixels
    expected = np.rint(gray16 / 257.0).astype(np.uint8)
    np.testing.assert_array_equal(pixels, np.repeat(expected[..., None], 3, axis=-1))


@pytest.mark.parametrize("scale", [1.0, 255.0], ids=["unit-range", "byte-range"])
def test_float_tiff_is_converted(scale):
    values = np.random.default_rng(1).random((40, 60)).astype(np.float32)
    buf = io.BytesIO()
    Image.fromarray(values * scale, "F").save(buf, format="TIFF")
    pixels = load_image(buf.getvalue()).pixels
    expected = np.clip(np.rint(values.astype(np.float64) * 255.0), 0, 255).astype(np.uint8)
    assert pixels.shape == (40, 60, 3)
    assert np.abs(pixels[..., 0].astype(int) - expected).max() <= 1  # float32 rounding at .5 only
