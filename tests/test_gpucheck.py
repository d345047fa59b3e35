"""The GPU check (`python -m raypipe.gpucheck`) and the engine and towers it drives, in a process where Ray
cannot be imported, as on the lent GPU machine.

One subprocess runs the whole command as its CPU dry run (`--cpu`): every family's vision tower on one
image and the engine generating on a full-attention and a hybrid preset without Ray, the `pytest -m gpu`
section (whose tests skip here, each listed with its reason), decode and encoder throughput on tiny
presets. Ray is made unimportable with a `sitecustomize` on `PYTHONPATH`, so the section processes and
their children (pytest, grammar workers) cannot import it either.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

from raypipe.gpucheck import plan as plans
from raypipe.gpucheck.runner import run_section
from tests.test_gpu import FAMILY_PRESETS

ROOT = pathlib.Path(__file__).resolve().parents[1]
NO_RAY = "import sys\nsys.modules['ray'] = None  # `import ray` raises ModuleNotFoundError\n"


def env_without_ray(tmp: pathlib.Path) -> dict:
    (tmp / "sitecustomize.py").write_text(NO_RAY)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), str(ROOT)]), "HF_HUB_OFFLINE": "1"}


def gpu_test_names() -> set[str]:
    """`module::test` of every test the GPU test files mark `gpu` (the module's `pytestmark` or a decorator)."""
    names = set()
    for file in plans.GPU_TEST_FILES:
        tree = ast.parse((ROOT / file).read_text())
        module_marked = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                            and getattr(n.value, "id", "") == "gpu" for n in tree.body)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and (
                    module_marked or any(getattr(d, "id", "") == "gpu" for d in node.decorator_list)):
                names.add(f"{file[:-3].replace('/', '.')}::{node.name}")
    return names


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("no-ray")
    env = env_without_ray(tmp)
    blocked = subprocess.run([sys.executable, "-c", "import ray"], env=env, capture_output=True, text=True)
    assert blocked.returncode != 0 and "ModuleNotFoundError" in blocked.stderr  # the blocker holds
    out = tmp / "report.json"
    done = subprocess.run([sys.executable, "-m", "raypipe.gpucheck", "--cpu", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=plans.CPU.total_s + 60)
    return done, json.loads(out.read_text())


def test_dry_run_finishes_every_section_without_ray(dry_run):
    done, report = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert list(report["sections"]) == list(plans.CPU.budgets_s)
    for name, section in report["sections"].items():
        assert section["status"] == "ok", (name, section.get("output_tail"))
        assert section["ray_imported"] is False, name
        assert section["seconds"] <= section["budget_s"]
    assert report["ray_in_this_process"] is False
    assert "sections" in done.stdout and "report:" in done.stdout  # the printed table


def test_every_family_tower_and_the_engine_run_without_ray(dry_run):
    rows = dry_run[1]["sections"]["smoke"]["results"]
    towers = {r["preset"]: r for r in rows if r["check"] == "tower"}
    assert set(towers) == set(plans.SMOKE_PRESETS)
    for preset, row in towers.items():
        assert row["rows"] > 0 and row["finite"], preset
    engines = {r["preset"]: r for r in rows if r["check"] == "engine"}
    assert set(engines) == set(plans.SMOKE_ENGINE_PRESETS)
    for preset, row in engines.items():
        assert row["tokens"] == 8, preset  # ignore_eos: exactly max_tokens


def test_gpu_tests_are_selected_and_skipped_with_their_reason(dry_run):
    section = dry_run[1]["sections"]["tests"]
    skipped = {s["item"]: s["reason"] for s in section["skipped"]}
    expected = gpu_test_names()
    assert expected == {name.split("[")[0] for name in skipped if "::" in name}
    assert all(reason == "needs CUDA" for name, reason in skipped.items() if "::" in name)
    for preset in FAMILY_PRESETS:  # every family's tower and language model
        assert f"tests.test_gpu::test_every_family_tower_in_bf16_matches_transformers[{preset}]" in skipped
        assert f"tests.test_gpu::test_every_family_language_model_in_bf16_matches_transformers[{preset}]" in skipped
    assert section["results"] == []  # nothing ran, nothing failed


def test_throughput_rows_and_gpu_only_items_are_skipped_with_reasons(dry_run):
    sections = dry_run[1]["sections"]
    decode = sections["decode"]
    measured = {(r["preset"], r["mode"], r["batch"]) for r in decode["results"] if r["tok_s"] > 0}
    assert measured == {(p, m, b) for p in ("tiny", "tiny-qwen3.5") for m in ("eager", "transformers")
                        for b in plans.CPU.decode_batches}
    assert all(r["tokens"] == r["batch"] * plans.CPU.decode_max_tokens for r in decode["results"])
    skipped = {s["item"]: s["reason"] for s in decode["skipped"]}
    assert skipped["tiny graphs"] == "CUDA graphs need a GPU" and "large preset" in skipped
    encode = sections["encode"]
    assert {(r["preset"], r["mode"]) for r in encode["results"] if r["images_s"] > 0} == {
        (p, m) for p in ("tiny", "tiny-qwen3.5") for m in ("eager", "budgets")}
    assert "mfu" in {s["item"] for s in encode["skipped"]}
    versions = sections["versions"]
    assert {r["package"]: r["version"] for r in versions["results"]}["torch"] == torch.__version__


def test_a_section_past_its_budget_is_cut_and_reported(tmp_path):
    started = time.monotonic()
    record = run_section("tests", plans.CPU, tmp_path, budget_s=1.0)  # pytest alone takes longer to start
    assert record["status"] == "cut" and record["budget_s"] == 1.0
    assert time.monotonic() - started < 10


def test_gpu_plan_fits_one_command_on_the_lent_machine():
    assert plans.GPU.total_s <= 8 * 60  # at most 10 minutes a command there; the rest is install and start-up
    assert list(plans.GPU.budgets_s) == list(plans.CPU.budgets_s)  # the dry run runs the same sections


def test_cli_subcommand_takes_the_module_flags():
    from raypipe.cli import build_parser

    args = build_parser().parse_args(["gpu-check", "--cpu", "--out", "r.json", "--sections", "versions"])
    assert (args.command, args.cpu, args.out, args.sections) == ("gpu-check", True, "r.json", "versions")
