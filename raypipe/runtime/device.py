"""Device and dtype choice inside an actor, shared by the encoder workers and the decode engine."""

from __future__ import annotations

import torch


def pick_device() -> torch.device:
    # Not ray.get_gpu_ids(): fake GPU resources exist on CPU-only machines.
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":  # exact fp32 on CPU; bf16 where tensor cores make it the sensible default
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}") from None
