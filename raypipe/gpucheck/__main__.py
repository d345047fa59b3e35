"""`python -m raypipe.gpucheck [--cpu] [--out report.json] [--sections a,b]`: the sections one after another,
each cut at its budget, the JSON report rewritten after each (a run stopped from outside keeps what it had)."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

from raypipe.gpucheck import plan as plans
from raypipe.gpucheck.options import add_arguments
from raypipe.gpucheck.runner import run_section
from raypipe.gpucheck.table import describe


def run(args: argparse.Namespace) -> dict:
    plan = plans.CPU if args.cpu else plans.GPU
    wanted = [s for s in args.sections.split(",") if s] or list(plan.budgets_s)
    unknown = sorted(set(wanted) - set(plan.budgets_s))
    if unknown:
        raise SystemExit(f"unknown sections {unknown}; known: {list(plan.budgets_s)}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="raypipe-gpucheck-"))
    report = {"device": plan.device, "plan": plan.to_json(), "budget_s": sum(plan.budgets_s[s] for s in wanted),
              "sections": {}, "seconds": 0.0, "ray_in_this_process": False}
    start = time.monotonic()
    for name in plan.budgets_s:
        if name not in wanted:
            continue
        print(f"[gpu-check] {name} (budget {plan.budgets_s[name]:.0f} s)", file=sys.stderr, flush=True)
        report["sections"][name] = run_section(name, plan, workdir, plan.budgets_s[name])
        report["seconds"] = round(time.monotonic() - start, 1)
        report["ray_in_this_process"] = sys.modules.get("ray") is not None
        out.write_text(json.dumps(report, indent=1, default=str))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raypipe.gpucheck", description=__doc__)
    add_arguments(parser)
    return run_command(parser.parse_args(argv))


def run_command(args: argparse.Namespace) -> int:
    """Run, print the tables; 0 when every section finished (its tests may still have failed: read the report)."""
    report = run(args)
    describe(report)
    print(f"\nreport: {args.out}")
    return 0 if all(s["status"] == "ok" for s in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
