"""Step3's routed experts as grouped GEMMs on CUDA, so its decode step can be captured in a CUDA graph.

transformers' `Step3p7Experts` loops over the experts a batch routes to and finds them on the host
(`nonzero`): a CUDA graph capture of that step fails, and the engine decoded Step3 eagerly on GPUs. Its
weights are laid out as the MoE experts transformers runs through `use_experts_implementation` (fused
gate | up, `(experts, out, in)`), and it defines the `_apply_gate` hook (Step3's SwiGLU clamp) that those
kernels call, so transformers' own `grouped_mm_experts_forward` computes the same thing with the routing
kept on the device (a sort and a histogram). Only on CUDA: on a CPU the loop's host reads cost nothing,
and torch.compile breaks its graph there instead.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _grouped_class() -> type:
    from transformers.integrations.moe import grouped_mm_experts_forward
    from transformers.models.step3p7.modeling_step3p7 import Step3p7Experts

    class GroupedStep3Experts(Step3p7Experts):
        # what transformers' experts kernels read (use_experts_implementation's defaults for this layout)
        has_gate, has_bias, has_post_expert_norm, is_transposed, is_concatenated = True, False, False, False, True
        _is_expert_parallel = False  # a rank holding some experts whole sets it (parallel/step3_shards.py)

        def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
            return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)

    return GroupedStep3Experts


def group_experts(model: torch.nn.Module, device: torch.device) -> None:
    """On CUDA, every `Step3p7Experts` of `model` runs grouped GEMMs."""
    from transformers.models.step3p7.modeling_step3p7 import Step3p7Experts

    if device.type != "cuda":
        return
    for module in model.modules():
        if type(module) is Step3p7Experts:  # not a quantized or LoRA-wrapped one
            to_grouped(module)


def to_grouped(experts: torch.nn.Module) -> None:
    """`experts` (a `Step3p7Experts`) runs grouped GEMMs from now on: same parameters and attributes, its forward
    the grouped one."""
    experts.__class__ = _grouped_class()
