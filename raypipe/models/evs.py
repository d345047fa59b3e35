"""EVS (efficient video sampling): drop the video tokens that barely changed since the previous frame group.

A video's embedding is `num_groups` frame groups of `tokens_per_group` rows, the same spatial
positions in the same order in every group. A token whose embedding is close (cosine) to the token
at the same position one group earlier adds little; with `rate` q the most similar ones go,
keeping `retained_count` tokens. The first group has no predecessor and is always kept whole.

How many tokens survive depends on the geometry alone, so the prompt's placeholders are planned
before encoding; which ones survive is decided from the embeddings after. Positions are the family's
(Qwen2.5-VL: the survivors keep those of the unpruned video; Qwen3-VL: `qwen3_vl/positions.py`).
The rule follows vLLM's `video_pruning_rate` (vllm/multimodal/evs.py): count
`max(tokens_per_group, int(total * (1 - q)))`, ties broken towards earlier tokens. The dissimilarity is
taken over the whole row the tower yields: for Qwen3-VL that is the merger's output and every deepstack
level side by side, as vLLM's `compute_retention_mask` gets them (its Qwen3-VL tower returns them
concatenated), and pruning rows prunes every level alike.

Where the kept count goes in the prompt depends on how the family lays a video out (`run_counts`): one
run (Qwen2.5-VL) holds all of it; one run per temporal group (Qwen3-VL, each after its `<t seconds>`)
gets vLLM's Qwen3-VL split (`Qwen3VLMultiModalProcessor._get_prompt_updates`): the first group whole,
the rest spread evenly over the other groups, the remainder one each to the earliest. The kept rows then
fill the runs in order, whichever groups they came from.
"""

from __future__ import annotations

import torch

from raypipe.errors import InvalidInput

_FIRST_GROUP = 4.0  # above any cosine dissimilarity (at most 2): the first group always ranks first


def check_rate(rate: float, item: str = "video_pruning_rate") -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate < 1.0:
        raise InvalidInput(f"video_pruning_rate must be a number in [0, 1), got {rate!r}", item=item,
                           code="invalid_video_pruning_rate")
    return float(rate)


def retained_count(num_groups: int, tokens_per_group: int, rate: float) -> int:
    """Tokens a video of this geometry keeps at pruning `rate` (all of them at rate 0)."""
    total = num_groups * tokens_per_group
    if rate <= 0:
        return total
    return max(tokens_per_group, int(total * (1.0 - rate)))


def run_counts(runs: list[int], num_groups: int, rate: float) -> list[int]:
    """Tokens each placeholder run of a video of `num_groups` groups keeps (its `runs`: one run, or one per
    group); a run may plan 0 tokens (Qwen3-VL's later groups at high rates)."""
    if len(runs) == 1:
        return [retained_count(num_groups, runs[0] // num_groups, rate)]
    if len(runs) != num_groups or len(set(runs)) != 1:
        raise InvalidInput("EVS (video_pruning_rate) is not supported for this model's video layout",
                           item="video_pruning_rate", code="invalid_video_pruning_rate")
    per = runs[0]
    rest, remainder = divmod(retained_count(num_groups, per, rate) - per, max(num_groups - 1, 1))
    return [per] + [rest + (g < remainder) for g in range(num_groups - 1)]


def retention_mask(embeds: torch.Tensor, num_groups: int, rate: float) -> torch.Tensor:
    """`(rows,)` bool: which rows of one video's `(num_groups * tokens_per_group, hidden)` embedding stay."""
    rows = embeds.shape[0]
    tokens_per_group = rows // num_groups
    if rate <= 0:
        return torch.ones(rows, dtype=torch.bool)
    grouped = embeds.float().reshape(num_groups, tokens_per_group, -1)
    dissimilarity = torch.full((num_groups, tokens_per_group), _FIRST_GROUP)
    dissimilarity[1:] = 1.0 - torch.nn.functional.cosine_similarity(grouped[1:], grouped[:-1], dim=-1)
    order = torch.argsort(dissimilarity.reshape(-1), descending=True, stable=True)
    mask = torch.zeros(rows, dtype=torch.bool)
    mask[order[: retained_count(num_groups, tokens_per_group, rate)]] = True
    return mask
