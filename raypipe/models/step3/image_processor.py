"""transformers' `Step3p7ImageProcessor` with its three torchvision kernels done in plain torch.

transformers ships Step3's image processor on its torchvision backend only, and the torchvision
wheels this project can install are CUDA builds that do not load next to the CPU torch (they need
`libc10_cuda.so`). Everything that decides *what* the model sees stays transformers' own code —
the crop plan (`_plan_patches`), square padding of extreme aspect ratios, the global view, the
order of crops, the placeholders — and this subclass replaces only *how* three tensor operations
run, with the same torch kernels torchvision calls for these inputs:

- `resize`: bilinear with antialias. For uint8 on CPU torchvision resizes natively in uint8
  (`interpolate(..., antialias=True)` on the uint8 tensor); otherwise in float, rounded back.
- `pad`: constant padding at the bottom/right.
- `normalize`: `(x - mean) / std` per channel.

Its `save_pretrained` writes `image_processor_type: Step3p7ImageProcessor`, so the checkpoint
stays a normal Step3 checkpoint for a machine that has torchvision.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.image_utils import PILImageResampling, SizeDict
from transformers.models.step3p7.image_processing_step3p7 import Step3p7ImageProcessor

STEP3_PROCESSOR_CONFIG = "preprocessor_config.json"


class Step3p7ImageProcessorTorch(Step3p7ImageProcessor):
    def resize(self, image: torch.Tensor, size: SizeDict, resample=None, antialias: bool = True,
               **kwargs) -> torch.Tensor:
        if resample not in (None, PILImageResampling.BILINEAR):
            raise ValueError(f"only bilinear resampling is implemented without torchvision, got {resample!r}")
        height, width = size.height, size.width
        if (height, width) == tuple(image.shape[-2:]):
            return image
        batch_shape, channels = image.shape[:-3], image.shape[-3]
        flat = image.reshape(-1, channels, *image.shape[-2:])
        native = flat.dtype == torch.uint8 and flat.device.type == "cpu"
        work = flat if native or flat.is_floating_point() else flat.float()
        out = torch.nn.functional.interpolate(work, size=(height, width), mode="bilinear", align_corners=False,
                                              antialias=antialias)
        if work.dtype != flat.dtype:
            out = out.round_().to(flat.dtype)
        return out.reshape(*batch_shape, channels, height, width)

    def pad(self, images: list[torch.Tensor], pad_size: SizeDict = None, fill_value: int | None = 0,
            padding_mode: str | None = "constant", **kwargs) -> list[torch.Tensor]:
        if padding_mode != "constant" or kwargs.get("return_mask"):
            raise ValueError("only constant padding without a mask is implemented without torchvision")
        out = []
        for image in images:
            pad_h, pad_w = pad_size.height - image.shape[-2], pad_size.width - image.shape[-1]
            if pad_h < 0 or pad_w < 0:
                raise ValueError(f"pad size {pad_size} is smaller than the image {tuple(image.shape[-2:])}")
            out.append(torch.nn.functional.pad(image, (0, pad_w, 0, pad_h), value=fill_value or 0))
        return out

    def normalize(self, image: torch.Tensor, mean, std, inplace: bool = False, **kwargs) -> torch.Tensor:
        mean = torch.as_tensor(mean, dtype=image.dtype, device=image.device).view(-1, 1, 1)
        std = torch.as_tensor(std, dtype=image.dtype, device=image.device).view(-1, 1, 1)
        return image.sub_(mean).div_(std) if inplace else (image - mean) / std

    def convert_to_rgb(self, image: torch.Tensor, input_data_format=None) -> torch.Tensor:
        if image.ndim == 2:
            image = image[None]
        if image.shape[-3] == 1:
            return image.expand(*image.shape[:-3], 3, *image.shape[-2:]).clone()
        if image.shape[-3] != 3:
            raise ValueError(f"expected 1 or 3 channels, got {image.shape[-3]} (raypipe sends RGB)")
        return image

    def to_dict(self):
        out = super().to_dict()
        out["image_processor_type"] = Step3p7ImageProcessor.__name__
        return out


def load_image_processor(checkpoint) -> Step3p7ImageProcessorTorch:
    """The checkpoint's Step3 image processor settings on the torch-only kernels."""
    return Step3p7ImageProcessorTorch.from_pretrained(checkpoint)


def as_tensor_image(pixels: np.ndarray) -> torch.Tensor:
    """(H, W, 3) uint8 -> (3, H, W) uint8, the layout the processor works in."""
    return torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1).contiguous()
