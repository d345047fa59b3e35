"""What every rank shares: a `ModelRunner` over this rank's shard, and the round messages that mirror sequences.

Each rank is an ordinary `decode.model_runner.ModelRunner` whose language model is this rank's
shard (`shards.WeightShard`) and whose cache holds this rank's heads (`RankAdapter.text_config`):
the runner's prefill and decode code is the same on every rank, so every rank issues the same
collectives in the same order. Rank 0 sends a round's work as messages of plain data; the other
ranks rebuild `Sequence`s from them with only the fields the runner reads (`prefill_fields`,
`decode_fields`).
"""

from __future__ import annotations

import os

import torch

from raypipe.decode.sequence import Sequence
from raypipe.parallel.shards import WeightShard, sharded_parameter_bytes
from raypipe.parallel.step3_shards import Step3Shard

# Text models sharded by a rule of raypipe's own instead of their config's plan (model_type -> rule).
OWN_RULES = {"step3p5": Step3Shard}


def weight_shard(text_config, rank: int, world_size: int, collectives, expert_split: str = "experts"):
    """Rank `rank`'s sharding rule: the family's own (`OWN_RULES`), else the checkpoint's plan (`WeightShard`,
    whose experts are split whole: `EngineConfig.expert_split` "tensor" is built for the own rules only)."""
    rule = OWN_RULES.get(text_config.model_type)
    if rule is not None:
        return rule(text_config, rank, world_size, collectives, expert_split)
    if expert_split != "experts" and getattr(text_config, "num_experts", 0):
        raise ValueError(f"expert_split {expert_split!r} is built for Step3 only; {type(text_config).__name__}'s "
                         f"experts are split whole across ranks (expert_split 'experts')")
    return WeightShard(text_config, rank, world_size, collectives)


class RankAdapter:
    """The two things `ModelRunner` asks its language adapter for, as one rank sees them."""

    def __init__(self, adapter, shard):
        self.adapter, self.shard = adapter, shard
        self.text_config = shard.local_text_config(adapter.text_config)

    def load_model(self, device: torch.device, dtype: torch.dtype):
        return self.adapter.load_model(device, dtype, shard=self.shard)


def prefill_fields(seq: Sequence) -> dict:
    """What a rank needs to prefill `seq`'s chunk of this round (its prompt, positions and visual rows, the
    state snapshots to take inside it, its LoRA adapter's slot)."""
    return dict(request_id=seq.request_id, prompt_ids=seq.prompt_ids, positions=seq.positions,
                rope_delta=seq.rope_delta, visual_embeds=seq.visual_embeds, output_ids=seq.output_ids, row=seq.row,
                block_table=seq.block_table, window_table=seq.window_table, num_computed=seq.num_computed,
                chunk_len=seq.chunk_len, snapshot_saves=seq.snapshot_saves, lora_slot=seq.lora_slot)


def decode_fields(seq: Sequence) -> dict:
    """What a rank needs for `seq`'s decode steps: its length, last token, block tables, rope offset, the
    state snapshot it takes where a step crosses a block boundary and its LoRA adapter's slot."""
    return dict(request_id=seq.request_id, prompt_ids=seq.prompt_ids, positions=None, rope_delta=seq.rope_delta,
                visual_embeds=None, output_ids=seq.output_ids, row=seq.row, block_table=seq.block_table,
                window_table=seq.window_table, num_computed=seq.num_computed, snapshot_saves=seq.snapshot_saves,
                lora_slot=seq.lora_slot)


def mirror(fields: dict) -> Sequence:
    return Sequence(params=None, deliver=None, **fields)


def rank_info(rank: int, runner, collective_seconds: float = 0.0) -> dict:
    """What a rank reports about itself, measured in its own process: pid, device, parameter bytes (decoder
    layers / the rest), its pool (blocks, bytes), resident memory and seconds spent in collectives."""
    return {"rank": rank, "pid": os.getpid(), "device": str(runner.device), "num_blocks": runner.cache.num_blocks,
            "parameter_bytes": sharded_parameter_bytes(runner.model), "kv_cache_bytes": runner.cache.nbytes,
            # bytes this process read from the checkpoint for its shard (families that count them: Step3)
            "checkpoint_bytes_read": getattr(runner.model, "checkpoint_bytes_read", None),
            "rss_bytes": _resident_bytes(), "collective_seconds": collective_seconds}


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
