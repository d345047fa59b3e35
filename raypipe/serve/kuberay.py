"""The Serve config for GPU clusters, derived from `deployments/config.yaml` (one source of truth).

config.yaml is written to run on one CPU machine. On an autoscaling GPU cluster exactly three
settings differ, and this module is the only place that says so:

- encoder workers ask for a whole GPU (`encoder_gpus: 1`). config.yaml's `null` means "1 if the
  cluster has or can start GPUs", but an autoscaling cluster starts with no GPU node and only
  autoscaler v2 publishes its node types: with v1 it would resolve to 0 and the encoders would
  never bring a GPU node up;
- each `Decoder` replica asks for one GPU (its language model gets the GPU to itself) per rank:
  with `engine.tensor_parallel_size` N its placement group holds N one-GPU bundles on one node
  (`serve.app.compose` derives them), so it needs a pod or node with N GPUs;
- the HTTP proxy listens on all interfaces, so KubeRay's Service (or a load balancer) reaches it.

    python -m raypipe.serve.kuberay                 # rewrite rayservice.yaml's serveConfigV2 block
    python -m raypipe.serve.kuberay --serve-config  # print it, for `serve deploy` on a cluster.yaml cluster

tests/test_cluster_config.py fails when rayservice.yaml is not what this module renders.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import re
import sys

import yaml

# The package's config.yaml is the repository's deployments/config.yaml (a link, packaged as data).
SERVE_CONFIG = pathlib.Path(__file__).resolve().parent / "config.yaml"
RAYSERVICE = pathlib.Path(__file__).resolve().parents[2] / "deployments" / "kuberay" / "rayservice.yaml"  # a checkout's
BLOCK_START = re.compile(r"^(?P<indent> *)serveConfigV2: \|\n", re.MULTILINE)


def gpu_serve_config(config: dict, model: str | None = None) -> dict:
    """`config` (config.yaml's content) with the GPU-cluster settings above; `model` replaces the app's model."""
    config = copy.deepcopy(config)
    config.setdefault("http_options", {})["host"] = "0.0.0.0"
    [app] = config["applications"]
    app["args"]["encoder_gpus"] = 1
    if model is not None:
        app["args"]["model"] = model
    [decoder] = [d for d in app["deployments"] if d["name"] == "Decoder"]
    decoder.setdefault("ray_actor_options", {})["num_gpus"] = 1
    return config


def load_serve_config(path: pathlib.Path = SERVE_CONFIG) -> dict:
    return yaml.safe_load(path.read_text())


def serve_config_text(config: dict) -> str:
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False, width=120)


def with_serve_config(manifest: str, config: dict) -> str:
    """`manifest` (RayService YAML text) with its `serveConfigV2: |` block replaced by `config`.

    Text surgery rather than a YAML round trip, so the manifest's own comments survive.
    """
    start = BLOCK_START.search(manifest)
    if start is None:
        raise ValueError("no `serveConfigV2: |` block in the manifest")
    body_indent = start["indent"] + "  "
    lines = manifest[start.end():].splitlines(keepends=True)
    kept = 0  # the old block: lines indented deeper than the key (blank lines inside it included)
    while kept < len(lines) and (lines[kept].startswith(body_indent) or not lines[kept].strip()):
        kept += 1
    while kept > 0 and not lines[kept - 1].strip():  # blank lines after the block belong to what follows
        kept -= 1
    block = "".join(body_indent + line if line.strip() else line
                    for line in serve_config_text(config).splitlines(keepends=True))
    return manifest[:start.end()] + block + "".join(lines[kept:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve-config", action="store_true", help="print the GPU-cluster Serve config instead")
    parser.add_argument("--model", help="model for the app (an s3:// URI or a path on every node)")
    args = parser.parse_args(argv)
    config = gpu_serve_config(load_serve_config(), model=args.model)
    if args.serve_config:
        sys.stdout.write(serve_config_text(config))
    elif not RAYSERVICE.is_file():
        parser.error(f"{RAYSERVICE} not found: rewrite the manifest from a checkout, or print with --serve-config")
    else:
        RAYSERVICE.write_text(with_serve_config(RAYSERVICE.read_text(), config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
