"""The slot cache: one `LayerRows` per decoder layer (kind from `layer_types`), allocated once.

Each running sequence owns one slot — row i of every layer's cache, whatever its kind (K/V for
full attention, conv + recurrent state for linear attention; see `cache_kinds.py`). The engine
keeps the running batch compact — batch row i is slot i — so the model always sees the first `n`
rows and no gather is needed. A request joining takes the next free row (nothing moves); a request
leaving has the last row's state copied into its row in every layer (one sequence, never the batch).

It is a transformers `Cache`, so transformers' layers call it themselves (`update` from attention
layers, `get_/update_conv_state` and `get_/update_recurrent_state` from gated-delta-net layers), and
each call goes to that layer's rows. The engine sets the write pattern before each forward with
`prepare_prefill` / `prepare_decode`, and passes `masks()` — one mask per layer type, which
transformers' decoder stacks accept as a dict and hand to each layer as it is.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import Cache

from raypipe.decode.cache_kinds import CACHE_KINDS, CacheLimits, LayerRows, WritePattern, layer_types


class SlotKVCache(Cache):
    def __init__(self, text_config, *, max_num_seqs: int, max_model_len: int, device: torch.device,
                 dtype: torch.dtype):
        super().__init__(layers=[])
        limits = CacheLimits(max_num_seqs, max_model_len, torch.device(device), dtype)
        self.layer_types = layer_types(text_config)
        self.rows: list[LayerRows] = [CACHE_KINDS[kind](text_config, limits) for kind in self.layer_types]
        self.kinds = {kind: rows for kind, rows in zip(self.layer_types, self.rows)}  # one instance per kind
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.device = limits.device
        self.dtype = dtype
        self.pattern = WritePattern()

    @property
    def padded_prefill_exact(self) -> bool:
        """Whether right-padded prompts of different lengths may share one prefill forward."""
        return all(kind.PADDED_PREFILL_EXACT for kind in self.kinds.values())

    def view(self) -> "SlotKVCache":
        """The same rows with a write pattern of its own, so two threads can run forwards at once on
        disjoint rows (prefill of joining rows while the running rows decode)."""
        other = copy.copy(self)
        other.pattern = WritePattern()
        return other

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for rows in self.rows for t in rows.tensors())

    def prepare_prefill(self, first_row: int, lengths: torch.Tensor, width: int) -> None:
        """Rows `first_row..+len(lengths)` get positions `0..width-1` (right-padded to `width`)."""
        self.pattern = WritePattern(rows=slice(first_row, first_row + len(lengths)), lengths=lengths, kv_len=width)

    def prepare_decode(self, num_rows: int, write_index: torch.Tensor, kv_len: int) -> None:
        """Rows `0..num_rows-1` each write one token at their own `write_index[row]`."""
        row_ids = self.pattern.row_ids
        if row_ids is None or row_ids.numel() != num_rows:
            row_ids = torch.arange(num_rows, device=self.device)
        self.pattern = WritePattern(rows=slice(0, num_rows), write_index=write_index, row_ids=row_ids, kv_len=kv_len)

    def masks(self, dtype: torch.dtype) -> dict[str, torch.Tensor | None]:
        """The attention mask of the prepared forward for each layer type present."""
        p = self.pattern
        if p.is_prefill:
            return {name: kind.prefill_mask(p, p.kv_len, dtype) for name, kind in self.kinds.items()}
        return {name: kind.decode_mask(p, dtype) for name, kind in self.kinds.items()}

    # Called by transformers' attention layers.
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.rows[layer_idx].update(key_states, value_states, self.pattern)

    # Called by transformers' gated-delta-net layers.
    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.rows[layer_idx].conv_state(self.pattern)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        return self.rows[layer_idx].update_conv(conv_states, self.pattern)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.rows[layer_idx].recurrent_state(self.pattern)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        self.rows[layer_idx].update_recurrent(recurrent_states, self.pattern)

    def is_recording_past(self, layer_idx: int) -> bool:
        return False  # rows keep only the latest state (no speculative rollback)

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Move one sequence (first `length` cached tokens) from row `src` to row `dst` in every layer."""
        for rows in self.rows:
            rows.move_row(src, dst, length)

    # The parts of transformers' Cache interface that code paths outside our forward may ask for.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.pattern.kv_len

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_model_len

    def __len__(self) -> int:
        return len(self.rows)
