"""One rank's share of the language model's weights, by the checkpoint's own tensor-parallel plan.

transformers' text configs carry `base_model_tp_plan` (Qwen2 / LLaVA-OneVision's text model,
Qwen2.5-VL, Qwen3.5, the MoE families): module patterns -> a style. We read that plan, not a copy
of it, and apply its two plain styles ourselves:

- `colwise`: the Linear keeps this rank's slice of its output features (weight rows, bias) —
  q/k/v keep its heads, gate/up its slice of the MLP's width;
- `rowwise`: the Linear keeps this rank's slice of its input features (weight columns) and sums
  the ranks' partial outputs (`all_reduce`), then adds its bias once — o_proj and down_proj.

Linear attention (the gated delta net of Qwen3.5 / MiniCPM-V 4.6) is split by heads too, by a rule
of ours (`DeltaNetHeads`): the plan gathers those layers' outputs (`colwise_gather_output`), so every
rank would run every head and hold every head's conv and recurrent state. Its heads are as
independent as attention's: each rank keeps its key heads and the value heads they serve (q, k, v
rows of the fused projection and of the depthwise conv; z, a, b, A_log, dt_bias rows), the gated
norm (per head size) whole, and `out_proj` is row-parallel.

Mixture-of-experts layers (Qwen3-VL-MoE, Qwen3.5-MoE) are expert-parallel (`ExpertSplit`): each rank holds E/N
whole experts (sliced from fused tensors, or only its experts' tensors read where the checkpoint stores
each expert apart and the family fuses them on load) (the plan's `packed_colwise` / `moe_tp_experts` entries would cut every expert in N and
need both an all-gather and an all-reduce per layer); the router is on every rank, so every rank
routes every token alike. transformers' expert loop already skips a sentinel index (its own
expert-parallel path): tokens routed to another rank's experts get it, each rank sums its experts'
share, and one all-reduce adds the ranks' shares.

Why not transformers' own `apply_tensor_parallelism`: it turns parameters into DTensors over a
DeviceMesh of the process-wide default group and loads them through `from_pretrained` of the whole
model class (vision tower included); raypipe builds the text model alone, reads only its tensors,
needs several groups per process (`collectives.py`) and drives the model with its own cache. The
two styles need nothing of DTensor: a local GEMM, then one all-reduce per row-parallel layer. Any
other style in a plan (`colwise_gather_output` of Qwen3.5's linear attention, the packed MoE
expert styles of Step3 and Qwen3-VL-MoE) is refused with its name, so a family is sharded exactly
or not at all.

Each tensor is read through `safe_open(...).get_slice`: only this rank's rows or columns are kept.
Layers outside the plan (embeddings, norms, lm_head) are read whole on every rank. A quantized layer
(`models/quantized`, swapped in before the shard prepares the model) splits itself (`split`,
`read_part`): its format knows which entries of its scales, zero points and packed words belong to a
range of features, and refuses a range that would cut one of them.
"""

from __future__ import annotations

import copy
import re

import torch

SUPPORTED_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")  # the last: replicated (no grads here)
LINEAR_ATTENTION = ".linear_attn."  # plan entries under a gated delta net: replaced by `DeltaNetHeads`
EXPERTS = ".mlp.experts"  # plan entries of fused MoE experts: replaced by `ExpertSplit`


class ColumnParallelLinear(torch.nn.Linear):
    """This rank's output features of a Linear (no communication). `part` and `whole` say what of which layer
    it keeps (a LoRA adapter's factors are cut by them, `models/lora.py`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 part: tuple[int, list[slice]], whole: tuple[int, int]):
        super().__init__(in_features, out_features, bias=bias, dtype=dtype)
        self.part, self.whole = part, whole


class RowParallelLinear(torch.nn.Linear):
    """This rank's input features of a Linear; the ranks' partial outputs are summed, the bias added once.
    `partial` and `finish` are the two halves of its forward: a LoRA delta joins the partial output between
    them, so the one all-reduce sums the ranks' deltas too."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, collectives,
                 part: tuple[int, list[slice]], whole: tuple[int, int]):
        super().__init__(in_features, out_features, bias=bias, dtype=dtype)
        self.collectives = collectives
        self.part, self.whole = part, whole

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)

    def finish(self, partial: torch.Tensor) -> torch.Tensor:
        out = self.collectives.all_reduce(partial)
        return out + self.bias if self.bias is not None else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(self.partial(x))


# Plans raypipe writes for text configs that carry none, in the shape of transformers' own (model_type -> plan).
# Qwen3-VL's dense text model (`qwen3_vl_text`) has no `base_model_tp_plan` in transformers 5.23, though its
# layers are Qwen3's: q/k/v split by heads (GQA: each rank keeps num_key_value_heads / N whole kv heads, still
# serving its own query heads), q_norm/k_norm normalise each head over head_dim and so stay whole on every
# rank, o_proj sums the ranks' heads; the MLP splits its width (gate/up rows, down columns). It is
# Qwen3-VL-MoE's plan less its expert entries, and Qwen3's (which lists q_norm/k_norm as replicated).
RAYPIPE_PLANS = {
    "qwen3_vl_text": {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    },
}


def tp_plan(text_config) -> dict[str, str]:
    """The config's `base_model_tp_plan` (else raypipe's own, `RAYPIPE_PLANS`), or `ValueError` naming what
    keeps it from being used."""
    plan = dict(getattr(text_config, "base_model_tp_plan", None)
                or RAYPIPE_PLANS.get(getattr(text_config, "model_type", None), {}))
    if "linear_attention" in (getattr(text_config, "layer_types", None) or ()):
        plan = {pattern: style for pattern, style in plan.items() if LINEAR_ATTENTION not in f".{pattern}"}
    if _num_experts(text_config):
        plan = {pattern: style for pattern, style in plan.items() if EXPERTS not in f".{pattern}"}
    if not plan:
        raise ValueError(f"{type(text_config).__name__} has no base_model_tp_plan: tensor parallelism needs one")
    styles = {style for style in plan.values() if style not in SUPPORTED_STYLES}
    if styles:
        raise ValueError(f"{type(text_config).__name__}'s tensor-parallel plan uses {sorted(styles)}, which "
                         f"raypipe does not shard yet (only {list(SUPPORTED_STYLES)}): run it with "
                         f"tensor_parallel_size 1")
    return plan


class WeightShard:
    """Rank `rank` of `world_size`: which modules are split how, and the reads that take only its slice."""

    def __init__(self, text_config, rank: int, world_size: int, collectives):
        self.rank, self.world_size, self.collectives = rank, world_size, collectives
        self.styles = [(re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$"), style)
                       for pattern, style in tp_plan(text_config).items()]
        self.delta_net = DeltaNetHeads(text_config, rank, world_size)
        self.quantized: dict[str, torch.nn.Module] = {}  # module name -> this rank's quantized layer (`local_linear`)
        self.experts = ExpertSplit(text_config, rank, world_size, collectives)
        for name in ("num_attention_heads", "num_key_value_heads", *self.delta_net.head_counts):
            heads = getattr(text_config, name)
            if heads % world_size:
                raise ValueError(f"{name} = {heads} is not divisible by tensor_parallel_size {world_size}")

    def style(self, module_name: str) -> str | None:
        return next((style for pattern, style in self.styles if pattern.match(module_name)), None)

    def local_text_config(self, text_config):
        """What one rank's cache holds: its share of the attention heads (head size unchanged)."""
        local = copy.copy(text_config)
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        local.head_dim = head_dim
        local.num_attention_heads = text_config.num_attention_heads // self.world_size
        local.num_key_value_heads = text_config.num_key_value_heads // self.world_size
        for name in self.delta_net.head_counts:
            setattr(local, name, getattr(text_config, name) // self.world_size)
        return local

    def prepare(self, model: torch.nn.Module) -> None:
        """Swap every planned Linear for an empty one of this rank's shape (filled by the load that follows)."""
        for name, module in list(model.named_modules()):
            if self.delta_net.owns(name):
                self.delta_net.prepare(name, module, self.local_linear)
                continue
            if self.experts.owns(name):
                self.experts.prepare(module)
                continue
            style = self.style(name)
            if style not in ("colwise", "rowwise"):
                continue
            dim = 0 if style == "colwise" else 1
            features = self._part((module.out_features, module.in_features)[dim], name)
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, self.local_linear(name, module, dim, [features]))

    def local_linear(self, name: str, module: torch.nn.Module, dim: int, features: list[slice]) -> torch.nn.Module:
        """An empty Linear for this rank's `features` (slices of the whole layer's) of `module`'s output (`dim` 0,
        column-parallel) or input features (`dim` 1, row-parallel). A quantized layer (`models/quantized`, one with
        `split`) splits itself: its stored tensors' blocks, groups and packed words decide where it may be cut."""
        if hasattr(module, "split"):
            local = module.split(name, dim, features, self.world_size, self.collectives.all_reduce if dim else None)
            self.quantized[name] = local
            return local
        if type(module) is not torch.nn.Linear:
            raise ValueError(f"{name} is a {type(module).__name__}; tensor parallelism shards torch.nn.Linear only")
        size, bias, dtype = sum(cut.stop - cut.start for cut in features), module.bias is not None, module.weight.dtype
        part, whole = (dim, features), (module.in_features, module.out_features)
        if dim == 0:
            return ColumnParallelLinear(module.in_features, size, bias, dtype, part, whole)
        return RowParallelLinear(size, module.out_features, bias, dtype, self.collectives, part, whole)

    def holds(self, name: str) -> bool:
        """Whether this rank reads tensor `name` at all (not another rank's expert stored apart)."""
        return self.experts.holds(name)

    def read(self, name: str, tensor_slice) -> torch.Tensor:
        """Tensor `name` (a state-dict key of the text model) from a safetensors slice: this rank's part."""
        module, _, param = name.rpartition(".")
        if module in self.quantized:
            return self.quantized[module].read_part(param, tensor_slice)
        if self.experts.owns(module):
            return self.experts.read(tensor_slice)
        owner = module if self.delta_net.owns(module) else module.rpartition(".")[0]
        if self.delta_net.owns(owner):
            return self.delta_net.read(module[len(owner) + 1:], param, tensor_slice)
        style = self.style(module)
        shape = tensor_slice.get_shape()
        if style == "colwise":
            size = shape[0] // self.world_size
            return tensor_slice[self.rank * size: (self.rank + 1) * size]
        if style == "rowwise" and param == "weight":
            size = shape[1] // self.world_size
            return tensor_slice[:, self.rank * size: (self.rank + 1) * size]
        return tensor_slice[:]

    def _part(self, features: int, name: str) -> slice:
        if features % self.world_size:
            raise ValueError(f"{name}: {features} features do not split over {self.world_size} ranks")
        size = features // self.world_size
        return slice(self.rank * size, (self.rank + 1) * size)


def _num_experts(text_config) -> int:
    return getattr(text_config, "num_experts", 0) or 0


class ExpertSplit:
    """This rank's whole experts of every fused-experts module (`layers.N.mlp.experts`)."""

    def __init__(self, text_config, rank: int, world_size: int, collectives):
        experts = _num_experts(text_config)
        if experts % world_size:
            raise ValueError(f"num_experts = {experts} is not divisible by tensor_parallel_size {world_size}")
        self.count = experts // world_size
        self.first = rank * self.count
        self.collectives = collectives

    def owns(self, module_name: str) -> bool:
        return self.count > 0 and re.fullmatch(r"layers\.\d+\.mlp\.experts", module_name) is not None

    def holds(self, name: str) -> bool:
        """Whether this rank reads tensor `name`: False for one expert's own tensor (a checkpoint that stores
        experts apart, `layers.N.mlp.experts.<e>.<proj>.weight`: Qwen3.5-MoE's) where `e` is another rank's."""
        apart = re.fullmatch(r"layers\.\d+\.mlp\.experts\.(\d+)\..+", name) if self.count else None
        return apart is None or self.first <= int(apart.group(1)) < self.first + self.count

    def prepare(self, experts: torch.nn.Module) -> None:
        if hasattr(experts, "keep_experts"):  # quantized (`models/quantized`): its stored tensors are read as they are
            experts.keep_experts(self.count)
        else:
            for name, param in list(experts.named_parameters(recurse=False)):
                setattr(experts, name, torch.nn.Parameter(torch.empty((self.count, *param.shape[1:]),
                                                                      dtype=param.dtype)))
            experts.num_experts = self.count
            experts._is_expert_parallel = True  # transformers' kernels skip the sentinel index `num_experts`
        experts.expert_share = (self.first, self.count)  # a LoRA adapter's experts are cut so (`lora_experts.py`)
        experts.register_forward_pre_hook(self._local_indices)
        experts.register_forward_hook(self._sum_over_ranks)

    def _local_indices(self, module, args):
        hidden, top_k_index, top_k_weights = args
        local = top_k_index - self.first
        return hidden, torch.where((local >= 0) & (local < self.count), local, self.count), top_k_weights

    def _sum_over_ranks(self, module, args, output):
        return self.collectives.all_reduce(output)

    def read(self, tensor_slice) -> torch.Tensor:
        """This rank's experts of a fused tensor (a quantized one's block scales too: one grid per expert)."""
        return tensor_slice[self.first: self.first + self.count]


class DeltaNetHeads:
    """This rank's heads of every gated-delta-net layer (`layers.N.linear_attn`), by head."""

    head_counts = ("linear_num_key_heads", "linear_num_value_heads")

    def __init__(self, text_config, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.on = "linear_attention" in (getattr(text_config, "layer_types", None) or ())
        if not self.on:
            self.head_counts = ()
            return
        c = text_config
        self.key_dim = c.linear_num_key_heads * c.linear_key_head_dim
        self.value_dim = c.linear_num_value_heads * c.linear_value_head_dim
        self.value_heads = c.linear_num_value_heads

    def owns(self, module_name: str) -> bool:
        return self.on and re.fullmatch(r"layers\.\d+\.linear_attn", module_name) is not None

    def _rows(self, total: int) -> slice:
        size = total // self.world_size
        return slice(self.rank * size, (self.rank + 1) * size)

    def _qkv_rows(self) -> list[slice]:
        """This rank's rows of the fused q | k | v channels (projection outputs, conv channels)."""
        q, k, v = self._rows(self.key_dim), self._rows(self.key_dim), self._rows(self.value_dim)
        return [q, slice(self.key_dim + k.start, self.key_dim + k.stop),
                slice(2 * self.key_dim + v.start, 2 * self.key_dim + v.stop)]

    def prepare(self, name: str, net: torch.nn.Module, local_linear) -> None:
        """`net`'s projections become this rank's (`local_linear`, `WeightShard`'s), its conv and per-head
        parameters this rank's channels and heads."""
        n = self.world_size
        dtype = net.conv1d.weight.dtype
        net.num_k_heads, net.num_v_heads = net.num_k_heads // n, net.num_v_heads // n
        net.key_dim, net.value_dim = net.key_dim // n, net.value_dim // n
        net.conv_dim = net.key_dim * 2 + net.value_dim
        heads, values = [self._rows(self.value_heads)], [self._rows(self.value_dim)]
        for child, dim, features in (("in_proj_qkv", 0, self._qkv_rows()), ("in_proj_z", 0, values),
                                     ("in_proj_b", 0, heads), ("in_proj_a", 0, heads), ("out_proj", 1, values)):
            setattr(net, child, local_linear(f"{name}.{child}", getattr(net, child), dim, features))
        net.conv1d = torch.nn.Conv1d(net.conv_dim, net.conv_dim, net.conv_kernel_size, groups=net.conv_dim,
                                     padding=net.conv_kernel_size - 1, bias=False, dtype=dtype)
        net.dt_bias = torch.nn.Parameter(torch.empty(net.num_v_heads, dtype=net.dt_bias.dtype))
        net.A_log = torch.nn.Parameter(torch.empty(net.num_v_heads, dtype=net.A_log.dtype))

    def read(self, child: str, param: str, tensor_slice) -> torch.Tensor:
        if child in ("in_proj_qkv", "conv1d"):
            return torch.cat([tensor_slice[rows] for rows in self._qkv_rows()])
        if child == "in_proj_z":
            return tensor_slice[self._rows(self.value_dim)]
        if child in ("in_proj_a", "in_proj_b") or param in ("dt_bias", "A_log"):
            return tensor_slice[self._rows(self.value_heads)]
        if child == "out_proj":
            return tensor_slice[:, self._rows(self.value_dim)]
        return tensor_slice[:]  # the gated norm: per head size, the same for every head


def sharded_parameter_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of parameter storage this process holds in the decoder layers (what the plan shards) and in the
    rest (embeddings, final norm, lm_head; tied ones counted once). Weights packed for oneDNN
    (`models/packed_linear.py`, buffers without a storage of their own) and a quantized layer's stored tensors
    (`models/quantized/`: buffers named in its `stored`) count as parameters; other buffers do not."""
    tensors = [*model.named_parameters(remove_duplicate=False),
               *((name, buffer) for name, buffer in model.named_buffers() if buffer.is_mkldnn),
               *((f"{name}.{stored}", getattr(module, stored)) for name, module in model.named_modules()
                 for stored in getattr(module, "stored", ()))]
    storages = {}
    for name, tensor in tensors:
        if tensor.is_mkldnn:
            storages[id(tensor)] = (tensor.nbytes, ".layers." in f".{name}")
        else:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = (storage.nbytes(), ".layers." in f".{name}")
    layers = sum(size for size, in_layers in storages.values() if in_layers)
    return {"decoder_layers": layers, "other": sum(size for size, _ in storages.values()) - layers}
