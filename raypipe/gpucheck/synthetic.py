"""Section `large`, and the preset it writes: a Qwen2.5-VL checkpoint of the 3B model's shape with random
weights, written on the GPU machine itself from a config (nothing downloaded, nothing carried: 7.5 GB
would not travel).

It is built on the GPU in bf16 (a CPU init of 3.8 B parameters would take minutes of the check's budget)
and written once under the preset cache, in a section of its own so that a slow disk is cut there and not
in the middle of a measurement; `decode` and `encode` only read it. Its tokenizer is the presets'
byte-level one, so the vocabulary (and the LM head) is far smaller than the real model's 151,936 tokens:
decode GEMMs are the real model's, the logits projection is not. Other presets come from the registry.
"""

from __future__ import annotations

import pathlib
import time

import torch

from raypipe.models.presets import PRESET_VERSION, default_cache_dir, write_once
from raypipe.models.qwen2_5_vl.preset import write_shape
from raypipe.models.registry import resolve_model

LARGE = "large"
ON_GPU_ONLY = "written and run only on a GPU (3.8 B parameters)"
# Qwen2.5-VL-3B-Instruct's shape (config.json of the released model), pixel bounds as the `small` preset's
LARGE_SHAPE = dict(
    vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                fullatt_block_indexes=[7, 15, 23, 31]),
    text=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
              num_key_value_heads=2, mrope_section=[16, 24, 24]),
    min_pixels=28 * 28 * 4,
    max_pixels=28 * 28 * 1024,
    video_min_pixels=28 * 28 * 16,
    video_max_pixels=28 * 28 * 256,
)


def run(plan, recorder) -> None:
    if plan.device != "cuda":
        recorder.skip(f"{LARGE} preset", ON_GPU_ONLY)
        return
    start = time.perf_counter()
    folder = write_once(large_folder(), write)
    recorder.add(preset=LARGE, seconds=round(time.perf_counter() - start, 1),
                 gigabytes=round(sum(f.stat().st_size for f in folder.iterdir()) / 1e9, 2))


def checkpoint_for(preset: str, plan, recorder) -> pathlib.Path | None:
    """The checkpoint folder of `preset`; None (and a skip) for the large one where section `large` did not write it."""
    if preset != LARGE:
        return resolve_model(preset)
    folder = large_folder()
    if not (folder / "raypipe_preset.json").is_file():  # written last: the folder is complete
        recorder.skip(f"{LARGE} preset", "not written: see section `large`" if plan.device == "cuda" else ON_GPU_ONLY)
        return None
    return folder


def large_folder() -> pathlib.Path:
    return default_cache_dir() / f"{LARGE}-qwen2_5_vl-{PRESET_VERSION}"


def write(folder: pathlib.Path) -> None:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            write_shape(folder, LARGE_SHAPE)
    finally:
        torch.set_default_dtype(previous)
