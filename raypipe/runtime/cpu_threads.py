"""Torch CPU threads in an engine process: one thread of the process owns OpenMP workers.

Each OS thread that runs a parallel torch op gets its own OpenMP team, and the team's workers stay for the
thread's life. libgomp lets a waiting worker spin ~300,000 times before it sleeps, but only 100 times once
the process holds more OpenMP threads than CPUs (libgomp's `GOMP_SPINCOUNT` documentation): from then on,
every parallel op of a decode step waits for a sleeping worker to wake. A decode engine has three threads
that could own teams (the one that loaded the model, the engine thread, the prefill thread); measured on
`small` (2 CPUs, 16 rows, K=8, eager), a decode round took 356-371 ms with all three against 291-302 ms
with one. So the engine thread loads the model and runs every forward that uses several threads, and the
engine's helper threads run torch on one thread each (`single_threaded`).

`torch.set_num_threads` sets the calling thread's count, and the count a thread takes when it first runs
a torch op (the last one set in the process), so a helper thread is set explicitly, never left to inherit.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def single_threaded():
    """Run the block's torch ops on this thread alone, without an OpenMP team (work an engine does outside its
    own thread: reading an adapter, a request's embedding rows and positions in the caller's thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
