"""A language model's linears with their weights pre-arranged for oneDNN's CPU GEMM kernels.

`nn.Linear` on a CPU calls MKL with the weight as stored, and the GEMM re-arranges ("packs") the
weight into the blocked layout its kernel reads on every call. oneDNN (torch's `mkldnn` ops, the
library vLLM's CPU build calls for its linears too) can pack a weight once and keep it packed:
`PackedLinear` holds only that packed copy (the plain weight is freed, so memory does not grow).

Measured on the shapes of the `small` preset's eight layers of linears (2 AVX2 cores, fp32, one loop
over all 56, so weights come from memory as in a step): 16.5 ms at batch 32 against MKL's 20.8, 9.7
against 12.9 at batch 8, 6.8 against 9.3 at batch 1; at a few hundred rows and up the two are even in
that loop, yet a burst's prefill in the engine took 2.25 s packed against 3.11 s (docs/performance.md,
"The CPU decode path"). Results differ from MKL's by float rounding only (another summation order).

Only plain `torch.nn.Linear` modules are packed: tensor-parallel shards, quantized stored weights and
anything else keep their own forward (a LoRA layer's base linear is plain and is packed; its adapter
matmuls are not). Where oneDNN cannot pack bf16 on this CPU (it needs AVX512 or AVX-NE-CONVERT), a bf16
model's linears are packed and computed in fp32 (`compute_dtype` says why that is exact enough).
"""

from __future__ import annotations

import torch


class PackedLinear(torch.nn.Module):
    """`y = x W^T + b` through oneDNN with `W` packed once, in `compute_dtype` (inputs cast to it, the
    output cast back to the input's dtype)."""

    def __init__(self, linear: torch.nn.Linear, compute_dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().to(compute_dtype)
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight))
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().to(compute_dtype),
                                                                        requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_gemm(x, self.packed_weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"compute_dtype={self.packed_weight.dtype}")


def packed_gemm(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x W^T + b` through oneDNN with `W` packed, computed in the packed weight's dtype, returned in `x`'s."""
    out = torch.ops.mkldnn._linear_pointwise(x.to(packed_weight.dtype), packed_weight, bias, "none", [], "")
    return out.to(x.dtype)


def compute_dtype(device: torch.device, dtype: torch.dtype) -> tuple[torch.dtype | None, str]:
    """The dtype a model in `dtype` gets its linears packed and computed in on `device`, and what that means;
    None and the reason where nothing is packed.

    A bf16 model on a CPU whose oneDNN has no bf16 GEMM (no AVX512 or AVX-NE-CONVERT: torch then runs a
    reference bf16 GEMM, 5-8x slower than fp32 at decode and prefill shapes here) is computed in fp32:
    bf16 inputs and weights are exact in fp32, sums are in fp32 as a bf16 GEMM keeps them, the output is
    rounded to bf16 once. The packed weights then take fp32's bytes."""
    if torch.device(device).type != "cpu":
        return None, f"packed weights are a CPU path (device {torch.device(device).type})"
    if not torch.backends.mkldnn.is_available():
        return None, "this torch has no oneDNN (mkldnn)"
    reasons = []
    for candidate in dict.fromkeys((dtype, torch.float32)):
        try:  # the op the packing runs, on a tiny weight: oneDNN says itself what this CPU supports
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros((8, 8), dtype=candidate))
        except RuntimeError as exc:
            reasons.append(f"oneDNN cannot pack {candidate} weights on this CPU ({str(exc).splitlines()[0]})")
            continue
        if candidate == dtype:
            return candidate, f"packed in {dtype}"
        return candidate, f"packed and computed in {candidate}: {reasons[-1]}"
    return None, "; ".join(reasons)


def pack_linears(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Replace every plain `nn.Linear` under `model` (except linears that share their weight with another
    module, a tied lm_head) by a `PackedLinear` computing in `dtype`; how many were replaced."""
    shared = shared_weights(model)
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and id(child.weight) not in shared:
                setattr(parent, name, PackedLinear(child, dtype))
                replaced += 1
    return replaced


def shared_weights(model: torch.nn.Module) -> set[int]:
    """ids of the parameters more than one module holds (a tied lm_head's weight)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    return {key for key, count in owners.items() if count > 1}
