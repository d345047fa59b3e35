"""The language model, its cache and the two batched forwards: prefill and a K-step decode round.

`prefill` runs one group of prefill chunks (the scheduler groups them by length) as one
right-padded batch into their blocks and rows, and samples the first token of each sequence whose
prompt it completes. A chunk starts where the sequence's cached tokens end (a cached prefix, an
earlier chunk, or 0): its positions and visual rows are those of its tokens in the whole prompt.
Rows of different lengths share the forward in every layer kind (a linear-attention row's state is
taken at its own end). State snapshots to take inside a chunk (`Sequence.snapshot_saves`) are filled by the
same forward (`WritePattern.captures`: gated-delta-net layers hand over their conv and recurrent state
there, `models/delta_net_prefill.py`), so no forward is split at a snapshot.
A snapshot at the chunk's end is a copy of the row after the forward; decode copies a row's state at
the step where it crosses its planned block boundary.
`decode` runs K steps for the whole running batch: every step feeds the previous
step's sampled ids (still on the device) back in, so the model never waits for the host.
Sampled ids go to the host per step for the stop check: on CUDA through pinned memory on a side
stream, read one step late so the copy overlaps the next step's kernels; on CPU directly.
With `use_static_step` a decode step's forward and logits run through `compiled_step` (bucketed
static shapes; torch.compile on CPU, CUDA graphs on GPU) instead of eagerly, LoRA rows included.
With LoRA adapters (`use_loras`) every forward, prefill or decode, sets its rows' adapter slots first
(`models/lora.py`); a batch of base rows only sets none and runs the base layers alone.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from raypipe.decode import attention, compiled_forward, compiled_step, round_reuse
from raypipe.decode.cache_kinds import LinearAttentionRows
from raypipe.decode.kv_cache import KVCache, block_tables, layer_types, paged_bytes_per_token
from raypipe.decode.kv_pool_size import PoolShape, pool_blocks
from raypipe.decode.sampler import SamplingBatch, sample
from raypipe.decode.sequence import Sequence, TokenLogprob
from raypipe.decode.sliding_window import window_bytes_per_token, window_pool_shape
from raypipe.models import lora, packed_linear, packed_siblings

PROMPT_LOGPROB_POSITIONS = 256  # positions whose full-vocabulary log-probabilities are held at once
SHARED_MIN_BLOCKS = 1  # a round's rows read leading blocks they all share once, from this many

# on_step(step, ids) -> True when every row is done and the round may end early.
StepCallback = Callable[[int, list[int]], bool]


class ModelRunner:
    # Hooks for a runner that spans devices (raypipe.parallel): its failure, if its devices failed.
    failed: BaseException | None = None

    def __init__(self, language_adapter, *, device: torch.device, dtype: torch.dtype, max_num_seqs: int,
                 max_model_len: int, num_scheduler_steps: int, block_size: int, kv_cache_memory: int | None,
                 kv_cache_free_memory_fraction: float, state_snapshot_fraction: float, max_num_batched_tokens: int,
                 pool: PoolShape | None = None):
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = language_adapter.load_model(self.device, dtype)
        attention.use_engine_attention(self.model.model)
        text = language_adapter.text_config
        self.vocab_size = text.vocab_size
        self.max_model_len = max_model_len
        self.bytes_per_token = paged_bytes_per_token(text, dtype)
        self.window_bytes_per_token = window_bytes_per_token(text, dtype)
        state_bytes = 0
        if pool is None:
            num_blocks, state_bytes, window_blocks = self._size_pool(
                text, block_size=block_size, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                kv_cache_memory=kv_cache_memory, kv_cache_free_memory_fraction=kv_cache_free_memory_fraction,
                state_snapshot_fraction=state_snapshot_fraction, num_scheduler_steps=num_scheduler_steps,
                max_num_batched_tokens=max_num_batched_tokens)
        else:
            num_blocks, window_blocks = pool.num_blocks, pool.window_blocks
        self.cache = KVCache(text, max_num_seqs=max_num_seqs, max_model_len=max_model_len, num_blocks=num_blocks,
                             block_size=block_size, device=self.device, dtype=dtype, window_blocks=window_blocks)
        state = self.cache.state_bytes_per_row
        self.num_snapshots = pool.num_snapshots if pool else state_bytes // state if state else 0
        self.cache.allocate_snapshots(self.num_snapshots)
        self.pool = PoolShape(num_blocks, window_blocks, self.num_snapshots)
        self.placeholder_ids = set(self.model.placeholder_ids.tolist())
        self.prefill_cache = self.cache.view()  # prefill may run on another thread than decode
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(self.device)
            self.host_ids = torch.empty((num_scheduler_steps, max_num_seqs), dtype=torch.long, pin_memory=True)
        self.static_step: compiled_step.StaticDecodeStep | None = None
        self.compiled_forward: compiled_forward.CompiledForward | None = None  # eager rounds' forwards, compiled
        self.lora_slots: lora.LoraSlots | None = None
        self._kept_round: round_reuse.KeptRound | None = None  # what the last eager decode round left

    def _size_pool(self, text, *, block_size: int, max_num_seqs: int, max_model_len: int,
                   kv_cache_memory: int | None, kv_cache_free_memory_fraction: float,
                   state_snapshot_fraction: float, num_scheduler_steps: int,
                   max_num_batched_tokens: int) -> tuple[int, int, int]:
        """Full-attention blocks, snapshot bytes and window blocks from the memory budget (`kv_pool_size.py`)."""
        has_rows = LinearAttentionRows.layer_type in layer_types(text)  # the kind that keeps row state
        return pool_blocks(
            device=self.device, bytes_per_token=self.bytes_per_token, block_size=block_size,
            max_num_seqs=max_num_seqs, max_model_len=max_model_len, kv_cache_memory=kv_cache_memory,
            kv_cache_free_memory_fraction=kv_cache_free_memory_fraction,
            state_fraction=state_snapshot_fraction if has_rows else 0.0,
            window_bytes_per_token=self.window_bytes_per_token,
            **window_pool_shape(text, block_size=block_size, max_model_len=max_model_len,
                                num_scheduler_steps=num_scheduler_steps, max_num_batched_tokens=max_num_batched_tokens))

    def use_loras(self, max_loras: int, max_lora_rank: int) -> None:
        """Give the model LoRA adapter slots (once; layers are wrapped as adapters are written)."""
        if self.lora_slots is None:
            self.lora_slots = lora.LoraSlots(self.model, max_loras, max_lora_rank, self.dtype, self.device)
            if self.static_step is not None:
                self.static_step.loras = self.lora_slots

    def wrap_lora_layers(self, names) -> None:
        """Wrap the linears adapters will target now, before a static step compiles or captures (`LoraSlots.wrap`)."""
        self._lora_layers_changed(self.lora_slots.wrap(names))

    def write_lora_slots(self, writes: list[tuple[int, lora.LoraWeights]]) -> None:
        """Put adapters into their slots `(slot, adapter)`: only where no forward runs (between rounds)."""
        for slot, adapter in writes:
            self._lora_layers_changed(self.lora_slots.write(slot, adapter))

    def _lora_layers_changed(self, changed: bool) -> None:
        if changed and self.static_step is not None:
            self.static_step.model_changed()

    def _lora_rows(self, seqs: list[Sequence]):
        """The context of a forward over `seqs` (row i = seqs[i]): their adapter slots, if any row has one."""
        if self.lora_slots is None or not any(s.lora_slot for s in seqs):
            return contextlib.nullcontext()
        return self.lora_slots.rows.using([s.lora_slot for s in seqs], self.dtype, self.device)

    def use_packed_weights(self) -> str:
        """Pack the language model's linears for oneDNN's CPU kernels (`models/packed_linear.py`; siblings
        sharing an input as one GEMM: `models/packed_siblings.py`); what was done."""
        dtype, how = packed_linear.compute_dtype(self.device, self.dtype)
        if dtype is None:
            return f"not packed: {how}"
        siblings = packed_siblings.pack_siblings(self.model, dtype)  # before the rest: it takes plain linears
        done = (f"{siblings + packed_linear.pack_linears(self.model, dtype)} linear layers {how} for oneDNN "
                f"({siblings} of them as q/k/v or gate/up siblings sharing a GEMM)")
        layers = list({id(layer): layer for layer in (
            getattr(module, "group", module) for module in self.model.modules()
            if isinstance(module, (packed_linear.PackedLinear, packed_siblings.SiblingLinear)))}.values())
        pays, plain, packed = packed_linear.plain_pays_at_one_row(layers)
        if not pays:
            packed_linear.drop_plain_weights(layers)
        extra = sum(layer.plain_weight.nbytes for layer in layers) if pays else 0
        return (f"{done}; one row at a time through {'plain' if pays else 'packed'} weights "
                f"({plain * 1e3:.2f} ms plain vs {packed * 1e3:.2f} ms packed, timed on the first "
                f"{packed_linear.ONE_ROW_TIMED_BYTES >> 20} MiB of them at most"
                + (f", {extra / 2**20:.1f} MiB kept" if pays else "") + ")")

    def use_static_step(self, batch_buckets: tuple[int, ...] | None = None,
                        kv_buckets: tuple[int, ...] | None = None) -> str | None:
        """Run decode steps through static-shape buckets from now on; the reason if it cannot."""
        reason = compiled_step.supports(self.cache)
        if reason is None:
            self.static_step = compiled_step.StaticDecodeStep(
                self.model, self.cache,
                batch_buckets=batch_buckets or compiled_step.batch_buckets_for(self.cache.max_num_seqs),
                kv_buckets=kv_buckets or compiled_step.kv_buckets_for(self.max_model_len))
            self.static_step.loras = self.lora_slots
        return reason

    def use_compiled_forward(self) -> str | None:
        """Run eager-path forwards (decode steps, prefills) compiled from now on (`compiled_forward.py`); the reason if
        they cannot."""
        reason = compiled_forward.supports(self.cache, self.device)
        if reason is None:
            self.compiled_forward = compiled_forward.CompiledForward(self.model, [self.cache, self.prefill_cache])
        return reason

    def drop_compiled_forward(self) -> None:
        """Back to eager forwards (a compiled forward that failed to compile)."""
        self.compiled_forward.release([self.cache, self.prefill_cache])
        self.compiled_forward = None

    def warm_up_compiled_forward(self) -> float:
        """Compile the compiled forward's graphs now; seconds taken."""
        start = time.perf_counter()
        self.compiled_forward.warm_up(self.cache, self.prefill_cache, self.dtype)
        return time.perf_counter() - start

    def warm_up_static_step(self) -> float:
        """Compile (CPU) or capture (CUDA) the static step's buckets now; seconds taken."""
        return self.static_step.warmup()

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], sampled: list[Sequence], batch: SamplingBatch | None) -> list[int]:
        """Compute the chunks of `seqs` (in their rows of the bounded cache kinds); first sampled ids of
        `sampled` (those whose prompt this completes, the rows of `batch`)."""
        if self._kept_round is not None and self._kept_round.holds_any(seqs):
            self._kept_round = None  # a recompute rewrites their K/V (round_reuse.py)
        order = [s for s in seqs if s in sampled]  # the logits' rows
        logits = self._prefill_logits(seqs, order)
        if not sampled:
            return []
        # One sampling call over the group's sampled rows, in the order of `sampled`.
        rows = logits[torch.tensor([order.index(s) for s in sampled], device=self.device)]
        return sample(rows, batch).tolist()

    @torch.inference_mode()
    def _prefill_logits(self, seqs: list[Sequence], sampled: list[Sequence]) -> torch.Tensor:
        """Last-position logits of `sampled` from a right-padded forward over the chunks of `seqs`."""
        ends = [s.num_computed + s.chunk_len for s in seqs]
        starts = [s.num_computed for s in seqs]
        lengths = [end - start for start, end in zip(starts, ends)]
        hidden = self._forward(seqs, starts, lengths)
        self._save_states(seqs, ends)
        for b, seq in enumerate(seqs):
            if seq.wants_prompt_logprobs:
                self._record_prompt_logprobs(seq, hidden[b, :lengths[b]], starts[b])
        rows = [seqs.index(s) for s in sampled]
        last = hidden[torch.tensor(rows, dtype=torch.long, device=self.device),
                      torch.tensor([lengths[r] - 1 for r in rows], dtype=torch.long, device=self.device)]
        return self.model.logits(last)

    def _record_prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor, start: int) -> None:
        """The log-probabilities this chunk's positions give the prompt tokens after them (position i predicts
        token i + 1), in slices of positions: all logits of a long chunk at once would not fit."""
        targets = seq.prompt_ids[start + 1: start + 1 + hidden.shape[0]]
        k = seq.params.prompt_logprobs
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = {}
        for lo in range(0, len(targets), PROMPT_LOGPROB_POSITIONS):
            ids = torch.tensor(targets[lo: lo + PROMPT_LOGPROB_POSITIONS], device=self.device)
            logprobs = self.model.logits(hidden[lo: lo + len(ids)]).float().log_softmax(dim=-1)
            chosen = logprobs.gather(-1, ids[:, None])[:, 0]
            ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
            top = logprobs.topk(k, dim=-1) if k else None
            top_ids, top_lps = (top.indices.tolist(), top.values.tolist()) if top is not None else ([[]] * len(ids), [[]] * len(ids))
            for i, (token, lp, rank) in enumerate(zip(ids.tolist(), chosen.tolist(), ranks.tolist())):
                seq.prompt_logprobs[start + 1 + lo + i] = TokenLogprob(token, lp, list(zip(top_ids[i], top_lps[i])),
                                                                       rank)

    def _forward(self, seqs: list[Sequence], starts: list[int], lengths: list[int]) -> torch.Tensor:
        """Final hidden states of one right-padded prefill forward: tokens `starts[b] .. + lengths[b]` of each."""
        width = max(lengths)
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        positions = torch.zeros((3, len(seqs), width), dtype=torch.long)
        visual = []
        for i, (seq, start, n) in enumerate(zip(seqs, starts, lengths)):
            tokens = seq.token_ids[start: start + n]
            ids[i, :n] = torch.tensor(tokens)
            positions[:, i, :n] = seq.positions_between(start, start + n)
            if seq.visual_embeds is not None:
                first = sum(t in self.placeholder_ids for t in seq.prompt_ids[:start])
                visual.append(seq.visual_embeds[first: first + sum(t in self.placeholder_ids for t in tokens)])
        visual_embeds = torch.cat(visual).to(self.device) if visual else None
        ids, positions = ids.to(self.device), positions.to(self.device)
        captures = [(b, point - start, slot) for b, (seq, start, n) in enumerate(zip(seqs, starts, lengths))
                    for point, slot in seq.snapshot_saves if start < point < start + n]
        self.prefill_cache.prepare_prefill([s.row for s in seqs], starts, lengths, [s.block_table for s in seqs],
                                           [s.window_table for s in seqs], captures)
        compiled = self.compiled_now()
        if compiled is not None and compiled.prefill_applies(width):
            return compiled.prefill(self.model.embed(ids, visual_embeds), positions,
                                    self.prefill_cache.masks(self.dtype), self.prefill_cache)
        with self._lora_rows(seqs):
            return self.model.prefill(ids, visual_embeds, positions, self.prefill_cache.masks(self.dtype),
                                      self.prefill_cache)

    def _save_states(self, seqs: list[Sequence], consumed: list[int]) -> None:
        """Copy the row state of each sequence that planned a snapshot where its chunk ended (snapshots
        inside the chunk were filled by the forward itself)."""
        for seq, position in zip(seqs, consumed):
            for point, slot in seq.snapshot_saves:
                if point == position:
                    self.prefill_cache.save_state(seq.row, slot)

    def restore(self, restores: list[tuple[int, int]]) -> None:
        """Copy snapshots into the rows of the sequences that continue from them: `(slot, row)`."""
        for slot, row in restores:
            self.cache.restore_state(slot, row)

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence], batch: SamplingBatch, steps: int, on_step: StepCallback) -> int:
        """Up to `steps` decode steps for the running batch `seqs` (row i = seqs[i]); steps run.

        Eager steps attend over the rows' K/V gathered once for the round (`KVCache.begin_decode_round`);
        the static-shape step gathers per step (its buffers must keep their shapes and addresses)."""
        longest = max(s.cache_len for s in seqs)
        width = -(-(min(longest + steps - 1, self.max_model_len - 1) + 1) // self.cache.block_size)
        tables = block_tables([s.block_table for s in seqs], width, self.device)
        window_tables = block_tables([s.window_table for s in seqs], width, self.device) if self.cache.window_blocks else None
        eager = self.static_step is None
        kept, self._kept_round = self._kept_round, None  # kept only for the round right after its own
        if eager:
            shared = self._shared_blocks(seqs)
            kept_rows = kept.rows_for(seqs, width, shared) if kept is not None else None
            capacity = kept.capacity_blocks if kept_rows is not None else width + round_reuse.SPARE_BLOCKS
            self.cache.begin_decode_round(tables, window_tables, shared, kept_rows, capacity - width)
        try:  # the static step sets its rows' adapter slots itself, per step (its shapes are the bucket's)
            with self._lora_rows(seqs) if eager else contextlib.nullcontext():
                steps_run = self._decode_steps(seqs, batch, steps, on_step, tables, window_tables)
        finally:
            if eager:
                self.cache.end_decode_round()
        if eager:
            self._kept_round = round_reuse.KeptRound.after(seqs, steps_run, shared, capacity, self.cache.block_size)
        return steps_run

    def _shared_blocks(self, seqs: list[Sequence]) -> int:
        """How many leading blocks every row of a round shares (one set of prefix-cache blocks), counted only where
        the engine's decode attention reads them once for all rows (CPU fp32: `decode/attention.py`) and there are
        at least `SHARED_MIN_BLOCKS`; only full blocks before every row's next token, which the round never writes."""
        if len(seqs) < 2 or self.device.type != "cpu" or self.dtype != torch.float32:
            return 0
        full = min(s.cache_len for s in seqs) // self.cache.block_size
        first = seqs[0].block_table
        shared = 0
        while shared < full and all(s.block_table[shared] == first[shared] for s in seqs):
            shared += 1
        return shared if shared >= SHARED_MIN_BLOCKS else 0

    def _decode_steps(self, seqs: list[Sequence], batch: SamplingBatch, steps: int, on_step: StepCallback,
                      tables: torch.Tensor, window_tables: torch.Tensor | None) -> int:
        n = len(seqs)
        tokens = torch.tensor([s.output_ids[-1] for s in seqs], device=self.device)
        cache_len = torch.tensor([s.cache_len for s in seqs], device=self.device)
        rope_delta = torch.tensor([s.rope_delta for s in seqs], device=self.device)
        lora_slots = [s.lora_slot for s in seqs] if self.lora_slots is not None else None
        longest = max(s.cache_len for s in seqs)
        # Row state to copy out after step s: a row that planned a snapshot where that step leaves it
        captures: dict[int, list[tuple[int, int]]] = {}
        for row, seq in enumerate(seqs):
            for point, slot in seq.snapshot_saves:
                captures.setdefault(point - seq.cache_len - 1, []).append((row, slot))
        pending: list[tuple[int, torch.cuda.Event]] = []
        for step in range(steps):
            # Rows already past the model length keep running until the round ends (their
            # tokens are dropped); clamping keeps their writes inside the cache.
            write_index = (cache_len + step).clamp_(max=self.max_model_len - 1)
            kv_len = min(longest + step, self.max_model_len - 1) + 1
            positions = (cache_len + step + rope_delta).view(1, n, 1).expand(3, n, 1)
            if self.static_step is not None:
                logits = self.static_step(tokens, positions, write_index, kv_len, tables, lora_slots, window_tables)
            else:
                self.cache.prepare_decode(n, write_index, kv_len, tables, window_tables)
                hidden = self._decode_forward()(self.model.embed(tokens[:, None]), positions,
                                                self.cache.masks(self.dtype), self.cache)
                logits = self.model.logits(hidden[:, -1])
            for row, slot in captures.get(step, ()):
                self.cache.save_state(row, slot)
            tokens = self.sample_step(logits, batch)
            if not self.cuda:
                if on_step(step, tokens.tolist()):
                    return step + 1
                continue
            pending.append((step, self._copy_to_host(step, tokens)))
            if len(pending) > 1 and self._drain_one(pending, n, on_step):
                return step + 1
        while pending:
            if self._drain_one(pending, n, on_step):
                break
        return steps

    def _decode_forward(self):
        """The model's forward for an eager step: compiled where it may run now (`compiled_now`)."""
        compiled = self.compiled_now()
        return self.model if compiled is None else compiled.decode

    def compiled_now(self) -> compiled_forward.CompiledForward | None:
        """The compiled forward, where set up, without adapters, and on the thread count it was compiled with. The
        engine's rounds then prefill before they decode, on its thread (`engine._prefill_then_decode`), so the
        thread count differs only for a forward run elsewhere (the prefill thread, a caller's `single_threaded`)."""
        compiled = self.compiled_forward
        return compiled if compiled is not None and self.lora_slots is None and compiled.applies() else None

    def _copy_to_host(self, step: int, tokens: torch.Tensor) -> "torch.cuda.Event":
        done = torch.cuda.Event()
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            self.host_ids[step, : tokens.shape[0]].copy_(tokens, non_blocking=True)
            done.record()
        tokens.record_stream(self.copy_stream)  # the sampler's buffer must outlive the async copy
        return done

    def _drain_one(self, pending: list, n: int, on_step: StepCallback) -> bool:
        step, done = pending.pop(0)
        done.synchronize()
        return on_step(step, self.host_ids[step, :n].tolist())

    def sample_step(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """A decode step's next ids (a rank of a tensor-parallel group takes rank 0's instead)."""
        return sample(logits, batch)

    def close(self) -> None:
        """Release what the runner holds besides tensors (a tensor-parallel group's other ranks)."""

    def move_rows(self, moves: list[tuple[int, int, int]]) -> None:
        for src, dst, length in moves:
            self.cache.move_row(src, dst, length)
