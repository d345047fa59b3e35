"""A linear layer whose weight stays in the checkpoint's quantized tensors and is dequantized per forward.

On a CPU (no FP8 or int4 matmul) the point of a quantized checkpoint is memory: the layer holds the
stored tensors (an FP8 weight and its block scales, an int4 packing and its group scales, ...) at
their stored dtypes, and each forward rebuilds the weight in the activations' dtype for one
`F.linear`, so one layer's full-precision weight exists at a time. A subclass says which tensors it
stores and how they become a weight (`dequantize`).

Tensor parallelism (`split`): a rank's layer keeps a range of the output features (column-parallel)
or of the input features (row-parallel, its partial outputs summed by `reduce`), and reads only the
matching part of every stored tensor. A subclass says, per stored tensor and dimension, how many
features one run of its entries covers (`Unit`: a scale block covers 128 rows, an int32 word eight
int4 columns, a group scale 64 columns); a split that would start or end inside such a run would
hand one scale or word to two ranks, so it is refused, naming the layer and the sizes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

AXES = ("output", "input")  # a weight's dim 0 and dim 1


class Unit(NamedTuple):
    """`features` consecutive input or output features are held by `entries` consecutive entries of a stored
    tensor along that dimension (a scale block: 128 -> 1; a packed int4 word: 8 -> 1); `what` names it."""
    features: int
    entries: int
    what: str


ONE = Unit(1, 1, "feature")


class StoredWeightLinear(torch.nn.Module):
    def __init__(self, in_features: int, out_features: int, stored: tuple[str, ...], bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.stored = stored
        self.bias_dtype = dtype
        for name in stored:  # filled by the checkpoint, as stored (`_load_from_state_dict`)
            self.register_buffer(name, None)
        self.bias = torch.nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.part: tuple[int, list[slice]] | None = None  # a rank's (dim, the whole layer's features it keeps)
        self.whole = (in_features, out_features)  # the layer a rank's part was split from
        self.reduce = None  # a row-parallel rank's sum of the ranks' partial outputs

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def units(self, name: str) -> tuple[Unit | None, Unit | None]:
        """How stored tensor `name`'s dim 0 and dim 1 follow the output and input features (None: that dim does
        not follow them, every rank reads it whole)."""
        raise NotImplementedError

    def like(self, in_features: int, out_features: int) -> "StoredWeightLinear":
        """A layer of the same format and options at another shape."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduce is None:
            return torch.nn.functional.linear(x, self.dequantize(x.dtype), self.bias)
        return self.finish(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel rank's own product (a LoRA delta joins it before `finish`, `models/lora.py`)."""
        return torch.nn.functional.linear(x, self.dequantize(x.dtype))

    def finish(self, partial: torch.Tensor) -> torch.Tensor:
        out = self.reduce(partial)
        return out + self.bias if self.bias is not None else out  # the bias once, after the sum

    def split(self, name: str, dim: int, features: list[slice], world_size: int, reduce=None) -> "StoredWeightLinear":
        """One rank's layer (`name` in the model) over `features` of the whole layer's output (`dim` 0) or input
        (`dim` 1) features, empty until its tensors are read with `read_part`; `reduce` sums the row-parallel
        ranks' outputs. `ValueError` where a range starts or ends inside a stored tensor's `Unit`."""
        total = (self.out_features, self.in_features)[dim]
        for stored in self.stored:
            unit = self.units(stored)[dim]
            if unit is None or unit.features == 1:
                continue
            for cut in features:
                if cut.start % unit.features or (cut.stop % unit.features and cut.stop != total):
                    raise ValueError(
                        f"{name}: tensor_parallel_size {world_size} would cut {unit.what} of {unit.features} "
                        f"{AXES[dim]} features ({stored}): this rank's {AXES[dim]} features {cut.start}:{cut.stop} "
                        f"of {total} must start and end on a multiple of {unit.features}; pick a "
                        f"tensor_parallel_size whose share of {total} is a multiple of {unit.features}")
        size = sum(cut.stop - cut.start for cut in features)
        local = self.like(size, self.out_features) if dim else self.like(self.in_features, size)
        local.part, local.whole, local.reduce = (dim, features), self.whole, reduce
        return local

    def read_part(self, name: str, tensor_slice) -> torch.Tensor:
        """This rank's part of stored tensor (or bias) `name`, from a safetensors slice (`split` first)."""
        dim, features = self.part
        unit = (ONE if dim == 0 else None) if name == "bias" else self.units(name)[dim]
        if unit is None:
            return tensor_slice[:]
        parts = []
        for cut in features:  # a partial last run (a size that is not a multiple of the unit) rounds up
            entries = slice(cut.start * unit.entries // unit.features, -(-cut.stop * unit.entries // unit.features))
            parts.append(tensor_slice[entries] if dim == 0 else tensor_slice[:, entries])
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if self.bias is not None:  # cast to the layer's dtype, as any parameter (before the buffers exist)
            super()._load_from_state_dict({k: v for k, v in state_dict.items() if k == prefix + "bias"}, prefix,
                                          local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        load_stored(self, state_dict, prefix, missing_keys, unexpected_keys, also=("bias",))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, stored={self.stored}"


def load_stored(module: torch.nn.Module, state_dict: dict, prefix: str, missing_keys: list, unexpected_keys: list,
                also: tuple[str, ...] = ()) -> None:
    """Set `module`'s stored tensors (`module.stored`) from a state dict as they are, dtype and all (a cast would
    change the dequantized weight); report missing ones and unexpected keys of its own (beyond `also`)."""
    for name in module.stored:
        if prefix + name in state_dict:
            setattr(module, name, state_dict[prefix + name])
        else:
            missing_keys.append(prefix + name)
    known = {prefix + name for name in (*module.stored, *also)}
    unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in known
                           and "." not in k[len(prefix):])
