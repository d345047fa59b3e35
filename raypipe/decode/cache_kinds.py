"""Per-layer cache kinds: what one decoder layer keeps for the running sequences.

A language model's `text_config.layer_types` names each layer's kind; `KVCache` (`kv_cache.py`)
builds one `LayerCache` per layer from `CACHE_KINDS`.

- `full_attention`: K/V in blocks of the paged pool (`paged_attention.py`), as many as a sequence's
  length needs; a sequence's block table says where its tokens are.
- `linear_attention` (gated delta net, Qwen3.5 / MiniCPM-V 4.6): a fixed-size conv state (the
  last `kernel` inputs of the short causal conv) and a recurrent state per row, whatever the
  sequence length. A recurrent state cannot skip padding, so the runner prefills such models in
  groups of equal length (`PADDED_PREFILL_EXACT = False`).
- `sliding_attention` (Step3): a ring of `sliding_window` K/V per row; memory bounded by the window.

The two bounded kinds keep fixed rows: `max_num_seqs` rows allocated up front, row i belonging to
batch row i, so rows join, leave and move together across those kinds. They are already bounded per
sequence, so paging them would buy no memory; what they cannot do is start from a cached past, so a
family with either kind prefills whole prompts from token 0 (no prefix caching, no chunked prefill).

A new kind subclasses `LayerCache`, implements the methods its transformers layer calls (`update`
for attention layers), its masks and `move_row`, and registers itself in `kv_cache.CACHE_KINDS`
under its `layer_types` name. Masks are asked of one instance per kind, so a kind may build them
from its config (the window).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import torch


@dataclasses.dataclass(slots=True)
class WritePattern:
    """Where the next forward writes and what it reads: set by `KVCache.prepare_*`, read by every layer.

    Prefill: rows `rows` get positions `starts[b] .. starts[b] + lengths[b] - 1` (right-padded to
    `width`; `starts` are tokens each row already has cached, 0 for a fresh prompt).
    Decode: rows `rows` (always `0..n-1`) each write one token at `write_index[row]`.
    Paged layers write the token slots `write_slots` (prefill: the `real` tokens, row-major) and read
    the blocks `read_blocks`, each row's first `kv_len / block_size` table entries, row-major (so
    `kv_len` is a whole number of blocks; not needed by a prefill without a past).
    """

    rows: slice = dataclasses.field(default_factory=lambda: slice(0, 0))
    lengths: torch.Tensor | None = None  # prefill only
    starts: torch.Tensor | None = None  # prefill only
    has_past: bool = False  # prefill only: some row starts after token 0
    real: torch.Tensor | None = None  # prefill only: (B, width) bool, the rows' real tokens
    write_index: torch.Tensor | None = None  # decode only
    row_ids: torch.Tensor | None = None  # decode only: arange(n), for indexed writes
    write_slots: torch.Tensor | None = None
    read_blocks: torch.Tensor | None = None
    in_round: bool = False  # decode: paged layers attend over the round's gathered rows (kv_cache.py)
    kv_len: int = 0  # keys an attention layer attends over in this forward

    @property
    def is_prefill(self) -> bool:
        return self.write_index is None


@dataclasses.dataclass(frozen=True, slots=True)
class CacheLimits:
    max_num_seqs: int
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    num_blocks: int  # paged pool, null block included
    block_size: int


class LayerCache(abc.ABC):
    """One layer's cache for the running sequences, allocated up front."""

    layer_type: ClassVar[str]
    PADDED_PREFILL_EXACT: ClassVar[bool] = True  # may right-padded rows share one prefill forward?

    @abc.abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer owns (for memory accounting)."""

    @abc.abstractmethod
    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy one sequence's state (its first `length` tokens' worth) from row `src` to row `dst`."""

    @classmethod
    @abc.abstractmethod
    def prefill_mask(cls, pattern: WritePattern, width: int, dtype: torch.dtype) -> torch.Tensor | None:
        """What transformers' layer of this type takes as `attention_mask` in a prefill forward."""

    @classmethod
    @abc.abstractmethod
    def decode_mask(cls, pattern: WritePattern, dtype: torch.dtype) -> torch.Tensor | None:
        """What it takes in a one-token decode forward."""


class LinearAttentionRows(LayerCache):
    """Gated-delta-net state rows: conv state `(conv_dim, kernel)` and recurrent state
    `(v_heads, k_dim, v_dim)` in fp32 (transformers keeps it fp32 too), fixed size per sequence.

    The methods are the ones transformers' `Qwen3_5GatedDeltaNet` calls on its cache. A prefill
    starts from an empty state (`None`), so the layer takes its chunked path from zeros.
    """

    layer_type = "linear_attention"
    PADDED_PREFILL_EXACT = False  # the recurrent state would run on through the padding

    def __init__(self, text_config, limits: CacheLimits):
        c = text_config
        key_dim = c.linear_key_head_dim * c.linear_num_key_heads
        conv_dim = 2 * key_dim + c.linear_value_head_dim * c.linear_num_value_heads
        self.kernel = c.linear_conv_kernel_dim
        self.conv = torch.zeros((limits.max_num_seqs, conv_dim, self.kernel), device=limits.device,
                                dtype=limits.dtype)
        self.recurrent = torch.zeros((limits.max_num_seqs, c.linear_num_value_heads, c.linear_key_head_dim,
                                      c.linear_value_head_dim), device=limits.device, dtype=torch.float32)

    def tensors(self) -> list[torch.Tensor]:
        return [self.conv, self.recurrent]

    def conv_state(self, pattern: WritePattern) -> torch.Tensor | None:
        # Decode updates this view in place (transformers' `causal_conv1d_update`).
        return None if pattern.is_prefill else self.conv[pattern.rows]

    def recurrent_state(self, pattern: WritePattern) -> torch.Tensor | None:
        return None if pattern.is_prefill else self.recurrent[pattern.rows]

    def update_conv(self, inputs: torch.Tensor, pattern: WritePattern) -> torch.Tensor:
        """Prefill: keep each row's last `kernel` real inputs (zeros before its start); return the
        inputs for the conv, which needs no past (a prefill starts every row fresh)."""
        if not pattern.is_prefill:  # multi-token continuation is never run by the engine
            raise RuntimeError("linear-attention rows take multi-token forwards only in prefill")
        padded = torch.nn.functional.pad(inputs, (self.kernel, 0))  # index j of inputs -> j + kernel
        ends = pattern.lengths.to(inputs.device) + self.kernel
        cols = ends[:, None] - self.kernel + torch.arange(self.kernel, device=inputs.device)[None, :]
        index = cols[:, None, :].expand(-1, inputs.shape[1], -1)
        self.conv[pattern.rows] = padded.gather(2, index).to(self.conv.dtype)
        return inputs

    def update_recurrent(self, state: torch.Tensor, pattern: WritePattern) -> None:
        self.recurrent[pattern.rows] = state.to(self.recurrent.dtype)

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.conv[dst] = self.conv[src]
        self.recurrent[dst] = self.recurrent[src]

    @classmethod
    def prefill_mask(cls, pattern, width, dtype):
        # transformers' 2-D padding mask for linear layers: zeroes padded inputs.
        return torch.arange(width, device=pattern.lengths.device)[None, :] < pattern.lengths[:, None]

    @classmethod
    def decode_mask(cls, pattern, dtype):
        return None  # a generated token is never padding


class SlidingWindowRows(LayerCache):
    """K/V rings of `sliding_window` tokens per row (Step3's `sliding_attention` layers).

    transformers' sliding layers let position q attend to keys k with `q - window < k <= q`, so a
    row never needs more than its last `window` tokens: token p lives in slot `p % ring`, memory is
    `max_num_seqs x ring` whatever the sequence length (ring = min(window, max_model_len)).

    Prefill attends over the prompt's own fresh keys (returned as they are, masked to the window)
    and then keeps each row's last `ring` real tokens. Decode writes slot `write_index % ring` and
    attends over the whole ring; slot j of a row at position c holds position
    `c - ((c - j) mod ring)`, which is in the window exactly when it is >= 0 (slots not yet written
    are masked). Keys come in ring order, not position order: attention does not care.
    """

    layer_type = "sliding_attention"

    def __init__(self, text_config, limits: CacheLimits):
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        self.window = text_config.sliding_window
        self.ring = min(self.window, limits.max_model_len)
        shape = (limits.max_num_seqs, text_config.num_key_value_heads, self.ring, head_dim)
        self.keys = torch.zeros(shape, device=limits.device, dtype=limits.dtype)
        self.values = torch.zeros(shape, device=limits.device, dtype=limits.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, pattern: WritePattern):
        if pattern.is_prefill:
            # Positions lengths-ring .. lengths-1 of each row; negative ones are slots no mask admits.
            positions = pattern.lengths[:, None] - self.ring + torch.arange(self.ring, device=key_states.device)
            take = positions.clamp(min=0)[:, None, :, None].expand(-1, key_states.shape[1], -1, key_states.shape[3])
            slots = positions.remainder(self.ring)[:, None, :, None].expand_as(take)
            for cache, fresh in ((self.keys, key_states), (self.values, value_states)):
                cache[pattern.rows] = torch.empty_like(cache[pattern.rows]).scatter_(2, slots, fresh.gather(2, take))
            return key_states, value_states
        slot = pattern.write_index.remainder(self.ring)
        self.keys[pattern.row_ids, :, slot] = key_states[:, :, 0]
        self.values[pattern.row_ids, :, slot] = value_states[:, :, 0]
        return self.keys[pattern.rows], self.values[pattern.rows]

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.keys[dst] = self.keys[src]
        self.values[dst] = self.values[src]

    def prefill_mask(self, pattern, width, dtype):
        pos = torch.arange(width, device=pattern.lengths.device)
        in_window = (pos[:, None] - pos[None, :]) < self.window
        causal = (pos[None, :] <= pos[:, None]) & in_window
        allowed = causal[None] & (pos[None, None, :] < pattern.lengths[:, None, None])
        return additive(allowed[:, None], dtype)

    def decode_mask(self, pattern, dtype):
        slots = torch.arange(self.ring, device=pattern.write_index.device)
        current = pattern.write_index[:, None]
        held = current - (current - slots[None, :]).remainder(self.ring)  # position each slot holds
        return additive((held >= 0)[:, None, None], dtype)


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # min-of-dtype, not -inf: eager attention adds the mask and -inf - -inf would be NaN.
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)
