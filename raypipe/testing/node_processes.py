"""The worker processes a Ray node runs, read from Linux's /proc (tests and `raypipe bench encode`).

Ray starts every worker process of a node (actors and task workers) from its raylet, so the
raylet's live children are that node's workers: a process started on a request's path shows up as a
child that was not there before.
"""

from __future__ import annotations

import pathlib


def parent_pid(pid: int) -> int:
    return int(_stat(pid)[1])


def live_children(pid: int) -> set[int]:
    """Processes whose parent is `pid`, zombies left out (PID 1 here does not reap them)."""
    children = set()
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, ppid = _stat(int(entry.name))[:2]
        except (FileNotFoundError, ProcessLookupError):
            continue  # it ended while we looked
        if int(ppid) == pid and state != "Z":
            children.add(int(entry.name))
    return children


def _stat(pid: int) -> list[str]:
    """`/proc/<pid>/stat` after the command name (which may hold spaces): state, ppid, ..."""
    text = pathlib.Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2:].split()
