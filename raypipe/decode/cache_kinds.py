"""Per-layer cache kinds: what one decoder layer keeps for the running sequences.

A language model's `text_config.layer_types` names each layer's kind; `KVCache` (`kv_cache.py`)
builds one `LayerCache` per layer from `CACHE_KINDS`.

- `full_attention`: K/V in blocks of the paged pool (`paged_attention.py`), as many as a sequence's
  length needs; a sequence's block table says where its tokens are.
- `linear_attention` (gated delta net, Qwen3.5 / MiniCPM-V 4.6): a fixed-size conv state (the
  last `kernel` inputs of the short causal conv) and a recurrent state per row, whatever the
  sequence length. Rows of different lengths prefill in one right-padded forward: the conv state is
  taken at each row's end, and padded tokens leave the recurrent state as it is
  (`models/delta_net_prefill.py`).
- `sliding_attention` (Step3): K/V in blocks of a pool of their own, through a window table per
  sequence whose blocks are freed once they have left the window (`sliding_window.py`).

The linear kind keeps fixed rows: `max_num_seqs` rows allocated up front (and one spare, row
`max_num_seqs`, through which the scheduler swaps two rows), row i belonging to batch row i, so rows
join, leave and move together (`row_tensors`: dim 0 is the row). A prefill may continue from a
row's state (`WritePattern.starts[b] > 0`): the state the row holds after its earlier chunk, or a
snapshot of those row tensors restored into the row (`kv_cache.KVCache.restore_state`,
`snapshot_pool.py`): the linear kind feeds its conv state and recurrent state to transformers' layer
as the chunk's initial state. Rows that start at token 0 ignore whatever their row held.

A new kind subclasses `LayerCache`, implements the methods its transformers layer calls (`update`
for attention layers), its masks, `move_row` and `row_tensors` (what a snapshot copies), and
registers itself in `kv_cache.CACHE_KINDS` under its `layer_types` name. Masks are asked of one
instance per kind, so a kind may build them from its config (the window).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import torch


@dataclasses.dataclass(slots=True)
class WritePattern:
    """Where the next forward writes and what it reads: set by `KVCache.prepare_*`, read by every layer.

    Prefill: rows `rows` (a tensor of row indices, not always consecutive) get positions
    `starts[b] .. starts[b] + lengths[b] - 1` (right-padded to `width`; `starts` are tokens each row
    already has cached, 0 for a fresh prompt).
    Decode: rows `rows` (`0..n-1`) each write one token at `write_index[row]`. An eager step's `rows` is
    the slice, so row-state kinds hand out views of their rows; a static-shape step's is an index tensor of
    its bucket's width whose padding rows name the spare row (`compiled_step.py`), so row state is read as
    a copy and written back (`LinearAttentionRows.keep_decode_rows`).
    Paged layers write the token slots `write_slots` (prefill: the `real` tokens, row-major) and read
    the blocks `read_blocks`, each row's first `kv_len / block_size` table entries, row-major (so
    `kv_len` is a whole number of blocks; not needed by a prefill without a past). Sliding-window
    layers do the same through the rows' window tables (`window_slots` / `window_blocks`).
    """

    rows: slice | torch.Tensor = dataclasses.field(default_factory=lambda: slice(0, 0))  # row indices or a slice
    lengths: torch.Tensor | None = None  # prefill only
    starts: torch.Tensor | None = None  # prefill only
    has_past: bool = False  # prefill only: some row starts after token 0
    real: torch.Tensor | None = None  # prefill only: (B, width) bool, the rows' real tokens
    write_index: torch.Tensor | None = None  # decode only
    row_ids: torch.Tensor | None = None  # decode only: arange(n), for indexed writes
    write_slots: torch.Tensor | None = None
    read_blocks: torch.Tensor | None = None
    window_slots: torch.Tensor | None = None
    window_blocks: torch.Tensor | None = None
    in_round: bool = False  # decode: paged layers attend over the round's gathered rows (kv_cache.py)
    kv_len: int = 0  # keys an attention layer attends over in this forward
    # prefill only: `(b, offset, slot)`: row b's state after `offset` tokens of its chunk goes to snapshot `slot`
    captures: tuple[tuple[int, int, int], ...] = ()

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
    window_blocks: int = 0  # the sliding-window layers' pool, null block included (0: no such layers)

    @property
    def num_rows(self) -> int:
        """Rows of the row-state kinds: one per running sequence, and the spare a swap goes through."""
        return self.max_num_seqs + 1


class LayerCache(abc.ABC):
    """One layer's cache for the running sequences, allocated up front."""

    layer_type: ClassVar[str]

    @abc.abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer owns (for memory accounting)."""

    def row_tensors(self) -> list[torch.Tensor]:
        """This layer's per-row state (dim 0 is the batch row): what a state snapshot copies. Paged
        kinds have none (their tokens live in blocks)."""
        return []

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

    The methods are the ones transformers' `Qwen3_5GatedDeltaNet` calls on its cache. A prefill row
    that starts at token 0 starts from zeros; one that continues (a later chunk, or a restored
    snapshot) starts from its row's conv and recurrent state. A prefill's captures are filled in the
    same forward (`models/delta_net_prefill.py`): the conv inputs before each capture's offset here,
    the recurrent state there from the delta rule's intermediate states.
    """

    layer_type = "linear_attention"

    def __init__(self, text_config, limits: CacheLimits):
        c = text_config
        key_dim = c.linear_key_head_dim * c.linear_num_key_heads
        conv_dim = 2 * key_dim + c.linear_value_head_dim * c.linear_num_value_heads
        self.kernel = c.linear_conv_kernel_dim
        self.conv = torch.zeros((limits.num_rows, conv_dim, self.kernel), device=limits.device,
                                dtype=limits.dtype)
        self.recurrent = torch.zeros((limits.num_rows, c.linear_num_value_heads, c.linear_key_head_dim,
                                      c.linear_value_head_dim), device=limits.device, dtype=torch.float32)

    def tensors(self) -> list[torch.Tensor]:
        return [self.conv, self.recurrent]

    def row_tensors(self) -> list[torch.Tensor]:
        return [self.conv, self.recurrent]

    def conv_state(self, pattern: WritePattern) -> torch.Tensor | None:
        # Decode updates this view (a copy in a static step: `keep_decode_rows`) in place.
        return None if pattern.is_prefill else self.conv[pattern.rows]

    def recurrent_state(self, pattern: WritePattern) -> torch.Tensor | None:
        if not pattern.is_prefill:
            return self.recurrent[pattern.rows]
        if not pattern.has_past:
            return None  # transformers' chunked rule starts from zeros
        return _continuing(self.recurrent[pattern.rows], pattern)

    def update_conv(self, inputs: torch.Tensor, pattern: WritePattern, stored: list[torch.Tensor]) -> torch.Tensor:
        """Prefill: keep each row's last `kernel` inputs (its state's columns before the chunk, then the
        chunk's real inputs), and those before each capture's offset in its snapshot slot (`stored`: this
        layer's snapshot tensors); return what the layer's causal conv runs over: the chunk's inputs after
        the rows' states (transformers keeps the conv's last `seq_len` outputs), or, when no row has a
        past, the inputs alone (the conv pads them with zeros, which is what a fresh state holds)."""
        if not pattern.is_prefill:  # multi-token continuation is never run by the engine
            raise RuntimeError("linear-attention rows take multi-token forwards only in prefill")
        if pattern.has_past:
            previous = _continuing(self.conv[pattern.rows], pattern).to(inputs.dtype)
        else:
            previous = inputs.new_zeros(inputs.shape[0], inputs.shape[1], self.kernel)
        joined = torch.cat([previous, inputs], dim=2)  # index j of inputs -> j + kernel
        ends = pattern.lengths.to(inputs.device) + self.kernel
        cols = ends[:, None] - self.kernel + torch.arange(self.kernel, device=inputs.device)[None, :]
        index = cols[:, None, :].expand(-1, inputs.shape[1], -1)
        self.conv[pattern.rows] = joined.gather(2, index).to(self.conv.dtype)
        for b, offset, slot in pattern.captures:
            stored[0][slot] = joined[b, :, offset: offset + self.kernel]
        return joined if pattern.has_past else inputs

    def update_recurrent(self, state: torch.Tensor, pattern: WritePattern, stored: list[torch.Tensor],
                         captured: dict[int, torch.Tensor] | None = None) -> None:
        """The rows' state after the forward, and into each capture's slot the state after its offset
        (`captured`: offset -> the batch's states there)."""
        self.recurrent[pattern.rows] = state.to(self.recurrent.dtype)
        for b, offset, slot in pattern.captures:
            stored[1][slot] = captured[offset][b]

    def keep_decode_rows(self, conv: torch.Tensor, recurrent: torch.Tensor, pattern: WritePattern) -> None:
        """After a decode step updated `conv_state` / `recurrent_state` in place: a static step's rows were
        copies (an index tensor's rows), so write them back; its padding rows all write the spare row, which
        only a swap between rounds uses. An eager step's were views of the rows: nothing to do."""
        if isinstance(pattern.rows, slice):
            return
        self.conv.index_copy_(0, pattern.rows, conv)
        self.recurrent.index_copy_(0, pattern.rows, recurrent)

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


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # min-of-dtype, not -inf: eager attention adds the mask and -inf - -inf would be NaN.
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def _continuing(state: torch.Tensor, pattern: WritePattern) -> torch.Tensor:
    """`state` (rows first) with the rows that start at token 0 zeroed: their row may hold an earlier
    occupant's state."""
    keep = (pattern.starts > 0).to(state.device).view(-1, *([1] * (state.dim() - 1)))
    return torch.where(keep, state, torch.zeros((), dtype=state.dtype, device=state.device))
