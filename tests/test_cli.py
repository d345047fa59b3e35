"""The command line as a user runs it: `raypipe demo`, `encode` and `generate`, in subprocesses.

`raypipe demo` starts a Ray of its own, as the README's first command does on a fresh machine. The
other commands join this module's running Ray (RAY_ADDRESS, as on a cluster): what they test is the
command, and a private Ray start per command cost ~10 s on 2 cores. Refusals that happen before any
Ray or model (a missing file) run `main` in this process.
"""

import os
import subprocess
import sys

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from raypipe.encode.budgets import TokenBudgets
from raypipe.encode.pool import WorkerOptions
from tests.conftest import random_images, reference_embeddings


def run_cli(*args, ray_address="", timeout=300):
    env = dict(os.environ, RAY_ADDRESS=ray_address)  # "": a private local Ray for the command
    return subprocess.run([sys.executable, "-m", "raypipe.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def ray_address(ray_local):
    """The running Ray's address, for commands that join it."""
    return ray_local.get_runtime_context().gcs_address


def test_demo_runs_and_verifies(tiny_ckpt):
    proc = run_cli("demo", "--model", str(tiny_ckpt))  # a cold start: its own Ray
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sharded embeddings equal the single-process vision tower: yes" in proc.stdout
    assert "worker 0: images" in proc.stdout and "worker 1: images" in proc.stdout
    assert "generated for images" in proc.stdout


def test_encode_writes_embeddings(tmp_path, tiny_ckpt, hf_model, ray_address):
    images = random_images([(120, 90), (300, 400)], seed=11)
    files = []
    for i, image in enumerate(images):
        path = tmp_path / f"img{i}.png"
        Image.fromarray(image).save(path)
        files.append(str(path))
    out = tmp_path / "emb.safetensors"
    proc = run_cli("encode", "--model", str(tiny_ckpt), "--num-encoders", "1", *files, "--out", str(out),
                   ray_address=ray_address)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tensors = load_file(out)
    # The reference on the one encoder's torch threads (os.cpu_count()), not this process's (torch's default
    # counts physical cores): on CPUs whose GEMMs round differently at another count, values moved ~1e-4 in CI.
    threads = WorkerOptions.for_cluster(str(tiny_ckpt), 1, gpus=0, dtype="auto", threads=None,
                                        budgets=TokenBudgets()).num_threads
    for i, ref in enumerate(reference_embeddings(hf_model, tiny_ckpt, images, threads=threads)):
        torch.testing.assert_close(tensors[f"image_{i}"], ref, atol=1e-5, rtol=1e-4)


def test_encode_reports_missing_file(tmp_path, capsys):
    from raypipe.cli import main

    code = main(["encode", "--model", "tiny", str(tmp_path / "nope.png"), "--out", str(tmp_path / "x.npz")])
    assert code == 2 and "no such image file" in capsys.readouterr().err


def test_generate_with_a_video_and_a_json_schema(tmp_path, tiny_ckpt, ray_address, capsys):
    """One command for both flags (each command costs ~30 s on 2 cores): the video's planned token count
    with EVS, and text that is JSON under the schema, ended by the grammar (finish_reason stop)."""
    import json

    import jsonschema

    from raypipe.cli import main
    from raypipe.inputs.video import VideoMetadata, VideoSampling
    from raypipe.models.evs import retained_count
    from raypipe.models.qwen2_5_vl.video import QwenVideoConfig, frame_planner
    from raypipe.testing.sample_videos import index_frames, make_video
    from raypipe.testing.structured_schemas import SCHEMAS

    video = tmp_path / "clip.mp4"
    video.write_bytes(make_video(index_frames(30, 96, 128), fps=10))
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMAS["nested"]))
    proc = run_cli("generate", "--model", str(tiny_ckpt), "--num-encoders", "1", "--video", str(video),
                   "--video-pruning-rate", "0.5", "--prompt", "What happens? A user as JSON.", "--max-tokens", "96",
                   "--temperature", "0", "--json-schema", str(schema_file), ray_address=ray_address)
    assert proc.returncode == 0 and "finish_reason=stop" in proc.stderr, proc.stdout + proc.stderr
    assert proc.stdout.strip()  # the generated text
    jsonschema.validate(json.loads(proc.stdout), SCHEMAS["nested"])
    config = QwenVideoConfig.from_checkpoint(tiny_ckpt)
    plan = frame_planner(config, VideoSampling())(VideoMetadata(30, 10.0, 3.0, 128, 96))
    groups = len(plan.indices) // config.temporal_patch_size
    planned = retained_count(groups, plan.height * plan.width // config.factor**2, 0.5)
    assert f"({planned} from 0 images and 1 videos)" in proc.stderr, proc.stderr
    with pytest.raises(SystemExit) as missing:  # argparse refuses it, before any model or Ray
        main(["generate", "--prompt", "x", "--json-schema", str(tmp_path / "nope.json")])
    assert missing.value.code == 2 and "cannot read" in capsys.readouterr().err


def test_generate_splits_reasoning_and_constrains_the_answer(tmp_path, ray_address):
    """Issue 44: a thinking model's reply as the endpoint splits it: the reasoning (transformers' own greedy text up
    to its `</think>`, split by vLLM's qwen3 rule) labelled on stderr, the answer alone on stdout, and
    `--json-schema` applied to the answer after `</think>`, not to the reasoning."""
    import json

    import jsonschema
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from raypipe.models.registry import preset_checkpoint
    from tests import qwen3_vl_reference as ref
    from tests.test_reasoning_parser import vllm_qwen3

    ckpt = preset_checkpoint("tiny-qwen3.5")
    images = random_images([(100, 60), (40, 170)], seed=1)
    files = []
    for i, image in enumerate(images):
        Image.fromarray(image).save(tmp_path / f"img{i}.png")
        files += ["--image", str(tmp_path / f"img{i}.png")]
    schema = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 8}}, "required": ["color"],
              "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    proc = run_cli("generate", "--model", "tiny-qwen3.5", "--num-encoders", "1", *files, "--prompt", "Describe it.",
                   "--max-tokens", "64", "--temperature", "0", "--json-schema", str(tmp_path / "schema.json"),
                   ray_address=ray_address)
    assert proc.returncode == 0 and "finish_reason=stop" in proc.stderr, proc.stdout + proc.stderr
    jsonschema.validate(json.loads(proc.stdout), schema)  # the answer alone, under the schema

    hf = AutoModelForImageTextToText.from_pretrained(ckpt).eval()
    processor = ref.hf_processor(ckpt)
    theirs = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    text = processor.apply_chat_template(theirs, add_generation_prompt=True, tokenize=False)
    inputs = dict(processor(text=[text], images=images, return_tensors="pt"))
    ids = ref.hf_generate(hf, inputs, 16, hf.generation_config.eos_token_id)
    reasoning = vllm_qwen3(processor.tokenizer.decode(ids, skip_special_tokens=True), True)[0]
    assert reasoning is not None and f"reasoning:\n{reasoning.strip()}\nanswer:" in proc.stderr, proc.stderr
