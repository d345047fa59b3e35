"""The benches' background sampler outlives a failed look (found when `raypipe bench cluster`'s second
cycle asked Serve for its status through the client cached from the first cycle's, gone, cluster:
the sampling thread died and the cycle waited out its 300 s timeout on samples that never came)."""

from __future__ import annotations

import time

from raypipe.bench.common import Sampler


class FailsThenCounts(Sampler):
    def __init__(self, failures: int):
        super().__init__(period_s=0.01)
        self.calls = 0
        self.failures = failures

    def sample(self) -> tuple:
        self.calls += 1
        if self.calls <= self.failures:
            raise RuntimeError("Can't find actor: it might be dead or it's from a different cluster")
        return (self.calls,)


def test_a_failed_look_is_recorded_and_sampling_goes_on():
    sampler = FailsThenCounts(failures=3).start()
    deadline = time.monotonic() + 10
    while len(sampler.samples) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop()
    assert len(sampler.errors) == 3 and "different cluster" in sampler.errors[0]
    assert [count for _, count in sampler.samples[:2]] == [4, 5]
