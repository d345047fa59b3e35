"""The attention function of the engine's forwards, registered with transformers' `AttentionInterface`.

transformers' attention layers project, apply rotary embeddings, hand their K/V to the cache (which
returns the keys the query attends over, `paged_attention.py`) and then call the attention function
their config names. The engine's language model names this one (`use_engine_attention`), so the
layers stay transformers' own and only the kernel behind them is raypipe's choice:

- **Decode** (one query per row): grouped by KV head as batched GEMMs. SDPA with grouped-query
  attention at one query per row spends its time re-arranging keys and computing one tiny block at a
  time; here each KV head's `G` query heads are one `(G, head_dim)` matrix per row against that head's
  keys, read where the cache keeps them, no copy. A decode round's rows are head-major `(rows,
  kv_heads, length, head_dim)` (`paged_attention.py`), so every (row, KV head) pair is one batch of a
  single GEMM; keys laid out otherwise (a static step's per-step gather) run one GEMM per KV head over
  strided `(rows, length, head_dim)` views. Measured at batch 32, 8 query / 2 KV heads of 64, 300 keys,
  2 AVX2 cores: 0.73 ms (one GEMM, head-major) against 1.19 (per head, strided) and SDPA's 1.77. The
  additive mask the cache built (`-finfo.min` where a row may not look) is added by the first GEMM, so
  masked keys get a softmax weight of exactly 0 as with SDPA.
  CPU and fp32 only: in bf16 the scores and softmax would be rounded to bf16 where SDPA keeps them in
  fp32, and on CUDA SDPA's fused kernels are the better choice.
- **Prefill** (several queries per row) on a CPU: torch's SDPA with the KV heads read in place and short
  chunks' query heads folded into one query per KV head (`prefill_attention.py`). Anything else (a GPU,
  softcap, position bias): transformers' SDPA function, unchanged (its flash kernel wins at many queries).

Results equal SDPA's up to float rounding (another summation order); the tests compare greedy
tokens against transformers' own `generate()`, which runs SDPA.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from raypipe.decode import prefill_attention
from raypipe.decode.paged_attention import SHARED_PREFIX

NAME = "raypipe"
# Attribute of an attention module whose cache write and attention a compiled forward calls as one opaque
# operation (`compiled_forward.py`, which registers `raypipe::cached_attention`)
OPAQUE_ATTENTION = "raypipe_opaque_attention"


def attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs):
    """`query` `(B, H, Q, D)`, `key`/`value` `(B, Hkv, L, D)` -> `((B, Q, H, D), None)` as transformers expects.
    Keys carrying a decode round's shared leading blocks (`paged_attention.SHARED_PREFIX`) hold only what follows
    them; the mask covers both."""
    if torch.compiler.is_compiling() and getattr(module, OPAQUE_ATTENTION, False):
        # `key`/`value` are the step's new K/V (`KVCache.update` left them to this operation)
        if kwargs.get("sliding_window") or kwargs.get("softcap") or kwargs.get("s_aux") is not None:
            raise NotImplementedError("a compiled forward's attention operation is plain causal attention: no "
                                      "sliding window, softcap or sinks")
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        return torch.ops.raypipe.cached_attention(query, key, value, attention_mask, module.layer_idx, scale), None
    shared = getattr(key, SHARED_PREFIX, None)
    fast = not (query.shape[2] != 1 or query.dtype != torch.float32 or query.device.type != "cpu" or dropout
                or kwargs.get("s_aux") is not None or kwargs.get("softcap"))
    if shared is not None and not (fast and _heads_merge(key) and _heads_merge(value)):
        rows, (shared_keys_t, shared_values) = key.shape[0], shared  # every row's own copy, as without sharing
        key, value = (torch.cat((part.expand(rows, -1, -1, -1), own), 2)
                      for part, own in zip((shared_keys_t.transpose(2, 3), shared_values), (key, value)))
        shared = None
    if not fast:
        if prefill_attention.applies(query, key, attention_mask, kwargs):
            return prefill_attention.attention(module, query, key, value, attention_mask, dropout, scaling,
                                               kwargs.get("is_causal")), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    rows, heads, _, head_dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scale = head_dim ** -0.5 if scaling is None else scaling
    if shared is not None:
        return _shared_then_own(query, shared, key, value, attention_mask, scale), None
    if _heads_merge(key) and _heads_merge(value):
        return _merged_heads(query, key, value, attention_mask, scale), None
    grouped = query.reshape(rows, kv_heads, groups, head_dim)
    mask = None if attention_mask is None else attention_mask.reshape(rows, 1, length)
    outputs = []
    for h in range(kv_heads):
        keys_t = key[:, h].transpose(1, 2)  # (rows, D, L)
        if mask is None:
            scores = torch.bmm(grouped[:, h], keys_t).mul_(scale)
        else:
            scores = torch.baddbmm(mask.to(query.dtype), grouped[:, h], keys_t, alpha=scale)
        outputs.append(torch.bmm(torch.softmax(scores, dim=-1), value[:, h]))  # (rows, G, D)
    return torch.stack(outputs, dim=1).reshape(rows, 1, heads, head_dim), None


def _heads_merge(states: torch.Tensor) -> bool:
    """Whether `(B, Hkv, L, D)` views as `(B * Hkv, L, D)` without a copy (head-major rows)."""
    return states.stride(0) == states.shape[1] * states.stride(1)


def _merged_heads(query, key, value, attention_mask, scale: float) -> torch.Tensor:
    """Every (row, KV head) pair as one batch of one GEMM: `(B, 1, H, D)`."""
    rows, heads, _, head_dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    pairs = rows * kv_heads
    scores = _pair_scores(query, key, attention_mask, scale)
    out = torch.bmm(torch.softmax(scores, dim=-1), value.reshape(pairs, length, head_dim))  # (pairs, G, D)
    return out.reshape(rows, 1, heads, head_dim)


def _pair_scores(query, key, attention_mask, scale: float) -> torch.Tensor:
    """Scaled, masked scores of every (row, KV head) pair's query heads over its keys: `(B * Hkv, G, L)`."""
    rows, heads, _, head_dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    pairs = rows * kv_heads
    grouped = query.reshape(pairs, heads // kv_heads, head_dim)
    keys_t = key.reshape(pairs, length, head_dim).transpose(1, 2)
    if attention_mask is None:
        return torch.bmm(grouped, keys_t).mul_(scale)
    mask = attention_mask.to(query.dtype).reshape(rows, 1, 1, length).expand(rows, kv_heads, 1, length)
    return torch.baddbmm(mask.reshape(pairs, 1, length), grouped, keys_t, alpha=scale)


def _shared_then_own(query, shared: tuple[torch.Tensor, torch.Tensor], key, value, attention_mask,
                     scale: float) -> torch.Tensor:
    """`_merged_heads` over the shared keys followed by each row's own: the shared keys (`SHARED_PREFIX`: K
    transposed, `(1, Hkv, D, P)`) are read once for all rows' queries (one GEMM per KV head, every row's query
    heads as its rows), and the softmax runs over the scores of both, side by side, as over one row of P + L keys.
    `attention_mask` covers P + L; every row sees all P shared keys."""
    rows, heads, _, head_dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    shared_keys_t, shared_values = shared
    prefix, pairs, groups = shared_keys_t.shape[3], rows * kv_heads, heads // kv_heads
    by_head = query.reshape(rows, kv_heads, groups, head_dim).transpose(0, 1).reshape(kv_heads, rows * groups, head_dim)
    shared_scores = torch.bmm(by_head, shared_keys_t[0]).mul_(scale)  # (Hkv, rows * G, P)
    shared_scores = shared_scores.view(kv_heads, rows, groups, prefix).transpose(0, 1).reshape(pairs, groups, prefix)
    own_scores = _pair_scores(query, key, None if attention_mask is None else attention_mask[..., prefix:], scale)
    weights = torch.softmax(torch.cat((shared_scores, own_scores), -1), dim=-1)  # (pairs, G, P + L)
    shared_weights = weights[..., :prefix].reshape(rows, kv_heads, groups, prefix).transpose(0, 1)
    out = torch.bmm(shared_weights.reshape(kv_heads, rows * groups, prefix), shared_values[0])  # (Hkv, rows * G, D)
    out = out.view(kv_heads, rows, groups, head_dim).transpose(0, 1).reshape(pairs, groups, head_dim)
    out = out.baddbmm_(weights[..., prefix:], value.reshape(pairs, length, head_dim))
    return out.reshape(rows, 1, heads, head_dim)


AttentionInterface.register(NAME, attention_forward)


def use_engine_attention(text_model: torch.nn.Module) -> None:
    """Point `text_model`'s attention layers (they read their config's implementation each forward) here."""
    text_model.config._attn_implementation = NAME
