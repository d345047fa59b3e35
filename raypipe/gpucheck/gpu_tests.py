"""Section `tests`: `pytest -m gpu` on the GPU test files, each test's outcome and every skip with its reason.

pytest runs as a child of this section's process and writes JUnit XML, which is read back per test, so the
report names each test that passed, failed (with the first lines of its message) or was skipped and why.
A run cut at the section's budget leaves the tests it did not reach out of the report, not failed.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

MESSAGE_CHARS = 600
INTERRUPT_GRACE_S = 5  # for pytest to write its XML once interrupted


def run(plan, recorder) -> None:
    root = pathlib.Path(__file__).resolve().parents[2]
    files = [f for f in plan.test_files if (root / f).is_file()]
    for missing in sorted(set(plan.test_files) - set(files)):
        recorder.skip(missing, "no such test file in this working tree")
    xml_path = pathlib.Path(tempfile.mkdtemp(prefix="raypipe-gpucheck-")) / "junit.xml"
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rs",
               f"--junitxml={xml_path}", *files]
    recorder.set("command", " ".join(command))
    timeout = plan.budgets_s["tests"] - 2 * INTERRUPT_GRACE_S
    process = subprocess.Popen(command, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # interrupted, pytest still writes the XML of the tests it finished; killed if it does not stop
        process.send_signal(signal.SIGINT)
        try:
            output, _ = process.communicate(timeout=INTERRUPT_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        recorder.skip("pytest", f"cut after {timeout:.0f} s: the tests it had not finished are not listed")
    recorder.set("pytest_exit_code", process.returncode)
    lines = output.strip().splitlines()
    recorder.set("pytest_summary", lines[-1] if lines else "")
    if process.returncode not in (0, 5):  # 5: no test was selected
        recorder.set("pytest_output_tail", output[-MESSAGE_CHARS * 4:])
    if xml_path.is_file():
        record_cases(xml_path, recorder)


def record_cases(xml_path: pathlib.Path, recorder) -> None:
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        seconds = round(float(case.get("time", 0.0)), 2)
        if case.find("skipped") is not None:
            recorder.skip(name, case.find("skipped").get("message", ""))
            continue
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        outcome = "passed" if problem is None else problem.tag
        message = "" if problem is None else (problem.get("message") or problem.text or "")[:MESSAGE_CHARS]
        recorder.add(test=name, outcome=outcome, seconds=seconds, **({"message": message} if message else {}))
