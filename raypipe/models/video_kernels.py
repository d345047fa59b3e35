"""torchvision's two kernels of transformers' video processors, in plain torch: torchvision does not load next to
the CPU torch, and transformers' `BaseVideoProcessor` resizes and normalizes through it.

For the inputs raypipe hands these processors (uint8 frames, bicubic, antialiased) torchvision's
`resize` runs torch's own `interpolate` on the uint8 tensor (its native uint8 path on CPU), and its
`normalize` is `(x - mean) / std`. Mixed in before a transformers video processor class, everything
else (frame sampling, sizes, the fused rescale + normalize, layouts) stays transformers' own code.
"""

from __future__ import annotations

import torch


class TorchVideoKernels:
    def resize(self, video: torch.Tensor, size, resample=None, antialias: bool = True, **kwargs) -> torch.Tensor:
        from transformers.image_utils import PILImageResampling

        if resample not in (None, PILImageResampling.BICUBIC):
            raise ValueError(f"only bicubic resampling is implemented without torchvision, got {resample!r}")
        if (size.height, size.width) == tuple(video.shape[-2:]):
            return video  # torchvision returns the same size unchanged
        flat = video.reshape(-1, *video.shape[-3:])
        out = torch.nn.functional.interpolate(flat, size=(size.height, size.width), mode="bicubic",
                                              align_corners=False, antialias=antialias)
        return out.reshape(*video.shape[:-2], size.height, size.width)

    def normalize(self, video: torch.Tensor, mean, std, inplace: bool = False, **kwargs) -> torch.Tensor:
        mean = torch.as_tensor(mean, dtype=video.dtype).view(-1, 1, 1)
        std = torch.as_tensor(std, dtype=video.dtype).view(-1, 1, 1)
        return (video - mean) / std
