"""One language model over several devices: a tensor-parallel decode group of Ray actors.

`runner_factory(config)` is what `LLMEngine` takes for `EngineConfig.tensor_parallel_size > 1`:
rank 0 (the engine's own process) schedules and samples; ranks 1..N-1 are `RankWorker` actors in
one placement group that run the same forwards on their shards (`group.py`, `worker.py`). The
weights are split by the checkpoint's own tensor-parallel plan (`shards.py`); ranks talk through
one torch.distributed process group (`collectives.py`: gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import functools


def runner_factory(config):
    """What `LLMEngine(..., runner_factory=...)` takes for `config` (an `EngineConfig`): None (one device,
    the engine's own `ModelRunner`) or rank 0's `GroupRunner` for `config.tensor_parallel_size` ranks."""
    if config.tensor_parallel_size == 1:
        return None
    from raypipe.parallel.leader import GroupRunner

    return functools.partial(GroupRunner, tensor_parallel_size=config.tensor_parallel_size,
                             num_threads=config.num_threads, expert_split=config.expert_split)
