"""The `raypipe` command as a tool (issue 44): a user's mistake is one line on stderr and a non-zero exit, found
before Ray starts; `--debug` shows the traceback; `--version`; every flag has help and shows its default.

The commands run as a user runs them: the installed `raypipe` script, in subprocesses, two at a time
(each costs the imports, ~3 s of CPU). They run with RAY_ADDRESS pointing at a closed port: a command that
tried to start or join Ray before refusing would fail with a Ray connection error instead of its message.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import pathlib
import subprocess
import sys

import pytest

from raypipe.cli import build_parser

RAYPIPE = str(pathlib.Path(sys.executable).with_name("raypipe"))  # the installed console script


def closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # nothing listens once the probe is closed


def run_all(commands: dict[str, list[str]], env: dict | None = None) -> dict[str, subprocess.CompletedProcess]:
    """Each command's result, two at a time (two cores: more would only starve the loopback S3 server)."""
    from concurrent.futures import ThreadPoolExecutor

    env = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{closed_port()}", **(env or {})}

    def run(args):
        return subprocess.run([RAYPIPE, *args], capture_output=True, text=True, env=env, timeout=300)

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(commands, pool.map(run, commands.values())))


@pytest.fixture(scope="module")
def moto_endpoint():
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def test_user_errors_are_one_line_before_ray(tmp_path, moto_endpoint, tiny_ckpt):
    out = tmp_path / "out"
    bucket_out = tmp_path / "bucket-out"
    empty = tmp_path / "empty"
    empty.mkdir()
    image = tmp_path / "image.png"
    image.write_bytes(b"an image")
    s3 = ["--s3-endpoint", moto_endpoint, "--s3-region", "us-east-1"]
    results = run_all({
        "port": ["serve", "--port", "99999"],  # was an OverflowError traceback from the port probe
        "preset": ["demo", "--model", "tinyy"],
        "debug": ["demo", "--model", "tinyy", "--debug"],
        "missing folder": ["batch", "--input", str(tmp_path / "no-such-folder"), "--output", str(out)],
        "empty folder": ["batch", "--input", str(empty), "--output", str(out), "--model", str(tiny_ckpt)],
        "missing bucket": ["batch", "--input", "s3://no-such-bucket/images/", "--output", str(bucket_out),
                           "--model", str(tiny_ckpt), *s3],
        "unreachable": ["batch", "--input", "s3://bucket/images/", "--output", str(out), "--model", str(tiny_ckpt),
                        "--s3-endpoint", f"http://127.0.0.1:{closed_port()}"],
        "image": ["generate", "--model", str(tiny_ckpt), "--prompt", "x", "--image", str(tmp_path / "nope.png")],
        "thinking": ["generate", "--model", str(tiny_ckpt), "--prompt", "x", "--no-thinking"],
        "encode out": ["encode", "--model", str(tiny_ckpt), str(image), "--out", "x.txt"],
        "version": ["--version"],
    }, env={"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"})
    expected = {
        "port": "a TCP port is 1-65535, got 99999",
        "preset": "unknown model 'tinyy': did you mean the preset 'tiny'?",
        "debug": "Traceback",
        "missing folder": f"{tmp_path / 'no-such-folder'} does not exist",
        "empty folder": f"no image or video files under {empty}",
        "missing bucket": "s3://no-such-bucket/images does not exist",
        "unreachable": "Could not connect",
        "image": f"no such image file: {tmp_path / 'nope.png'}",
        "thinking": "this model's chat template has no 'enable_thinking' switch",
        "encode out": "--out must end in .safetensors or .npz, got 'x.txt'",
    }
    for name, message in expected.items():
        proc = results[name]
        assert proc.returncode != 0, (name, proc.stdout, proc.stderr)
        assert message in proc.stderr, (name, proc.stderr)
        if name != "debug":
            assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, (name, proc.stderr)
            assert proc.stderr.startswith("raypipe") and not proc.stdout, (name, proc.stdout)
    assert not out.exists() and not bucket_out.exists()  # a refused batch job creates no output folder
    version = results["version"]
    assert version.returncode == 0 and version.stdout.strip() == f"raypipe {importlib.metadata.version('raypipe')}"


def subcommands() -> dict[str, argparse.ArgumentParser]:
    [action] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def test_every_flag_has_help_and_shows_its_default():
    for name, parser in subcommands().items():
        help_text = " ".join(parser.format_help().split())
        for action in parser._actions:
            assert action.help, f"raypipe {name} {action.option_strings or action.dest} has no help"
            shown = action.default
            if isinstance(shown, (str, int, float)) and shown is not False and shown is not None \
                    and action.option_strings and shown != argparse.SUPPRESS:
                assert f"(default: {shown})" in help_text, f"raypipe {name} {action.option_strings[0]}"
    top = build_parser().format_help()
    assert "vision-language models" in top and "`raypipe COMMAND --help`" in top and "one config per" not in top


def test_serve_engine_flags_override_the_config_file():
    """`serve --max-num-seqs` etc. land in the app's `engine:` args; left out, the file's values stand."""
    from raypipe.serve.run import serve_config

    config = serve_config(build_parser().parse_args(
        ["serve", "--max-num-seqs", "7", "--max-model-len", "512", "--dtype", "float32", "--no-prefix-caching"]))
    engine = config["applications"][0]["args"]["engine"]
    assert {k: engine[k] for k in ("max_num_seqs", "max_model_len", "dtype", "enable_prefix_caching")} == \
        {"max_num_seqs": 7, "max_model_len": 512, "dtype": "float32", "enable_prefix_caching": False}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-num-seqs", "0"])
