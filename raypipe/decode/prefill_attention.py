"""Prefill attention on a CPU (several queries per row): torch's SDPA as transformers' SDPA function calls it,
with the KV heads read in place and, for short chunks, each KV head's query heads taken as one long query.

- **KV heads in place** (`enable_gqa`). transformers passes `enable_gqa` only without a mask (on CUDA a masked
  GQA call leaves the flash kernel), so a chunk that continues cached keys (masked) had every KV head copied
  once per query head first. On a CPU the flash kernel takes both alike and the outputs are bit-identical; the
  copies are gone: 10 rows x 92 tokens over 900 cached keys, 8 query / 2 KV heads of 64, 31.5 against 47.4 ms a
  layer (2 cores).
- **Query heads folded into the query length.** torch's CPU flash kernel takes a row's queries in blocks of 32
  below `FLASH_WIDER_BLOCKS_FROM` of them (64 from there, 256 from 768): a chunk of 92 tokens runs 32-query
  GEMMs against every key block. The `G` query heads that share a KV head attend over the same keys, so in
  fp32 they go in as one query of `G x width` rows under that KV head (the mask tiled `G` times, built once per
  forward and mask), which the kernel takes in blocks of 64. Same machine, fp32, outputs bit-identical: 10 rows x
  92 tokens over 900 cached keys 28.6 -> 17.9 ms a layer, 12 x 87 over 912 35.2 -> 22.8, an image burst's 16 x
  136 with no cached keys (causal: the mask now explicit) 11.0 -> 8.6; a lone 976-token prompt is faster causal
  and unfolded (10.5 against 15.6), and in bf16 folding measured faster and slower by turns, so neither folds.
  A masked chunk (one that continues cached keys) folds up to `FLASH_WIDEST_BLOCKS_FROM` queries: it has a mask
  anyway, and folded it reaches the kernel's 256-query blocks. One row over 768 cached keys, 8 query / 2 KV
  heads of 64, outputs bit-identical: 300 new tokens (a chat turn) 4.62 -> 4.08 ms a layer, 500 over 1,000
  10.5 -> 9.9, 700 over 700 12.8 -> 12.5; 1,000 over 500 lost (19.5 -> 21.1), so the bound. A causal chunk of
  192-700 tokens would trade the kernel's skipped upper blocks for a mask: 0.56 -> 0.61 ms at 200, 4.8 -> 7.8 at
  700, so causal chunks fold below `FLASH_WIDER_BLOCKS_FROM` only.

Anything else (a GPU, softcap, position bias, sinks, one query per row) is not this module's: `applies` says
so, and the caller runs transformers' SDPA function.
"""

from __future__ import annotations

import functools

import torch

# Arguments of transformers' SDPA function beside the mask that change what it computes (it ignores the rest: a
# layer's sliding_window, position_ids, use_cache): a call with any of them is not this module's.
DECLINED_ARGUMENTS = ("softcap", "position_bias", "cache", "s_aux")
# torch's CPU flash attention takes queries in blocks of 32 below this many per row (64 from there, 256 from the
# next): below it, query heads sharing a KV head are folded into one query (fp32) ...
FLASH_WIDER_BLOCKS_FROM = 192
# ... and below this one too where the chunk has a mask (it continues cached keys)
FLASH_WIDEST_BLOCKS_FROM = 768
# ... unless the tiled mask would take more than this (rows x query heads per KV head x queries x keys)
FOLDED_MASK_MAX_BYTES = 64 << 20
# Attribute of a forward's mask holding its tiled copy: every layer of the forward gets the same mask tensor
FOLDED = "raypipe_folded"


def applies(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict) -> bool:
    """Whether `attention` computes what transformers' SDPA function would: a CPU, several queries per row (one
    query goes through transformers' own grouping), grouped KV heads, none of `DECLINED_ARGUMENTS`, and the keys
    the queries' own where no mask is given (transformers crops longer keys for its causal kernel)."""
    changes_math = any(kwargs.get(name) is not None for name in DECLINED_ARGUMENTS)
    return (query.device.type == "cpu" and query.shape[2] > 1 and not changes_math and key.shape[1] != query.shape[1]
            and (attention_mask is not None or key.shape[2] == query.shape[2]))


def attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float, scaling: float | None,
              is_causal: bool | None) -> torch.Tensor:
    """SDPA over `key`/`value`'s own KV heads: `(B, Q, H, D)`. Causal where transformers' function is: no mask and
    a causal call (`is_causal`, else the module's)."""
    is_causal = attention_mask is None and (getattr(module, "is_causal", True) if is_causal is None else is_causal)
    rows, heads, width, dim = query.shape
    groups = heads // key.shape[1]
    if _folds(query, groups, key.shape[2], attention_mask):
        mask = (_tiled(attention_mask, groups) if attention_mask is not None
                else _causal_tiled(width, groups, query.dtype) if is_causal else None)
        out = torch.nn.functional.scaled_dot_product_attention(
            query.reshape(rows, key.shape[1], groups * width, dim), key, value, attn_mask=mask, dropout_p=dropout,
            scale=scaling)
        return out.view(rows, heads, width, dim).transpose(1, 2).contiguous()
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, is_causal=is_causal,
                                                           enable_gqa=True)
    return out.transpose(1, 2).contiguous()


def _folds(query: torch.Tensor, groups: int, length: int, attention_mask: torch.Tensor | None) -> bool:
    """Whether folding the query heads gives the flash kernel wider query blocks, in fp32, with a tiled mask of at
    most `FOLDED_MASK_MAX_BYTES`."""
    width = query.shape[2]
    if attention_mask is not None and attention_mask.shape[1] != 1:
        return False  # a mask per head: not tiled here
    mask_rows = 1 if attention_mask is None else attention_mask.shape[0]
    below = FLASH_WIDER_BLOCKS_FROM if attention_mask is None else FLASH_WIDEST_BLOCKS_FROM
    return (query.dtype == torch.float32 and width < below and FLASH_WIDER_BLOCKS_FROM <= groups * width
            and mask_rows * groups * width * length * query.element_size() <= FOLDED_MASK_MAX_BYTES)


def _tiled(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """`mask` `(B, 1, W, L)` repeated `groups` times along its queries, `(B, 1, groups * W, L)`: query `g * W + w` of
    a folded row is query `w` of head `g`. Made once per forward (kept on the mask tensor)."""
    tiled = getattr(mask, FOLDED, None)
    if tiled is None or tiled.shape[2] != groups * mask.shape[2]:
        tiled = mask.repeat(1, 1, groups, 1)
        setattr(mask, FOLDED, tiled)
    return tiled


@functools.lru_cache(maxsize=8)
def _causal_tiled(width: int, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """The causal mask of a chunk of `width` queries over its own keys, tiled `groups` times: `(1, 1, groups * W, W)`."""
    visible = torch.ones(width, width, dtype=torch.bool).tril()
    return torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype).repeat(groups, 1)[None, None]
