"""The documentation site (issue 44): `mkdocs build --strict` succeeds (a broken link or a missing nav page is an
error), and the Serving page lists every request field the endpoint accepts, read from its pydantic request
models, so the table generated at build time cannot drift from the code."""

from __future__ import annotations

import html
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    mkdocs = pathlib.Path(sys.executable).with_name("mkdocs")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(out)], cwd=ROOT, capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out


def accepted_fields(model, prefix=""):
    """Every field path the endpoint's request model accepts, nested models walked (written here, not the hook's)."""
    import typing

    from pydantic import BaseModel

    def models_in(annotation, many=False):
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield annotation, many
        for arg in typing.get_args(annotation):
            yield from models_in(arg, many or typing.get_origin(annotation) is list)

    for name, field in model.model_fields.items():
        path = prefix + (field.alias or name)
        yield path
        for nested, many in models_in(field.annotation):
            if nested is not model:
                yield from accepted_fields(nested, path + ("[]." if many else "."))


def test_site_builds_strict_with_every_page(site):
    pages = {p.parent.name for p in site.glob("*/index.html")}
    assert {"getting-started", "cli", "python", "serving", "serving-fields", "batch", "scaling", "models",
            "performance", "operations", "gpu", "ARCHITECTURE", "layout"} <= pages
    getting_started = html.unescape(re.sub(r"<[^>]+>", "", (site / "getting-started" / "index.html").read_text()))
    assert "random weights" in getting_started and "curl" in getting_started and "OpenAI(" in getting_started


def test_serving_page_lists_every_request_field(site):
    from raypipe.serve.openai.schemas import ChatCompletionRequest, CompletionRequest

    page = html.unescape((site / "serving" / "index.html").read_text())
    listed = set(re.findall(r"<td><code>([^<]+)</code></td>", page))
    for model in (ChatCompletionRequest, CompletionRequest):
        fields = set(accepted_fields(model))
        assert {"model", "max_tokens"} <= fields
        assert fields - listed == set(), f"{model.__name__} fields missing from the Serving page"


def test_readme_is_a_front_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme) < 6000  # one or two screens; the site holds the rest
    assert "make demo" in readme and "make test" in readme and "random weights" in readme
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).is_file(), link
