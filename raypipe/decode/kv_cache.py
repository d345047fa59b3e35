"""The engine's cache: one `LayerCache` per decoder layer (kind from `layer_types`), allocated once.

Full-attention layers keep K/V in blocks of the paged pool (`paged_attention.py`; which blocks a
sequence holds is `block_pool.py`'s business), so memory follows actual lengths; sliding-window
layers the same through a pool and window tables of their own (`sliding_window.py`), so their memory
follows the window. Linear-attention state keeps one fixed row per running sequence: batch row i
is row i, the engine keeps the running batch compact, a request joining takes the next free row
and a request leaving has the last row's state copied into its row (one sequence, never the batch).
State snapshots (`snapshot_pool.py` decides which) are copies of one row of every row-state layer
in slots allocated once (`allocate_snapshots`): `save_state(row, slot)`, `restore_state(slot, row)`.

It is a transformers `Cache`, so transformers' layers call it themselves (`update` from attention
layers, `get_/update_conv_state` and `get_/update_recurrent_state` from gated-delta-net layers), and
each call goes to that layer's cache. The engine sets the write pattern before each forward with
`prepare_prefill` / `prepare_decode` (token slots are computed there once for all layers), and
passes `masks()`: one mask per layer type, which transformers' decoder stacks accept as a dict and
hand to each layer as it is.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import Cache

from raypipe.decode.block_pool import NULL_BLOCK
from raypipe.decode.cache_kinds import CacheLimits, LayerCache, LinearAttentionRows, WritePattern
from raypipe.decode.paged_attention import PagedAttentionLayer, token_slots
from raypipe.decode.sliding_window import SlidingWindowBlocks

CACHE_KINDS: dict[str, type[LayerCache]] = {
    PagedAttentionLayer.layer_type: PagedAttentionLayer,
    LinearAttentionRows.layer_type: LinearAttentionRows,
    SlidingWindowBlocks.layer_type: SlidingWindowBlocks,
}


def layer_types(text_config) -> list[str]:
    """Each decoder layer's kind; a config without `layer_types` is all full attention."""
    types = getattr(text_config, "layer_types", None) or ["full_attention"] * text_config.num_hidden_layers
    unknown = sorted(set(types) - set(CACHE_KINDS))
    if unknown:
        raise ValueError(f"layer types {unknown} have no cache kind (known: {sorted(CACHE_KINDS)})")
    return list(types)


def paged_bytes_per_token(text_config, dtype: torch.dtype) -> int:
    """K/V bytes one token takes in the paged pool (every full-attention layer)."""
    full = layer_types(text_config).count(PagedAttentionLayer.layer_type)
    return full * PagedAttentionLayer.bytes_per_token(text_config, dtype)


def block_tables(tables: list[list[int]], width: int, device: torch.device) -> torch.Tensor:
    """`(len(tables), width)` block ids, padded with the null block."""
    out = torch.full((len(tables), width), NULL_BLOCK, dtype=torch.long)
    for i, table in enumerate(tables):
        out[i, : len(table)] = torch.tensor(table[:width], dtype=torch.long)
    return out.to(device)


class KVCache(Cache):
    def __init__(self, text_config, *, max_num_seqs: int, max_model_len: int, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, window_blocks: int = 0):
        super().__init__(layers=[])
        limits = CacheLimits(max_num_seqs, max_model_len, torch.device(device), dtype, num_blocks, block_size,
                             window_blocks)
        self.layer_types = layer_types(text_config)
        self.caches: list[LayerCache] = [CACHE_KINDS[kind](text_config, limits) for kind in self.layer_types]
        self.kinds = {kind: layer for kind, layer in zip(self.layer_types, self.caches)}  # one instance per kind
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.window_blocks = window_blocks
        self.block_size = block_size
        self.device = limits.device
        self.dtype = dtype
        self.pattern = WritePattern()
        self.in_round = False  # between begin_decode_round and end_decode_round
        # A compiled forward's attention layers write and read this cache in one opaque operation each
        # (`compiled_forward.py`): their modules by layer index
        self.opaque_attention = False
        self.attention_modules: dict[int, torch.nn.Module] = {}
        # per layer, per row tensor: (slots, *row shape); none until `allocate_snapshots`
        self.snapshots: list[list[torch.Tensor]] = [[] for _ in self.caches]

    @property
    def row_state_kinds(self) -> list[str]:
        """The layer types that keep per-row state (what a prefix hit must restore besides blocks)."""
        return sorted(name for name, kind in self.kinds.items() if kind.row_tensors())

    @property
    def state_bytes_per_row(self) -> int:
        """Bytes of one sequence's row state in every layer: what one state snapshot takes."""
        return sum(t[0].numel() * t.element_size() for layer in self.caches for t in layer.row_tensors())

    def allocate_snapshots(self, num_slots: int) -> None:
        self.snapshots = [[torch.zeros((num_slots, *t.shape[1:]), dtype=t.dtype, device=t.device)
                           for t in layer.row_tensors()] for layer in self.caches]

    def save_state(self, row: int, slot: int) -> None:
        for layer, slots in zip(self.caches, self.snapshots):
            for tensor, stored in zip(layer.row_tensors(), slots):
                stored[slot].copy_(tensor[row])

    def restore_state(self, slot: int, row: int) -> None:
        for layer, slots in zip(self.caches, self.snapshots):
            for tensor, stored in zip(layer.row_tensors(), slots):
                tensor[row].copy_(stored[slot])

    def view(self) -> "KVCache":
        """The same storage with a write pattern of its own, so two threads can run forwards at once on
        disjoint rows and blocks (prefill of joining sequences while the running ones decode)."""
        other = copy.copy(self)
        other.pattern = WritePattern()
        return other

    @property
    def nbytes(self) -> int:
        """Bytes of the layers' caches (paged blocks and rows; snapshots not included)."""
        return sum(t.numel() * t.element_size() for layer in self.caches for t in layer.tensors())

    def prepare_prefill(self, rows: list[int], starts: list[int], lengths: list[int], tables: list[list[int]],
                        window_tables: list[list[int]] | None = None,
                        captures: list[tuple[int, int, int]] = ()) -> None:
        """Rows `rows` (a group's sequences need not hold consecutive ones) compute positions
        `starts[b]..starts[b]+lengths[b]-1` (right-padded to the longest), writing through their block
        `tables` (and, for sliding-window layers, their `window_tables`); `captures` `(b, offset, slot)`:
        row b's state after `offset` tokens goes to snapshot `slot`."""
        width = max(lengths)
        kv_blocks = -(-max(s + n for s, n in zip(starts, lengths)) // self.block_size)
        starts_t = torch.tensor(starts, device=self.device)
        lengths_t = torch.tensor(lengths, device=self.device)
        table_width = max(kv_blocks, -(-(max(starts) + width) // self.block_size))
        query = starts_t[:, None] + torch.arange(width, device=self.device)[None, :]
        real = torch.arange(width, device=self.device)[None, :] < lengths_t[:, None]
        has_past = any(starts)

        def access(block_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
            table = block_tables(block_ids, table_width, self.device)
            return (token_slots(table, query, self.block_size)[real],
                    table[:, :kv_blocks].reshape(-1) if has_past else None)

        write_slots, read_blocks = access(tables)
        window_slots, window_blocks = access(window_tables) if self.window_blocks else (None, None)
        self.pattern = WritePattern(rows=torch.tensor(rows, device=self.device), lengths=lengths_t,
                                    starts=starts_t, has_past=has_past, real=real,
                                    write_slots=write_slots, read_blocks=read_blocks,
                                    window_slots=window_slots, window_blocks=window_blocks,
                                    kv_len=kv_blocks * self.block_size if has_past else width,
                                    captures=tuple(captures))

    def prepare_decode(self, num_rows: int, write_index: torch.Tensor, kv_len: int, tables: torch.Tensor,
                       window_tables: torch.Tensor | None = None, state_rows: torch.Tensor | None = None) -> None:
        """Rows `0..num_rows-1` each write one token at their own `write_index[row]` and attend over their
        first `kv_len` positions, rounded up to whole blocks; `tables` are their block tables
        `(num_rows, >= kv_len / block_size)`, padded with the null block (`window_tables` likewise, for
        sliding-window layers). `state_rows`: the row-state rows each batch row uses (a static step's,
        `compiled_step.py`); by default row i's own."""
        self.pattern = self.decode_pattern(num_rows, write_index, kv_len, tables, self.pattern.row_ids, window_tables,
                                           state_rows)

    def decode_pattern(self, num_rows: int, write_index: torch.Tensor, kv_len: int, tables: torch.Tensor,
                       row_ids: torch.Tensor | None = None, window_tables: torch.Tensor | None = None,
                       state_rows: torch.Tensor | None = None) -> WritePattern:
        if row_ids is None or row_ids.numel() != num_rows:
            row_ids = torch.arange(num_rows, device=self.device)
        kv_blocks = -(-kv_len // self.block_size)

        def access(table: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            if table is None:
                return None, None
            return (token_slots(table, write_index[:, None], self.block_size)[:, 0],
                    None if self.in_round else table[:, :kv_blocks].reshape(-1))

        write_slots, read_blocks = access(tables)
        window_slots, window_blocks = access(window_tables)
        return WritePattern(rows=slice(0, num_rows) if state_rows is None else state_rows, write_index=write_index,
                            row_ids=row_ids,
                            kv_len=kv_blocks * self.block_size, write_slots=write_slots, read_blocks=read_blocks,
                            window_slots=window_slots, window_blocks=window_blocks, in_round=self.in_round)

    def begin_decode_round(self, tables: torch.Tensor, window_tables: torch.Tensor | None = None,
                           shared_blocks: int = 0, kept_rows: list[int] | None = None, spare_blocks: int = 0) -> None:
        """The decode rows' K/V (blocks `tables`, `(rows, blocks)`; sliding layers' blocks `window_tables`)
        gathered once for a round of eager steps, which then append to them (see paged_attention.py);
        until `end_decode_round`. `shared_blocks`: full-attention blocks every row shares from the start,
        gathered once for all rows. `kept_rows`, `spare_blocks`: the full-attention layers' rows continued from
        the previous round, or gathered with room for more (`round_reuse.py`); a window's blocks change as it
        slides, so sliding layers gather every round."""
        for layer in self.caches:
            if isinstance(layer, SlidingWindowBlocks):
                layer.begin_round(window_tables)
            elif isinstance(layer, PagedAttentionLayer):
                layer.begin_round(tables, shared_blocks, kept_rows, spare_blocks)
        self.in_round = True

    def end_decode_round(self) -> None:
        for layer in self.caches:
            if isinstance(layer, PagedAttentionLayer):
                layer.end_round()
        self.in_round = False

    def masks(self, dtype: torch.dtype) -> dict[str, torch.Tensor | None]:
        """The attention mask of the prepared forward for each layer type present."""
        p = self.pattern
        if p.is_prefill:
            width = p.real.shape[1]
            return {name: kind.prefill_mask(p, width, dtype) for name, kind in self.kinds.items()}
        return {name: kind.decode_mask(p, dtype) for name, kind in self.kinds.items()}

    # Called by transformers' attention layers.
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.opaque_attention and torch.compiler.is_compiling():
            return key_states, value_states  # written by the attention's opaque operation (compiled_forward.py)
        return self.caches[layer_idx].update(key_states, value_states, self.pattern)

    # Called by the gated-delta-net layers (transformers' forward, and raypipe's prefill forward,
    # models/delta_net_prefill.py, which also asks where states are to be captured).
    def state_capture_offsets(self) -> list[int] | None:
        """In a prefill: the distinct offsets into the chunk where some row's state is captured; None in decode."""
        return sorted({offset for _, offset, _ in self.pattern.captures}) if self.pattern.is_prefill else None

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.caches[layer_idx].conv_state(self.pattern)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        return self.caches[layer_idx].update_conv(conv_states, self.pattern, self.snapshots[layer_idx])

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.caches[layer_idx].recurrent_state(self.pattern)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               captured: dict[int, torch.Tensor] | None = None, **kwargs):
        self.caches[layer_idx].update_recurrent(recurrent_states, self.pattern, self.snapshots[layer_idx], captured)

    def keep_decode_rows(self, layer_idx: int, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        """A decode step's rows of a row-state layer, updated in place: kept (`LinearAttentionRows.keep_decode_rows`)."""
        self.caches[layer_idx].keep_decode_rows(conv_state, recurrent_state, self.pattern)

    def is_recording_past(self, layer_idx: int) -> bool:
        return False  # rows keep only the latest state (no speculative rollback)

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Move one sequence's row state (first `length` cached tokens) from row `src` to row `dst`."""
        for layer in self.caches:
            layer.move_row(src, dst, length)

    # The parts of transformers' Cache interface that code paths outside our forward may ask for.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.pattern.kv_len

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_model_len

    def __len__(self) -> int:
        return len(self.caches)
