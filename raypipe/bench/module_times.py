"""Where a model's forward time goes: wall time per module class, prefill and decode apart.

`ModuleTimes(model)` hooks every submodule of `model` (forward pre- and post-hooks) while it is open and adds up
each module's time from its own start to its own end, on whichever thread runs it (the engine's forwards run on
its threads, not the caller's). `seconds` includes the module's children, so those rows overlap (a decoder layer,
then its attention or gated delta net, then their linears); `self_seconds` leaves its submodules out: the work
written in the module's own forward (a gated delta net's recurrence, an attention's kernel call), and those rows
add up to the outermost forwards' time (`forward_seconds`). That is thread time: where the engine prefills on a
thread beside its decode, it exceeds the wall time the run took. The phase is the outermost module's: a forward
of one token per row is a decode step, any other a prefill (`_phase`). The hooks cost a few microseconds a module:
measure speed with them off, and read the shares here. Eager forwards only: dynamo guards on hooks, so they would
recompile a compiled forward.
"""

from __future__ import annotations

import collections
import threading
import time

import torch


class ModuleTimes:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.seconds: dict[tuple[str, str], float] = collections.defaultdict(float)
        self.self_seconds: dict[tuple[str, str], float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()
        self.forward_seconds = 0.0  # the outermost modules' calls, every thread's added up
        self._local = threading.local()
        self._lock = threading.Lock()  # a prefill thread beside the decode adds up into the same totals
        self._handles = []

    def __enter__(self) -> "ModuleTimes":
        for module in self.model.modules():
            self._handles.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._leave, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _enter(self, module, args, kwargs) -> None:
        stack = self._local.__dict__.setdefault("stack", [])
        if not stack:
            self._local.phase = _phase(args, kwargs)
        stack.append([time.perf_counter(), 0.0])  # start, time in submodules

    def _leave(self, module, args, kwargs, output) -> None:
        stack = self._local.stack
        start, inside = stack.pop()
        elapsed = time.perf_counter() - start
        key = (type(module).__name__, self._local.phase)
        with self._lock:
            if stack:
                stack[-1][1] += elapsed
            else:
                self.forward_seconds += elapsed
            self.seconds[key] += elapsed
            self.self_seconds[key] += elapsed - inside
            self.calls[key] += 1

    def rows(self, wall_s: float) -> list[dict]:
        """Every (module class, phase) pair, the most time of its own first, with its shares of `wall_s`."""
        ranked = sorted(self.self_seconds, key=lambda key: -self.self_seconds[key])
        return [{"module": name, "phase": phase, "calls": self.calls[(name, phase)],
                 "seconds": self.seconds[(name, phase)], "self_seconds": self.self_seconds[(name, phase)],
                 "share": self.seconds[(name, phase)] / wall_s, "self_share": self.self_seconds[(name, phase)] / wall_s}
                for name, phase in ranked]


def _phase(args, kwargs) -> str:
    """The outermost forward's phase from its first tensor: token ids `(B, L)` or embeddings `(B, L, D)` are a decode
    step when `L` is 1, a prefill otherwise; anything else (the lm_head over some rows' hidden states `(N, D)`) has
    no phase: "rows"."""
    first = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)), None)
    sequence_dims = 3 if first is not None and first.is_floating_point() else 2  # embeddings, or token ids
    if first is None or first.dim() != sequence_dims:
        return "rows"
    return "decode" if first.shape[1] == 1 else "prefill"
