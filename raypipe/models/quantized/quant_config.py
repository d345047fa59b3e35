"""A checkpoint's `quantization_config`: the plan of which linears are quantized and how, and the swap.

A plan is read once per load from `config.json`; a config this path cannot read is refused at load
with a `ValueError` naming its field (the loader's convention), never half-loaded.
`quantize_linears` puts a stored-weight layer in place of every `nn.Linear` the plan quantizes, before
the checkpoint's tensors are loaded into them.
"""

from __future__ import annotations

import torch

from raypipe.models.quantized.compressed import CompressedTensorsPlan
from raypipe.models.quantized.fp8_block import Fp8BlockPlan

PLANS = {"fp8": Fp8BlockPlan, "compressed-tensors": CompressedTensorsPlan}


def quantization_plan(config: dict):
    """The plan for a checkpoint's `config.json` (as a dict), or None for an unquantized checkpoint."""
    quant = config.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise ValueError(f"quantization_config must be a mapping, got {type(quant).__name__}")
    method = quant.get("quant_method")
    if method not in PLANS:
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported (supported: {', '.join(PLANS)})")
    return PLANS[method](quant)


def quantize_linears(module: torch.nn.Module, plan, prefixes: tuple[str, ...], dtype: torch.dtype) -> int:
    """Replace the linears and fused-experts modules of `module` that `plan` quantizes; how many. A module's
    checkpoint name is tried under every layout `prefixes` accepts: ignore lists name modules as the checkpoint does."""
    swaps = []
    for name, child in module.named_modules():
        names = [prefix + name for prefix in prefixes]
        if isinstance(child, torch.nn.Linear):
            layer = plan.layer_for(names, child, dtype)
        elif name.endswith(".experts") and isinstance(getattr(child, "gate_up_proj", None), torch.nn.Parameter):
            layer = plan.experts_for(names, child)
        else:
            layer = None
        if layer is not None:
            swaps.append((name, layer))
    for name, layer in swaps:
        parent, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(parent), leaf, layer)
    return len(swaps)


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of `module`'s parameters and buffers, each tensor once (tied weights share one)."""
    seen = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        seen[id(tensor) if tensor.is_mkldnn else tensor.data_ptr()] = tensor.nbytes  # oneDNN's have no data_ptr
    return sum(seen.values())
