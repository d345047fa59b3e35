"""compressed-tensors checkpoints (llmcompressor's output: FP8 dynamic, W8A8 int8, W4A16 pack-quantized, ...).

The layer keeps the tensors the scheme's compressor stores (`compression_param_names`: an int4
`weight_packed` with `weight_scale` and `weight_shape`, an fp8 or int8 `weight` with its scale) and
rebuilds the weight with that compressor's own `decompress`, so compressed-tensors reads its format.
Activations stay in the compute dtype on this path (a scheme's `input_activations` are not applied),
as transformers computes with `CompressedTensorsConfig(dequantize=True)`.
"""

from __future__ import annotations

import torch

from raypipe.models.quantized.stored_linear import StoredWeightLinear


class CompressedTensorsLinear(StoredWeightLinear):
    def __init__(self, in_features: int, out_features: int, scheme, compressor, bias: bool, dtype: torch.dtype):
        super().__init__(in_features, out_features, tuple(compressor.compression_param_names(scheme)), bias, dtype)
        self.scheme = scheme
        self.compressor = compressor

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        stored = {name: getattr(self, name) for name in self.stored}
        return self.compressor.decompress(stored, self.scheme)["weight"].to(dtype)


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
