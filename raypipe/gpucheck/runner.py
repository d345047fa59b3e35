"""`run_section`: one section in a process of its own, cut at its time budget.

A CUDA kernel that hangs, a graph capture that deadlocks or a crash in native code cannot be stopped from
a thread of the same process; a process can be killed. What the section recorded before the cut stays.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from raypipe.gpucheck.plan import CheckPlan
from raypipe.gpucheck.record import read

ERROR_TAIL_CHARS = 3000  # of a failed section's output, in the report


def run_section(name: str, plan: CheckPlan, workdir: pathlib.Path, budget_s: float) -> dict:
    """The section's record plus `status` ("ok", "failed", "cut"), `seconds` and `budget_s`."""
    plan_path, out_path, log_path = (workdir / f"{name}.{suffix}" for suffix in ("plan.json", "json", "log"))
    plan_path.write_text(json.dumps(plan.to_json()))
    start = time.monotonic()
    with open(log_path, "w") as log:
        # a session of its own, so a cut also ends what the section started (pytest, compile workers)
        process = subprocess.Popen([sys.executable, "-m", "raypipe.gpucheck.sections", name, str(plan_path),
                                    str(out_path)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            code = process.wait(timeout=budget_s)
            status = "ok" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            status = "cut"
    record = read(out_path)
    record.update(status=status, seconds=round(time.monotonic() - start, 1), budget_s=budget_s)
    if status != "ok":
        record["output_tail"] = log_path.read_text(errors="replace")[-ERROR_TAIL_CHARS:]
    return record
