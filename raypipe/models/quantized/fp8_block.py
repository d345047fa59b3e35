"""FP8 block-wise checkpoints (`quant_method: fp8`): e4m3 weights with one `weight_scale_inv` per block.

The layout is the one transformers' `FineGrainedFP8Config` and Qwen's -FP8 releases write: a weight of
(out, in) holds e4m3 values, `weight_scale_inv` holds one float per `weight_block_size` block,
ceil(out / block_out) x ceil(in / block_in) of them, the last row and column of blocks partial where a
size is not a multiple of the block (vLLM reads them so; transformers' CPU dequantization derives the
block from the grid, which agrees wherever a size is at most one block or a multiple of it).

A mixture-of-experts layer's fused experts (transformers' `*.experts` module: `gate_up_proj`, `down_proj`
of (experts, out, in)) are quantized the way transformers' `FP8Experts` holds them, one block grid per
expert in `gate_up_proj_scale_inv` / `down_proj_scale_inv` (`Fp8BlockExperts`).
"""

from __future__ import annotations

import torch

from raypipe.models.quantized.stored_experts import EXPERT_WEIGHTS, StoredExperts
from raypipe.models.quantized.stored_linear import ONE, StoredWeightLinear, Unit


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
                      ) -> torch.Tensor:
    """`weight` (..., out, in) in e4m3 times its `scale_inv` (..., ceil(out / rows), ceil(in / cols)), one per
    block, in `dtype` (leading dims: a fused-experts tensor's one grid per expert)."""
    rows, cols = block
    out_features, in_features = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(rows, -2)[..., :out_features, :]  # block scales per row
    weight = weight.float()  # a fresh copy, scaled in place
    whole = in_features // cols
    if whole:
        weight[..., : whole * cols].unflatten(-1, (whole, cols)).mul_(scale[..., :whole, None])
    if in_features % cols:  # the partial last block of columns
        weight[..., whole * cols:].mul_(scale[..., whole:])
    return weight.to(dtype)


class Fp8BlockLinear(StoredWeightLinear):
    def __init__(self, in_features: int, out_features: int, block: tuple[int, int], bias: bool, dtype: torch.dtype):
        super().__init__(in_features, out_features, ("weight", "weight_scale_inv"), bias, dtype)
        self.block = block

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_blocks(self.weight, self.weight_scale_inv, self.block, dtype)

    def units(self, name: str) -> tuple[Unit | None, Unit | None]:
        if name == "weight":
            return ONE, ONE
        rows, cols = self.block
        block = f"a {rows}x{cols} scale block"
        return Unit(rows, 1, block), Unit(cols, 1, block)

    def like(self, in_features: int, out_features: int) -> "Fp8BlockLinear":
        return Fp8BlockLinear(in_features, out_features, self.block, self.bias is not None, self.bias_dtype)


class Fp8BlockExperts(StoredExperts):
    """Fused experts stored in e4m3 with one block grid of scales per expert (`gate_up_proj_scale_inv`,
    `down_proj_scale_inv`: the names transformers' `FP8Experts` loads), rebuilt per forward (`StoredExperts`)."""

    def __init__(self, experts: torch.nn.Module, block: tuple[int, int]):
        super().__init__(experts, tuple(n for weight in EXPERT_WEIGHTS for n in (weight, f"{weight}_scale_inv")))
        self.block = block

    def routed_weights(self, routed: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {name: self.expert_weight(name, routed, dtype) for name in EXPERT_WEIGHTS}  # all routed at once

    def expert_shape(self, name: str) -> tuple[int, int, int]:
        return tuple(getattr(self, name).shape)

    def expert_weight(self, name: str, expert, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_blocks(getattr(self, name)[expert], getattr(self, f"{name}_scale_inv")[expert], self.block,
                                 dtype)

    def extra_repr(self) -> str:
        return f"block={self.block}, stored={self.stored}"


class Fp8BlockPlan:
    """Which linears an `fp8` config quantizes (all but `modules_to_not_convert`, matched by transformers'
    own rule) and their block; a config this path cannot read is refused naming its field."""

    def __init__(self, config: dict):
        block = config.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2
                and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)):
            raise ValueError(f"quantization_config.weight_block_size must be two positive integers [rows, cols] "
                             f"(block-wise FP8; per-tensor FP8 is not supported), got {block!r}")
        _require(config, "activation_scheme", "dynamic")
        _require(config, "fmt", "e4m3")
        _require(config, "scale_fmt", "float")
        if config.get("modules_to_convert"):
            raise ValueError("quantization_config.modules_to_convert (FP8 embeddings) is not supported")
        skip = config.get("modules_to_not_convert") or []
        if not (isinstance(skip, list) and all(isinstance(name, str) for name in skip)):
            raise ValueError(f"quantization_config.modules_to_not_convert must be a list of module names, got {skip!r}")
        self.block = tuple(block)
        self.skip = skip
        self.description = f"fp8 e4m3 weights, {block[0]}x{block[1]} blocks"

    def layer_for(self, names: list[str], linear: torch.nn.Linear, dtype: torch.dtype) -> "Fp8BlockLinear | None":
        from transformers.quantizers.quantizers_utils import should_convert_module

        if not all(should_convert_module(name, self.skip) for name in names):
            return None
        return Fp8BlockLinear(linear.in_features, linear.out_features, self.block, linear.bias is not None, dtype)

    def experts_for(self, names: list[str], experts: torch.nn.Module) -> Fp8BlockExperts | None:
        """A fused-experts module (transformers' `*.experts` with 3-D `gate_up_proj` / `down_proj`) the config
        quantizes (transformers' FP8 quantizer converts every `*.experts` module not skipped)."""
        from transformers.quantizers.quantizers_utils import should_convert_module

        if not all(should_convert_module(name, self.skip) for name in names):
            return None
        return Fp8BlockExperts(experts, self.block)


def _require(config: dict, field: str, value: str) -> None:
    """`field` is absent (the format's default) or `value`."""
    if config.get(field, value) != value:
        raise ValueError(f"quantization_config.{field} {config[field]!r} is not supported (only {value!r})")
