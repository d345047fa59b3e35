"""Checkpoints in object storage (`s3://bucket/checkpoints/name/`), copied once per node.

A freshly autoscaled node starts with an empty disk, so every process that loads a model
(encoder workers, the decode engine, Serve replicas, batch actors) resolves the same URI to a local
folder under the raypipe cache. The first process on a node copies it; the others wait on a file
lock and reuse the copy. The copy is made in a staging folder, checked (every object present with
its listed size, `config.json` there), then renamed into place, so a crash mid-copy never leaves a
folder that looks complete. A manifest of what was copied is kept beside it and checked on reuse.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pathlib
import shutil
import tempfile

MANIFEST = ".raypipe-remote.json"  # written last, inside the folder: its presence means "complete"


def cache_root() -> pathlib.Path:
    root = os.environ.get("RAYPIPE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "raypipe")
    return pathlib.Path(root) / "models"


def local_folder(uri: str) -> pathlib.Path:
    """Where `uri` lives on this node: a readable name plus a hash of the full URI (no collisions)."""
    name = uri.rstrip("/").rsplit("/", 1)[-1] or "model"
    return cache_root() / f"{name}-{hashlib.sha256(uri.rstrip('/').encode()).hexdigest()[:16]}"


def fetch_model(uri: str, options=None) -> pathlib.Path:
    """The local copy of the checkpoint at `uri`, copying it first if this node has none."""
    from raypipe.storage import open_filesystem

    target = local_folder(uri)
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.with_name(target.name + ".lock")):
        if _is_complete(target):  # another process on this node copied it while we waited
            return target
        fs, root = open_filesystem(uri, options)
        _copy(fs, root, uri, target)
    return target


def _copy(fs, root: str, uri: str, target: pathlib.Path) -> None:
    from raypipe.errors import InvalidInput
    from raypipe.storage import list_files

    files = list_files(fs, root)
    names = {info.path[len(root) + 1:]: info.size for info in files}
    if "config.json" not in names:
        raise InvalidInput(f"no config.json under {uri!r}: expected an HF checkpoint folder", item="model",
                           code="model_not_found")
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        for name, size in names.items():
            dest = staging / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            with fs.open_input_stream(f"{root}/{name}") as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out, length=8 * 1024 * 1024)
            if dest.stat().st_size != size:
                raise OSError(f"copy of {uri}/{name} has {dest.stat().st_size} bytes, the store lists {size}")
        (staging / MANIFEST).write_text(json.dumps({"uri": uri, "files": names}, indent=1))
        if target.exists():  # an incomplete or stale copy (its manifest failed the check)
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _is_complete(folder: pathlib.Path) -> bool:
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError):
        return False
    return all((folder / name).is_file() and (folder / name).stat().st_size == size for name, size in files.items())


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes, also if the process dies
        yield
