"""Turn what users send as images into validated RGB pixel arrays: visual items of kind "image".

Accepted: PIL images, numpy arrays (HxW, HxWx1/3/4, uint8), raw encoded bytes, and `data:` URLs
(scheme in any case, base64 possibly line-wrapped as `base64.encodebytes` writes it).
`http(s)://` and `file://` URLs are refused unless their prefix is explicitly allowed (`raypipe.inputs.urls`,
shared with videos). Dimensions are read from the file header *before* decoding, so a decompression
bomb is refused without ever allocating its pixels. Every refusal is an `InvalidInput` naming the item and the reason.

Images are turned upright by their EXIF orientation (a phone photo stored sideways reaches the model
as it is viewed), and high-bit-depth modes are converted to 8 bits: 16-bit integer images keep their
top 8 bits; float images are read as 0..1 when their maximum is at most 1, else as 0..255 (clipped).

Each model family's adapter then resizes the decoded image to what its vision tower consumes
(`VisionAdapter.resize_for_tower`), where the image is decoded, so only those pixels travel to the
encoder workers. Normalising and patchifying run inside the workers.
"""

from __future__ import annotations

import dataclasses
import io
import warnings
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from raypipe.errors import InvalidInput
from raypipe.inputs.media import DecodedVisual, pixel_hash
from raypipe.inputs.urls import read_url

# Modes PIL can convert to RGB without guessing a value range.
_CONVERTIBLE_MODES = {"1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "RGBa", "CMYK", "YCbCr", "La"}
# Single-channel modes with more than 8 bits, converted to "L" by `_to_8_bit`.
_HIGH_DEPTH_MODES = {"I", "I;16", "I;16B", "I;16L", "I;16N", "F"}


@dataclasses.dataclass(frozen=True, slots=True)
class ImageLimits:
    min_side: int = 14  # smaller than one ViT patch carries nothing
    max_pixels: int = 40_000_000  # > 8K x 4K; real limit on what the encoder is asked to hold
    max_aspect_ratio: float = 200.0  # Qwen's smart_resize refuses more
    max_bytes: int = 50 * 1024 * 1024  # encoded size
    allowed_url_prefixes: tuple[str, ...] = ()  # e.g. ("https://images.example.com/", "file:///data/")
    fetch_timeout_s: float = 10.0
    low_detail_pixels: int = 512 * 512  # an image sent with detail "low": OpenAI's low-resolution view, 512 x 512

    def __post_init__(self):
        if self.min_side < 1 or self.max_pixels < self.min_side**2:
            raise ValueError(f"inconsistent image limits: {self}")


def load_images(images: Sequence, limits: ImageLimits = ImageLimits(), *, item_prefix: str = "images"
                ) -> list[DecodedVisual]:
    """Validate and decode every image; the first bad one raises `InvalidInput` naming its index."""
    return [load_image(image, limits, item=f"{item_prefix}[{i}]") for i, image in enumerate(images)]


def load_image(image, limits: ImageLimits = ImageLimits(), *, item: str = "image") -> DecodedVisual:
    if isinstance(image, DecodedVisual) and image.kind == "image":
        return image
    if isinstance(image, Image.Image):
        pixels = _pil_to_rgb(image, limits, item)
    elif isinstance(image, np.ndarray):
        pixels = _array_to_rgb(image, limits, item)
    elif isinstance(image, (bytes, bytearray, memoryview)):
        pixels = _decode_bytes(bytes(image), limits, item)
    elif isinstance(image, str):
        data = read_url(image, kind="image", allowed_prefixes=limits.allowed_url_prefixes,
                        timeout_s=limits.fetch_timeout_s, max_bytes=limits.max_bytes, item=item)
        pixels = _decode_bytes(data, limits, item)
    else:
        raise InvalidInput(f"unsupported image type {type(image).__name__}; expected PIL image, numpy array, "
                           "bytes or a data: URL", item=item, code="unsupported_image_type")
    return DecodedVisual(pixels, pixel_hash(pixels), "image")


def shrink_to(image: DecodedVisual, max_pixels: int) -> DecodedVisual:
    """`image` scaled down (aspect ratio kept, bicubic) to at most `max_pixels` pixels; unchanged if it holds fewer.
    The hash is of the new pixels, so caches tell the two apart."""
    height, width = image.pixels.shape[:2]
    if height * width <= max_pixels:
        return image
    scale = (max_pixels / (height * width)) ** 0.5
    size = (max(1, int(width * scale)), max(1, int(height * scale)))
    pixels = np.ascontiguousarray(Image.fromarray(image.pixels).resize(size, Image.Resampling.BICUBIC))
    return DecodedVisual(pixels, pixel_hash(pixels), "image")


def _check_size(width: int, height: int, limits: ImageLimits, item: str) -> None:
    if width <= 0 or height <= 0:
        raise InvalidInput(f"image has zero size ({width}x{height})", item=item, code="image_too_small")
    if min(width, height) < limits.min_side:
        raise InvalidInput(f"image is {width}x{height}; both sides must be at least {limits.min_side} pixels",
                           item=item, code="image_too_small")
    if width * height > limits.max_pixels:
        raise InvalidInput(f"image is {width}x{height} = {width * height} pixels; the limit is {limits.max_pixels}",
                           item=item, code="image_too_large")
    if max(width, height) / min(width, height) > limits.max_aspect_ratio:
        raise InvalidInput(f"aspect ratio of {width}x{height} exceeds {limits.max_aspect_ratio:g}", item=item,
                           code="bad_aspect_ratio")


def _pil_to_rgb(image: Image.Image, limits: ImageLimits, item: str) -> np.ndarray:
    _check_size(image.width, image.height, limits, item)
    if image.mode not in _CONVERTIBLE_MODES | _HIGH_DEPTH_MODES:
        raise InvalidInput(f"unsupported image mode {image.mode!r}", item=item, code="unsupported_image_mode")
    try:
        image.load()
        image = ImageOps.exif_transpose(image)  # upright as viewers show it (EXIF Orientation)
    except (OSError, SyntaxError, ValueError) as exc:  # PIL reports truncation and corruption as these
        raise InvalidInput(f"image data is truncated or corrupt ({exc})", item=item, code="corrupt_image") from None
    if image.mode in _HIGH_DEPTH_MODES:
        image = _to_8_bit(image)
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (image.mode == "P" and "transparency" in image.info):
        # Composite on white, as viewers show it, rather than keeping whatever the hidden RGB holds.
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, rgba)
    return np.ascontiguousarray(np.asarray(image.convert("RGB"), dtype=np.uint8))


def _to_8_bit(image: Image.Image) -> Image.Image:
    values = np.asarray(image)
    if image.mode == "F":
        values = values.astype(np.float64)
        values = np.nan_to_num(values, nan=0.0, posinf=255.0, neginf=0.0)
        scaled = values * 255.0 if values.size and values.max() <= 1.0 else values
        return Image.fromarray(np.clip(np.rint(scaled), 0, 255).astype(np.uint8), "L")
    values = values.astype(np.int64)
    # 16-bit data (also 16-bit PNGs that PIL opens as 32-bit "I"): keep the top 8 bits, rounded.
    return Image.fromarray(np.clip(np.rint(values / 257.0), 0, 255).astype(np.uint8), "L")


def _array_to_rgb(array: np.ndarray, limits: ImageLimits, item: str) -> np.ndarray:
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[-1] not in (3, 4)):
        raise InvalidInput(f"array of shape {array.shape} is not an image; expected HxW, HxWx1, HxWx3 or HxWx4",
                           item=item, code="not_an_image")
    if array.dtype != np.uint8:
        raise InvalidInput(f"array dtype {array.dtype} unsupported; expected uint8", item=item,
                           code="unsupported_image_mode")
    height, width = array.shape[:2]
    _check_size(width, height, limits, item)
    if array.ndim == 2:
        array = np.repeat(array[..., None], 3, axis=-1)
    elif array.shape[-1] == 4:
        return _pil_to_rgb(Image.fromarray(array, "RGBA"), limits, item)
    return np.ascontiguousarray(array)


def _decode_bytes(data: bytes, limits: ImageLimits, item: str) -> np.ndarray:
    if not data:
        raise InvalidInput("image data is empty", item=item, code="not_an_image")
    if len(data) > limits.max_bytes:
        raise InvalidInput(f"encoded image is {len(data)} bytes; the limit is {limits.max_bytes}", item=item,
                           code="image_too_large")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))  # lazy: reads the header only
    except Image.DecompressionBombError as exc:
        raise InvalidInput(f"decompression bomb refused ({exc})", item=item, code="image_too_large") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        raise InvalidInput("data is not a recognised image format", item=item, code="not_an_image") from None
    with image:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return _pil_to_rgb(image, limits, item)
