"""Small helpers shared by the benchmarks: medians, tables, JSON output."""

from __future__ import annotations

import json
import pathlib
import statistics
import threading
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def print_table(title: str, headers: list[str], rows: list[list]) -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def write_json(out_dir: str, name: str, result: dict) -> pathlib.Path:
    path = pathlib.Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    target = path / f"{name}.json"
    target.write_text(json.dumps(result, indent=2))
    return target


def emit(args, name: str, result: dict, describe: Callable[[dict, pathlib.Path], None]) -> int:
    """Write `result` as `<args.out>/<name>.json`, then print it as JSON (`--json`) or `describe` it; exit status 0."""
    path = write_json(args.out, name, result)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        describe(result, path)
    return 0


class Sampler:
    """Records `(time.monotonic(), *self.sample())` every `period_s` in a daemon thread."""

    def __init__(self, period_s: float = 0.5):
        self.period_s = period_s
        self.samples: list[tuple] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> tuple:
        raise NotImplementedError

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def first(self, predicate, since: float) -> float | None:
        """Seconds from `since` to the first sample whose values satisfy `predicate(*values)`; None if none has."""
        return next((at - since for at, *values in self.samples if at >= since and predicate(*values)), None)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.monotonic(), *self.sample()))
            except Exception as exc:  # noqa: BLE001 - a failed look is a missing sample, not the end of sampling
                # e.g. serve.status() before this cycle's Serve starts: Serve's cached client still
                # points at the previous cycle's controller, on a cluster that is gone
                self.errors.append(f"{type(exc).__name__}: {exc}"[:200])
            self._stop.wait(self.period_s)


def gpu_nodes() -> int:
    """Alive nodes with GPUs in the Ray cluster this process is connected to."""
    import ray

    return sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) > 0)
