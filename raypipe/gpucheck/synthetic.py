"""The `large` preset: a Qwen2.5-VL checkpoint of the 3B model's shape with random weights, written on the
GPU machine itself from a config (nothing downloaded, nothing carried: 7.5 GB would not travel).

It is built on the GPU in bf16 (a CPU init of 3.8 B parameters would take minutes of the check's budget)
and written once under the preset cache. Its tokenizer is the presets' byte-level one, so the vocabulary
(and the LM head) is far smaller than the real model's 151,936 tokens: decode GEMMs are the real model's,
the logits projection is not. Other presets come from the registry as usual.
"""

from __future__ import annotations

import pathlib

import torch

from raypipe.models.presets import PRESET_VERSION, default_cache_dir, write_once
from raypipe.models.qwen2_5_vl.preset import write_shape
from raypipe.models.registry import resolve_model

LARGE = "large"
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


def checkpoint_for(preset: str, plan, recorder) -> pathlib.Path | None:
    """The checkpoint folder of `preset`, the large one written first if needed; None (and a skip) where it cannot be."""
    if preset != LARGE:
        return resolve_model(preset)
    if plan.device != "cuda":
        recorder.skip(f"{LARGE} preset", "written and run only on a GPU (3.8 B parameters)")
        return None
    return write_large()


def write_large() -> pathlib.Path:
    def write(folder: pathlib.Path) -> None:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda"):
                write_shape(folder, LARGE_SHAPE)
        finally:
            torch.set_default_dtype(previous)

    return write_once(default_cache_dir() / f"{LARGE}-qwen2_5_vl-{PRESET_VERSION}", write)
