"""transformers' own `MiniCPMV4_6VideoProcessor` (its `preprocess`, unchanged) as the reference for raypipe's
MiniCPM-V video path, run with a stand-in for the two torchvision kernels it calls.

transformers runs the processor's resize and normalize through `torchvision.transforms.v2.functional`,
which does not load here. The stand-in below is written for this test, from torchvision's documented
behaviour for these inputs: a uint8 CPU tensor is resized bicubic with antialias by interpolating the
uint8 tensor itself (same size: returned as is); `normalize` is `(x - mean) / std` per channel.
Everything else -- frame sampling, canvases, grouping by second, slicing, patch layout -- is
transformers' code as shipped.
"""

from __future__ import annotations

import enum
import types

import numpy as np
import torch


class InterpolationMode(enum.Enum):
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"  # compared against, never used


def _resize(image: torch.Tensor, size, interpolation=None, antialias=True) -> torch.Tensor:
    assert interpolation == InterpolationMode.BICUBIC and image.dtype == torch.uint8
    if tuple(size) == tuple(image.shape[-2:]):
        return image
    flat = image.reshape(-1, *image.shape[-3:])
    out = torch.nn.functional.interpolate(flat, size=tuple(size), mode="bicubic", align_corners=False,
                                          antialias=antialias)
    return out.reshape(*image.shape[:-2], *size)


def _normalize(image: torch.Tensor, mean, std, inplace=False) -> torch.Tensor:
    return (image - torch.as_tensor(mean).view(-1, 1, 1)) / torch.as_tensor(std).view(-1, 1, 1)


def install(monkeypatch) -> None:
    """Point transformers' torchvision backend at the stand-in kernels."""
    import transformers.image_processing_backends as backends
    from transformers.image_utils import PILImageResampling

    tvf = types.SimpleNamespace(resize=_resize, normalize=_normalize, InterpolationMode=InterpolationMode)
    monkeypatch.setattr(backends, "tvF", tvf, raising=False)
    monkeypatch.setattr(backends, "pil_torch_interpolation_mapping",
                        {PILImageResampling.BICUBIC: InterpolationMode.BICUBIC}, raising=False)


def processor(checkpoint=None, **kwargs):
    """transformers' class itself, from the checkpoint's config (or built with `kwargs`)."""
    from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import MiniCPMV4_6VideoProcessor

    return MiniCPMV4_6VideoProcessor.from_pretrained(checkpoint) if checkpoint else MiniCPMV4_6VideoProcessor(**kwargs)


def metadata(source: np.ndarray, fps: float):
    """What transformers' own decoders report for these frames (duration = frames / fps)."""
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(total_num_frames=len(source), fps=fps, duration=len(source) / fps,
                         height=source.shape[1], width=source.shape[2])


def preprocess(proc, source: np.ndarray, fps: float, **kwargs):
    """`preprocess` of one video given all its source frames `(N, H, W, 3)` at `fps`; it samples frames itself."""
    return proc.preprocess([source], video_metadata=[metadata(source, fps)], return_tensors="pt", **kwargs)
