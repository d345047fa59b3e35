"""`CompilerPool`: a few warm `grammar_worker` processes that trial-compile constraints for one decoder.

Why processes and not threads: a native llguidance compile can neither be interrupted (it holds no
Python frame to raise in) nor survived when it segfaults, so it must run where it can be killed and
where dying hurts nobody. Why plain `subprocess` and not `multiprocessing` or a Ray actor: the child
is a ~100-line script that imports only llguidance (a spawn context would re-import the Ray worker's
`__main__`; an actor would import raypipe, torch and transformers and add a Ray round trip per
compile). A worker is started when the pool is made and again right after one is killed, never on a
request's path once warm.

Each compile takes a free worker (at most `workers` run at once; a request that finds none free
within `timeout_s` gets `CapacityError`, retryable), sends one line, and waits at most `timeout_s`
for the answer. Past that the worker is killed (the compile stops with it) and replaced; a worker
that dies mid-compile (a segfault, the memory limit) is replaced too. Both are reported to the
caller as the constraint's own fault (`CompileRefused`), since the same constraint would do it again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import queue
import selectors
import signal
import subprocess
import sys
import threading
import time

from raypipe.errors import CapacityError

log = logging.getLogger(__name__)

WORKER_SCRIPT = pathlib.Path(__file__).with_name("grammar_worker.py")
START_TIMEOUT_S = 60.0  # a worker's first answer (import llguidance, build the tokenizer: ~0.1-1 s)


@dataclasses.dataclass(frozen=True)
class CompileRefused(Exception):
    """The worker refused the constraint (or died or overran on it): `reason`, and an error code."""

    reason: str
    code: str


@dataclasses.dataclass(frozen=True)
class WorkerSetup:
    """What every worker is started with (the first line it reads)."""

    tokenizer_json: str  # the fast tokenizer's serialized form (llguidance builds its token trie from it)
    n_vocab: int
    eos: tuple[int, ...]
    memory_bytes: int  # RLIMIT_AS of the worker process
    stack_bytes: int  # stack of the worker's compile thread


class _Worker:
    def __init__(self, setup: WorkerSetup):
        self.process = subprocess.Popen([sys.executable, "-I", str(WORKER_SCRIPT)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
        line = json.dumps({"tokenizer": setup.tokenizer_json, "n_vocab": setup.n_vocab, "eos": list(setup.eos),
                           "memory_bytes": setup.memory_bytes, "stack_bytes": setup.stack_bytes}) + "\n"
        # Written from a thread: a large tokenizer fills the pipe until the worker has imported llguidance.
        threading.Thread(target=self._send_setup, args=(line,), name="raypipe-grammar-setup", daemon=True).start()
        self.ready = False
        self.killed = False  # by us (a timeout or close), not by a crash

    def _send_setup(self, line: str) -> None:
        try:
            self.process.stdin.write(line)
            self.process.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):  # killed before it read its setup
            pass

    def wait_ready(self) -> bool:
        """Wait for the worker's start (once); False if it failed to start (it is then killed)."""
        if not self.ready:
            self.ready = self._read(START_TIMEOUT_S) is not None
        return self.ready

    def ask(self, request: dict, timeout_s: float) -> dict | None:
        """The answer to `request`, or None if the worker died or did not answer in time (it is then killed)."""
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        return self._read(timeout_s)

    def _read(self, timeout_s: float) -> dict | None:
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout_s):
                self.kill()
                return None
        line = self.process.stdout.readline()  # the worker writes whole lines
        if not line:  # end of file: the worker died
            self.process.wait()
            return None
        return json.loads(line)

    def death(self) -> str:
        """How the worker ended (after `ask` returned None)."""
        code = self.process.poll()
        if code is None or code == -signal.SIGKILL and self.killed:
            return "it was stopped after the time limit"
        if code < 0:
            return f"the compiler process died of {signal.Signals(-code).name}"
        return f"the compiler process exited with status {code}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.killed = True
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:  # a broken pipe on flush: the process is gone anyway
                pass


class CompilerPool:
    """`workers` warm compiler processes; `compile` is thread-safe."""

    def __init__(self, setup: WorkerSetup, *, workers: int, timeout_s: float):
        self.setup = setup
        self.timeout_s = timeout_s
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()
        self._live: set[_Worker] = set()
        for _ in range(workers):
            self._idle.put(self._start())

    def compile(self, kind: str, value, thinking_end: str | None = None) -> str:
        """llguidance's grammar text for a constraint that compiled in a worker; `CompileRefused` otherwise.

        `thinking_end`: the constraint applies after free text closed by this token (`grammar_worker.after_thinking`)."""
        try:
            worker = self._idle.get(timeout=self.timeout_s)
        except queue.Empty:
            raise CapacityError(f"every grammar compiler has been busy for {self.timeout_s:g} s; retry later") from None
        if not worker.wait_ready():  # not the constraint's fault: an error of ours, not cached as a refusal
            death = worker.death()
            self._replace(worker)
            raise RuntimeError(f"a grammar compiler process failed to start: {death}")
        start = time.perf_counter()
        answer = worker.ask({"kind": kind, "value": value, "thinking_end": thinking_end}, self.timeout_s)
        if answer is None:
            death = worker.death()
            overran = time.perf_counter() - start >= self.timeout_s
            log.warning("grammar compile of a %s constraint failed: %s; replacing the worker", kind, death)
            self._replace(worker)
            if overran:
                raise CompileRefused(f"did not compile within {self.timeout_s:g} s; simplify it", "grammar_too_complex")
            raise CompileRefused(f"could not be compiled: {death}; simplify it", "grammar_too_complex")
        self._idle.put(worker)
        if "error" in answer:
            raise CompileRefused(answer["error"], answer.get("code", "invalid_structured_output"))
        return answer["grammar"]

    def close(self) -> None:
        """Kill every worker (idle or busy); a compile still waiting gets `CompileRefused` as if it had died."""
        with self._lock:
            self._closed = True
            live, self._live = list(self._live), set()
        for worker in live:
            worker.kill()

    def _start(self) -> _Worker:
        worker = _Worker(self.setup)
        with self._lock:
            self._live.add(worker)
        return worker

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._live.discard(worker)
            if self._closed:
                return
        self._idle.put(self._start())
