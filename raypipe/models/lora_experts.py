"""LoRA adapters on a mixture-of-experts layer's fused experts (PEFT's `target_parameters`).

transformers keeps a MoE layer's experts as two 3-D parameters of one module (`*.experts`): `gate_up_proj`
(experts, 2 x width, hidden) and `down_proj` (experts, hidden, width), each expert's weight laid out (out, in).
PEFT adapts such a parameter with `target_parameters` (its `ParamWrapper`): `lora_A` is (r x experts, in) and
`lora_B` (out, r x experts); expert e's delta weight is `B_e A_e` times the scaling, with `A_e` the rows
`e*r .. e*r + r - 1` of `lora_A` and `B_e` the columns `e, e + E, e + 2E, ...` of `lora_B` (its
`reshape(out, r, E)[..., e]`), added to the weight for the forward (merged). Several parameters of one module
nest as `experts.base_layer` in the save; which parameter a pair adapts is told by its shapes (`hidden` and
`width` differ).

Here the delta is applied unmerged, as on linears (`lora.py`): `LoraExperts` wraps the experts module and, when
a forward's rows use adapters, runs transformers' per-expert loop itself with each routed token's
`x @ A_e @ B_e` (its row's adapter slot) added to both projections, the module's own gate function between
(`_apply_gate` where it has one: Step3's clamped SwiGLU). A forward of base rows only runs the module as is.
Slots sit side by side as `lora.py`'s do: A `(experts, in, slots * r)`, B `(experts, slots * r, out)`: an adapter
on experts holds `experts x r x (in + out)` numbers per parameter, experts times a linear's.

On a tensor-parallel rank holding whole experts (`expert_split="experts"`) each rank keeps its experts'
factors. On a rank holding a slice of every expert's width (Step3's `expert_split="tensor"`: the experts'
`width_part`), `gate_up_proj` is column-parallel, so the rank keeps its slice of B's gate columns and of its
up columns (as its weight rows were read), and `down_proj` row-parallel, so it keeps its slice of A's rows:
the rank's down delta is partial and joins the layer's sum over ranks with the base product.

Quantized experts that rebuild an expert's weight on demand (FP8 block-wise: `expert_weight`) take adapters
too: the loop rebuilds each routed expert's weights for the forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raypipe.errors import InvalidInput

PARAMETERS = ("gate_up_proj", "down_proj")  # transformers' fused experts, (experts, out, in) each


def unwrapped(module: torch.nn.Module | None) -> torch.nn.Module | None:
    return module.base if isinstance(module, LoraExperts) else module


def is_experts(module: torch.nn.Module | None) -> bool:
    """A transformers fused-experts module whose parameters this applies adapters to (or one already wrapped), or a
    quantized one that rebuilds an expert's weight on demand (`expert_weight`: models/quantized/stored_experts.py)."""
    module = unwrapped(module)
    if module is None:
        return False
    if hasattr(module, "expert_weight"):
        shaped = all(len(module.expert_shape(p)) == 3 for p in PARAMETERS)
    else:
        shaped = all(isinstance(getattr(module, p, None), torch.nn.Parameter) and getattr(module, p).dim() == 3
                     for p in PARAMETERS)
    return (shaped and not getattr(module, "is_transposed", False) and getattr(module, "is_concatenated", True)
            and not getattr(module, "has_bias", False))


def expert_shape(module: torch.nn.Module, parameter: str) -> tuple[int, ...]:
    """(experts, out, in) of `module`'s `parameter`: a quantized module says it, transformers' holds the tensor."""
    return tuple(module.expert_shape(parameter) if hasattr(module, "expert_shape") else getattr(module, parameter).shape)


def module_of(name: str) -> str:
    """A PEFT save's module name for a parameter adapter, without the `base_layer` nesting of a second one."""
    while name.endswith(".base_layer"):
        name = name[: -len(".base_layer")]
    return name


def expert_factors(module_name: str, experts: torch.nn.Module, config, a: torch.Tensor, b: torch.Tensor, rank: int,
                   scaling: float, where: str) -> tuple[str, tuple[torch.Tensor, torch.Tensor]]:
    """`(f"{module_name}.{parameter}", (A (experts, in, r), B scaled (experts, r, out)))` from PEFT's saved
    `lora_A (r x experts, in)`, `lora_B (out, r x experts)` of one of `experts`' parameters (`config`: the text
    model's, which says the whole layer's shapes)."""
    count = getattr(config, "num_experts", None) or config.num_local_experts  # the whole layer's
    width, hidden = config.moe_intermediate_size, config.hidden_size
    held = getattr(experts, "expert_share", (0, count))[1]  # a tensor-parallel rank's whole experts
    part = getattr(experts, "width_part", None)  # or its slice of every expert's width
    local = width if part is None else part[0].stop - part[0].start
    gate_up, down = (expert_shape(experts, p) for p in PARAMETERS)
    if gate_up != (held, 2 * local, hidden) or down != (held, hidden, local):
        raise InvalidInput(f"module {module_name!r} holds experts of shapes {gate_up} and {down}: neither the layer's "
                           "nor a tensor-parallel rank's known share of them", item=where, code="invalid_lora_adapter")
    whole = {"gate_up_proj": (2 * width, hidden), "down_proj": (hidden, width)}  # (out, in) of the whole layer
    for parameter in PARAMETERS:
        out_features, in_features = whole[parameter]
        if a.dim() == b.dim() == 2 and a.shape == (rank * count, in_features) and b.shape == (out_features, rank * count):
            a3 = a.float().reshape(count, rank, in_features).transpose(1, 2)
            b3 = b.float().reshape(out_features, rank, count).permute(2, 1, 0) * scaling
            return f"{module_name}.{parameter}", (a3.contiguous(), b3.contiguous())
    raise InvalidInput(f"module {module_name!r}: lora_A/lora_B shapes {tuple(a.shape)}/{tuple(b.shape)} fit neither "
                       f"of its experts' parameters {PARAMETERS} at r={rank}", item=where, code="invalid_lora_adapter")


class LoraExperts(torch.nn.Module):
    """An experts module plus each routed token's adapter delta on both projections (see the top).

    On a tensor-parallel rank the module holds a share of whole experts (`expert_share`: first, count), with hooks
    that number the routed experts locally before its forward and sum the ranks' outputs after it: the hooks move
    to this wrapper, so the loop here sees local numbers and its output is summed as the module's was."""

    def __init__(self, base: torch.nn.Module, rows, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.width_part = getattr(base, "width_part", None)  # (this rank's slice, the whole width) on a width split
        for hooks in ("_forward_pre_hooks", "_forward_hooks"):  # torch keeps a module's hooks in these dicts
            getattr(self, hooks).update(getattr(base, hooks))
            getattr(base, hooks).clear()
        self.share = getattr(base, "expert_share", None)
        self.base = base
        self.rows = rows  # `lora.LoraRows`: the forward's slots and row mask
        self.max_rank = max_rank
        self.num_experts = expert_shape(base, "gate_up_proj")[0]
        for parameter in PARAMETERS:
            out_features, in_features = expert_shape(base, parameter)[1:]
            width = num_slots * max_rank
            self.register_buffer(f"{parameter}_a", torch.zeros(self.num_experts, in_features, width, dtype=dtype,
                                                               device=device))
            self.register_buffer(f"{parameter}_b", torch.zeros(self.num_experts, width, out_features, dtype=dtype,
                                                               device=device))

    def parameter(self, name: str) -> "ExpertParameter":
        return ExpertParameter(self, name)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        used = self.rows.used
        if not used:
            return self.base.forward(hidden_states, top_k_index, top_k_weights)  # its hooks are this module's
        first = self.rows.first * self.max_rank
        columns = slice(first, first + used * self.max_rank)
        mask = self.rows.mask  # [rows, 1, used, 1]: one row's tokens are consecutive in the flattened batch
        if mask is not None:
            mask = mask.expand(mask.shape[0], hidden_states.shape[0] // mask.shape[0], used, 1).reshape(-1, used, 1)
        base = self.base
        gated = getattr(base, "experts", base)  # a quantized module keeps transformers' (its gate function) inside
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            routed = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(routed.sum(dim=(-1, -2)), 0).nonzero()
        for expert in hit:
            expert = expert[0]
            if expert == self.num_experts:
                continue
            position, token = torch.where(routed[expert])
            rows = None if mask is None else mask[token]
            x = hidden_states[token]
            gate_up = F.linear(x, self._weight("gate_up_proj", expert, x.dtype)) + self._delta(
                "gate_up_proj", expert, x, columns, rows)
            if hasattr(gated, "_apply_gate"):
                current = gated._apply_gate(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                current = gated.act_fn(gate) * up
            current = F.linear(current, self._weight("down_proj", expert, x.dtype)) + self._delta(
                "down_proj", expert, current, columns, rows)
            current = current * top_k_weights[token, position, None]
            final.index_add_(0, token, current.to(final.dtype))
        return final

    def _weight(self, parameter: str, expert, dtype: torch.dtype) -> torch.Tensor:
        """Expert `expert`'s weight of `parameter`: a view of the module's, or rebuilt from a quantized module's."""
        if hasattr(self.base, "expert_weight"):
            return self.base.expert_weight(parameter, expert, dtype)
        return getattr(self.base, parameter)[expert]

    def _delta(self, parameter: str, expert, x: torch.Tensor, columns: slice, rows: torch.Tensor | None):
        h = x @ getattr(self, f"{parameter}_a")[expert][:, columns]
        if rows is not None:
            h = (h.view(h.shape[0], -1, self.max_rank) * rows).view(h.shape)
        return h @ getattr(self, f"{parameter}_b")[expert][columns]


class ExpertParameter:
    """One parameter's slots of a `LoraExperts`, as `LoraSlots` writes and counts a linear's."""

    def __init__(self, experts: LoraExperts, name: str):
        self.experts, self.name = experts, name
        self.lora_a, self.lora_b = getattr(experts, f"{name}_a"), getattr(experts, f"{name}_b")

    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Slot `slot` holds `(a (experts, in, r), b (experts, r, out))`, every expert's (a tensor-parallel rank
        keeps its share); None: zeros."""
        rank = self.experts.max_rank
        first = slot * rank
        self.lora_a[:, :, first: first + rank] = 0
        self.lora_b[:, first: first + rank] = 0
        if a is not None:
            if self.experts.share is not None:
                start, count = self.experts.share
                a, b = a[start: start + count], b[start: start + count]
            if self.experts.width_part is not None:
                part, width = self.experts.width_part
                if self.name == "gate_up_proj":  # the rank's gate columns, then its up columns
                    b = torch.cat((b[:, :, part], b[:, :, width + part.start: width + part.stop]), dim=2)
                else:
                    a = a[:, part]
            self.lora_a[:, :, first: first + a.shape[2]] = a
            self.lora_b[:, first: first + a.shape[2]] = b
