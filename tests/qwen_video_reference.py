"""transformers' own `Qwen2VLVideoProcessor`, loaded without torchvision, as the reference for raypipe's video path.

Its module imports `torchvision.transforms.v2.functional` at import time, and transformers' lazy
loader hands out a dummy class when torchvision is missing. So the module file is executed directly
with a stub `torchvision` in `sys.modules`. Only its own logic runs (frame indices, the size its
`resize` asks for, `patchify`): the stub's `resize` records the requested size and never resizes.
"""

from __future__ import annotations

import enum
import importlib.util
import pathlib
import sys
import types

import torch

MODULE = "transformers.models.qwen2_vl.video_processing_qwen2_vl"


class InterpolationMode(enum.Enum):
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


def stub_torchvision() -> dict[str, types.ModuleType]:
    """`sys.modules` entries of a torchvision whose `transforms.v2.functional.resize` records sizes."""
    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2", "torchvision.transforms.v2.functional"]
    modules = {name: types.ModuleType(name) for name in names}
    for parent, child in zip(names, names[1:]):
        setattr(modules[parent], child.rsplit(".", 1)[1], modules[child])
    functional = modules[names[-1]]
    functional.InterpolationMode = InterpolationMode
    functional.requested_sizes = []

    def resize(image, size, interpolation=None, antialias=True):
        functional.requested_sizes.append(tuple(size))
        return image

    functional.resize = resize
    return modules


def load_processor(monkeypatch):
    """A `Qwen2VLVideoProcessor` instance (its `__init__` skipped) and the stub `tvF` it resizes with."""
    import transformers.image_processing_backends as backends
    import transformers.models.qwen2_vl as package

    modules = stub_torchvision()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    tvf = modules["torchvision.transforms.v2.functional"]
    monkeypatch.setattr(backends, "tvF", tvf, raising=False)  # the base class's resize calls it
    spec = importlib.util.spec_from_file_location(MODULE, pathlib.Path(package.__path__[0]) / "video_processing_qwen2_vl.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, MODULE, module)  # transformers' docstring tooling looks the module up
    spec.loader.exec_module(module)
    processor = object.__new__(module.Qwen2VLVideoProcessor)
    processor.fps = processor.num_frames = None  # what `__init__` would set; every call below passes its own
    return processor, tvf


def reference_frame_size(processor, tvf, frames: int, height: int, width: int, *, min_pixels: int, max_pixels: int,
                         max_video_tokens: int) -> tuple[int, int]:
    """The size `Qwen2VLVideoProcessor.resize` (with `cap_pixels_per_frame`) resizes `frames` frames to."""
    from transformers.image_utils import SizeDict

    processor.max_video_tokens = max_video_tokens
    videos = torch.zeros(1, 1, 1, 1, 1, dtype=torch.uint8).expand(1, frames, 3, height, width)
    processor.resize(videos, size=SizeDict(shortest_edge=min_pixels, longest_edge=max_pixels),
                     resample=InterpolationMode.BICUBIC, factor=28, temporal_factor=2, cap_pixels_per_frame=True)
    return tvf.requested_sizes.pop()
