"""Linears that read the same input packed as one oneDNN GEMM: q/k/v projections, gate/up projections.

transformers' attention layers call `q_proj`, `k_proj` and `v_proj` one after another on the same hidden
states, and gated MLPs call `gate_proj` and `up_proj` on the same input. Packed side by side (their weights
concatenated along the output dimension, `packed_linear.py` for the packing), one GEMM computes them all:
one call instead of three and wider GEMMs, which oneDNN runs closer to peak. Measured on the `small`
preset's eight layers (2 AVX2 cores, fp32, weights from memory as in a step): 22.5 ms against 24.7 at
batch 32, 8.6 against 10.2 at batch 1. Each sibling's slice is bit-identical to its own packed GEMM
(oneDNN's sums run over the input dimension, which the concatenation leaves alone).

The siblings stay modules of their own, so transformers' code runs unchanged: the first one called with an
input computes every sibling's output and keeps them; a sibling called with that same tensor (the same
object, not modified in place since) returns its slice. A sibling called with anything else computes the
whole GEMM again and takes its slice: always correct, only slower. Outputs are kept until every sibling
has taken its own, per thread (the engine's prefill runs beside its decode on the same modules).
"""

from __future__ import annotations

import threading

import torch

from raypipe.models.packed_linear import packed_gemm, shared_weights

# Child names of one module that read the same input, in the order the model calls them.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class PackedSiblings:
    """The shared GEMM of a set of sibling linears, in `compute_dtype`, and the outputs not yet taken."""

    def __init__(self, linears: list[torch.nn.Linear], compute_dtype: torch.dtype):
        weight = torch.cat([linear.weight.detach() for linear in linears]).to(compute_dtype)
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.plain_weight: torch.Tensor | None = weight  # for one row, until dropped (`packed_linear.py`)
        biases = [linear.bias for linear in linears]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases]).to(compute_dtype)
        self.sizes = [linear.out_features for linear in linears]
        self._kept = threading.local()  # per thread: the engine's prefill and decode threads share the model

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # each sibling's GEMM call: the compiled graph keeps one (compiled_forward.py)
            return self.gemm(x).split(self.sizes, dim=-1)[index]
        kept, version = self._kept, input_version(x)
        if getattr(kept, "input", None) is not x or kept.version != version or index not in kept.untaken:
            kept.input, kept.version = x, version
            kept.parts = self.gemm(x).split(self.sizes, dim=-1)
            kept.untaken = set(range(len(self.sizes)))
        part = kept.parts[index]
        kept.untaken.discard(index)
        if not kept.untaken:  # every sibling served: let the input and outputs go
            kept.input, kept.parts = None, ()
        return part


    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """Every sibling's output, side by side in the last dimension."""
        return packed_gemm(x, self.packed_weight, self.bias, self.plain_weight)


def input_version(x: torch.Tensor) -> int | None:
    """`x`'s in-place modification count; None for an inference tensor, which counts none (the engine's
    forwards run in inference mode: there the same object is taken as the same values, which transformers'
    layers honour, since nothing writes a layer's input between its siblings' calls)."""
    return None if x.is_inference() else x._version


class SiblingLinear(torch.nn.Module):
    """One sibling of a `PackedSiblings` group: its slice of the group's GEMM."""

    def __init__(self, group: PackedSiblings, index: int, in_features: int):
        super().__init__()
        self.group, self.index = group, index
        self.in_features, self.out_features = in_features, group.sizes[index]
        if index == 0:  # the group's tensors, registered once: what the model holds is counted (parallel/shards.py)
            self.register_buffer("packed_weight", group.packed_weight)
            self.bias = None if group.bias is None else torch.nn.Parameter(group.bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(self.index, x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, sibling {self.index} of "
                f"{len(self.group.sizes)}, compute_dtype={self.group.packed_weight.dtype}")


def pack_siblings(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Replace each complete set of `SIBLINGS` under `model` (plain `nn.Linear` children of one module, or the
    plain `base` linears of the LoRA layers there, with one input width, all with a bias or none, no weight
    shared elsewhere) by `SiblingLinear`s over one packed GEMM in `dtype`; how many linears were replaced.
    A LoRA layer (`models/lora.py`) calls its base with its own input, so its siblings' bases share the GEMM
    as plain siblings do."""
    shared = shared_weights(model)
    replaced = 0
    for parent in list(model.modules()):
        for names in SIBLINGS:
            holders = [_linear_holder(parent, name) for name in names]
            linears = [getattr(owner, name, None) for owner, name in holders]
            if not all(type(linear) is torch.nn.Linear and id(linear.weight) not in shared for linear in linears):
                continue
            if len({linear.in_features for linear in linears}) != 1 or len({linear.bias is None
                                                                            for linear in linears}) != 1:
                continue
            group = PackedSiblings(linears, dtype)
            for index, ((owner, name), linear) in enumerate(zip(holders, linears)):
                setattr(owner, name, SiblingLinear(group, index, linear.in_features))
            replaced += len(names)
    return replaced


def _linear_holder(parent: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """Where child `name`'s plain linear is set: on `parent`, or on the LoRA layer there as its `base`."""
    child = getattr(parent, name, None)
    return (child, "base") if type(getattr(child, "base", None)) is torch.nn.Linear else (parent, name)
