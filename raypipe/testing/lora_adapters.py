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


def peft_model(model, folders: dict):
    """transformers `model` under every adapter of `folders` (name -> PEFT save), unmerged: PEFT's own `PeftModel`,
    the oracle raypipe's adapters are compared with."""
    from peft import PeftModel

    first, *rest = folders
    peft = PeftModel.from_pretrained(model, folders[first], adapter_name=first).eval()
    for name in rest:
        peft.load_adapter(folders[name], adapter_name=name)
    return peft


def active_adapter(peft, name: str | None):
    """The context under which `peft` runs adapter `name` (None: with its adapters disabled, the base model)."""
    import contextlib

    if name is None:
        return peft.disable_adapter()
    peft.set_adapter(name)
    return contextlib.nullcontext()
