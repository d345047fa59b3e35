"""The check's command-line flags, shared by `python -m raypipe.gpucheck` and `raypipe gpu-check`."""

from __future__ import annotations

import argparse

from raypipe.gpucheck.plan import GPU


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpu", action="store_true", help="dry run on CPU with tiny presets (seconds)")
    parser.add_argument("--out", default="gpu-check.json", help="where the JSON report goes")
    parser.add_argument("--sections", default="", help=f"comma-separated subset of {', '.join(GPU.budgets_s)}")
