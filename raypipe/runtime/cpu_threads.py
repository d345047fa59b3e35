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

A thread that runs the engine's forwards also flushes denormal floats to zero (`forward_thread`).
"""

from __future__ import annotations

import contextlib

import torch


def forward_thread(num_threads: int) -> None:
    """Set up the calling thread to run model forwards: `num_threads` torch threads, and floats below fp32's
    normal range (~1.2e-38) flushed to zero, as inputs and as results (x86's DAZ and FTZ). Call it before the
    thread's first parallel op: its OpenMP workers, created then, start with the thread's float settings.

    Why: over long contexts most softmax weights are denormal (keys far below a row's best), and every multiply
    on a denormal takes the CPU's slow path. 16 rows decoding over a shared 1,900-token prompt spent half of each
    step in attention's GEMMs; flushed, a step took a third less (`small`, fp32, 2 cores). A flushed value is
    below half an fp32 ulp of any normal number it is summed with, so outputs move only where every term is
    denormal."""
    torch.set_flush_denormal(True)
    torch.set_num_threads(num_threads)


def single_threaded():
    """Run the block's torch ops on this thread alone, without an OpenMP team (work an engine does outside its
    own thread: reading an adapter, a request's embedding rows and positions in the caller's thread)."""
    return torch_threads(1)


@contextlib.contextmanager
def torch_threads(count: int):
    """Run the block's torch ops on `count` threads, then restore this thread's count."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
