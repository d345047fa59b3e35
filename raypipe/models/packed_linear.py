"""A language model's linears with their weights pre-arranged for oneDNN's CPU GEMM kernels.

`nn.Linear` on a CPU calls MKL with the weight as stored, and the GEMM re-arranges ("packs") the
weight into the blocked layout its kernel reads on every call. oneDNN (torch's `mkldnn` ops, the
library vLLM's CPU build calls for its linears too) can pack a weight once and keep it packed:
`PackedLinear` holds only that packed copy (the plain weight is freed, so memory does not grow).

Measured on the shapes of the `small` preset's eight layers of linears (2 AVX2 cores, fp32, one loop
over all 56, so weights come from memory as in a step): 16.5 ms at batch 32 against MKL's 20.8, 9.7
against 12.9 at batch 8, 6.8 against 9.3 at batch 1; at a few hundred rows and up the two are even in
that loop, yet a burst's prefill in the engine took 2.25 s packed against 3.11 s (docs/performance.md,
"The CPU decode path"). Results differ from MKL's by float rounding only (another summation order).

One row at a time (a lone request's decode step) a GEMM is a matrix-vector product, and there the packed
layout can lose: on an Intel Xeon with AVX512 (2 cores) MKL's plain `nn.Linear` decoded one request at 13.1
ms a token against 15.8 packed, while at 16 rows packed ran 2.5x MKL's speed (an AVX2 EPYC was faster packed
at one row too). So when the packing measures that (`plain_pays_at_one_row`, on the engine's own linears when
it loads), each packed layer also keeps its plain weight, and a one-row input goes through it: twice the
linears' weight bytes, where it pays.

Only plain `torch.nn.Linear` modules are packed: tensor-parallel shards, quantized stored weights and
anything else keep their own forward (a LoRA layer's base linear is plain and is packed; its adapter
matmuls are not). A bf16 model's linears are packed and computed in fp32 where oneDNN cannot pack bf16 on
this CPU (it needs AVX512 or AVX-NE-CONVERT), or can but computes it slower than fp32: without AVX512-BF16 or
AMX it converts every bf16 element in software (an AVX512 Xeon: 2.4x fp32's time at 32 rows, 4x at 512, on
`small-qwen3.5`'s linear shapes). `compute_dtype` measures that at load and says why fp32 is exact enough.
"""

from __future__ import annotations

import time

import torch

# One-row inputs keep a plain copy of each packed weight when MKL's matrix-vector product over it takes at most
# this fraction of the packed GEMM's time (measured at load: `plain_pays_at_one_row`)
ONE_ROW_PLAIN_AT_MOST = 0.9
# ... timed over the model's first linears up to this many weight bytes: more than a CPU's last-level cache, so the
# weights come from memory as in a step, and a second or less of start-up for a model of any size
ONE_ROW_TIMED_BYTES = 256 << 20
# A bf16 (fp16) model's linears are computed in that dtype where oneDNN's GEMM in it takes at most fp32's time,
# timed at load (`low_precision_pays`) on a GEMM of this many rows (a decode batch, a prefill piece) over a
# weight of this shape (kept in cache: what differs is the arithmetic, native or converted in software)
LOW_PRECISION_TIMED_ROWS = 32
LOW_PRECISION_TIMED_WEIGHT = (2048, 2048)


class PackedLinear(torch.nn.Module):
    """`y = x W^T + b` through oneDNN with `W` packed once, in `compute_dtype` (inputs cast to it, the
    output cast back to the input's dtype); through `plain_weight` for a one-row input, while it is kept."""

    def __init__(self, linear: torch.nn.Linear, compute_dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().to(compute_dtype)
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight))
        self.plain_weight: torch.Tensor | None = weight.contiguous()  # until `drop_plain_weights`
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().to(compute_dtype),
                                                                        requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_gemm(x, self.packed_weight, self.bias, self.plain_weight)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"compute_dtype={self.packed_weight.dtype}")


def packed_gemm(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                plain_weight: torch.Tensor | None = None) -> torch.Tensor:
    """`x W^T + b` through oneDNN with `W` packed, computed in the packed weight's dtype, returned in `x`'s; one
    row through `plain_weight` (MKL's matrix-vector product) where given."""
    if plain_weight is not None and x.numel() == x.shape[-1]:
        return torch.nn.functional.linear(x.to(plain_weight.dtype), plain_weight, bias).to(x.dtype)
    gemm = torch.ops.raypipe.packed_gemm if torch.compiler.is_compiling() else _onednn_gemm
    return gemm(x.to(packed_weight.dtype), packed_weight, bias).to(x.dtype)


def _onednn_gemm(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


# The same GEMM as an opaque operation where a forward is compiled (`decode/compiled_forward.py`): inductor cannot
# lower the packed layout. Eager calls skip the custom operation's dispatch.
torch.library.custom_op("raypipe::packed_gemm", _onednn_gemm, mutates_args=())


@torch.library.register_fake("raypipe::packed_gemm")
def _(x, packed_weight, bias):
    return x.new_empty(*x.shape[:-1], packed_weight.shape[0])


def plain_pays_at_one_row(layers: list, repeats: int = 5) -> tuple[bool, float, float]:
    """Whether one row through the plain weights of `layers` (packed layers still holding them: `PackedLinear`s
    or sibling groups, in model order) takes at most `ONE_ROW_PLAIN_AT_MOST` of the time through their packed
    weights, measured on the calling thread (the engine's, with its threads) as the best of `repeats` alternating
    passes over the first of them up to `ONE_ROW_TIMED_BYTES`; and the two times (s)."""
    timed, total = [], 0
    for layer in layers:
        if total >= ONE_ROW_TIMED_BYTES:
            break
        timed.append(layer)
        total += layer.plain_weight.nbytes
    layers = timed
    inputs = {layer.plain_weight.shape[1]: torch.randn(1, layer.plain_weight.shape[1], dtype=layer.plain_weight.dtype)
              for layer in layers}

    def one_pass(plain: bool) -> None:
        for layer in layers:
            x = inputs[layer.plain_weight.shape[1]]
            packed_gemm(x, layer.packed_weight, layer.bias, layer.plain_weight if plain else None)

    plain, packed = _best_times(lambda: one_pass(True), lambda: one_pass(False), repeats)
    return plain <= ONE_ROW_PLAIN_AT_MOST * packed, plain, packed


def _best_times(first, second, repeats: int) -> tuple[float, float]:
    """The best of `repeats` alternating timed calls of `first` and `second` (s each), in inference mode, after one
    untimed call of each (first touches: pages, oneDNN creating its kernels)."""
    def timed(run) -> float:
        start = time.perf_counter()
        run()
        return time.perf_counter() - start

    with torch.inference_mode():
        first(), second()
        best = [min(times) for times in zip(*((timed(first), timed(second)) for _ in range(repeats)))]
    return best[0], best[1]


def drop_plain_weights(layers: list) -> None:
    """Free the plain weights of `layers`: every input goes through the packed ones."""
    for layer in layers:
        layer.plain_weight = None


def compute_dtype(device: torch.device, dtype: torch.dtype) -> tuple[torch.dtype | None, str]:
    """The dtype a model in `dtype` gets its linears packed and computed in on `device`, and what that means;
    None and the reason where nothing is packed.

    A bf16 model is computed in fp32 where oneDNN has no bf16 GEMM on this CPU (no AVX512 or AVX-NE-CONVERT:
    torch then runs a reference bf16 GEMM, 5-8x slower than fp32 at decode and prefill shapes) or its bf16 GEMM
    is slower than fp32's (`low_precision_pays`): bf16 inputs and weights are exact in fp32, sums are in fp32 as
    a bf16 GEMM keeps them, the output is rounded to bf16 once. The packed weights then take fp32's bytes."""
    if torch.device(device).type != "cpu":
        return None, f"packed weights are a CPU path (device {torch.device(device).type})"
    if not torch.backends.mkldnn.is_available():
        return None, "this torch has no oneDNN (mkldnn)"
    reasons = []
    for candidate in dict.fromkeys((dtype, torch.float32)):
        refused = pack_refusal(candidate)
        if refused is not None:
            reasons.append(refused)
            continue
        if candidate == dtype != torch.float32:
            pays, native, single = low_precision_pays(dtype)
            if not pays:
                reasons.append(f"oneDNN's {dtype} GEMM took {native * 1e3:.2f} ms against fp32's {single * 1e3:.2f} "
                               f"({LOW_PRECISION_TIMED_ROWS} rows, a {LOW_PRECISION_TIMED_WEIGHT} weight): slower "
                               "here, where oneDNN converts it in software")
                continue
        if candidate == dtype:
            return candidate, f"packed in {dtype}"
        return candidate, f"packed and computed in {candidate}: {reasons[-1]}"
    return None, "; ".join(reasons)


def pack_refusal(dtype: torch.dtype) -> str | None:
    """Why oneDNN cannot pack `dtype` weights on this CPU; None where it can. It says so itself: the packing op is
    run on a tiny weight."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros((8, 8), dtype=dtype))
    except RuntimeError as exc:
        return f"oneDNN cannot pack {dtype} weights on this CPU ({str(exc).splitlines()[0]})"
    return None


def low_precision_pays(dtype: torch.dtype, repeats: int = 5) -> tuple[bool, float, float]:
    """Whether oneDNN's packed GEMM in `dtype` takes at most fp32's time on this CPU, measured on the calling
    thread (the engine's, with its threads) as the best of `repeats` alternating runs; and the two times (s)."""
    weight = torch.randn(LOW_PRECISION_TIMED_WEIGHT).to(dtype)
    x = torch.randn(LOW_PRECISION_TIMED_ROWS, weight.shape[1]).to(dtype)
    native, single = (torch.ops.mkldnn._reorder_linear_weight(weight.to(compute)) for compute in (dtype, torch.float32))
    native, single = _best_times(lambda: packed_gemm(x, native, None), lambda: packed_gemm(x, single, None), repeats)
    return native <= single, native, single


def pack_linears(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Replace every plain `nn.Linear` under `model` (except linears that share their weight with another
    module, a tied lm_head) by a `PackedLinear` computing in `dtype`; how many were replaced."""
    shared = shared_weights(model)
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and id(child.weight) not in shared:
                setattr(parent, name, PackedLinear(child, dtype))
                replaced += 1
    return replaced


def fp32_where_faster(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> str:
    """`module`'s plain linears (a vision tower's) packed for fp32 compute where it runs in a low-precision `dtype`
    on a CPU whose oneDNN computes that dtype slower than fp32 (`compute_dtype`), each output rounded to `dtype`
    once as that GEMM rounds it; elsewhere left as loaded (an encoder's large-row GEMMs gain nothing from packing
    in the dtype they already run in). What was done."""
    if dtype == torch.float32 or torch.device(device).type != "cpu":
        return f"linears as loaded ({dtype} on {torch.device(device).type})"
    compute, how = compute_dtype(device, dtype)
    if compute != torch.float32:
        return f"linears as loaded: {how}"
    count = pack_linears(module, compute)
    drop_plain_weights([layer for layer in module.modules() if isinstance(layer, PackedLinear)])  # no one-row inputs
    return f"{count} linear layers {how}"


def shared_weights(model: torch.nn.Module) -> set[int]:
    """ids of the parameters more than one module holds (a tied lm_head's weight)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    return {key for key, count in owners.items() if count > 1}
