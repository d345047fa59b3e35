"""Section `encode`: vision tower images/s and model FLOPs utilisation, eager against token budgets
(`encode/budget_forwards.py`: packed forwards, replayed as CUDA graphs where the tower can be captured).

A request is 8 images of a mixed-size set (thumbnails to 1080p, resized by the family's processor). MFU
counts 2 x tower parameters x patch tokens per image (the GEMMs; attention's own FLOPs are left out, so
it is a lower bound) against the GPU's dense bf16 peak (`PEAK_TFLOPS`); on a CPU it is not reported.
"""

from __future__ import annotations

import time

import torch

from raypipe.encode.budget_forwards import BudgetedForwards
from raypipe.encode.budgets import TokenBudgets
from raypipe.gpucheck.synthetic import checkpoint_for
from raypipe.gpucheck.workload import images
from raypipe.models.registry import vision_adapter
from raypipe.runtime.device import resolve_dtype

IMAGES_PER_REQUEST = 8
SIZES = ((64, 64), (224, 224), (480, 640), (720, 1280), (96, 128), (1080, 1920), (320, 240), (1200, 300))
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0}  # dense bf16, SXM parts


def run(plan, recorder) -> None:
    device = torch.device(plan.device)
    dtype = resolve_dtype(plan.dtype, device)
    peak = peak_flops(recorder)
    for preset in plan.encode_presets:
        checkpoint = checkpoint_for(preset, plan, recorder)
        if checkpoint is None:
            continue
        vision = vision_adapter(checkpoint)
        tower = vision.load_tower(device, dtype)
        params = sum(p.numel() for p in tower.model.parameters()) if hasattr(tower, "model") else None
        units = [vision.units(vision.make_item(d))
                 for d in images([SIZES[i % len(SIZES)] for i in range(plan.encode_images)])]
        requests = [[u for image in units[i:i + IMAGES_PER_REQUEST] for u in image]
                    for i in range(0, len(units), IMAGES_PER_REQUEST)]
        tokens = sum(tower.budget_tokens(u) for image in units for u in image) if tower.packs_to_budgets else None
        for mode, encode in modes(tower, device, preset, recorder):
            seconds = timed(encode, requests, device)
            flops = 2 * params * tokens if tokens and params else None
            recorder.add(preset=preset, mode=mode, images=len(units), seconds=round(seconds, 3),
                         images_s=round(len(units) / seconds, 1),
                         tower_params_m=round(params / 1e6, 1) if params else None,
                         mfu=round(flops / seconds / peak, 4) if flops and peak else None)
        del tower
        if device.type == "cuda":
            torch.cuda.empty_cache()


def modes(tower, device, preset: str, recorder):
    yield "eager", tower.encode
    if not tower.packs_to_budgets:
        recorder.skip(f"{preset} budgets", f"{type(tower).__name__} has no budgeted forwards")
        return
    packed = BudgetedForwards(tower, TokenBudgets(enabled=True))
    if device.type == "cuda" and not packed.graphs:
        recorder.skip(f"{preset} budgets + CUDA graphs",
                      f"{type(tower).__name__} cannot be captured here (the Qwen towers' variable-length attention "
                      "needs flash_attn in a graph; MiniCPM-V's runs SDPA); packed forwards run eagerly")
    yield ("budgets + CUDA graphs" if packed.graphs else "budgets"), packed.encode


@torch.inference_mode()
def timed(encode, requests, device) -> float:
    encode(requests[0])  # warm-up: first kernels, allocator
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for request in requests:
        encode(request)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def peak_flops(recorder) -> float | None:
    if not torch.cuda.is_available():
        recorder.skip("mfu", "no GPU: a CPU has no peak worth dividing by")
        return None
    name = torch.cuda.get_device_name(0)
    for key, tflops in PEAK_TFLOPS.items():
        if key in name:
            recorder.set("peak_tflops", tflops)
            return tflops * 1e12
    recorder.skip("mfu", f"no peak FLOPs known for {name!r} (PEAK_TFLOPS)")
    return None
