"""compressed-tensors checkpoints (llmcompressor's output: FP8 dynamic, W8A8 int8, W4A16 pack-quantized, ...).

The layer keeps the tensors the scheme's compressor stores (`compression_param_names`: an int4
`weight_packed` with `weight_scale` and `weight_shape`, an fp8 or int8 `weight` with its scale) and
rebuilds the weight with that compressor's own `decompress`, so compressed-tensors reads its format.
Activations stay in the compute dtype on this path (a scheme's `input_activations` are not applied),
as transformers computes with `CompressedTensorsConfig(dequantize=True)`.

A mixture-of-experts layer's experts are stored as llmcompressor writes them, one compressed linear per expert
and projection (`mlp.experts.<e>.gate_proj.weight_packed`, ...; `expert_layout.fused_experts` stacks each
projection's tensors over the experts): `CompressedTensorsExperts` rebuilds the routed experts' projections
with the same compressor per forward.
"""

from __future__ import annotations

import math

import torch

from raypipe.models.quantized.stored_experts import EXPERT_WEIGHTS, PROJECTIONS, StoredExperts
from raypipe.models.quantized.stored_linear import ONE, StoredWeightLinear, Unit


class CompressedTensorsLinear(StoredWeightLinear):
    def __init__(self, in_features: int, out_features: int, scheme, compressor, bias: bool, dtype: torch.dtype):
        super().__init__(in_features, out_features, tuple(compressor.compression_param_names(scheme)), bias, dtype)
        self.scheme = scheme
        self.compressor = compressor

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        stored = {name: getattr(self, name) for name in self.stored}
        return self.compressor.decompress(stored, self.scheme)["weight"].to(dtype)

    def units(self, name: str) -> tuple[Unit | None, Unit | None]:
        args = self.scheme.weights
        if name == "weight":
            return ONE, ONE
        if name == "weight_packed":  # int`bits` values packed densely along each row, 32 / bits to a word
            return ONE, _packed(args.num_bits)
        if name in ("weight_scale", "weight_zero_point"):
            rows, cols = _scale_units(args)
            if name == "weight_zero_point" and "weight_packed" in self.stored and rows is not None:
                rows = _packed(args.num_bits)  # pack-quantized packs per-channel / group zero points along dim 0
            return rows, cols
        return None, None  # `weight_shape` (`read_part` writes this rank's), global scales: whole

    def like(self, in_features: int, out_features: int) -> "CompressedTensorsLinear":
        return CompressedTensorsLinear(in_features, out_features, self.scheme, self.compressor, self.bias is not None,
                                       self.bias_dtype)

    def read_part(self, name: str, tensor_slice) -> torch.Tensor:
        if name != "weight_shape":
            return super().read_part(name, tensor_slice)
        shape = tensor_slice[:].clone()  # the whole layer's (out, in): the unpacking needs this rank's
        dim = self.part[0]
        shape[dim] = (self.out_features, self.in_features)[dim]
        return shape


class CompressedTensorsExperts(StoredExperts):
    """Experts stored as compressed linears, each projection's tensors stacked over the experts
    (`gate_proj_weight_packed`: (experts, width, hidden / 8), ...), rebuilt per forward (`StoredExperts`)."""

    def __init__(self, experts: torch.nn.Module, scheme, compressor):
        self.params = tuple(compressor.compression_param_names(scheme))
        super().__init__(experts, tuple(f"{projection}_{name}" for projection in PROJECTIONS for name in self.params))
        self.scheme, self.compressor = scheme, compressor

    def projection(self, projection: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `expert`'s `projection` weight (out, in), decompressed by the scheme's compressor, in `dtype`."""
        stored = {name: getattr(self, f"{projection}_{name}")[expert] for name in self.params}
        return self.compressor.decompress(stored, self.scheme)["weight"].to(dtype)

    def routed_weights(self, routed: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        experts = routed.tolist()
        return {name: torch.stack([self.expert_weight(name, e, dtype) for e in experts]) for name in EXPERT_WEIGHTS}

    def expert_weight(self, name: str, expert, dtype: torch.dtype) -> torch.Tensor:
        if name == "gate_up_proj":  # gate rows first, as transformers fuses them
            return torch.cat([self.projection(p, expert, dtype) for p in ("gate_proj", "up_proj")])
        return self.projection("down_proj", expert, dtype)

    def expert_shape(self, name: str) -> tuple[int, int, int]:
        experts = getattr(self, self.stored[0]).shape[0]
        if name == "gate_up_proj":
            (gate, hidden), (up, _) = self.projection_shape("gate_proj"), self.projection_shape("up_proj")
            return experts, gate + up, hidden
        return (experts, *self.projection_shape("down_proj"))

    def projection_shape(self, projection: str) -> tuple[int, int]:
        """(out, in) of `projection`'s weight: its stored `weight_shape` (packed formats), else its stored weight's."""
        if "weight_shape" in self.params:
            return tuple(getattr(self, f"{projection}_weight_shape")[0].tolist())
        return tuple(getattr(self, f"{projection}_weight").shape[1:])

    def extra_repr(self) -> str:
        return f"{self.compressor.__name__}, stored={self.stored}"


def _packed(bits: int) -> Unit:
    """A run of values that fills whole int32 words in compressed-tensors' dense packing (value i at bit i x bits)."""
    common = math.gcd(32, bits)
    return Unit(32 // common, bits // common, f"a run of int{bits} values packed into {bits // common} int32 word(s)")


def _scale_units(args) -> tuple[Unit | None, Unit | None]:
    """How a scale (or zero point) of `args`' strategy follows the weight's output and input features."""
    strategy = getattr(args.strategy, "value", args.strategy)
    if strategy == "channel":
        return ONE, None
    if strategy in ("group", "tensor_group"):
        return ONE, Unit(args.group_size, 1, f"a group of {args.group_size} input features (one scale)")
    if strategy == "block":
        rows, cols = args.block_structure
        block = f"a {rows}x{cols} scale block"
        return Unit(rows, 1, block), Unit(cols, 1, block)
    return None, None  # one scale for the whole tensor


# The formats whose compressor rebuilds a dense weight from a linear's stored tensors.
FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")


class CompressedTensorsPlan:
    """A `compressed-tensors` config read by the library (`QuantizationConfig`); which linears each
    group quantizes (its `targets` minus `ignore`, compressed-tensors' own matching); a config this
    path cannot read is refused naming its field."""

    def __init__(self, config: dict):
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.quantization import QuantizationConfig
        from pydantic import ValidationError

        for field in ("sparsity_config", "transform_config", "kv_cache_scheme"):
            if config.get(field):
                raise ValueError(f"quantization_config.{field} is not supported (weight quantization only)")
        try:
            parsed = QuantizationConfig.model_validate({k: v for k, v in config.items() if k != "version"})
        except ValidationError as e:
            raise ValueError(f"quantization_config does not parse as compressed-tensors' QuantizationConfig: {e}") from e
        if parsed.quantization_status != "compressed":
            raise ValueError(f"quantization_config.quantization_status {parsed.quantization_status.value!r} is not "
                             "supported (only 'compressed': weights stored in their format)")
        self.groups, described = [], []
        for name, scheme in parsed.config_groups.items():
            fmt = scheme.format or parsed.format
            fmt = getattr(fmt, "value", fmt)
            if fmt not in FORMATS:
                raise ValueError(f"quantization_config.config_groups.{name}.format {fmt!r} is not supported "
                                 f"(supported: {', '.join(FORMATS)})")
            if scheme.weights is None:
                raise ValueError(f"quantization_config.config_groups.{name}.weights is missing (weight quantization only)")
            self.groups.append((scheme, BaseCompressor.get_value_from_registry(fmt)))
            described.append(f"{fmt} {scheme.weights.type}{scheme.weights.num_bits} {scheme.weights.strategy}")
        self.ignore = parsed.ignore or []
        self.description = "compressed-tensors " + ", ".join(described)

    def layer_for(self, names: list[str], linear: torch.nn.Linear, dtype: torch.dtype) -> CompressedTensorsLinear | None:
        from compressed_tensors.utils.match import is_match

        if any(is_match(name, linear, self.ignore) for name in names):
            return None
        for scheme, compressor in self.groups:
            if any(is_match(name, linear, scheme.targets) for name in names):
                return CompressedTensorsLinear(linear.in_features, linear.out_features, scheme, compressor,
                                               linear.bias is not None, dtype)
        return None

    def experts_for(self, names: list[str], experts: torch.nn.Module) -> CompressedTensorsExperts | None:
        """A fused-experts module whose per-expert linears (`<name>.<e>.gate_proj`, ..., Linears in the model
        llmcompressor quantized) the config quantizes: matched as expert 0's projections, by the same rules."""
        from compressed_tensors.utils.match import is_match

        probe = torch.nn.Linear(1, 1, device="meta")
        linears = [f"{name}.0.{projection}" for name in names for projection in PROJECTIONS]
        if any(is_match(name, probe, self.ignore) for name in linears):
            return None
        for scheme, compressor in self.groups:
            if any(is_match(name, probe, scheme.targets) for name in linears):
                return CompressedTensorsExperts(experts, scheme, compressor)
        return None
