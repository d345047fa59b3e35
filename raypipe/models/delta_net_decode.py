"""The decode step of transformers' gated-delta-net layers, with the recurrent state updated in place.

One decode step of a gated-delta-net layer (Qwen3.5, MiniCPM-V 4.6) updates each row's recurrent state
`S` (`k_dim x v_dim` per value head, fp32): decay by `exp(g)`, read `S^T k`, write `k (beta (v - S^T
k))^T`, output `S^T q` (`delta_rule.py` states the rule). transformers' torch fallback does it with
broadcast multiplies and sums, each making a new state-sized tensor, and hands the new state to the
cache, which copies it into the row: at batch 32 with 8 value heads of 64 x 64 that is ~6 passes over
4 MiB per layer per step. Here the cache's rows are the state (`get_recurrent_state` returns a view
of them): one in-place scale, the read and the output as batched GEMVs, the write as one in-place
batched outer product (`baddbmm_`). (A static-shape step's rows are copies, its padding rows included,
written back once at the end: `KVCache.keep_decode_rows`.) The conv state is rolled in place and the causal conv's one new
output computed as a multiply and a sum (`_conv_step`); projections, gated norm and output projection
are the layer's own modules, so a tensor-parallel rank's head slice runs the same code.

Results equal transformers' step up to float rounding (GEMV sums in another order); the tests compare
greedy tokens against transformers' own `generate()`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from raypipe.models.delta_rule import l2_normalize


def decode_forward(net, hidden_states: torch.Tensor, cache) -> torch.Tensor:
    """`net`'s output for one token per row `(B, 1, hidden)`; the rows' conv and recurrent states in `cache`
    (views of its rows, updated in place) advance by that token."""
    batch = hidden_states.shape[0]
    state = cache.get_recurrent_state(net.layer_idx)  # (B, Hv, dk, dv), fp32, the cache's rows
    conv_state = cache.get_conv_state(net.layer_idx)
    mixed = _conv_step(net, net.in_proj_qkv(hidden_states)[:, 0], conv_state)
    query, key, value = mixed.float().split([net.key_dim, net.key_dim, net.value_dim], -1)
    heads = net.num_v_heads
    repeat = heads // net.num_k_heads  # each key head serves `repeat` consecutive value heads
    query = l2_normalize(query.view(batch, net.num_k_heads, net.head_k_dim)).repeat_interleave(repeat, 1)
    key = l2_normalize(key.view(batch, net.num_k_heads, net.head_k_dim)).repeat_interleave(repeat, 1)
    query = query / net.head_k_dim ** 0.5
    value = value.view(batch, heads, net.head_v_dim)
    beta = net.in_proj_b(hidden_states).sigmoid().float().view(batch, heads, 1)
    decay = (-net.A_log.float().exp() * F.softplus(net.in_proj_a(hidden_states).float() + net.dt_bias)).exp()

    rows = state.view(batch * heads, net.head_k_dim, net.head_v_dim)
    state.mul_(decay.view(batch, heads, 1, 1))
    read = torch.bmm(key.reshape(-1, 1, net.head_k_dim), rows).view(batch, heads, net.head_v_dim)
    delta = (value - read) * beta
    rows.baddbmm_(key.reshape(-1, net.head_k_dim, 1), delta.reshape(-1, 1, net.head_v_dim))
    out = torch.bmm(query.reshape(-1, 1, net.head_k_dim), rows)  # (B * Hv, 1, dv)
    cache.keep_decode_rows(net.layer_idx, conv_state, state)  # a static step's rows are copies: written back

    gate = net.in_proj_z(hidden_states).reshape(-1, net.head_v_dim)
    out = net.norm(out.reshape(-1, net.head_v_dim).to(hidden_states.dtype), gate)
    return net.out_proj(out.reshape(batch, 1, -1))


def _conv_step(net, inputs: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
    """The causal depthwise conv at one new input per row `(B, C)`: `conv_state` `(B, C, kernel)` (the rows'
    last inputs) rolled by one in place, the output is its window times the kernel, plus the bias, then
    the layer's activation. transformers' `causal_conv1d_update` runs `F.conv1d(groups=C)` for this,
    which in bf16 on a CPU is a loop over the C channels (~50k small convolutions a step on
    `small-qwen3.5`); here it is one multiply and a sum over the kernel, in fp32 (the conv's own
    accumulation), rounded to the model's dtype once as the conv's output is."""
    conv_state.copy_(torch.cat([conv_state[:, :, 1:], inputs[:, :, None].to(conv_state.dtype)], dim=2))
    weight = net.conv1d.weight.squeeze(1).float()  # (C, kernel)
    out = (conv_state.float() * weight).sum(dim=-1)
    if net.conv1d.bias is not None:
        out = out + net.conv1d.bias.float()
    return ACT2FN[net.activation](out.to(inputs.dtype))
