"""Rank 0: the engine's `ModelRunner` for a tensor-parallel group.

The engine in rank 0's process schedules, samples and streams as with one device; its runner is
this `GroupRunner`, which sends each piece of work to the other ranks before running it itself:

    prefill (a group of chunks)   -> ("prefill", the chunks' sequences)   once per prefill group
    decode (K steps of a round)   -> ("decode", the rows, K)              once per round
                                     then after each step the sampled ids and whether the round ends
    move_rows                     -> ("move", moves)
    restore (prefix hits)         -> ("restore", (slot, row) pairs)
    write_lora_slots              -> ("lora", max_loras, max_lora_rank, (slot, whole adapter) pairs)
    use_static_step (at start)    -> ("static", batch buckets, KV buckets), then ("warmup",)

so the plan travels once per round and a step adds one broadcast of `rows + 1` ids next to the
layers' all-reduces.

Row-state snapshots (a hybrid family's prefix caching, `decode/snapshot_pool.py`) are mirrored: every
rank holds rank 0's number of snapshot slots, each slot holding that rank's heads' state. A take
(row r's state at position p into slot s) is part of the sequence's fields in the prefill or decode
message (`Sequence.snapshot_saves`), so every rank copies at the same point of the same forward; a
restore (slot s into row r) is its own message before the round's forwards; a drop is bookkeeping on
rank 0 only (the slot is simply written again later).

LoRA adapter slots are mirrored the same way: the engine assigns slots on rank 0 and writes them at its
round boundary; the write goes to every rank with the adapters' whole factors (one broadcast), and
each rank cuts them to its own layers' parts (`models/lora.py`), as it read its weights. Sending each
rank only its part would save less than half the bytes (a column-parallel layer's A and a
row-parallel layer's B are whole on every rank) and rank 0 would need every rank's shard plan. A
row's slot travels in its prefill and decode fields, so every rank applies the same rows' slots.

Sampling happens on rank 0 only (every sampler feature, grammars included,
as with one device); the other ranks take its ids as their next input.

The engine may prefill on one thread while it decodes on another; a group runs the two one after
the other (a lock), because the ranks must issue their collectives in one order. For the same
reason rank 0 reads each step's ids on the host before the next step (no step-late copy on CUDA),
and on CUDA decode steps run eager (CUDA graphs would hold the NCCL all-reduces: not verified on a GPU yet). On
a CPU a compiled static step (`compiled_decode=True`) runs on every rank: each builds it over its own shard and
cache and warms it up beside rank 0 (messages `static`, `warmup`); torch.compile breaks its graph at each gloo
all-reduce and compiles the pieces between.

Any exception inside group work leaves the ranks out of step: the group is then `failed`, this and
every later call raises `GroupFailed` (a retryable `CapacityError`, HTTP 503), and whoever owns the
engine starts a new one with a new group (`serve.decoder`).
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch

from raypipe.decode.model_runner import ModelRunner
from raypipe.errors import GroupFailed
from raypipe.parallel.collectives import Collectives
from raypipe.parallel.group import RankGroup
from raypipe.parallel.rank_runner import RankAdapter, decode_fields, prefill_fields, rank_info, weight_shard

log = logging.getLogger(__name__)


class GroupRunner(ModelRunner):
    def __init__(self, adapter, *, tensor_parallel_size: int, num_threads: int | None, expert_split: str,
                 **runner_kwargs):
        device = torch.device(runner_kwargs["device"])
        self.collectives = Collectives(0, tensor_parallel_size, device)
        super().__init__(RankAdapter(adapter, weight_shard(adapter.text_config, 0, tensor_parallel_size,
                                                          self.collectives, expert_split)), **runner_kwargs)
        self.cuda = False  # ids read on the host after every step: the ranks' collectives stay in one order
        self._lock = threading.Lock()
        self.decode_collective_seconds = 0.0  # of collectives.seconds, inside decode rounds (the benchmark's share)
        # The other ranks get this pool's exact size, its blocks and its snapshot slots (on CUDA free memory
        # differs per device).
        rank_kwargs = dict(runner_kwargs, pool=self.pool, device=None)
        self.group = RankGroup.start(str(adapter.checkpoint), self.collectives, rank_kwargs, num_threads, expert_split)

    def use_static_step(self, batch_buckets=None, kv_buckets=None) -> str | None:
        """Every rank builds the same static step (its own shard and cache) and warms it up beside rank 0's
        (`warm_up_static_step`): their forwards issue the same all-reduces in the same order."""
        if self.device.type == "cuda":
            return "a tensor-parallel group on CUDA runs eager decode steps (CUDA graphs holding NCCL all-reduces " \
                   "are not verified on a GPU yet)"
        with self._group_work("static step"):
            self.collectives.broadcast_object(("static", batch_buckets, kv_buckets))
            return super().use_static_step(batch_buckets, kv_buckets)

    def warm_up_static_step(self) -> float:
        """A warm-up that fails leaves the ranks out of step: the group fails (GroupFailed) and the engine with it."""
        with self._group_work("static step warm-up"):
            self.collectives.broadcast_object(("warmup",))
            return super().warm_up_static_step()

    def prefill(self, seqs, sampled, batch):
        with self._group_work("prefill"):
            self.collectives.broadcast_object(("prefill", [prefill_fields(s) for s in seqs]))
            return super().prefill(seqs, sampled, batch)

    def decode(self, seqs, batch, steps, on_step):
        def shared(step: int, ids: list[int]) -> bool:
            stop = on_step(step, ids)
            self.collectives.broadcast_ids(torch.tensor([*ids, int(stop)], dtype=torch.long))
            return stop

        with self._group_work("decode"):
            before = self.collectives.seconds
            self.collectives.broadcast_object(("decode", [decode_fields(s) for s in seqs], steps))
            try:
                return super().decode(seqs, batch, steps, shared)
            finally:
                self.decode_collective_seconds += self.collectives.seconds - before

    def move_rows(self, moves) -> None:
        if not moves:
            return
        with self._group_work("move"):
            self.collectives.broadcast_object(("move", moves))
            super().move_rows(moves)

    def restore(self, restores) -> None:
        if not restores:
            return
        with self._group_work("restore"):
            self.collectives.broadcast_object(("restore", restores))
            super().restore(restores)

    def write_lora_slots(self, writes) -> None:
        if not writes:
            return
        with self._group_work("lora"):
            slots = self.lora_slots
            self.collectives.broadcast_object(("lora", slots.max_loras, slots.max_lora_rank, writes))
            super().write_lora_slots(writes)

    @contextlib.contextmanager
    def _group_work(self, what: str):
        with self._lock:
            if self.failed is not None:
                raise GroupFailed(f"the decode group failed earlier ({self.failed!r}); it is restarting, retry")
            try:
                yield
            except Exception as exc:
                self.failed = exc
                log.error("decode group failed during %s: %r", what, exc)
                raise GroupFailed(f"a rank of the decode group failed during {what}: {exc}; retry") from exc

    def info(self) -> list[dict]:
        """Per rank (0 first): `rank_info`, and rank 0's seconds in collectives during decode rounds."""
        own = dict(rank_info(0, self, self.collectives.seconds), decode_collective_seconds=self.decode_collective_seconds)
        return [own, *self.group.info()]

    def close(self) -> None:
        with self._lock:
            if self.failed is None:
                with contextlib.suppress(Exception):
                    self.collectives.broadcast_object(("stop",))
            self.failed = self.failed or RuntimeError("closed")
        self.group.stop()
