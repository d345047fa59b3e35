"""LoRA adapters (PEFT checkpoints) on the language model, several of them served in one batch.

A save is split where it is read: `read_adapter` takes the language model's part (the decode engine's), and
`read_tower_adapter` the vision tower's, for a family whose encoders apply tower adapters
(`ModelFamily.lora_tower_prefixes`; `encode/tower_lora.py` applies them there, one adapter per forward).

A PEFT LoRA adapter adds `scaling * B(A(x))` to chosen linear layers (`scaling` is alpha / r, or
alpha / sqrt(r) with `use_rslora`). To serve rows of different adapters, and rows of none, in one
forward, every linear that some adapter targets keeps all adapters' factors in fixed-shape slot tensors,
`A [max_loras + 1, in, max_lora_rank]` and `B [(max_loras + 1) * max_lora_rank, out]` (slot s is `A[s]` and
B's rows `s * max_lora_rank` onwards): slot 0 holds zeros (the base model's rows), a rank below
`max_lora_rank` is padded with zeros (which add exact zeros), the scaling is folded into B. A is stored
slot by slot so that a decode forward's batched GEMMs read each slot's `(in, r)` as it lies; kept as
`[in, slots * r]` instead, every decode forward copied the used slots' A out first (a third of the LoRA
time at 16 adapters).

The delta of a batch is two GEMMs over the slots the batch uses, whatever mix of adapters its rows
name: `x @ A[slots]` (the used slots' A side by side, `[in, used * r]`, a copy) gives every row every used
slot's `r` columns, a one-hot mask keeps the row's
own slot's (the rest become exact zeros; no mask when every row uses one slot), and `@ B[slots]` adds
back onto the output. That is Punica / S-LoRA's batched LoRA done with dense GEMMs: it computes `used
slots x r` columns instead of `r`, but copies only the used slots' A once (not each row's factors: gathering
each row's A and B cost a third of a decode step on a CPU) and adds a few operations a layer. Never one
forward per adapter.

A decode forward (one token per row) mixing adapters groups its rows by slot instead (`Segments`): batched
GEMMs of each used slot's factors over that slot's rows, `r` columns per row. A static-shape decode step
(`decode/compiled_step.py`) cannot let `used slots` vary: it runs every slot
(`LoraRows.every_slot`) with a one-hot mask buffer it refills in place, one graph for any mix.

Which adapter a slot holds is the engine's choice (`decode/lora_pool.py`); `LoraSlots.write` puts it
there, wrapping a linear in a `LoraLinear` the first time an adapter targets it.

On a tensor-parallel rank a linear is one part of a whole layer (`raypipe.parallel.shards`, and quantized
layers' own `split`): it says which (`part`: dim 0, the output features it keeps, or dim 1, the input
features, as slices of the whole layer's; `whole`: the whole layer's `(in, out)`). An adapter is read and
checked against the whole layers and handed to every rank whole; each rank cuts it by its layers' `part`,
the slices its weights were read with: a column-parallel layer keeps all of A and its output features'
columns of B (a fused projection's several runs, e.g. a gated delta net's q | k | v heads, joined as its
weight rows are), a row-parallel one its input features' rows of A and all of B. A row-parallel layer's
delta `(x_local @ A_local) @ B` is a partial sum like its base product: it is added to the partial output
before the layer's all-reduce (`partial`, then `finish`), so one all-reduce sums both. The row -> slot mask of
a forward is set per thread (`LoraRows.using`): the engine runs a prefill and a decode forward on two
threads at once. An adapter is read from a local folder or `s3://` (`raypipe.storage`) and fingerprinted
by the bytes read. Anything PEFT would apply that this does not is refused at
load with `InvalidInput` naming the config field or the module: DoRA, `modules_to_save`, biases,
per-module rank or alpha patterns, embeddings, lm_head, and the vision tower of a family whose encoders
take no tower adapters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import pathlib
import threading

import safetensors.torch
import torch

from raypipe.errors import InvalidInput
from raypipe.models import lora_experts
from raypipe.models.checkpoint import strip_prefix
from raypipe.models.family import ModelFamily
from raypipe.models.packed_siblings import input_version

ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_KEY_PREFIX = "base_model.model."  # every module of a PEFT save sits under the wrapped model
FACTORS = {"lora_A.weight": 0, "lora_B.weight": 1}
# LoraConfig fields whose non-default value changes what PEFT computes beyond plain LoRA on linears.
UNSUPPORTED_FIELDS = ("use_dora", "modules_to_save", "lora_bias", "fan_in_fan_out", "rank_pattern", "alpha_pattern",
                      "layer_replication", "trainable_token_indices", "alora_invocation_tokens", "use_qalora",
                      "use_bdlora", "arrow_config")


@dataclasses.dataclass(frozen=True, eq=False)
class LoraWeights:
    """One adapter read from its folder: per language-model module (its name inside the text model),
    `(A (in, r), B scaled (r, out))`, ready to be stacked, and `fingerprint`, a sha256 of exactly the bytes
    read (config and weights): the adapter's identity for the prefix cache and the device slots, which a
    name is not once adapters can be unloaded and loaded again."""

    name: str
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    fingerprint: str = ""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.factors.values())


def read_adapter(name: str, folder: str | pathlib.Path, decoder, max_lora_rank: int,
                 where: str | None = None, family: ModelFamily | None = None) -> LoraWeights:
    """The language-model part of adapter `name` from a PEFT folder (local or `s3://`), checked against `decoder`
    (a `TextDecoder`): every tensor must belong to one of its linear layers, or to the vision tower where
    `family`'s encoders apply tower adapters (`ModelFamily.lora_tower_prefixes`: those modules are the encoder's
    part, `read_tower_adapter`), and every listed target must match one. Errors name `where` (default
    `lora_modules.<name>`) and the field."""
    where = where or f"lora_modules.{name}"
    save = _read_save(str(folder), where, max_lora_rank)
    modules = dict(decoder.model.named_modules())
    pairs, tower, experts = {}, [], {}
    for module, pair in save.pairs.items():
        owner = strip_prefix(lora_experts.module_of(module), decoder.key_prefixes, decoder.key_excluded)
        if lora_experts.is_experts(modules.get(owner)):  # a parameter adapter on fused experts (`target_parameters`)
            parameter, factors = lora_experts.expert_factors(
                owner, lora_experts.unwrapped(modules[owner]), decoder.model.config,
                *(_factor(t, module, w, where) for t, w in zip(pair, "AB")), save.config.r, save.scaling, where)
            experts[parameter] = factors
            continue
        if save.config.target_parameters and owner in modules and not _is_linear(modules[owner]):
            raise InvalidInput(f"module {owner!r} is a {type(modules[owner]).__name__}: target_parameters adapt only "
                               "fused experts modules (transformers', or quantized ones: FP8 block-wise, compressed-tensors)",
                               item=f"{where}.target_parameters", code="invalid_lora_adapter")
        inside = strip_prefix(module, decoder.key_prefixes, decoder.key_excluded)
        if inside is None and family is not None and tower_module(module, family) is not None:
            tower.append(module)  # the encoder's part
            continue
        if inside is None or inside not in modules:
            kind = family.model_type if family else type(decoder).__name__
            raise InvalidInput(f"module {module!r} is not a layer of {kind}'s language model (adapters on lm_head "
                               "or embeddings are not supported, nor on the tower of a family whose encoders take "
                               "no tower adapters)",
                               item=where, code="invalid_lora_adapter")
        pairs[inside] = pair
    _check_targets(save.config.target_modules, [*pairs, *tower, *experts], where)
    return LoraWeights(name, _fitted(pairs, modules, save.scaling, where, rank=save.config.r) | experts,
                       save.fingerprint)


def read_tower_adapter(name: str, folder: str | pathlib.Path, family: ModelFamily,
                       where: str | None = None, max_lora_rank: int | None = None) -> LoraWeights | None:
    """The vision-tower part of adapter `name`, its modules named inside the tower (`family.lora_tower_prefixes`
    stripped), or None when it targets no tower module (the engine's `read_adapter` refuses tower modules of a
    family without such prefixes). Shapes are checked where the tower is (`check_tower_factors`); the save's rank
    against `max_lora_rank` where given (a batch job checks its adapter before it starts any actor)."""
    where = where or f"lora_modules.{name}"
    save = _read_save(str(folder), where, max_lora_rank)
    factors = {}
    for module, (a, b) in save.pairs.items():
        inside = tower_module(module, family)
        if inside is not None:
            factors[inside] = (_factor(a, module, "A", where).t().float(),
                               _factor(b, module, "B", where).t().float() * save.scaling)
    return LoraWeights(name, factors, save.fingerprint) if factors else None


def tower_module(module: str, family: ModelFamily) -> str | None:
    """`module`'s name inside the encoders' tower (`VisionTower.lora_root`), by `family.lora_tower_prefixes`; None
    when it is no tower module the encoders apply adapters on."""
    for prefix, inside in family.lora_tower_prefixes:
        if module.startswith(prefix):
            return inside + module[len(prefix):]
        if module + "." == prefix and inside:  # the prefix's module itself (Step3's projector is one linear)
            return inside[:-1]
    return None


def check_tower_factors(adapter: LoraWeights, tower: torch.nn.Module, where: str) -> None:
    """Every module of a tower adapter is a linear layer of `tower` (its `lora_root`) with the factors' shapes."""
    _fitted(adapter.factors, dict(tower.named_modules()), 1.0, where, transposed=True)


@dataclasses.dataclass(frozen=True)
class _Save:
    """A PEFT save as read: its config, the scaling of its B factors, `[A, B]` per module (its name in the whole
    model, as PEFT saved it) and the fingerprint of the bytes read."""

    config: object
    scaling: float
    pairs: dict[str, list]
    fingerprint: str


def _read_save(folder: str, where: str, max_lora_rank: int | None) -> _Save:
    config_bytes, weight_bytes = _read_files(folder, where)
    config = _parse_config(config_bytes, where)
    _check_config(config, where, max_lora_rank)
    scaling = config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)
    try:
        tensors = safetensors.torch.load(weight_bytes)
    except Exception as exc:  # noqa: BLE001 - the library's own error on a broken file
        raise InvalidInput(f"{ADAPTER_WEIGHTS} is not a readable safetensors file ({exc})", item=where,
                           code="invalid_lora_adapter") from None
    pairs: dict[str, list] = {}
    for key, tensor in tensors.items():
        module, factor = _split_key(key, where)
        pairs.setdefault(module, [None, None])[factor] = tensor
    fingerprint = hashlib.sha256(config_bytes + b"\0" + weight_bytes).hexdigest()
    return _Save(config, scaling, pairs, fingerprint)


def _factor(t: torch.Tensor | None, module: str, which: str, where: str) -> torch.Tensor:
    """A LoRA factor of a linear layer (a convolution's are not 2-D)."""
    if t is None or t.dim() != 2:
        raise InvalidInput(f"module {module!r}: lora_{which} is {_shape(t)}; LoRA is supported on linear layers only",
                           item=where, code="invalid_lora_adapter")
    return t


def _fitted(pairs: dict, modules: dict, scaling: float, where: str, rank: int | None = None,
            transposed: bool = False) -> dict:
    """`(A (in, r), B scaled (r, out))` per module, each checked to be a linear of `modules` its factors fit, of rank
    `rank` where given (PEFT's saved `lora_A (r, in)`, `lora_B (out, r)`; already `(in, r)`, `(r, out)` when
    `transposed`)."""
    factors = {}
    for module, (a, b) in pairs.items():
        linear = modules.get(module)
        if linear is None:
            raise InvalidInput(f"module {module!r} is not a layer of the vision tower", item=where,
                               code="invalid_lora_adapter")
        if not _is_linear(linear):
            raise InvalidInput(f"module {module!r} is a {type(linear).__name__}; LoRA is supported on "
                               "linear layers only", item=where, code="invalid_lora_adapter")
        if not transposed:
            a, b = _factor(a, module, "A", where).t(), _factor(b, module, "B", where).t()
        in_features, out_features = _whole_shape(linear)  # a tensor-parallel rank's part: the whole layer's
        if a.shape[0] != in_features or b.shape[1] != out_features \
                or a.shape[1] != b.shape[0] or a.shape[1] != (rank or a.shape[1]):
            raise InvalidInput(f"module {module!r}: lora_A/lora_B shapes {_shape(a)}/{_shape(b)} (as (in, r)/(r, out)) "
                               f"do not fit a {in_features}->{out_features} linear"
                               + (f" at r={rank}" if rank else ""), item=where, code="invalid_lora_adapter")
        factors[module] = (a.float(), b.float() * scaling)
    return factors


def _read_files(folder: str, where: str) -> tuple[bytes, bytes]:
    """The bytes of a PEFT save's config and weights, from a local folder or object storage."""
    from raypipe.storage import join, open_filesystem, read_bytes

    fs, root = open_filesystem(folder)
    try:
        return read_bytes(fs, join(root, "adapter_config.json")), read_bytes(fs, join(root, ADAPTER_WEIGHTS))
    except (FileNotFoundError, OSError) as exc:
        raise InvalidInput(f"{folder} has no adapter_config.json and {ADAPTER_WEIGHTS} (a PEFT LoRA save): {exc}",
                           item=where, code="lora_adapter_not_found") from None


def _parse_config(data: bytes, where: str):
    from peft import PeftConfig

    try:
        fields = json.loads(data)
        return PeftConfig.from_peft_type(**PeftConfig.check_kwargs(**fields))
    except (ValueError, TypeError) as exc:
        raise InvalidInput(f"adapter_config.json is not a PEFT config ({exc})", item=f"{where}.adapter_config",
                           code="invalid_lora_adapter") from None


def _is_linear(module: torch.nn.Module) -> bool:
    """A linear layer, plain or as the engine keeps it (oneDNN-packed, already LoRA-wrapped, quantized)."""
    return isinstance(module, torch.nn.Linear) or (hasattr(module, "in_features") and hasattr(module, "out_features"))


def _whole_shape(linear: torch.nn.Module) -> tuple[int, int]:
    """`(in, out)` features of the whole layer: a tensor-parallel rank's part names the layer it was cut from."""
    return getattr(linear, "whole", (linear.in_features, linear.out_features))


def _check_config(config, where: str, max_lora_rank: int | None) -> None:
    """PEFT's variants beyond plain LoRA on linears are refused; so is a rank above the engine's slots (None: the
    encoder's part, which takes no slots)."""
    if config.peft_type != "LORA":  # PeftType is a str enum
        raise InvalidInput(f"peft_type is {config.peft_type}; only LORA adapters are served", item=f"{where}.peft_type",
                           code="invalid_lora_adapter")
    for field in UNSUPPORTED_FIELDS:
        if getattr(config, field, None):
            raise InvalidInput(f"{field}={getattr(config, field)!r} is not supported (plain LoRA on linear layers only)",
                               item=f"{where}.{field}", code="invalid_lora_adapter")
    for parameter in config.target_parameters or ():
        if parameter.rpartition(".")[2] not in lora_experts.PARAMETERS:
            raise InvalidInput(f"target parameter {parameter!r} is not supported (only MoE experts' "
                               f"{' and '.join(lora_experts.PARAMETERS)})", item=f"{where}.target_parameters",
                               code="invalid_lora_adapter")
    if config.bias != "none":
        raise InvalidInput(f"bias={config.bias!r} is not supported (only 'none')", item=f"{where}.bias",
                           code="invalid_lora_adapter")
    if max_lora_rank is not None and not 1 <= config.r <= max_lora_rank:
        raise InvalidInput(f"r={config.r} exceeds EngineConfig.max_lora_rank={max_lora_rank}", item=f"{where}.r",
                           code="invalid_lora_adapter")


def _split_key(key: str, where: str) -> tuple[str, int]:
    """`(module name in the full model, 0 for A / 1 for B)` of one adapter tensor."""
    for suffix, factor in FACTORS.items():
        if key.startswith(PEFT_KEY_PREFIX) and key.endswith("." + suffix):
            return key[len(PEFT_KEY_PREFIX): -len(suffix) - 1], factor
    raise InvalidInput(f"tensor {key!r} is not a LoRA factor of a linear layer (DoRA magnitudes, embedding "
                       "adapters and saved modules are not supported)", item=where, code="invalid_lora_adapter")


def _check_targets(targets, modules: list[str], where: str) -> None:
    """Each name of a target list must match a module the adapter holds (PEFT's rule: the name, or its
    last dotted parts); a regex target must have matched something."""
    if not modules:
        raise InvalidInput(f"target_modules {targets!r} matches no layer of the model",
                           item=f"{where}.target_modules", code="invalid_lora_adapter")
    if isinstance(targets, str):
        return
    for target in targets or ():
        if not any(m == target or m.endswith("." + target) for m in modules):
            raise InvalidInput(f"target {target!r} matches no module the adapter holds",
                               item=f"{where}.target_modules", code="invalid_lora_adapter")


def _shape(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else tuple(t.shape)


@dataclasses.dataclass(frozen=True)
class Segments:
    """A mixed forward's rows grouped by slot, for a one-token-per-row (decode) forward to run each slot's factors
    on its own rows only, as batched GEMMs (`torch.bmm`, one matrix per used slot), instead of every used slot's on
    every row: the masked GEMMs compute `used` times the columns, which at 16 adapters in a round cost twice the
    grouped form on a CPU. Position `k * width + j` is the j-th row of slot `first + k`; `rows` names each
    position's row (row 0 for a position no row fills), and `filled` is 1 where a row does, 0 elsewhere (None when
    every position is filled), so an empty position's delta is zeros. `back` names each row's position, the way
    back: a base row's is an empty one, or one past the last (`zero_row`: a row of zeros is appended there) when
    none is empty. Taking the deltas back by gathering positions, not by scattering into rows, is an ordinary
    indexed read: `index_add_` scattered at a third of the bmm's time."""

    width: int
    rows: torch.Tensor
    filled: torch.Tensor | None
    back: torch.Tensor
    zero_row: bool

    @classmethod
    def of(cls, slots: list[int], first: int, used: int, dtype: torch.dtype, device: torch.device) -> "Segments":
        groups = [[row for row, slot in enumerate(slots) if slot == first + k] for k in range(used)]
        width = max(len(group) for group in groups)
        rows = [group[j] if j < len(group) else 0 for group in groups for j in range(width)]
        filled = [float(j < len(group)) for group in groups for j in range(width)]
        position = {row: k * width + j for k, group in enumerate(groups) for j, row in enumerate(group)}
        empty = filled.index(0.0) if not all(filled) else len(rows)
        return cls(width, torch.tensor(rows, device=device),
                   None if all(filled) else torch.tensor(filled, dtype=dtype, device=device).view(used, width, 1),
                   torch.tensor([position.get(row, empty) for row in range(len(slots))], device=device),
                   zero_row=empty == len(rows) and len(position) < len(slots))


class LoraRows:
    """Which slots this thread's current forward uses: slots `first .. first + used - 1`, and the mask
    `[rows, 1, used, 1]` (1 where row i uses the slot) that picks each row's own, with the rows grouped by slot
    (`Segments`) for a decode forward; no mask when every row uses one slot. `used` is 0 when every row is the
    base model's."""

    def __init__(self):
        self._local = threading.local()

    @property
    def first(self) -> int:
        return getattr(self._local, "first", 0)

    @property
    def used(self) -> int:
        return getattr(self._local, "used", 0)

    @property
    def mask(self) -> torch.Tensor | None:
        return getattr(self._local, "mask", None)

    @property
    def segments(self) -> Segments | None:
        return getattr(self._local, "segments", None)

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """`x`'s rows in `segments` order (`Segments.rows`). Kept for the next call with the same tensor: q/k/v and
        gate/up projections read one input, so their layers share one gather (as their base GEMMs do,
        `models/packed_siblings.py`, whose `input_version` tells the same tensor unchanged)."""
        local, version = self._local, input_version(x)
        kept = getattr(local, "grouped_of", None)
        if kept is None or kept[0] is not x or kept[1] != version:
            kept = local.grouped_of = (x, version, x.reshape(-1, x.shape[-1]).index_select(0, self.segments.rows))
        return kept[2]

    @contextlib.contextmanager
    def using(self, slots: list[int], dtype: torch.dtype, device: torch.device):
        named = [s for s in slots if s]
        local = self._local
        local.first, last = min(named), max(named)
        local.used = last - local.first + 1
        if len(named) < len(slots) or local.first != last:
            span = torch.arange(local.first, last + 1)
            local.mask = (torch.tensor(slots)[:, None] == span).to(device, dtype)[:, None, :, None]
            local.segments = Segments.of(slots, local.first, local.used, dtype, device)
        try:
            yield
        finally:
            local.first, local.used, local.mask, local.segments, local.grouped_of = 0, 0, None, None, None

    @contextlib.contextmanager
    def every_slot(self, mask: torch.Tensor):
        """A static-shape forward (`decode/compiled_step.py`): every slot in use, `mask [rows, 1, slots, 1]` one-hot
        on each row's own. Its shapes never change, so one compiled graph or CUDA graph serves any mix of adapters:
        the caller refills `mask` in place between steps (a captured graph reads it by address)."""
        local = self._local
        saved = self.first, self.used, self.mask, self.segments
        local.first, local.used, local.mask, local.segments = 0, mask.shape[2], mask, None
        try:
            yield
        finally:
            local.first, local.used, local.mask, local.segments = saved


class LoraLinear(torch.nn.Module):
    """A base linear plus each row's adapter delta from the side-by-side slot tensors (on a tensor-parallel rank,
    this rank's part of them; see the top)."""

    def __init__(self, base: torch.nn.Module, rows: LoraRows, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.base = base
        self.rows = rows
        self.max_rank = max_rank
        self.in_features, self.out_features = base.in_features, base.out_features
        self.part = getattr(base, "part", None)  # (dim, slices of the whole layer's features) on a rank
        self.whole = _whole_shape(base)
        self.row_parallel = self.part is not None and self.part[0] == 1
        self.register_buffer("lora_a", torch.zeros(num_slots, self.in_features, max_rank, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(num_slots * max_rank, self.out_features, dtype=dtype, device=device))

    @property
    def weight(self) -> torch.Tensor:  # transformers' code reads a projection's weight (dtype, device)
        return self.base.weight

    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Slot `slot` holds `(a, b)`, the whole layer's factors (cut here to this layer's `part`); None: zeros
        (the slot's adapter does not target this layer)."""
        first = slot * self.max_rank
        self.lora_a[slot] = 0
        self.lora_b[first: first + self.max_rank] = 0
        if a is not None:
            if self.part is not None:
                dim, features = self.part
                a = torch.cat([a[cut] for cut in features]) if dim == 1 else a
                b = torch.cat([b[:, cut] for cut in features], dim=1) if dim == 0 else b
            self.lora_a[slot, :, : a.shape[1]] = a
            self.lora_b[first: first + a.shape[1]] = b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A row-parallel rank adds its partial delta to its partial product, before the sum over ranks (top)
        out = self.base.partial(x) if self.row_parallel else self.base(x)
        used = self.rows.used
        if used:
            mask, segments = self.rows.mask, self.rows.segments
            if segments is not None and x.numel() == mask.shape[0] * x.shape[-1]:  # one token per row: decode
                out = self._grouped_delta(x, out, used, segments)
            else:
                first = self.rows.first
                a = self.lora_a[first: first + used].permute(1, 0, 2).reshape(self.in_features, -1)  # a copy
                columns = slice(first * self.max_rank, (first + used) * self.max_rank)
                h = x.reshape(-1, x.shape[-1]) @ a
                if mask is not None:
                    h = (h.view(mask.shape[0], -1, used, self.max_rank) * mask).view(h.shape)
                out = torch.addmm(out.reshape(-1, out.shape[-1]), h, self.lora_b[columns]).view_as(out)
        return self.base.finish(out) if self.row_parallel else out

    def _grouped_delta(self, x: torch.Tensor, out: torch.Tensor, used: int, segments: Segments) -> torch.Tensor:
        """`out` plus each row's delta from its own slot's factors only (`Segments`)."""
        rank, slots = self.max_rank, slice(self.rows.first, self.rows.first + used)
        a = self.lora_a[slots]  # (used, in, r), a view
        h = torch.bmm(self.rows.grouped(x).view(used, segments.width, -1), a)
        if segments.filled is not None:
            h.mul_(segments.filled)
        delta = torch.bmm(h, self.lora_b.view(-1, rank, self.lora_b.shape[1])[slots])  # (used, width, out)
        delta = delta.view(-1, delta.shape[-1])
        if segments.zero_row:
            delta = torch.nn.functional.pad(delta, (0, 0, 0, 1))
        return out.reshape(-1, out.shape[-1]).add_(delta.index_select(0, segments.back)).view_as(out)


class LoraSlots:
    """The model's adapter slots: `write` puts an adapter's factors into slot 1..max_loras of every layer,
    wrapping in a `LoraLinear` first each linear no earlier adapter targeted, and zeroing the slot in the
    wrapped layers this adapter does not target (a slot is reused by other adapters). It changes the model:
    call it only where no forward runs (the engine's round boundary)."""

    def __init__(self, decoder, max_loras: int, max_lora_rank: int, dtype: torch.dtype, device: torch.device):
        self.decoder, self.max_loras, self.max_lora_rank = decoder, max_loras, max_lora_rank
        self.dtype, self.device = dtype, torch.device(device)
        self.rows = LoraRows()
        self.layers: dict[str, LoraLinear] = {}

    @property
    def num_slots(self) -> int:
        return self.max_loras + 1  # slot 0: the base model's rows

    def wrap(self, names) -> bool:
        """Wrap the linears `names` (inside the text model) in `LoraLinear`s where not yet; whether any was new (the
        model changed: a captured decode graph must be captured again)."""
        new = [name for name in names if name not in self.layers]
        for name in new:
            parent_name, _, child = name.rpartition(".")
            parent = self.decoder.model.get_submodule(parent_name)
            if child in lora_experts.PARAMETERS and lora_experts.is_experts(parent):
                self.layers[name] = self._experts(parent_name, parent).parameter(child)  # a fused experts' parameter
                continue
            self.layers[name] = LoraLinear(getattr(parent, child), self.rows, self.num_slots, self.max_lora_rank,
                                           self.dtype, self.device)
            setattr(parent, child, self.layers[name])
        return bool(new)

    def _experts(self, name: str, module: torch.nn.Module) -> lora_experts.LoraExperts:
        """The `LoraExperts` wrapping experts module `name` (made the first time one of its parameters is targeted)."""
        if isinstance(module, lora_experts.LoraExperts):
            return module
        wrapped = lora_experts.LoraExperts(module, self.rows, self.num_slots, self.max_lora_rank, self.dtype, self.device)
        parent_name, _, child = name.rpartition(".")
        setattr(self.decoder.model.get_submodule(parent_name), child, wrapped)
        return wrapped

    def write(self, slot: int, adapter: LoraWeights) -> bool:
        """Put `adapter` into `slot`; whether that wrapped new layers (`wrap`)."""
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"LoRA slot {slot} is outside 1..{self.max_loras}")
        wrapped = self.wrap(adapter.factors)
        for name, layer in self.layers.items():
            a, b = adapter.factors.get(name, (None, None))
            layer.set_slot(slot, None if a is None else a.to(layer.lora_a), None if b is None else b.to(layer.lora_b))
        return wrapped

    @property
    def nbytes(self) -> int:
        """Device bytes of the slot tensors so far (they grow as adapters target new layers)."""
        return sum(layer.lora_a.nbytes + layer.lora_b.nbytes for layer in self.layers.values())
