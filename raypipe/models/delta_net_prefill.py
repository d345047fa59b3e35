"""The prefill forward of transformers' gated-delta-net layers, handing the cache states at chosen positions.

Prefix caching for a hybrid model (Qwen3.5, MiniCPM-V 4.6) keeps snapshots of each linear-attention
layer's conv and recurrent state at block boundaries inside a prefill chunk (the prompt's last
boundary, branch points, every N blocks: `decode/scheduler.py`). transformers' layer only hands its
cache the state at the chunk's end, so the engine used to split the whole forward at each such
position. This forward does the layer's work once over the chunk and asks the cache where it wants
states (`state_capture_offsets()`: tokens into the chunk); the cache keeps the conv inputs there
itself (`update_conv_state` sees them all), and the delta rule returns the recurrent states there
(`delta_rule.py`), given back with the final one (`update_recurrent_state(..., captured=...)`).
Attention and MLP layers are untouched, so they run once over the whole chunk. Rows of different lengths share
one right-padded forward: the conv state is taken at each row's end (`update_conv`), and a padded token neither
decays nor writes the recurrent state, so the state after the chunk is each row's at its own end.

Everything else is transformers' layer as it is (its projections, causal conv, gated norm; a cache
that does not ask for captures goes to its own `forward`), so the module's weights and shapes are its
own (a tensor-parallel rank's head slice too). The engine's decode step goes to
`delta_net_decode.py`, which updates the rows in place.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from raypipe.models import delta_net_decode
from raypipe.models.delta_rule import chunked_gated_delta_rule


def install(model: torch.nn.Module) -> None:
    """Route the prefill of every gated-delta-net layer of `model` through `prefill_forward`, and the engine's
    decode step through `delta_net_decode.decode_forward`."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet

    for module in model.modules():
        if isinstance(module, (Qwen3_5GatedDeltaNet, Qwen3_5MoeGatedDeltaNet)):
            module.forward = functools.partial(_forward, module, module.forward)


def _forward(net, transformers_forward, hidden_states: torch.Tensor, cache_params=None, attention_mask=None,
             **kwargs) -> torch.Tensor:
    engine_cache = hasattr(cache_params, "state_capture_offsets")
    offsets = cache_params.state_capture_offsets() if engine_cache else None
    if offsets is not None:
        return prefill_forward(net, hidden_states, cache_params, attention_mask, offsets)
    if engine_cache and hidden_states.shape[1] == 1:  # the engine's decode step: its rows updated in place
        return delta_net_decode.decode_forward(net, hidden_states, cache_params)
    return transformers_forward(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)


def prefill_forward(net, hidden_states: torch.Tensor, cache, attention_mask: torch.Tensor | None,
                    offsets: list[int]) -> torch.Tensor:
    """`net`'s output over a prefill chunk `(B, L, hidden)`; the cache gets the conv and recurrent state at
    the chunk's end and at each of `offsets` (tokens into the chunk)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_mask_to_padding_states

    hidden_states = apply_mask_to_padding_states(hidden_states, attention_mask)
    batch, length, _ = hidden_states.shape
    initial = cache.get_recurrent_state(net.layer_idx)
    # The cache keeps each row's last conv inputs (and those before each offset) and returns what the
    # causal conv runs over: the chunk after the rows' earlier inputs; its last `length` outputs are ours.
    mixed = cache.update_conv_state(net.in_proj_qkv(hidden_states).transpose(1, 2), net.layer_idx)
    mixed = _causal_conv(net, mixed)
    query, key, value = mixed[:, :, -length:].transpose(1, 2).split([net.key_dim, net.key_dim, net.value_dim], -1)
    query = query.reshape(batch, length, -1, net.head_k_dim)
    key = key.reshape(batch, length, -1, net.head_k_dim)
    value = value.reshape(batch, length, -1, net.head_v_dim)
    beta = net.in_proj_b(hidden_states).sigmoid()
    g = -net.A_log.float().exp() * F.softplus(net.in_proj_a(hidden_states).float() + net.dt_bias)
    if attention_mask is not None and not attention_mask.all():
        # Right padding (rows of different lengths in one forward): a padded token neither decays the state nor
        # writes to it (g = 0, beta = 0, k = v = 0), so the state after the chunk is each row's at its own end.
        real = attention_mask[:, :, None].to(g.dtype)
        key, value = key * real[..., None].to(key.dtype), value * real[..., None].to(value.dtype)
        g, beta = g * real, beta * real.to(beta.dtype)
    out, final, captured = chunked_gated_delta_rule(query, key, value, g, beta, initial, boundaries=offsets)
    cache.update_recurrent_state(final, net.layer_idx, captured=dict(zip(offsets, captured)))
    gate = net.in_proj_z(hidden_states).reshape(-1, net.head_v_dim)
    out = net.norm(out.reshape(-1, net.head_v_dim), gate).reshape(batch, length, -1)
    return net.out_proj(out)


def _causal_conv(net, inputs: torch.Tensor) -> torch.Tensor:
    """The layer's causal depthwise conv over `inputs` `(B, C, L)` (outputs for every position, zero history
    before the first), then its activation: transformers' `causal_conv1d_fn`, except that a conv in a
    low-precision dtype runs in fp32 and is rounded once. On a CPU, `F.conv1d(groups=C)` in bf16 is a loop
    over the C channels (~20 ms a layer for a 100-token chunk of `small-qwen3.5`, against ~2 ms in fp32);
    its result is the fp32 conv's rounded, so the output is the same."""
    weight, bias = net.conv1d.weight, net.conv1d.bias
    if inputs.dtype != torch.float32:
        weight, bias = weight.float(), None if bias is None else bias.float()
    out = F.conv1d(inputs.to(weight.dtype), weight, bias, padding=weight.shape[-1] - 1, groups=inputs.shape[1])
    return ACT2FN[net.activation](out[:, :, : inputs.shape[2]].to(inputs.dtype))
