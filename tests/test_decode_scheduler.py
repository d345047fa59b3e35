"""Scheduler admission: joining prompts are prefilled in length groups with bounded padding."""

from __future__ import annotations

from types import SimpleNamespace

from raypipe.decode.scheduler import MAX_PADDING, Scheduler, group_by_length


def _seqs(lengths):
    return [SimpleNamespace(prompt_len=n, row=None) for n in lengths]


def test_groups_bound_padding_and_keep_every_sequence():
    seqs = _seqs([460, 82, 95, 270, 126, 83, 175, 271, 94, 127])
    groups = group_by_length(seqs, MAX_PADDING)
    assert sorted(id(s) for g in groups for s in g) == sorted(id(s) for s in seqs)
    for group in groups:
        real = sum(s.prompt_len for s in group)
        assert len(group) * max(s.prompt_len for s in group) <= (1 + MAX_PADDING) * real
    assert len(groups) < len(seqs)  # similar lengths do share a forward


def test_admitted_groups_take_consecutive_rows_after_the_running_batch():
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=1000)
    for seq in _seqs([300, 80, 290, 85]):
        scheduler.add(seq)
    scheduler.running = _seqs([10, 10])  # rows 0 and 1
    groups = scheduler.admit()
    rows = [s.row for g in groups for s in g]
    assert rows == [2, 3, 4, 5]
    assert [s.row for s in scheduler.running[2:]] == rows


def test_token_budget_counts_prompt_tokens_first_come_first_served():
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=500)
    first, second, third = _seqs([300, 150, 100])
    for seq in (first, second, third):
        scheduler.add(seq)
    joined = [s for g in scheduler.admit() for s in g]
    assert joined == [second, first]  # 450 tokens fit; the third waits even though it is short
    assert list(scheduler.waiting) == [third]
