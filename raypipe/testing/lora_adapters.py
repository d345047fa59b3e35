"""Random PEFT LoRA adapters of a checkpoint, written by PEFT itself (tests and `raypipe bench decode --loras`)."""

from __future__ import annotations

import pathlib


def write_adapters(checkpoint, folder: pathlib.Path, adapters: dict[str, dict]) -> dict[str, pathlib.Path]:
    """PEFT saves of `adapters` (name -> LoraConfig fields) of `checkpoint` under `folder`; name -> its folder."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(checkpoint)
    # init_lora_weights=False: B random too (PEFT's default B = 0 would leave the model unchanged)
    configs = {name: LoraConfig(init_lora_weights=False, **fields) for name, fields in adapters.items()}
    first, *rest = configs
    model = get_peft_model(model, configs[first], adapter_name=first)
    for name in rest:
        model.add_adapter(name, configs[name])
    model.save_pretrained(folder)  # each adapter in a folder of its name
    return {name: folder / name for name in adapters}
