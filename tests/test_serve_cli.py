"""`raypipe serve` as a user runs it: its own process and Ray, a key from RAYPIPE_API_KEY, stopped by SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.test_serve_api import free_port, image_url, user


def test_raypipe_serve_command(tiny_ckpt, tmp_path):
    port = free_port()
    env = {**os.environ, "RAYPIPE_API_KEY": "env-key", "RAY_ADDRESS": ""}
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "raypipe.cli", "serve", "--model", "tiny", "--port", str(port),
                             "--num-encoders", "1"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300  # a fresh Ray, Serve and three replicas: minutes on a busy 2-core machine
        healthy = False
        while time.monotonic() < deadline and proc.poll() is None and not healthy:
            try:
                healthy = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert healthy and proc.poll() is None, open(tmp_path / "serve.log").read()[-3000:]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="env-key", max_retries=0)
        response = client.chat.completions.create(model="tiny", messages=user("hi", image_url(56, 56)), max_tokens=4,
                                                  temperature=0)
        assert response.usage.completion_tokens >= 1
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        log.close()
    output = open(tmp_path / "serve.log").read()
    assert code == 0, output[-3000:]
    # Issue 9 item 12: a fresh start and a clean stop print nothing alarming.
    for noise in ("Connecting to existing Serve app", "graceful_shutdown", "never retrieved", "Traceback"):
        assert noise not in output, output[-3000:]


def test_taken_port_fails_at_start(capsys, monkeypatch):
    """Issue 9 item 2: Serve's proxy binds with SO_REUSEPORT, so a second server would share the port.
    The command's `main` in this process: the refusal comes before any Ray (a subprocess cost ~10 s of imports)."""
    from raypipe.cli import main

    monkeypatch.setenv("RAYPIPE_API_KEY", "")
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as Serve's own proxy binds
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code = main(["serve", "--model", "tiny", "--port", str(port)])
    stderr = capsys.readouterr().err
    assert code == 1 and f"port {port}" in stderr and "in use" in stderr, stderr
    assert "Ray" not in stderr  # refused before starting (or joining) any Ray


def test_serve_runs_the_config_file_with_flags_overriding(tmp_path):
    """Issue item 3: `raypipe serve` runs config.yaml's application; flags change only what they name."""
    import yaml

    from raypipe.cli import build_parser
    from raypipe.serve.app import compose, deployment_options
    from raypipe.serve.kuberay import load_serve_config
    from raypipe.serve.run import serve_config

    packaged = load_serve_config()
    assert serve_config(build_parser().parse_args(["serve"])) == packaged
    config = serve_config(build_parser().parse_args(["serve", "--model", "small", "--port", "8100",
                                                     "--num-encoders", "3"]))
    [app] = config["applications"]
    assert app["args"] == {**packaged["applications"][0]["args"], "model": "small", "num_encoders": 3}
    assert config["http_options"] == {**packaged["http_options"], "port": 8100}
    ingress = compose(app["args"], deployment_options(config))._bound_deployment
    assert ingress._deployment_config.autoscaling_config.max_replicas == 4  # config.yaml's Ingress options

    own = tmp_path / "serve.yaml"
    own.write_text(yaml.safe_dump({**packaged, "logging_config": {"encoding": "JSON"}}))
    with pytest.raises(ValueError, match="logging_config"):
        serve_config(build_parser().parse_args(["serve", "--config", str(own)]))
