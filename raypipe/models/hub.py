"""Hugging Face model ids (`org/name`, `org/name@revision`) resolved to a local snapshot folder.

`huggingface_hub.snapshot_download` does the work, so raypipe shares the hub's own cache with
transformers and every other tool on the machine: a snapshot already there is used without a network
call when `HF_HUB_OFFLINE=1` (and after one cheap revision check otherwise); a missing one is
downloaded with the hub's progress bars. Every node resolves the id itself, as it copies an `s3://`
checkpoint (`remote.py`): the id is what actors are handed.

Only the files a raypipe model needs are fetched (config, tokenizer, processor, safetensors weights):
no `.bin`/`.pth` duplicates of the same weights, no ONNX or GGUF exports.
"""

from __future__ import annotations

import pathlib
import re

from raypipe.errors import InvalidInput

# `org/name` with an optional `@revision` (a branch, tag or commit); the hub's own name rule.
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
NEEDED_FILES = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.py")


def is_hub_id(model: str) -> bool:
    """Whether `model` reads as a hub id (`org/name[@revision]`); a local folder is checked first by the caller."""
    return HUB_ID.match(model) is not None and not model.startswith((".", "/", "~"))


def split_hub_id(model: str) -> tuple[str, str | None]:
    """(repo id, revision or None for the default branch)."""
    match = HUB_ID.match(model)
    if match is None:
        raise InvalidInput(f"{model!r} is not a Hugging Face model id (org/name or org/name@revision)", item="model")
    return match["repo"], match["revision"]


def snapshot_folder(model: str) -> pathlib.Path:
    """The local snapshot of hub id `model`: from the hub cache, else downloaded (unless offline)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, \
        RevisionNotFoundError

    repo_id, revision = split_hub_id(model)
    try:
        return pathlib.Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(NEEDED_FILES)))
    except LocalEntryNotFoundError:  # offline (HF_HUB_OFFLINE=1, or no network) and not in the cache
        raise InvalidInput(f"{model!r} is not in the Hugging Face cache and cannot be downloaded (offline): "
                           "run once with network access (or `hf download " + repo_id + "`), or unset "
                           "HF_HUB_OFFLINE", item="model", code="model_not_found") from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise InvalidInput(f"{model!r}: {type(exc).__name__} on the Hugging Face hub (a private or gated repo "
                           "needs HF_TOKEN)", item="model", code="model_not_found") from None
    except HfHubHTTPError as exc:
        raise InvalidInput(f"{model!r}: the Hugging Face hub answered {' '.join(str(exc).split())}", item="model",
                           code="model_not_found") from None
