"""A mixture-of-experts layer's experts kept as the checkpoint stores them, rebuilt per forward for the routed ones.

transformers holds a layer's experts fused (`*.experts`: `gate_up_proj` (experts, 2 x width, hidden), gate rows
first, and `down_proj` (experts, hidden, width)) and runs its routing loop or grouped GEMMs over them. A quantized
checkpoint's experts stay in their stored tensors here; each forward a subclass rebuilds, in the compute dtype,
only the experts that forward routes to (`routed_weights`), and transformers' own module runs on them. A decode
step of a few rows rebuilds a few of a layer's experts (one row with 8 of 128 routed: 1/16 of the layer); a
prefill of many tokens most of them.
"""

from __future__ import annotations

import copy

import torch

from raypipe.models.quantized.stored_linear import load_stored

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # transformers' fused experts: (experts, out, in) each
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # an expert's linears, where a checkpoint stores experts apart


class StoredExperts(torch.nn.Module):
    """transformers' experts module `experts` over weights rebuilt per forward from the stored tensors `stored`
    (buffers, filled by the checkpoint as stored, one entry per expert along dim 0)."""

    def __init__(self, experts: torch.nn.Module, stored: tuple[str, ...]):
        super().__init__()
        self.stored = stored
        for name in stored:
            self.register_buffer(name, None)
        for name in EXPERT_WEIGHTS:  # the module's weights become a per-call copy's plain attributes (`forward`)
            delattr(experts, name)
        self.experts = experts

    def routed_weights(self, routed: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """`gate_up_proj` and `down_proj` of the experts `routed` (indices, ascending), in `dtype`."""
        raise NotImplementedError

    def expert_shape(self, name: str) -> tuple[int, int, int]:
        """(experts, out, in) of transformers' `name` (one of `EXPERT_WEIGHTS`) as this module rebuilds it."""
        raise NotImplementedError

    def expert_weight(self, name: str, expert, dtype: torch.dtype) -> torch.Tensor:
        """Expert `expert`'s `name` weight (out, in) rebuilt in `dtype`: LoRA adapters on these experts run
        transformers' per-expert loop over it (`models/lora_experts.py`)."""
        raise NotImplementedError

    def keep_experts(self, count: int) -> None:
        """A tensor-parallel rank's module: `count` whole experts (its stored tensors are read as its share)."""
        self.experts.num_experts = count
        self.experts._is_expert_parallel = True  # transformers' kernels skip the sentinel index `num_experts`

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        # The routed experts are numbered 0.. in expert order, every other index becoming the skipped sentinel:
        # each routed expert sees the same rows, in the same order, as with all of them rebuilt.
        count = self.experts.num_experts  # this module's experts (a tensor-parallel rank's share)
        routed = torch.unique(top_k_index)
        routed = routed[routed < count]  # a rank's sentinel for other ranks' experts is not one of them
        if not len(routed):  # every row went to other ranks' experts: this rank's share of the sum is zero
            return torch.zeros_like(hidden_states)
        renumber = torch.full((count + 1,), len(routed), dtype=top_k_index.dtype, device=top_k_index.device)
        renumber[routed] = torch.arange(len(routed), dtype=top_k_index.dtype, device=top_k_index.device)
        # A copy per call holds this call's weights: the engine's prefill thread and its decode loop may run the
        # same layer at once. Its tensors die with it.
        run = copy.copy(self.experts)
        run.num_experts, run._is_expert_parallel = len(routed), True  # transformers skips the sentinel's rows
        for name, weight in self.routed_weights(routed, hidden_states.dtype).items():
            setattr(run, name, weight)
        return run(hidden_states, renumber[top_k_index], top_k_weights)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        load_stored(self, state_dict, prefix, missing_keys, unexpected_keys)

    def extra_repr(self) -> str:
        return f"stored={self.stored}"
