"""Section `versions`: what the check ran with (Python, torch, CUDA, transformers, the GPU), for reading its numbers."""

from __future__ import annotations

import importlib.metadata
import platform

PACKAGES = ("torch", "transformers", "tokenizers", "huggingface_hub", "safetensors", "triton", "llguidance", "av",
            "numpy", "pillow", "flash_attn", "ray")


def run(plan, recorder) -> None:
    import torch

    recorder.set("python", platform.python_version())
    recorder.set("cuda", torch.version.cuda)
    recorder.set("cuda_available", torch.cuda.is_available())
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        recorder.set("gpu", props.name)
        recorder.set("gpu_memory_gib", round(props.total_memory / 2**30, 1))
        recorder.set("capability", f"{props.major}.{props.minor}")
    for name in PACKAGES:
        try:
            recorder.add(package=name, version=importlib.metadata.version(name),
                         path=str(importlib.metadata.distribution(name).locate_file("")))
        except importlib.metadata.PackageNotFoundError:
            recorder.skip(f"package {name}", "not installed")
