"""Quantized presets: a random preset's language model quantized by the formats' own libraries.

`<preset>-<format>` (`tiny-fp8`, `tiny-qwen3.5-w4a16`, ...) is the preset's checkpoint with every
language-model linear but lm_head quantized (the vision tower stays as it is, as in Qwen's and
llmcompressor's releases), from the bf16 weights:
- `fp8`: block-wise e4m3 by transformers' own `Fp8Quantize` (what `FineGrainedFP8Config` writes),
  `weight_block_size` [128, 128]; a weight smaller than a block is zero-padded to whole blocks for
  the quantizer and cut back, so its scales are those of the partial blocks (ceil(size / 128) per dim).
- `fp8-dynamic`, `w8a8`, `w4a16`: compressed-tensors' preset schemes (`FP8_DYNAMIC`, `W8A8`, `W4A16`),
  scales from each weight's min/max by compressed-tensors' `calculate_qparams`, compressed and
  described in `config.json` by its `ModelCompressor` (llmcompressor's save path). W4A16's group is
  the largest of at most 128 columns that divides every quantized layer's input width.
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil

FORMATS = ("fp8", "fp8-dynamic", "w8a8", "w4a16")
BASES = ("tiny", "tiny-qwen3.5", "small", "small-qwen3.5")
FP8_BLOCK = [128, 128]
# What stays unquantized, in transformers' module names: the output head and the vision tower.
NOT_QUANTIZED = ["lm_head", "model.visual"]
_COMPRESSED_TENSORS_SCHEMES = {"fp8-dynamic": "FP8_DYNAMIC", "w8a8": "W8A8", "w4a16": "W4A16"}


def quantized_presets() -> dict[str, tuple[str, str]]:
    """Preset name -> (base preset, format)."""
    return {f"{base}-{fmt}": (base, fmt) for base in BASES for fmt in FORMATS}


def write_quantized(base: pathlib.Path, folder: pathlib.Path, fmt: str) -> None:
    """`base`'s checkpoint with its language model quantized in `fmt`, written to `folder`."""
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.bfloat16).eval()
    if fmt == "fp8":
        _write_fp8(model, folder)
    else:
        _write_compressed_tensors(model, folder, _COMPRESSED_TENSORS_SCHEMES[fmt])
    for extra in base.iterdir():  # tokenizer, processors, generation config, preset marker
        if not (folder / extra.name).exists():
            shutil.copy(extra, folder / extra.name)


def _quantized_linears(model):
    import torch
    from transformers.quantizers.quantizers_utils import should_convert_module

    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and should_convert_module(name, NOT_QUANTIZED)]


def _write_fp8(model, folder: pathlib.Path) -> None:
    import torch
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    config = FineGrainedFP8Config(weight_block_size=FP8_BLOCK, modules_to_not_convert=NOT_QUANTIZED)
    quantize = Fp8Quantize(FineGrainedFP8HfQuantizer(config))
    rows, cols = FP8_BLOCK
    for _, linear in _quantized_linears(model):
        out_features, in_features = linear.weight.shape
        padded = torch.nn.functional.pad(linear.weight.detach(), (0, -in_features % cols, 0, -out_features % rows))
        quantized = quantize.convert({"weight": padded})
        linear.weight = torch.nn.Parameter(quantized["weight"][:out_features, :in_features].contiguous(),
                                           requires_grad=False)
        linear.weight_scale_inv = torch.nn.Parameter(quantized["weight_scale_inv"], requires_grad=False)
    model.save_pretrained(folder)
    config_path = folder / "config.json"
    written = json.loads(config_path.read_text())
    written["quantization_config"] = config.to_dict()
    config_path.write_text(json.dumps(written, indent=2, default=str))


def _write_compressed_tensors(model, folder: pathlib.Path, preset: str) -> None:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStrategy,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme(preset, ["Linear"])
    linears = _quantized_linears(model)
    if scheme.weights.strategy == QuantizationStrategy.GROUP:
        scheme.weights.group_size = math.gcd(scheme.weights.group_size, *(m.in_features for _, m in linears))
    ignore = NOT_QUANTIZED[:1] + [f"re:{NOT_QUANTIZED[1]}.*"]
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore))
    for _, linear in linears:
        args, weight = linear.quantization_scheme.weights, linear.weight.detach()
        if args.strategy == QuantizationStrategy.GROUP:  # one min/max per row and group of columns
            weight = weight.unflatten(-1, (-1, args.group_size))
            low, high = weight.amin(-1), weight.amax(-1)
        else:  # per output channel
            low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
        scale, zero_point = calculate_qparams(low, high, args)
        linear.weight_scale.data = scale.to(linear.weight_scale.dtype).reshape(linear.weight_scale.shape)
        if hasattr(linear, "weight_zero_point"):
            linear.weight_zero_point.data = zero_point.to(linear.weight_zero_point.dtype).reshape(
                linear.weight_zero_point.shape)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
