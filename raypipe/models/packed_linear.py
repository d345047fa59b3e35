"""A language model's linears with their weights pre-arranged for oneDNN's CPU GEMM kernels.

`nn.Linear` on a CPU calls MKL with the weight as stored, and the GEMM re-arranges ("packs") the
weight into the blocked layout its kernel reads on every call. oneDNN (torch's `mkldnn` ops, the
library vLLM's CPU build calls for its linears too) can pack a weight once and keep it packed:
`PackedLinear` holds only that packed copy (the plain weight is freed, so memory does not grow).

Measured on the `small` preset's eight layers of linears (2 AVX2 cores, fp32, `raypipe bench decode`
reproduces the engine-level effect): 16.5 ms per decode step's GEMMs at batch 32 against MKL's 20.8,
9.7 against 12.9 at batch 8, 6.8 against 9.3 at batch 1; prefill shapes (a few hundred rows and up)
are equal. Results differ from MKL's by float rounding only (another summation order).

Only plain `torch.nn.Linear` modules are packed: tensor-parallel shards, quantized stored weights and
anything else keep their own forward (a LoRA layer's base linear is plain and is packed; its adapter
matmuls are not). Where oneDNN cannot pack the dtype on this CPU (bf16 needs AVX512 or AVX-NE-CONVERT),
nothing is packed and the reason is returned.
"""

from __future__ import annotations

import torch


class PackedLinear(torch.nn.Module):
    """`y = x W^T + b` through oneDNN with `W` packed once."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach()))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why weights cannot be packed for `device` / `dtype` here; None if they can."""
    if torch.device(device).type != "cpu":
        return f"packed weights are a CPU path (device {torch.device(device).type})"
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN (mkldnn)"
    try:  # the same op the packing runs, on a tiny weight: oneDNN says itself what this CPU supports
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros((8, 8), dtype=dtype))
    except RuntimeError as exc:
        return f"oneDNN cannot pack {dtype} weights on this CPU ({str(exc).splitlines()[0]})"
    return None


def pack_linears(model: torch.nn.Module, skip: tuple[torch.nn.Module, ...] = ()) -> int:
    """Replace every plain `nn.Linear` under `model` (except the modules in `skip` and linears that share
    their weight with another module, a tied lm_head) by a `PackedLinear`; how many were replaced."""
    shared = _shared_weights(model)
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child not in skip and id(child.weight) not in shared:
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    return replaced


def _shared_weights(model: torch.nn.Module) -> set[int]:
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    return {key for key, count in owners.items() if count > 1}
