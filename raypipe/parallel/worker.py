"""`RankWorker`: rank r > 0 of a decode group, a Ray actor that runs what rank 0 sends.

It holds its shard of the language model and its own paged pool (rank 0's number of blocks, its
own heads; rank 0's number of state snapshot slots), and on a thread of its own repeats: receive the
next message, run it through its `ModelRunner` exactly as rank 0 does (prefill chunks, a decode round,
row moves, snapshot restores, LoRA slot writes). It never samples:
each decode step's input ids (and whether the round ends) come from rank 0 after that step, and
its language model has no lm_head (logits are rank 0's).

A failure here (or rank 0 going away) ends the process: the other ranks' next collective then fails
at once instead of waiting for a rank that stopped answering.
"""

from __future__ import annotations

import logging
import os
import threading

import ray
import torch

from raypipe.decode.model_runner import ModelRunner
from raypipe.models.registry import language_adapter
from raypipe.parallel.collectives import Collectives
from raypipe.parallel.rank_runner import RankAdapter, mirror, rank_info, weight_shard
from raypipe.runtime.cpu_threads import forward_thread, single_threaded
from raypipe.runtime.device import pick_device

log = logging.getLogger(__name__)


class FollowerRunner(ModelRunner):
    """A rank's runner whose sampled ids are rank 0's, in a pool of rank 0's shape (`runner_kwargs["pool"]`)."""

    def __init__(self, adapter, collectives: Collectives, **runner_kwargs):
        super().__init__(adapter, **runner_kwargs)
        self.collectives = collectives
        self.cuda = False  # as rank 0 (leader.py): every step's ids on the host before the next step
        self.stop_round = False

    def sample_step(self, logits, batch) -> torch.Tensor:
        ids = self.collectives.broadcast_ids(torch.empty(logits.shape[0] + 1, dtype=torch.long))
        self.stop_round = bool(ids[-1])
        return ids[:-1].to(self.device)

    def on_step(self, step: int, ids: list[int]) -> bool:
        return self.stop_round


class RankWorker:
    def __init__(self, checkpoint: str, rank: int, world_size: int, runner_kwargs: dict, num_threads: int | None,
                 expert_split: str):
        # The rank's forwards run on its serving thread, which alone keeps OpenMP workers (runtime/cpu_threads.py)
        self.num_threads = num_threads or torch.get_num_threads()
        device = pick_device()
        adapter = language_adapter(checkpoint)
        self.collectives = Collectives(rank, world_size, device)
        with single_threaded():
            shard = weight_shard(adapter.text_config, rank, world_size, self.collectives, expert_split)
            self.runner = FollowerRunner(RankAdapter(adapter, shard), self.collectives,
                                         **dict(runner_kwargs, device=device))
        self.runner.model.lm_head = torch.nn.Identity()  # logits are rank 0's: this rank keeps no vocab matrix
        self.rank = rank

    def loaded(self) -> bool:
        return True

    def join(self, host: str, port: int, generation: str) -> None:
        self.collectives.connect(None, host, port, generation)
        threading.Thread(target=self._serve, name=f"raypipe-rank-{self.rank}", daemon=True).start()

    def info(self) -> dict:
        return rank_info(self.rank, self.runner, self.collectives.seconds)

    def _serve(self) -> None:
        forward_thread(self.num_threads)
        try:
            while True:
                kind, *args = self.collectives.broadcast_object()
                if kind == "stop":
                    return
                if kind == "prefill":
                    self.runner.prefill([mirror(f) for f in args[0]], [], None)
                elif kind == "decode":
                    rows, steps = args
                    self.runner.decode([mirror(f) for f in rows], None, steps, self.runner.on_step)
                elif kind == "move":
                    self.runner.move_rows(args[0])
                elif kind == "restore":
                    self.runner.restore(args[0])
                elif kind == "static":
                    self.runner.use_static_step(*args)
                elif kind == "warmup":
                    self.runner.warm_up_static_step()
                elif kind == "lora":
                    max_loras, max_lora_rank, writes = args
                    self.runner.use_loras(max_loras, max_lora_rank)
                    self.runner.write_lora_slots(writes)
        except BaseException:
            log.exception("rank %d of the decode group failed", self.rank)
            os._exit(1)


RemoteRankWorker = ray.remote(RankWorker)
