"""Read parts of a local HF checkpoint folder without instantiating the whole model.

A serving process that holds only the vision tower (or only the language model) should read only
those tensors: `load_tensors` opens every `*.safetensors` file lazily and returns just the keys
under one of the given prefixes, with the prefix stripped.
"""

from __future__ import annotations

import json
import pathlib

import torch
from safetensors import safe_open


def read_config(folder: str | pathlib.Path) -> dict:
    with open(pathlib.Path(folder) / "config.json") as f:
        return json.load(f)


def safetensors_files(folder: str | pathlib.Path) -> list[pathlib.Path]:
    folder = pathlib.Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {folder}")
    return files


def load_tensors(folder: str | pathlib.Path, prefixes: tuple[str, ...], *, dtype: torch.dtype | None = None,
                 exclude: tuple[str, ...] = (), shard=None) -> dict[str, torch.Tensor]:
    """Tensors whose key starts with one of `prefixes` (first matching prefix stripped).

    Checkpoints in the wild use different layouts for the same module (`visual.*` in the original
    Qwen release, `model.visual.*` in newer transformers saves); callers pass every layout they accept.
    With `shard` (a tensor-parallel rank's weight shard, `raypipe.parallel.shards`), each tensor is
    read through `shard.read(name, f.get_slice(key))` and only this rank's slice is kept (tensors it does not
    hold at all, `shard.holds(name)` false, are not read).
    """
    out: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                name = strip_prefix(key, prefixes, exclude)
                if name is None:
                    continue
                if shard is not None and not shard.holds(name):  # another rank's expert, stored apart
                    continue
                if name in out:
                    raise ValueError(f"{path}: {key!r} duplicates a tensor already read under another layout")
                tensor = f.get_tensor(key) if shard is None else _own(shard.read(name, f.get_slice(key)))
                out[name] = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
    if not out:
        raise ValueError(f"{folder}: no tensors under any of {prefixes}")
    return out


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in storage of its own size: safetensors' torch slices are views of the whole tensor it read, so a
    rank keeping the view (no dtype cast copies it: quantized tensors, a checkpoint already in the compute dtype)
    would hold every rank's part."""
    if tensor.untyped_storage().nbytes() > tensor.nbytes:
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def strip_prefix(key: str, prefixes: tuple[str, ...], exclude: tuple[str, ...]) -> str | None:
    """`key` without the first of `prefixes` it starts with; None when it starts with none or with one of
    `exclude` (a module's name inside a part of the model, from its name in the whole checkpoint)."""
    if any(key.startswith(p) for p in exclude):
        return None
    prefix = next((p for p in prefixes if key.startswith(p)), None)
    return None if prefix is None else key[len(prefix):]


def load_module_weights(module: torch.nn.Module, state: dict[str, torch.Tensor], *, what: str) -> None:
    """Strict load with an error that says which part of which checkpoint did not match."""
    # strict=False only to phrase the error ourselves; non-persistent buffers (rotary inv_freq) are
    # rebuilt by the module and never appear in `missing`.
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{what}: checkpoint does not match the module (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
