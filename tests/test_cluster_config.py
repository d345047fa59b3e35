"""cluster.yaml, the Dockerfile and the KubeRay manifests: Ray's own validation plus our checks.

All offline: no cloud, no Kubernetes, no Docker daemon. What can be proven here is proven: Ray
accepts cluster.yaml, every GPU node type declares its GPUs, every node installs a wheel built
from this checkout (and that wheel holds exactly the checkout's code), the image installs the repo
with torch pinned as the Makefile pins it, and the RayService runs deployments/config.yaml's app.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import zipfile

import pytest
import ray
import yaml

from raypipe.serve import kuberay as render

ROOT = pathlib.Path(__file__).resolve().parent.parent
KUBERAY = ROOT / "deployments" / "kuberay"
# GPUs per instance type used in cluster.yaml (AWS: g6.2xlarge 1 x L4, g6.12xlarge 4 x L4).
AWS_GPUS = {"m6i.2xlarge": 0, "g6.2xlarge": 1, "g6.12xlarge": 4}


def makefile_torch_pin() -> str:
    [version] = set(re.findall(r"torch==([\d.]+)", (ROOT / "Makefile").read_text()))
    return version


@pytest.fixture(scope="module")
def cluster_yaml() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def test_cluster_yaml_passes_rays_own_validation(cluster_yaml):
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(cluster_yaml))


def test_cluster_yaml_node_types_are_consistent(cluster_yaml):
    types = cluster_yaml["available_node_types"]
    head = types[cluster_yaml["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0, "the head must run no GPU work"
    assert head["max_workers"] == 0
    gpu_types = {name: t for name, t in types.items() if name != cluster_yaml["head_node_type"]}
    assert {t["resources"].get("GPU") for t in gpu_types.values()} >= {1}, "a 1-GPU worker type"
    assert any(t["resources"].get("GPU", 0) in (4, 8) for t in gpu_types.values()), "a 4- or 8-GPU worker type"
    for name, node_type in types.items():
        assert 0 <= node_type.get("min_workers", 0) <= node_type["max_workers"], name
        # the declared GPUs are the instance's GPUs: the autoscaler plans with the declaration
        assert node_type["resources"].get("GPU", 0) == AWS_GPUS[node_type["node_config"]["InstanceType"]], name
    assert cluster_yaml["max_workers"] >= max(t["max_workers"] for t in gpu_types.values())
    assert cluster_yaml["idle_timeout_minutes"] > 0 and cluster_yaml["upscaling_speed"] > 0


def test_every_node_installs_this_checkouts_wheel_after_pinned_torch(cluster_yaml):
    [(remote_dist, local_dist)] = cluster_yaml["file_mounts"].items()
    assert pathlib.Path(local_dist) == pathlib.Path("dist"), "the folder `make wheel` writes"
    assert "wheel:" in (ROOT / "Makefile").read_text() and "-w dist" in (ROOT / "Makefile").read_text()
    torch = f"torch=={makefile_torch_pin()}"
    common = cluster_yaml.get("setup_commands") or []
    for role in ("head_setup_commands", "worker_setup_commands"):
        commands = common + cluster_yaml[role]
        torch_at = next(i for i, c in enumerate(commands) if f"pip install {torch}" in c)
        wheel_at = next(i for i, c in enumerate(commands) if f"{remote_dist}/raypipe-" in c and ".whl" in c)
        assert torch_at < wheel_at, f"{role}: torch first, else the wheel's torch range pulls another build"
        assert "--force-reinstall" in commands[wheel_at], f"{role}: a same-version older raypipe must be replaced"


def test_the_wheel_holds_exactly_this_checkouts_code(tmp_path):
    # The same command as `make wheel` (into a temporary folder instead of dist/).
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True)
    [wheel] = tmp_path.glob("raypipe-*.whl")
    tracked = subprocess.run(["git", "ls-files", "raypipe", "deployments"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.split()
    sources = {p for p in tracked if p.endswith(".py")}
    with zipfile.ZipFile(wheel) as archive:
        packed = {name for name in archive.namelist() if name.endswith(".py")}
        assert sources <= packed, f"missing from the wheel: {sorted(sources - packed)}"
        for path in sources:
            assert archive.read(path) == (ROOT / path).read_bytes(), path
        assert "deployments/config.yaml" not in packed  # data files are not code: Serve config travels separately


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [tuple(line.split(None, 1)) for line in lines]


def test_dockerfile_installs_this_repository_with_pinned_torch():
    instructions = dockerfile_instructions()
    args = {value.split("=", 1)[0]: value.split("=", 1)[1] for op, value in instructions if op == "ARG" and "=" in value}
    assert instructions[0] == ("ARG", f"BASE_IMAGE={args['BASE_IMAGE']}") and "cpu" in args["BASE_IMAGE"]
    assert ("FROM", "${BASE_IMAGE}") in instructions, "the CUDA base is a build argument"
    assert f"ray:{ray.__version__}-" in args["BASE_IMAGE"], "the base image's Ray is the Ray we pin"
    assert args["TORCH_VERSION"] == makefile_torch_pin() and args["TORCH_INDEX_URL"].endswith("/cpu")
    runs = [value for op, value in instructions if op == "RUN"]
    torch_at = next(i for i, r in enumerate(runs) if '"torch==${TORCH_VERSION}"' in r)
    repo_at = next(i for i, r in enumerate(runs) if re.search(r"pip install [^|&]*\.( |$)", r))
    assert torch_at < repo_at
    copied = {src for op, value in instructions if op == "COPY" for src in value.split()[1:-1]}
    [include] = re.findall(r"^include = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    packages = [name.strip(' "*') for name in include.split(",")]  # setuptools' package patterns
    assert packages == ["raypipe"]  # `deployments` is no package: raypipe.serve packages its config.yaml
    assert {"pyproject.toml", "README.md", "deployments", *packages} <= copied
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert all(f"!{name}" in ignore or f"!{name}/" in ignore for name in copied), "copied paths are not ignored"


@pytest.fixture(scope="module")
def rayservice() -> dict:
    return yaml.safe_load((KUBERAY / "rayservice.yaml").read_text())


def test_rayservice_serve_config_is_rendered_from_config_yaml(rayservice):
    from ray.serve.schema import ServeDeploySchema

    text = (KUBERAY / "rayservice.yaml").read_text()
    assert render.with_serve_config(text, render.gpu_serve_config(render.load_serve_config())) == text, \
        "rayservice.yaml is stale: run `python -m raypipe.serve.kuberay`"
    served = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(served)
    local = render.load_serve_config()
    assert served == render.gpu_serve_config(local)
    # ... and the GPU form differs from config.yaml only where GPUs and the proxy's interface are named.
    assert _differences(local, served) == {
        "http_options.host", "applications.0.args.encoder_gpus", "applications.0.deployments.2.ray_actor_options.num_gpus"}
    assert served["applications"][0]["deployments"][2]["name"] == "Decoder"


def _differences(a, b, path="") -> set[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return {d for k in a.keys() | b.keys() for d in _differences(a.get(k), b.get(k), f"{path}{k}.")}
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return {d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}{i}.")}
    return set() if a == b else {path.rstrip(".")}


def _check_autoscaling_cluster(spec: dict, where: str) -> list[dict]:
    assert spec["enableInTreeAutoscaling"] is True, where
    assert spec["rayVersion"] == ray.__version__, where
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0", f"{where}: the head runs no GPU work"
    for container in head["template"]["spec"]["containers"]:
        assert "nvidia.com/gpu" not in container["resources"].get("limits", {}), where
    groups = spec["workerGroupSpecs"]
    for group in groups:
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], f"{where}: {group['groupName']}"
        [container] = group["template"]["spec"]["containers"]
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1, f"{where}: {group['groupName']}"
    return groups


def test_rayservice_cluster_autoscales_gpu_workers_under_a_cpu_head(rayservice):
    groups = _check_autoscaling_cluster(rayservice["spec"]["rayClusterConfig"], "RayService")
    serve_app = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]
    decoder = next(d for d in serve_app["deployments"] if d["name"] == "Decoder")
    group = next(d for d in serve_app["deployments"] if d["name"] == "EncoderGroup")
    most_gpus = (decoder["autoscaling_config"]["max_replicas"] * decoder["ray_actor_options"]["num_gpus"]
                 + group["autoscaling_config"]["max_replicas"] * serve_app["args"]["num_encoders"]
                 * serve_app["args"]["encoder_gpus"])
    capacity = sum(g["maxReplicas"] * int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
                   for g in groups)
    assert most_gpus <= capacity, "every deployment at its max_replicas must fit on the GPU workers"


def test_rayjob_runs_the_batch_command_on_an_autoscaling_cluster():
    job = yaml.safe_load((KUBERAY / "rayjob-batch.yaml").read_text())
    assert job["kind"] == "RayJob" and job["spec"]["shutdownAfterJobFinishes"] is True
    groups = _check_autoscaling_cluster(job["spec"]["rayClusterSpec"], "RayJob")
    from raypipe.cli import build_parser

    argv = job["spec"]["entrypoint"].split()
    assert argv[0] == "raypipe"
    args = build_parser().parse_args(argv[1:])  # the entrypoint is a valid `raypipe batch` command line
    assert args.command == "batch"
    low, high = args.num_encoders
    assert 1 <= low < high <= sum(g["maxReplicas"] for g in groups), "the encoder pool can grow to its max"
    # explicit: the default share is 0 on a cluster that starts without GPU pods, and nothing would scale
    assert args.encoder_gpus == 1


def test_default_gpu_share_counts_gpu_nodes_the_autoscaler_can_start(ray_local):
    """A cluster that scales GPU nodes from zero has no GPU when the job starts: the default share
    must still be 1, or no actor ever asks for a GPU and no GPU node ever starts.

    The node types are the ClusterConfig that autoscaler v2 reports to the GCS; it is written here
    into the local Ray's GCS the way the GCS stores it (v2 does not run on the fake provider)."""
    from ray._raylet import GCS_AUTOSCALER_CLUSTER_CONFIG_KEY, GCS_AUTOSCALER_STATE_NAMESPACE
    from ray.core.generated import autoscaler_pb2
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_put

    from raypipe.runtime.ray_cluster import default_encoder_gpus

    def publish(**groups):
        config = autoscaler_pb2.ClusterConfig(node_group_configs=[
            autoscaler_pb2.NodeGroupConfig(name=name, resources=resources, min_count=0, max_count=4)
            for name, resources in groups.items()])
        _internal_kv_put(GCS_AUTOSCALER_CLUSTER_CONFIG_KEY, config.SerializeToString(), overwrite=True,
                         namespace=GCS_AUTOSCALER_STATE_NAMESPACE)

    assert ray.cluster_resources().get("GPU", 0) == 0  # the session's local Ray: CPUs only
    assert default_encoder_gpus() == 0  # no autoscaler, no GPU: a CPU-only cluster
    try:
        publish(head={"CPU": 8}, cpu_workers={"CPU": 16})
        assert default_encoder_gpus() == 0, "an autoscaler without GPU node types is still CPU-only"
        publish(head={"CPU": 8}, gpu_1x={"CPU": 8, "GPU": 1})
        assert default_encoder_gpus() == 1
    finally:
        _internal_kv_del(GCS_AUTOSCALER_CLUSTER_CONFIG_KEY, namespace=GCS_AUTOSCALER_STATE_NAMESPACE)
    assert default_encoder_gpus() == 0
