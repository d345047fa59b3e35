"""Hugging Face model ids (issue 44): `org/name[@revision]` resolves through `huggingface_hub` to a snapshot in
the hub's own cache, in every entry point that takes a model (they all go through `resolve_model`).

Offline, as every test: a hub cache laid out as `huggingface_hub` writes it (`models--org--name/snapshots/<commit>/`
and `refs/main`) in a temporary folder, holding the tiny preset's files. Nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from raypipe.errors import InvalidInput
from raypipe.models.registry import family_of, model_for_actors, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "acme/tiny-vl"


@pytest.fixture
def hub_cache(tmp_path, tiny_ckpt, monkeypatch):
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny-vl" / "snapshots" / COMMIT
    shutil.copytree(tiny_ckpt, snapshot)
    (cache / "models--acme--tiny-vl" / "refs").mkdir()
    (cache / "models--acme--tiny-vl" / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))  # for the subprocesses
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snapshot


def test_hub_ids_resolve_from_the_cache(hub_cache, tmp_path, tiny_ckpt, monkeypatch):
    for name in (REPO, f"{REPO}@main", f"{REPO}@{COMMIT}"):
        path = resolve_model(name)
        assert path.resolve() == hub_cache.resolve(), name
        assert family_of(path).model_type == "qwen2_5_vl"
    assert model_for_actors(REPO, resolve_model(REPO)) == REPO  # each node resolves the id from its own cache
    with pytest.raises(InvalidInput, match=r"'acme/missing' is not in the Hugging Face cache .*HF_HUB_OFFLINE"):
        resolve_model("acme/missing")
    with pytest.raises(InvalidInput, match=f"'{REPO}@v9' is not in the Hugging Face cache"):
        resolve_model(f"{REPO}@v9")
    # A local folder spelt like an id is the folder, not the hub.
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_ckpt, tmp_path / "acme" / "tiny-vl")
    assert resolve_model(REPO).resolve() == tmp_path / "acme" / "tiny-vl"
    assert model_for_actors(REPO, resolve_model(REPO)) == str(tmp_path / "acme" / "tiny-vl")


def test_cli_takes_hub_ids(hub_cache):
    """The command resolves the id before Ray (RAY_ADDRESS points nowhere): a cached id gets as far as the
    template check, a missing one is the one-line offline error naming it."""
    raypipe = os.path.join(os.path.dirname(sys.executable), "raypipe")
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1"}
    cached = subprocess.run([raypipe, "generate", "--model", REPO, "--prompt", "x", "--no-thinking"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert cached.returncode == 2 and "no 'enable_thinking' switch" in cached.stderr, cached.stderr
    missing = subprocess.run([raypipe, "demo", "--model", "acme/missing@v2"], capture_output=True, text=True, env=env,
                             timeout=300)
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    assert "'acme/missing@v2' is not in the Hugging Face cache" in missing.stderr, missing.stderr
