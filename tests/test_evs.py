"""EVS pruning rule (`raypipe.models.evs`) against a plain per-token statement of the same rule."""

from __future__ import annotations

import math

import pytest
import torch

from raypipe.errors import InvalidInput
from raypipe.models import evs


def reference_mask(embeds: torch.Tensor, groups: int, rate: float) -> list[bool]:
    """The rule as the issue states it, one token at a time: keep the first group whole, then the
    tokens least similar to the same position one group earlier, `max(P, int(T*P*(1-q)))` in all,
    ties to the earlier token."""
    per = embeds.shape[0] // groups
    keep = max(per, int(groups * per * (1 - rate)))
    scored = []
    for t in range(groups):
        for p in range(per):
            row = t * per + p
            if t == 0:
                score = math.inf
            else:
                a, b = embeds[row].double(), embeds[row - per].double()
                score = 1.0 - float(a @ b / (a.norm() * b.norm()))
            scored.append((-score, row))
    kept = {row for _, row in sorted(scored)[:keep]}
    return [row in kept for row in range(embeds.shape[0])]


@pytest.mark.parametrize("groups,per,rate", [(1, 4, 0.5), (2, 4, 0.5), (5, 6, 0.75), (8, 9, 0.3), (3, 16, 0.99)])
def test_mask_keeps_the_first_group_and_the_planned_count(groups, per, rate):
    torch.manual_seed(groups * 100 + per)
    embeds = torch.randn(groups * per, 12)
    if groups > 1:
        embeds[per:2 * per] = embeds[:per] + 1e-3 * torch.randn(per, 12)  # group 1 barely moves: pruned first
    mask = evs.retention_mask(embeds, groups, rate)
    assert int(mask.sum()) == evs.retained_count(groups, per, rate) == max(per, int(groups * per * (1 - rate)))
    assert mask[:per].all()
    assert mask.tolist() == reference_mask(embeds, groups, rate)


def test_rate_zero_keeps_everything():
    embeds = torch.randn(24, 8)
    assert evs.retained_count(4, 6, 0.0) == 24
    assert evs.retention_mask(embeds, 4, 0.0).all()


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5, float("nan"), "0.5", True])
def test_bad_rates_are_refused(rate):
    with pytest.raises(InvalidInput) as err:
        evs.check_rate(rate)
    assert err.value.code == "invalid_video_pruning_rate"
