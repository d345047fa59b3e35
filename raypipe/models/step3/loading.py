"""Load a Step3 checkpoint: the whole model through `from_pretrained`, or one rank's language shard by slices.

Step3 checkpoints are stored in StepFun's original layout (fused ViT qkv with a rope permutation,
per-layer stacked MoE projections, `vit_large_projector`, ...). transformers converts that layout while
loading (`conversion_mapping.py`: renames, chunking, permutes, concatenations). On one device both
sides load the whole model the supported way and drop what they do not run (`load_step3_model`):
loading reads every tensor once. For the presets that is nothing; for the released checkpoint an
encoder worker briefly holds the language model too (see docs/models.md, Step3).

A rank of a tensor-parallel decode group must not read every tensor (`language_shard_tensors`). Its
language tensors are named by transformers' own mapping for `step3p7` (`rename_source_key` over the
mapping's renamings and converters, so the names cannot drift from what `from_pretrained` loads), and
each one is read through `safe_open(...).get_slice`, file by file, as the rank's `read(name, slice)`
returns it: only the rank's rows or experts leave the file. The text side's one converter stacks the
routed experts' `gate_proj` and `up_proj` into `gate_up_proj` along dim 1 (`Concatenate`); the rank
reads its part of each source and concatenates the parts. Any other conversion op on a language
tensor is refused by name. MTP layers (`layers.N` past `num_hidden_layers`) and the vision side are
skipped unread.
"""

from __future__ import annotations

import collections
import dataclasses
import pathlib
import re

import torch
from safetensors import safe_open

from raypipe.models.checkpoint import safetensors_files

LANGUAGE_PREFIX = "model.language_model."  # where the mapping puts the text model's tensors
HEAD_KEY = "lm_head.weight"


def load_step3_model(checkpoint: str | pathlib.Path, dtype: torch.dtype):
    from transformers import Step3p7ForConditionalGeneration

    return Step3p7ForConditionalGeneration.from_pretrained(checkpoint, dtype=dtype).eval()


@dataclasses.dataclass
class ShardTensors:
    """One rank's language tensors: the text model's state dict (module names), lm_head's weight, and the
    bytes that left the checkpoint files for them (what the rank process materialised)."""

    state: dict[str, torch.Tensor]
    head: torch.Tensor | None  # None: tied to the embeddings
    bytes_read: int


def language_shard_tensors(checkpoint: str | pathlib.Path, text_config, dtype: torch.dtype, read) -> ShardTensors:
    """The language model's tensors named as `Step3p7TextModel`'s parameters; each decoder-layer tensor as
    `read(module_name, safetensors_slice)` returns it (a rank's slice), the rest (embeddings, norm, lm_head) whole."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import Concatenate, WeightConverter, rename_source_key

    mapping = get_checkpoint_conversion_mapping("step3p7")
    renamings = [t for t in mapping if not isinstance(t, WeightConverter)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    state, pieces, head, nbytes = {}, collections.defaultdict(dict), None, 0
    for path in safetensors_files(checkpoint):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                target, piece = rename_source_key(key, renamings, converters)
                if target == HEAD_KEY:
                    tensor = f.get_tensor(key)
                elif target.startswith(LANGUAGE_PREFIX) and _runs(target, text_config.num_hidden_layers):
                    name = target[len(LANGUAGE_PREFIX):]
                    tensor = read(name, f.get_slice(key)) if name.startswith("layers.") else f.get_tensor(key)
                else:
                    continue  # vision tower, projector, MTP layers: never read
                nbytes += tensor.numel() * tensor.element_size()
                tensor = tensor.to(dtype) if tensor.is_floating_point() else tensor
                if target == HEAD_KEY:
                    head = tensor
                elif piece is None:
                    state[name] = tensor
                else:
                    pieces[name][piece] = tensor
    for name, parts in pieces.items():
        converter = next(c for c in converters if set(parts) <= set(c.source_patterns))
        ops = converter.operations
        if len(ops) != 1 or not isinstance(ops[0], Concatenate) or set(parts) != set(converter.source_patterns):
            raise ValueError(f"{checkpoint}: {name} is converted by {ops} from {sorted(parts)}; a rank reads "
                             f"slices of concatenated tensors only")
        state[name] = torch.cat([parts[p] for p in converter.source_patterns], dim=ops[0].dim)
    if head is None and not text_config.tie_word_embeddings:
        raise ValueError(f"{checkpoint}: no {HEAD_KEY}")
    return ShardTensors(state, head, nbytes)


def _runs(target: str, num_layers: int) -> bool:
    """Whether a language tensor belongs to a layer the text model runs (not an MTP layer past the stack)."""
    layer = re.match(re.escape(LANGUAGE_PREFIX) + r"layers\.(\d+)\.", target)
    return layer is None or int(layer.group(1)) < num_layers
