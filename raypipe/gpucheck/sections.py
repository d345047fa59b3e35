"""The sections by name, and the entry a section's own process runs: `python -m raypipe.gpucheck.sections`.

Each section is a module with `run(plan, recorder)`, imported only in its own process, so the parent
never imports torch or initialises CUDA and a section that hangs or crashes cannot take the others down.
"""

from __future__ import annotations

import importlib
import json
import sys

from raypipe.gpucheck.plan import CheckPlan
from raypipe.gpucheck.record import Recorder

SECTIONS = {  # name -> module; run in the order of the plan's budgets
    "versions": "raypipe.gpucheck.versions",
    "smoke": "raypipe.gpucheck.smoke",
    "tests": "raypipe.gpucheck.gpu_tests",
    "large": "raypipe.gpucheck.synthetic",
    "decode": "raypipe.gpucheck.decode_speed",
    "encode": "raypipe.gpucheck.encode_speed",
}


def main(argv: list[str]) -> int:
    name, plan_path, out_path = argv
    plan = CheckPlan.from_json(json.loads(open(plan_path).read()))
    recorder = Recorder(out_path)
    importlib.import_module(SECTIONS[name]).run(plan, recorder)
    # the answer to "does it run without Ray": asked after the section's work, in the process that did it
    # (a blocked import leaves None under the name)
    recorder.set("ray_imported", sys.modules.get("ray") is not None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
