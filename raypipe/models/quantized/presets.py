"""Quantized presets: a random preset's language model quantized by the formats' own libraries.

`<preset>-<format>` (`tiny-fp8`, `tiny-qwen3.5-w4a16`, ...) is the preset's checkpoint with every
language-model linear but lm_head and a gated delta net's `in_proj_a` / `in_proj_b` quantized (the
vision tower stays as it is, as in Qwen's and llmcompressor's releases; `in_proj_a` / `in_proj_b`
have one output row per value head, too few for a block per rank, and llmcompressor's Qwen3.5
recipe leaves the whole linear attention unquantized), from the bf16 weights:
- `fp8`: block-wise e4m3 by transformers' own `Fp8Quantize` (what `FineGrainedFP8Config` writes); a
  mixture-of-experts model's fused experts too (`tiny-qwen3-vl-moe-fp8`: `experts.gate_up_proj` and
  `experts.down_proj`, one block grid per expert, beside them `gate_up_proj_scale_inv` and
  `down_proj_scale_inv`, the names and shapes of transformers' `FP8Experts`), its router not (not a
  Linear, as Qwen's -FP8 releases keep `mlp.gate`);
- `fp8-dynamic`, `w8a8`, `w4a16`: compressed-tensors' preset schemes (`FP8_DYNAMIC`, `W8A8`, `W4A16`),
  scales from each weight's min/max by compressed-tensors' `calculate_qparams`, compressed and
  described in `config.json` by its `ModelCompressor` (llmcompressor's save path). A mixture-of-experts
  model's experts too (`tiny-qwen3.5-moe-w4a16`), one compressed linear per expert and projection
  (`mlp.experts.<e>.gate_proj.weight_packed`, ...), the layout llmcompressor writes: it quantizes the
  experts as the per-expert Linears they are during its calibration, and `ModelCompressor` describes them
  by the same `Linear` target. The router (`mlp.gate`) and `shared_expert_gate` (one output row) are not
  quantized, as llmcompressor's Qwen MoE recipes leave them.

Block and group sizes are at most 128 (real checkpoints' size) and small enough that every preset splits
over two tensor-parallel ranks, which cut nothing on a block or group boundary (`two_rank_size`):
FP8's square block divides half of every quantized width (and of a gated delta net's key and value
widths, which its fused projection is split by); W4A16's group divides half of every input width.
`fp8_block` writes another block (a checkpoint that a tensor-parallel group must refuse, in tests): a
weight smaller than it is zero-padded to whole blocks for the quantizer and cut back, so its scales
are those of the partial blocks (ceil(size / block) per dim).
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil

FORMATS = ("fp8", "fp8-dynamic", "w8a8", "w4a16")
BASES = ("tiny", "tiny-qwen3.5", "small", "small-qwen3.5")
# Bases with experts, and their formats: the experts quantized too.
MOE_BASES = {"tiny-qwen3-vl-moe": ("fp8",), "tiny-qwen3.5-moe": ("w4a16",)}
VERSION = "q3"  # part of a quantized preset's cache folder name: bump when what they hold changes
LARGEST_BLOCK = 128
TP_READY = 2  # the tensor_parallel_size every preset's blocks and groups split over
# What stays unquantized, in transformers' module names: the output head, the vision tower, a gated delta
# net's per-head projections.
NOT_QUANTIZED = ["lm_head", "model.visual", "linear_attn.in_proj_a", "linear_attn.in_proj_b", "shared_expert_gate"]
_COMPRESSED_TENSORS_SCHEMES = {"fp8-dynamic": "FP8_DYNAMIC", "w8a8": "W8A8", "w4a16": "W4A16"}


def quantized_presets() -> dict[str, tuple[str, str]]:
    """Preset name -> (base preset, format)."""
    return {**{f"{base}-{fmt}": (base, fmt) for base in BASES for fmt in FORMATS},
            **{f"{base}-{fmt}": (base, fmt) for base, formats in MOE_BASES.items() for fmt in formats}}


def write_quantized(base: pathlib.Path, folder: pathlib.Path, fmt: str,
                    fp8_block: tuple[int, int] | None = None) -> None:
    """`base`'s checkpoint with its language model quantized in `fmt`, written to `folder` (`fp8` with
    `fp8_block`, else a square block that `two_rank_size` picks)."""
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.bfloat16).eval()
    if fmt == "fp8":
        linears = [m for _, m in _quantized_linears(model)]
        delta_net = _delta_net_widths(model.config.get_text_config())
        size = two_rank_size([m.out_features for m in linears] + [m.in_features for m in linears] + delta_net)
        size = math.gcd(size, *_expert_widths(model.config.get_text_config()))
        _write_fp8(model, folder, list(fp8_block or (size, size)))
    else:
        _write_compressed_tensors(model, folder, _COMPRESSED_TENSORS_SCHEMES[fmt])
    for extra in base.iterdir():  # tokenizer, processors, generation config, preset marker
        if not (folder / extra.name).exists():
            shutil.copy(extra, folder / extra.name)


def two_rank_size(widths: list[int]) -> int:
    """The largest block or group of at most `LARGEST_BLOCK` features that divides each width's share on one of
    `TP_READY` ranks."""
    return math.gcd(LARGEST_BLOCK, *(width // TP_READY for width in widths))


def _delta_net_widths(text_config) -> list[int]:
    """A gated delta net's key and value widths (its fused q | k | v projection is split within each), if any."""
    if "linear_attention" not in (getattr(text_config, "layer_types", None) or ()):
        return []
    c = text_config
    return [c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim]


def _expert_widths(text_config) -> list[int]:
    """A fused-experts model's expert width (the gate | up boundary of `gate_up_proj`) and hidden size: a block
    divides them, whole experts go to each rank (`parallel.shards.ExpertSplit`), so not their halves."""
    width = getattr(text_config, "moe_intermediate_size", None) if getattr(text_config, "num_experts", 0) else None
    return [] if width is None else [width, text_config.hidden_size]


def _quantized_experts(model):
    """The fused-experts modules transformers' FP8 quantizer converts: named `*.experts` (its rule), not skipped."""
    import torch
    from transformers.quantizers.quantizers_utils import should_convert_module

    return [(name, module) for name, module in model.named_modules()
            if name.endswith(".experts") and isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter)
            and should_convert_module(name, NOT_QUANTIZED)]


def _quantized_linears(model):
    import torch
    from transformers.quantizers.quantizers_utils import should_convert_module

    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and should_convert_module(name, NOT_QUANTIZED)]


def _write_fp8(model, folder: pathlib.Path, block: list[int]) -> None:
    import torch
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    config = FineGrainedFP8Config(weight_block_size=block, modules_to_not_convert=NOT_QUANTIZED)
    quantize = Fp8Quantize(FineGrainedFP8HfQuantizer(config))
    rows, cols = block
    for _, linear in _quantized_linears(model):
        out_features, in_features = linear.weight.shape
        padded = torch.nn.functional.pad(linear.weight.detach(), (0, -in_features % cols, 0, -out_features % rows))
        quantized = quantize.convert({"weight": padded})
        linear.weight = torch.nn.Parameter(quantized["weight"][:out_features, :in_features].contiguous(),
                                           requires_grad=False)
        linear.weight_scale_inv = torch.nn.Parameter(quantized["weight_scale_inv"], requires_grad=False)
    for name, experts in _quantized_experts(model):
        for param in ("gate_up_proj", "down_proj"):  # (experts, out, in): one block grid per expert
            weight = getattr(experts, param).detach()
            if weight.shape[-2] % rows or weight.shape[-1] % cols:  # `Fp8Quantize` would leave it unquantized
                raise ValueError(f"{name}.{param} {tuple(weight.shape)} is not a whole number of {rows}x{cols} blocks")
            for key, tensor in quantize.convert({param: weight}).items():  # `param` and `param`_scale_inv
                setattr(experts, key, torch.nn.Parameter(tensor, requires_grad=False))
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

    scheme = preset_name_to_scheme(preset, ["Linear"])
    linears = _quantized_linears(model)
    experts = _expert_widths(model.config.get_text_config())  # whole experts per rank: not halved
    if scheme.weights.strategy == QuantizationStrategy.GROUP:
        scheme.weights.group_size = math.gcd(two_rank_size([m.in_features for _, m in linears]), *experts)
    ignore = ["lm_head", "re:model.visual.*", r"re:.*linear_attn\.in_proj_[ab]$", r"re:.*shared_expert_gate$"]
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore))
    for _, linear in linears:
        scale, zero_point = _qparams(linear.weight.detach(), linear.quantization_scheme.weights)
        linear.weight_scale.data = scale.to(linear.weight_scale.dtype).reshape(linear.weight_scale.shape)
        if hasattr(linear, "weight_zero_point"):
            linear.weight_zero_point.data = zero_point.to(linear.weight_zero_point.dtype).reshape(
                linear.weight_zero_point.shape)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
    if experts:
        written = compressor.quantization_config
        _compress_saved_experts(folder, written.config_groups["group_0"], written.format)


def _qparams(weight, args):
    """compressed-tensors' scale and zero point of `weight` (out, in) from its min/max, per `args`' strategy."""
    from compressed_tensors.quantization import QuantizationStrategy
    from compressed_tensors.quantization.utils import calculate_qparams

    if args.strategy == QuantizationStrategy.GROUP:  # one min/max per row and group of columns
        weight = weight.unflatten(-1, (-1, args.group_size))
        return calculate_qparams(weight.amin(-1), weight.amax(-1), args)
    return calculate_qparams(weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True), args)  # per channel


def _compress_saved_experts(folder: pathlib.Path, scheme, fmt: str) -> None:
    """Compress, in the written checkpoint, each expert's projection (`mlp.experts.<e>.<proj>.weight`: transformers
    saves the fused experts apart again) as the linear it is: `scheme` (the written config's) by `fmt`'s compressor."""
    import re

    from compressed_tensors.compressors import BaseCompressor
    from safetensors.torch import load_file, save_file

    compressor = BaseCompressor.get_value_from_registry(scheme.format or fmt)
    expert = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")
    index = folder / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.exists() else None
    for path in sorted(folder.glob("*.safetensors")):
        state, compressed = load_file(path), {}
        for key, tensor in state.items():
            if not expert.fullmatch(key):
                compressed[key] = tensor
                continue
            scale, zero_point = _qparams(tensor.float(), scheme.weights)
            parts = compressor.compress({"weight": tensor, "weight_scale": scale.to(tensor.dtype),
                                         "weight_zero_point": zero_point}, scheme)
            prefix = key.removesuffix("weight")
            for name, part in parts.items():
                compressed[prefix + name] = part.contiguous()
                if weight_map is not None:
                    weight_map[prefix + name] = path.name
            if weight_map is not None and "weight" not in parts:
                del weight_map[key]
        save_file(compressed, path, metadata={"format": "pt"})
    if weight_map is not None:
        written = json.loads(index.read_text())
        written["weight_map"] = weight_map
        index.write_text(json.dumps(written, indent=2))
