"""Step3's text model over N ranks: raypipe's own sharding rule, not the config's plan.

transformers' plan for `step3p5` (`Step3p7TextConfig.base_model_tp_plan`) cannot drive raypipe's
explicit-cache forward:

- attention: q/k/v/g are `colwise_gather_output` and o_proj `rowwise_split_input`. The outputs of
  q/k/v are gathered back to every head (transformers' attention reshapes by the layer's full head
  count), so every rank would run every head and hold every head's K/V in its paged pool and
  sliding rows — no memory saved where Step3 needs it most. We split by heads instead: q, k, v and
  the per-head gate g keep this rank's heads (their rows), o_proj keeps the matching input columns
  and sums the ranks' outputs (one all-reduce), and the attention module's `num_heads` becomes the
  rank's count. Full and sliding layers alike (the sliding layers have fewer query heads:
  `num_sliding_attention_heads`); the key/value heads split the same way, so each query head keeps
  its key/value head (`num_key_value_groups` is unchanged) and the rank's cache holds `1/N` of the heads.
  q_norm / k_norm act per head size and stay whole.
- experts: the plan's `packed_colwise` / `moe_tp_experts` (tensor-parallel experts) and its
  `base_model_ep_plan` (`ep_dispatch_experts`: all-to-all dispatch) are DTensor machinery over the
  process-wide default group. We split the routed experts ourselves, one of two ways
  (`EngineConfig.expert_split`):
  `"experts"` (the default): each rank holds E/N whole experts, the router is on every rank (so every
  rank routes every token alike), tokens routed to another rank's experts get the sentinel index
  `num_experts`, which Step3's expert loop skips (as `shards.ExpertSplit` does for Qwen3-VL-MoE);
  `"tensor"`: each rank holds every expert's slice of the expert width (gate and up rows, down columns),
  runs every routed expert on its slice.
- shared expert and the dense MLP layers: gate/up colwise, down rowwise.

One all-reduce per MoE layer: the routed experts' partial sum, times `routed_scaling_factor`, plus the
shared expert's partial down projection (no reduce of its own) are summed across ranks once, at the
MoE block's output — the block is linear in both. A dense MLP layer has its down projection's
all-reduce, attention its o_proj's: two all-reduces per decoder layer.

Biases on the MLP projections (`mlp_bias`) are refused: Step3's are off, and a partial down
projection would add its bias N times.
"""

from __future__ import annotations

import copy
import re

import torch

from raypipe.decode.config import EXPERT_SPLITS
from raypipe.parallel.shards import ColumnParallelLinear, RowParallelLinear

_LAYER = re.compile(r"layers\.\d+\.(.+)\.(weight|bias)$")
_COLUMNS = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.g_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"}  # this rank's output rows
_ROWS = {"self_attn.o_proj", "mlp.down_proj", "mlp.shared_experts.down_proj"}  # this rank's input columns


class Step3Shard:
    """Rank `rank` of `world_size` for `Step3p7TextModel`: which modules are split how, and the reads that take
    only this rank's slice (`read(module_name, safetensors_slice)`, the names of transformers' mapping)."""

    def __init__(self, text_config, rank: int, world_size: int, collectives, expert_split: str = "experts"):
        if expert_split not in EXPERT_SPLITS:
            raise ValueError(f"expert_split {expert_split!r}: expected one of {EXPERT_SPLITS}")
        self.rank, self.world_size, self.collectives, self.expert_split = rank, world_size, collectives, expert_split
        c = text_config
        if c.mlp_bias:
            raise ValueError("Step3 with mlp_bias: a partial down projection would add its bias on every rank")
        # Query heads are per layer (`per_layer_config`: the sliding layers have their own count).
        sizes = {f"layer {i}'s num_attention_heads": c.per_layer_config[i].num_attention_heads
                 for i in range(c.num_hidden_layers)}
        sizes.update(num_key_value_heads=c.num_key_value_heads, intermediate_size=c.intermediate_size,
                     share_expert_dim=c.share_expert_dim)
        sizes["n_routed_experts" if expert_split == "experts" else "moe_intermediate_size"] = (
            c.n_routed_experts if expert_split == "experts" else c.moe_intermediate_size)
        for name, size in sizes.items():
            if size % world_size:
                raise ValueError(f"{name} = {size} is not divisible by tensor_parallel_size {world_size}")
        self.expert_count = c.n_routed_experts // world_size  # "experts": this rank's experts
        self.first_expert = rank * self.expert_count
        self.expert_width = c.moe_intermediate_size  # "tensor": each expert's width, split in N

    def local_text_config(self, text_config):
        """What one rank's cache holds: its share of the key/value heads (head size unchanged)."""
        local = copy.copy(text_config)
        local.num_key_value_heads = text_config.num_key_value_heads // self.world_size
        return local

    def prepare(self, model: torch.nn.Module) -> None:
        """Give every decoder layer this rank's shapes (empty; the load that follows fills them)."""
        for layer in model.layers:
            self._attention(layer.self_attn)
            mlp = layer.mlp
            if hasattr(mlp, "experts"):
                self._moe(mlp)
            else:
                self._columns(mlp, "gate_proj", "up_proj")
                self._row_parallel(mlp, "down_proj")

    def read(self, name: str, tensor_slice) -> torch.Tensor:
        """Tensor `name` of a decoder layer (a module name of the text model) from a safetensors slice: this rank's part."""
        shape = tensor_slice.get_shape()
        if name.endswith(".mlp.experts.gate_up_proj"):  # (E, I, H) per source (gate or up), or (E, 2I, H) packed
            if self.expert_split == "experts":
                return tensor_slice[self.first_expert: self.first_expert + self.expert_count]
            return torch.cat([tensor_slice[:, self._part(start, self.expert_width)]
                              for start in range(0, shape[1], self.expert_width)], dim=1)
        if name.endswith(".mlp.experts.down_proj"):  # (E, H, I)
            if self.expert_split == "experts":
                return tensor_slice[self.first_expert: self.first_expert + self.expert_count]
            return tensor_slice[:, :, self._part(0, shape[2])]
        match = _LAYER.match(name)
        module, param = (match.group(1), match.group(2)) if match else (None, None)
        if module in _COLUMNS:
            return tensor_slice[self._part(0, shape[0])]
        if module in _ROWS and param == "weight":
            return tensor_slice[:, self._part(0, shape[1])]
        return tensor_slice[:]  # norms, the router and its bias: whole on every rank

    def _part(self, start: int, size: int) -> slice:
        """This rank's share of `size` entries from `start`."""
        share = size // self.world_size
        return slice(start + self.rank * share, start + (self.rank + 1) * share)

    def _attention(self, attn: torch.nn.Module) -> None:
        self._columns(attn, "q_proj", "k_proj", "v_proj", "g_proj")
        self._row_parallel(attn, "o_proj")
        attn.num_heads //= self.world_size  # its output is viewed per head; the q/kv ratio is unchanged

    def _moe(self, moe: torch.nn.Module) -> None:
        shared = moe.shared_experts
        self._columns(shared, "gate_proj", "up_proj")
        down = shared.down_proj
        shared.down_proj = torch.nn.Linear(down.in_features // self.world_size, down.out_features, bias=False,
                                           dtype=down.weight.dtype)  # partial: summed with the experts' below
        experts = moe.experts
        gate_up, down = experts.gate_up_proj, experts.down_proj
        if self.expert_split == "experts":
            shapes = ((self.expert_count, *gate_up.shape[1:]), (self.expert_count, *down.shape[1:]))
            experts.num_experts = self.expert_count
            experts._is_expert_parallel = True  # transformers' grouped kernel (on CUDA) skips the sentinel index
            experts.expert_share = (self.first_expert, self.expert_count)  # LoRA factors are cut so (`lora_experts.py`)
            experts.register_forward_pre_hook(self._local_experts)
        else:
            experts.intermediate_dim //= self.world_size
            experts.width_part = (self._part(0, self.expert_width), self.expert_width)  # LoRA factors are cut so
            shapes = ((gate_up.shape[0], gate_up.shape[1] // self.world_size, gate_up.shape[2]),
                      (down.shape[0], down.shape[1], down.shape[2] // self.world_size))
        experts.gate_up_proj = torch.nn.Parameter(torch.empty(shapes[0], dtype=gate_up.dtype))
        experts.down_proj = torch.nn.Parameter(torch.empty(shapes[1], dtype=down.dtype))
        moe.register_forward_hook(self._sum_over_ranks)

    def _local_experts(self, module, args):
        """Route to this rank's experts by local index; tokens of other ranks' experts get the skipped sentinel."""
        hidden, top_k_index, top_k_weights = args
        local = top_k_index - self.first_expert
        inside = (local >= 0) & (local < self.expert_count)
        return hidden, torch.where(inside, local, self.expert_count), top_k_weights

    def _sum_over_ranks(self, module, args, output):
        return self.collectives.all_reduce(output)

    def _columns(self, parent: torch.nn.Module, *names: str) -> None:
        for name in names:
            linear = getattr(parent, name)
            setattr(parent, name, ColumnParallelLinear(
                linear.in_features, linear.out_features // self.world_size, linear.bias is not None,
                linear.weight.dtype, (0, [self._part(0, linear.out_features)]), (linear.in_features, linear.out_features)))

    def _row_parallel(self, parent: torch.nn.Module, name: str) -> None:
        linear = getattr(parent, name)
        setattr(parent, name, RowParallelLinear(
            linear.in_features // self.world_size, linear.out_features, linear.bias is not None, linear.weight.dtype,
            self.collectives, (1, [self._part(0, linear.in_features)]), (linear.in_features, linear.out_features)))
