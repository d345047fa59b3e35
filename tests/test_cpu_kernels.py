"""The engine's CPU kernel choices against what they replace: oneDNN-packed linears against `nn.Linear`,
the decode attention function against transformers' SDPA function (greedy tokens against `generate()`
are checked by every decode test, which run with both)."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from raypipe.decode import attention
from raypipe.models import packed_linear, packed_siblings


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 16)
        self.up = torch.nn.Linear(16, 48)
        self.down = torch.nn.Linear(48, 16, bias=False)
        self.head = torch.nn.Linear(16, 10, bias=False)
        self.head.weight = self.embed.weight  # tied, as an lm_head may be


class _Subclassed(torch.nn.Linear):
    pass


CPU_FP32 = packed_linear.compute_dtype(torch.device("cpu"), torch.float32)[0]


@pytest.mark.skipif(CPU_FP32 is None, reason="oneDNN cannot pack fp32 weights here")
def test_packed_linears_compute_what_the_plain_ones_did_and_skip_tied_and_other_layers():
    torch.manual_seed(0)
    model = _Layer()
    model.other = _Subclassed(16, 16)
    x = torch.randn(3, 5, 16)
    with torch.inference_mode():
        want = model.down(torch.relu(model.up(x)))
        assert packed_linear.pack_linears(model, torch.float32) == 2  # up, down: not the tied head, not the subclass
        assert isinstance(model.up, packed_linear.PackedLinear) and isinstance(model.down, packed_linear.PackedLinear)
        assert type(model.head) is torch.nn.Linear and type(model.other) is _Subclassed
        got = model.down(torch.relu(model.up(x)))
        rows = model.up(x[:, 1:3])  # a strided input
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows, torch.nn.functional.linear(x[:, 1:3], model.up.packed_weight.to_dense(),
                                                                model.up.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(CPU_FP32 is None, reason="oneDNN cannot pack fp32 weights here")
def test_one_row_goes_through_the_plain_weight_while_it_is_kept(monkeypatch):
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 24)
    block = _Block()
    with torch.inference_mode():
        packed = packed_linear.PackedLinear(linear, torch.float32)
        packed_siblings.pack_siblings(block, torch.float32)
        group = block.q_proj.group
        row, rows = torch.randn(1, 1, 16), torch.randn(3, 1, 16)
        packed_gemm = torch.ops.mkldnn._linear_pointwise
        # One row: MKL over the plain weight, as nn.Linear computes it; several: the packed GEMM.
        assert torch.equal(packed(row), linear(row))
        assert torch.equal(packed(rows), packed_gemm(rows, packed.packed_weight, packed.bias, "none", [], ""))
        assert torch.equal(block.q_proj(row), torch.nn.functional.linear(row, group.plain_weight, group.bias)[..., :16])
        # Measured: kept where the plain product takes at most ONE_ROW_PLAIN_AT_MOST of the packed one's time.
        layers = [packed, group]
        monkeypatch.setattr(packed_linear, "ONE_ROW_PLAIN_AT_MOST", 1e6)
        pays, plain_s, packed_s = packed_linear.plain_pays_at_one_row(layers)
        assert pays and plain_s > 0 and packed_s > 0
        monkeypatch.setattr(packed_linear, "ONE_ROW_PLAIN_AT_MOST", 0.0)
        assert not packed_linear.plain_pays_at_one_row(layers)[0]
        # Timed on the first layers up to ONE_ROW_TIMED_BYTES (a large model's start-up stays short)
        calls = []
        gemm = packed_linear.packed_gemm
        monkeypatch.setattr(packed_linear, "packed_gemm", lambda *args: calls.append(args[1]) or gemm(*args))
        monkeypatch.setattr(packed_linear, "ONE_ROW_TIMED_BYTES", 1)
        packed_linear.plain_pays_at_one_row(layers, repeats=2)
        assert calls and all(weight is packed.packed_weight for weight in calls) and len(calls) == 2 + 2 * 2
        packed_linear.drop_plain_weights(layers)
        assert packed.plain_weight is None and group.plain_weight is None
        assert torch.equal(packed(row), packed_gemm(row, packed.packed_weight, packed.bias, "none", [], ""))
        want = torch.nn.functional.linear(row, block.q_proj.packed_weight.to_dense()[:16], group.bias[:16])
        torch.testing.assert_close(block.q_proj(row), want, rtol=1e-5, atol=1e-5)


class _Block(torch.nn.Module):
    """q/k/v with biases, gate/up without, and a q/k/v set whose widths differ (not fused)."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(16, n) for n in (16, 8, 8))
        self.gate_proj, self.up_proj = (torch.nn.Linear(16, 24, bias=False) for _ in range(2))
        self.odd = torch.nn.Module()
        self.odd.q_proj, self.odd.k_proj, self.odd.v_proj = (torch.nn.Linear(k, 8) for k in (16, 16, 12))


@pytest.mark.skipif(CPU_FP32 is None, reason="oneDNN cannot pack fp32 weights here")
def test_sibling_linears_share_one_gemm_and_stay_exact_however_they_are_called(monkeypatch):
    torch.manual_seed(0)
    block = _Block()
    names = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
    plain = {name: getattr(block, name) for name in names}
    own = {name: packed_linear.PackedLinear(linear, torch.float32) for name, linear in plain.items()}
    x, other = torch.randn(3, 5, 16), torch.randn(3, 5, 16)
    gemms = []  # (thread, group) per shared GEMM run
    gemm = packed_siblings.PackedSiblings.gemm
    monkeypatch.setattr(packed_siblings.PackedSiblings, "gemm",
                        lambda group, inputs: gemms.append((threading.get_ident(), group)) or gemm(group, inputs))
    with torch.inference_mode():
        assert packed_siblings.pack_siblings(block, torch.float32) == 5
        assert all(isinstance(getattr(block, name), packed_siblings.SiblingLinear) for name in names)
        assert type(block.odd.q_proj) is torch.nn.Linear  # input widths differ: left alone
        assert block.q_proj.group is block.v_proj.group is not block.up_proj.group

        def check(name, inputs, new_gemms):
            """Bit-identical to the sibling's own packed GEMM, close to nn.Linear, after `new_gemms` shared GEMMs."""
            before = len(gemms)
            got = getattr(block, name)(inputs)
            assert torch.equal(got, own[name](inputs))
            torch.testing.assert_close(got, plain[name](inputs), rtol=1e-5, atol=1e-5)
            assert len(gemms) - before == new_gemms, name

        for name, new in zip(names, [1, 0, 0, 1, 0]):  # the order models call them in: a GEMM per set
            check(name, x, new)
        for name, new in zip(["v_proj", "q_proj", "k_proj", "up_proj", "gate_proj"], [1, 0, 0, 1, 0]):
            check(name, x, new)  # another order
        check("q_proj", x, 1)
        check("k_proj", other, 1)  # another input between siblings: computed again
        check("v_proj", x, 1)
        check("gate_proj", x, 1)
        x.add_(1.0)  # the same tensor modified in place: what was kept for it is stale
        check("up_proj", x, 1)
        # The engine's prefill and decode threads call the same modules: each thread keeps its own outputs.
        check("q_proj", x, 1)
        worker = threading.Thread(target=lambda: [block.q_proj(other), block.k_proj(other), block.v_proj(other)])
        worker.start()
        worker.join()
        assert len({thread for thread, _ in gemms[-2:]}) == 2  # the worker ran its own GEMM
        check("k_proj", x, 0)  # this thread's kept outputs survived it
        check("v_proj", x, 0)


def test_packing_says_why_not_where_it_cannot():
    assert packed_linear.compute_dtype(torch.device("meta"), torch.float32) == (
        None, "packed weights are a CPU path (device meta)")


@pytest.mark.skipif(CPU_FP32 is None, reason="oneDNN cannot pack fp32 weights here")
def test_a_bf16_linear_packed_for_fp32_rounds_the_fp32_result_once():
    """Where oneDNN has no bf16 GEMM, bf16 weights and inputs are computed in fp32 (exact products, fp32
    sums, as a bf16 GEMM keeps them) and the result is rounded to bf16 once."""
    torch.manual_seed(3)
    linear = torch.nn.Linear(64, 96).to(torch.bfloat16)
    x = torch.randn(7, 64, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float()).to(torch.bfloat16)
    with torch.inference_mode():
        got = packed_linear.PackedLinear(linear, torch.float32)(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0.02)
    dtype, how = packed_linear.compute_dtype(torch.device("cpu"), torch.bfloat16)
    assert dtype in (torch.bfloat16, torch.float32)
    assert how == "packed in torch.bfloat16" or how.startswith("packed and computed in torch.float32: oneDNN")


def _can_pack(dtype: torch.dtype) -> bool:
    return packed_linear.pack_refusal(dtype) is None


@pytest.mark.parametrize("bf16_faster", [True, False])
def test_a_bf16_model_is_packed_in_whichever_dtype_the_load_measured_faster(monkeypatch, bf16_faster):
    """Where oneDNN packs bf16 but converts it in software (no AVX512-BF16 or AMX), its bf16 GEMM is slower than
    fp32's and the model's linears are computed in fp32; where it is faster they stay bf16. The measurement itself
    says which it saw."""
    measure = packed_linear.low_precision_pays
    pays, native, single = measure(torch.bfloat16 if _can_pack(torch.bfloat16) else torch.float32)  # a real timing
    assert native > 0 and single > 0 and pays == (native <= single)
    times = (0.001, 0.002) if bf16_faster else (0.003, 0.001)
    monkeypatch.setattr(packed_linear, "low_precision_pays", lambda dtype: (times[0] <= times[1], *times))
    dtype, how = packed_linear.compute_dtype(torch.device("cpu"), torch.bfloat16)
    if not _can_pack(torch.bfloat16):  # no measurement: oneDNN refuses bf16 on this CPU
        assert dtype == torch.float32 and "oneDNN cannot pack torch.bfloat16" in how
    elif bf16_faster:
        assert (dtype, how) == (torch.bfloat16, "packed in torch.bfloat16")
    else:
        assert dtype == torch.float32
        assert "bfloat16 GEMM took 3.00 ms against fp32's 1.00" in how


class _Attention(torch.nn.Module):
    num_key_value_groups = 4
    is_causal = True
    training = False


def _laid_out(layout: str, rows: int, length: int, kv_heads: int, dim: int) -> torch.Tensor:
    """`(rows, kv_heads, length, dim)` keys as the cache hands them over: a decode round's head-major rows
    (a prefix of longer rows), or a per-step gather's token-major rows transposed."""
    if layout == "head-major":
        return torch.randn(rows, kv_heads, length + 7, dim)[:, :, :length]
    return torch.randn(rows, length + 7, kv_heads, dim)[:, :length].transpose(1, 2)


@pytest.mark.parametrize("layout", ["head-major", "token-major"])
@pytest.mark.parametrize("length", [16, 300])
def test_decode_attention_equals_sdpa_with_masked_keys_weighted_zero(length, layout):
    """One query per row, 8 query heads over 2 KV heads, keys laid out as the cache keeps them, a padded
    mask per row."""
    torch.manual_seed(1)
    rows, heads, kv_heads, dim = 5, 8, 2, 32
    query = torch.randn(rows, heads, 1, dim)
    keys = _laid_out(layout, rows, length, kv_heads, dim)
    values = _laid_out(layout, rows, length, kv_heads, dim)
    assert attention._heads_merge(keys) == (layout == "head-major")
    lengths = torch.tensor([1, length // 3, length, 2, length - 1])
    allowed = torch.arange(length)[None, :] < lengths[:, None]
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[:, None, None, :]
    want, _ = sdpa_attention_forward(_Attention(), query, keys, values, mask, scaling=dim ** -0.5)
    got, _ = attention.attention_forward(_Attention(), query, keys, values, mask, scaling=dim ** -0.5)
    assert got.shape == want.shape == (rows, 1, heads, dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Values behind the mask change nothing: their weight is exactly 0.
    noisy = values.clone()
    noisy[1, :, length // 3:] = 1e6
    again, _ = attention.attention_forward(_Attention(), query, keys, noisy, mask, scaling=dim ** -0.5)
    assert torch.equal(again, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("past", [0, 37, 300])
@pytest.mark.parametrize("width", [21, 60, 200, 800])
def test_prefill_attention_is_transformers_sdpa_bit_for_bit_without_repeating_kv_heads(monkeypatch, width, past,
                                                                                       dtype):
    """Several queries per row (a prefill chunk, after `past` cached keys: then with a mask, else causal): the
    engine's attention equals transformers' SDPA function exactly, and reads the KV heads in place: transformers'
    `repeat_kv`, which copies each KV head for its query heads, is never called. In fp32 a chunk too short for the
    flash kernel's wider query blocks (60 tokens x 4 query heads per KV head: 240 queries) goes in with each KV
    head's query heads as one query, and so does a masked chunk below its widest blocks (200 tokens after cached
    keys); 21 tokens (84 queries), a causal 200 and 800 tokens do not, nor does bf16."""
    from transformers.integrations import sdpa_attention

    from raypipe.decode import prefill_attention

    torch.manual_seed(2)
    rows, heads, kv_heads, dim = 3, 8, 2, 16
    query = torch.randn(rows, heads, width, dim).to(dtype)
    keys, values = (_laid_out("token-major", rows, past + width, kv_heads, dim).to(dtype) for _ in range(2))
    mask = None
    if past:
        visible = torch.arange(past + width)[None, :] <= past + torch.arange(width)[:, None]
        mask = torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)[None, None].expand(rows, 1, -1, -1)
    want, _ = sdpa_attention_forward(_Attention(), query, keys, values, mask, scaling=0.25)

    def copied(*args):
        raise AssertionError("KV heads repeated")

    sdpa, widths = torch.nn.functional.scaled_dot_product_attention, []
    monkeypatch.setattr(sdpa_attention, "repeat_kv", copied)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, *args, **kwargs: widths.append(q.shape[1:3]) or sdpa(q, *args, **kwargs))
    got, _ = attention.attention_forward(_Attention(), query, keys, values, mask, scaling=0.25,
                                         sliding_window=None, use_cache=True)
    assert got.shape == (rows, width, heads, dim)
    assert torch.equal(got, want)
    folds = dtype == torch.float32 and (width == 60 or (width == 200 and past > 0))
    assert widths == [(kv_heads, 4 * width) if folds else (heads, width)]
    if folds and past:  # every layer of a forward gets the same mask: its tiled copy is made once
        attention.attention_forward(_Attention(), query, keys, values, mask, scaling=0.25)
        assert getattr(mask, prefill_attention.FOLDED).shape == (rows, 1, 4 * width, past + width)


def test_prefill_attention_with_what_changes_the_math_is_transformers_own_call(monkeypatch):
    """An argument transformers' SDPA function acts on (here a position bias) sends the call to that function."""
    from transformers.integrations import sdpa_attention

    calls = []
    monkeypatch.setattr(attention, "sdpa_attention_forward",
                        lambda *args, **kwargs: calls.append(kwargs) or sdpa_attention.sdpa_attention_forward(*args,
                                                                                                              **kwargs))
    query, keys, values = torch.randn(2, 8, 6, 16), torch.randn(2, 2, 6, 16), torch.randn(2, 2, 6, 16)
    bias = torch.randn(1, 8, 6, 6)
    attention.attention_forward(_Attention(), query, keys, values, None, scaling=0.25, position_bias=bias)
    assert len(calls) == 1 and calls[0]["position_bias"] is bias


@pytest.mark.parametrize("bf16_faster", [True, False])
def test_a_bf16_tower_computes_its_linears_in_fp32_only_where_bf16_measured_slower(monkeypatch, bf16_faster):
    """An encoder's bf16 tower keeps transformers' bf16 linears where oneDNN's bf16 GEMM pays, else packs them for
    fp32 compute (no plain copy kept: a tower has no one-row inputs), each output rounded to bf16 once; an fp32
    tower is never touched."""
    times = (0.001, 0.002) if bf16_faster else (0.003, 0.001)
    monkeypatch.setattr(packed_linear, "low_precision_pays", lambda dtype: (times[0] <= times[1], *times))
    torch.manual_seed(5)
    tower = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 16)).to(torch.bfloat16)
    x = torch.randn(9, 32, dtype=torch.bfloat16)
    first, last = tower[0], tower[2]
    want = torch.nn.functional.linear(
        torch.nn.functional.gelu(torch.nn.functional.linear(x.float(), first.weight.float(), first.bias.float())
                                 .to(torch.bfloat16)).float(), last.weight.float(), last.bias.float()).to(torch.bfloat16)
    assert packed_linear.fp32_where_faster(tower, torch.device("cpu"), torch.float32) == "linears as loaded (torch.float32 on cpu)"
    how = packed_linear.fp32_where_faster(tower, torch.device("cpu"), torch.bfloat16)
    packed = [m for m in tower if isinstance(m, packed_linear.PackedLinear)]
    if bf16_faster and _can_pack(torch.bfloat16):
        assert how == "linears as loaded: packed in torch.bfloat16" and not packed
        return
    assert how.startswith("2 linear layers packed and computed in torch.float32") and len(packed) == 2
    assert all(m.packed_weight.dtype == torch.float32 and m.plain_weight is None for m in packed)
    with torch.inference_mode():
        got = tower(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0.02)
