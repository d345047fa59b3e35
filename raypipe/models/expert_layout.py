"""Per-expert checkpoint tensors fused as transformers' MoE experts modules hold them.

Released MoE checkpoints store each expert's projections apart (`mlp.experts.<e>.gate_proj.weight`, as Qwen3.5's
releases and transformers' own `save_pretrained` write them, and as Qwen's Qwen3-VL-MoE -FP8 releases do); the
module holds them fused per layer: `gate_up_proj` (experts, 2 x width, hidden; gate rows first) and `down_proj`
(experts, hidden, width). transformers converts on load (its `qwen2_moe` conversion); `fused_experts` does the
same for the tensors raypipe reads, FP8 block scales (`weight_scale_inv`) included: a fused scale grid is the
gate's block rows then the up's, which is the fused weight's own grid only when the width is a whole number of
blocks (otherwise a block of the fused weight would straddle the gate | up boundary: refused).

Experts stored as compressed-tensors linears (`weight_packed`, `weight_scale`, `weight_shape`, ...: llmcompressor's
layout) are not fused: each projection's tensors are stacked over the experts as `<proj>_<tensor>`
(`gate_proj_weight_packed`), the names `quantized.compressed.CompressedTensorsExperts` holds them by.
"""

from __future__ import annotations

import re

import torch

from raypipe.models.quantized.stored_experts import PROJECTIONS

_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight\w*)")
_FUSED = {"weight": "", "weight_scale_inv": "_scale_inv"}  # suffix of the fused tensor's name


def _block_rows(config) -> int | None:
    """The rows of a checkpoint's FP8 scale block (`quantization_config.weight_block_size`, which the FP8 plan has
    checked by the time a state is converted), if it has one."""
    quant = getattr(config, "quantization_config", None) or {}
    block = quant.get("weight_block_size") if isinstance(quant, dict) else getattr(quant, "weight_block_size", None)
    return block[0] if block else None


def fused_experts(state: dict[str, torch.Tensor], config=None) -> dict[str, torch.Tensor]:
    """`state` with per-expert projections (and their FP8 block scales, by the block of `config`, the checkpoint's
    config) fused: the experts present in index order (a tensor-parallel rank reads only its own:
    `raypipe.parallel.shards.ExpertSplit`). Tensors already fused, and every other tensor, pass unchanged."""
    out, experts = {}, {}
    for key, tensor in state.items():
        match = _EXPERT.fullmatch(key)
        if match is None:
            out[key] = tensor
        else:
            prefix, expert, projection, kind = match.groups()
            experts.setdefault((prefix, kind), {})[(int(expert), projection)] = tensor
    compressed = {prefix for prefix, kind in experts if kind not in _FUSED}  # compressed-tensors experts: stacked
    for (prefix, kind), parts in experts.items():
        held = sorted({e for e, _ in parts})  # every expert, or a tensor-parallel rank's consecutive share
        missing = [f"{prefix}.{e}.{p}.{kind}" for e in held for p in PROJECTIONS if (e, p) not in parts]
        if missing:
            raise ValueError(f"the checkpoint stores experts apart but lacks {', '.join(missing[:3])}"
                             f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''}")
        if prefix in compressed:
            for projection in PROJECTIONS:
                out[f"{prefix}.{projection}_{kind}"] = torch.stack([parts[e, projection] for e in held])
            continue
        if kind == "weight_scale_inv":
            width = state[f"{prefix}.{held[0]}.gate_proj.weight"].shape[0]
            scale_block_rows = _block_rows(config)
            if scale_block_rows is None or width % scale_block_rows:
                raise ValueError(f"{prefix}: an expert width of {width} rows is not a whole number of "
                                 f"{scale_block_rows}-row FP8 scale blocks: the fused gate | up weight's blocks "
                                 "would straddle the boundary, so these per-expert scales cannot be fused")
        suffix = _FUSED[kind]
        out[f"{prefix}.gate_up_proj{suffix}"] = torch.stack([torch.cat((parts[e, "gate_proj"], parts[e, "up_proj"]))
                                                             for e in held])
        out[f"{prefix}.down_proj{suffix}"] = torch.stack([parts[e, "down_proj"] for e in held])
    return out
