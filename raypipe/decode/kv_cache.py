"""A slot KV cache: memory for `max_num_seqs x max_model_len` tokens, allocated once.

Each running sequence owns one slot (a row of every layer's K and V tensor). The engine keeps the
running batch compact — batch row i is slot i — so the model always sees a view of the first
`n` rows and no gather is needed. A request joining takes the next free row (nothing moves); a
request leaving has the last row's cache copied into its row (one sequence's tokens, never the
whole batch).

It is a transformers `Cache`, so transformers' attention layers call `update` themselves; the
engine sets the write pattern before each forward with `prepare_prefill` / `prepare_decode` and
passes a 4-D mask it builds (transformers passes 4-D masks through untouched).
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import Cache


class SlotKVCache(Cache):
    def __init__(self, *, num_layers: int, max_num_seqs: int, max_model_len: int, num_kv_heads: int,
                 head_dim: int, device: torch.device, dtype: torch.dtype):
        super().__init__(layers=[])
        shape = (max_num_seqs, num_kv_heads, max_model_len, head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.dtype = dtype
        # Write pattern of the next forward (see prepare_*).
        self._rows = slice(0, 0)
        self._write_index: torch.Tensor | None = None
        self._row_ids: torch.Tensor | None = None
        self._kv_len = 0

    def view(self) -> "SlotKVCache":
        """The same K/V tensors with a write pattern of its own, so two threads can run forwards at
        once on disjoint rows (prefill of joining rows while the running rows decode)."""
        other = copy.copy(self)
        other._rows, other._write_index, other._row_ids, other._kv_len = slice(0, 0), None, None, 0
        return other

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def prepare_prefill(self, first_row: int, num_rows: int, length: int) -> None:
        """Rows `first_row..+num_rows` get positions `0..length-1` written (right-padded prompts)."""
        self._rows = slice(first_row, first_row + num_rows)
        self._write_index = None
        self._kv_len = length

    def prepare_decode(self, num_rows: int, write_index: torch.Tensor, kv_len: int) -> None:
        """Rows `0..num_rows-1` each write one token at their own `write_index[row]`."""
        self._rows = slice(0, num_rows)
        self._write_index = write_index
        if self._row_ids is None or self._row_ids.numel() != num_rows:
            self._row_ids = torch.arange(num_rows, device=self.device)
        self._kv_len = kv_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self._write_index is None:
            q_len = key_states.shape[2]
            keys[self._rows, :, :q_len] = key_states
            values[self._rows, :, :q_len] = value_states
        else:
            keys[self._row_ids, :, self._write_index] = key_states[:, :, 0]
            values[self._row_ids, :, self._write_index] = value_states[:, :, 0]
        return keys[self._rows, :, : self._kv_len], values[self._rows, :, : self._kv_len]

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy one sequence's first `length` cached tokens from row `src` to row `dst`."""
        for keys, values in zip(self.keys, self.values):
            keys[dst, :, :length] = keys[src, :, :length]
            values[dst, :, :length] = values[src, :, :length]

    # The parts of transformers' Cache interface that code paths outside our forward may ask for.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_model_len

    def __len__(self) -> int:
        return len(self.keys)


def prefill_mask(lengths: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """`(B, 1, L, L)` additive mask for right-padded prompts: causal, and no key past a row's end.

    Padded query rows still see their row's real keys, so no softmax row is all -inf (NaN-free).
    """
    pos = torch.arange(length, device=lengths.device)
    allowed = (pos[None, :] <= pos[:, None])[None] & (pos[None, None, :] < lengths[:, None, None])
    return _additive(allowed[:, None], dtype)


def decode_mask(write_index: torch.Tensor, kv_len: int, dtype: torch.dtype) -> torch.Tensor:
    """`(B, 1, 1, kv_len)` additive mask: each row sees its keys up to and including the new one."""
    pos = torch.arange(kv_len, device=write_index.device)
    allowed = pos[None, :] <= write_index[:, None]
    return _additive(allowed[:, None, None], dtype)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # min-of-dtype, not -inf: eager attention adds the mask and -inf - -inf would be NaN.
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)
