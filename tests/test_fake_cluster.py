"""Autoscaling on a fake multi-node cluster: load brings GPU nodes up, idleness takes them away.

Serve: one cycle of `raypipe bench cluster` (see raypipe/bench/cluster.py): deploy the GPU-cluster
Serve config with the tiny preset on a head with no GPUs, push concurrent traffic until Serve has
added replicas and the autoscaler nodes (`--quick`: the Decoder's, 2 -> 3 GPU nodes), then trickle traffic
until both went back down. Every
request is counted; none may fail.

Batch: one run of `raypipe bench cluster-batch` (raypipe/bench/cluster_batch.py): an embed job
whose encoder pool (1 to 2 actors with `--quick`, a GPU each) grows onto the GPU nodes its demand brings up.

Each runs in a subprocess, so its Ray driver joins its own fake cluster without disturbing the
session's local Ray. That subprocess inherits RAY_AUTH_MODE=token from this one once any test has
called `ray.init()`; the benches restart themselves in the cluster's mode (`run_as_driver`).

The two cycles take ~5 min on 2 cores: they are marked `autoscaling` and run by `make test-autoscaling`,
not `make test` (CI's time), with the token-mode driver test, which holds the fake cluster they run on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from raypipe.bench.cluster import BASE_GPU_NODES, QUICK_AUTOSCALING, max_gpu_nodes
from raypipe.bench.cluster_batch import QUICK_ENCODERS
from raypipe.testing.fake_cluster import AUTH_MODE
from tests.conftest import reference_embeddings


@pytest.mark.autoscaling
def test_serve_scales_gpu_nodes_up_and_down_without_failed_requests(tmp_path):
    run = subprocess.run([sys.executable, "-m", "raypipe.cli", "bench", "cluster", "--quick", "--json",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((tmp_path / "cluster.json").read_text())
    [cycle] = summary["runs"]
    print(json.dumps(cycle))  # the measured times, with -s
    # the head has no GPUs: every GPU node counted here was started by the autoscaler
    assert cycle["gpu_nodes_after_deploy"] == BASE_GPU_NODES >= 1
    assert cycle["max_gpu_nodes"] == max_gpu_nodes(QUICK_AUTOSCALING) > BASE_GPU_NODES  # the Decoder's 2nd
    assert cycle["gpu_nodes_after_scale_down"] == BASE_GPU_NODES
    assert cycle["requests_during_scale_up"] > 0 and cycle["requests_during_scale_down"] > 0
    assert cycle["failed_during_scale_up"] == 0 and cycle["failed_during_scale_down"] == 0, cycle["errors"]
    assert summary["failed"] == 0


@pytest.mark.autoscaling
def test_a_token_mode_driver_keeps_its_actors_and_stop_ends_only_the_clusters_processes():
    """A process that starts with RAY_AUTH_MODE=token (as every subprocess of a test session does
    after a `ray.init()`) and then drives a fake cluster. Without `run_as_driver` it never joins
    (no GCS connection in 60 s); the benches, which set the variable after importing ray, joined
    but the GCS cancelled every actor they owned before it started ("The actor never ran").
    Then `stop()` ends the cluster's processes and no other (a bystander, this session's Ray)."""
    script = textwrap.dedent("""
        import os
        import ray
        from raypipe.testing.fake_cluster import FakeCluster, run_as_driver

        run_as_driver()

        @ray.remote(num_cpus=0.1)
        class Owned:  # not detached: it lives only while this driver holds it
            def mode(self):
                return os.environ["RAY_AUTH_MODE"]

        cluster = FakeCluster({"gpu_1x": {"resources": {"GPU": 1}, "max_workers": 1}}).start()
        try:
            assert cluster.node_count() == 1, "only the head until something asks for a GPU"
            ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
            print("driver", os.environ["RAY_AUTH_MODE"], "actor", ray.get(Owned.remote().mode.remote(), timeout=120))
            ray.shutdown()
            print("own", *sorted(cluster.own_pids()))
        finally:
            cluster.stop()
        print("left", *sorted(cluster.own_pids()), "temp dir", cluster.temp_dir.exists())
    """)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    try:
        run = subprocess.run([sys.executable, "-c", script], env={**os.environ, "RAY_AUTH_MODE": "token"},
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        assert f"driver {AUTH_MODE} actor {AUTH_MODE}" in run.stdout
        [own] = [line.split()[1:] for line in run.stdout.splitlines() if line.startswith("own")]
        assert own and str(bystander.pid) not in own
        assert "left temp dir False" in run.stdout  # no process of the cluster left, its temp dir removed
        assert bystander.poll() is None, "a process outside the cluster was stopped"
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.autoscaling
def test_batch_encoder_pool_grows_onto_new_gpu_nodes_and_writes_each_input_once(tmp_path, tiny_ckpt, hf_model):
    """`raypipe batch --num-encoders 1:3 --encoder-gpus 1` on a head with no GPUs: the pool's actors
    bring up GPU nodes, the pool grows onto them, and the output holds every input exactly once
    with the embedding transformers' vision tower gives."""
    # started in token mode, as after any ray.init() in this session: the bench must still drive the cluster
    run = subprocess.run([sys.executable, "-m", "raypipe.cli", "bench", "cluster-batch", "--quick", "--json",
                          "--out", str(tmp_path)], env={**os.environ, "RAY_AUTH_MODE": "token"},
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [cycle] = json.loads((tmp_path / "cluster_batch.json").read_text())["runs"]
    print(json.dumps({k: v for k, v in cycle.items() if k != "summary"}))  # the measured times, with -s
    # Encoder actors alive at the same time on distinct GPU nodes, each started by the autoscaler
    # (the head has none): the pool grew past its minimum of 1 onto new nodes, within its maximum.
    assert cycle["max_encoder_nodes_at_once"] >= 2 and len(cycle["encoder_nodes"]) >= 2
    assert cycle["encoders"] == list(QUICK_ENCODERS)
    assert cycle["max_encoders_alive"] <= QUICK_ENCODERS[1] and cycle["max_gpu_nodes"] <= 3  # the node type's max
    assert cycle["first_gpu_node_s"] < cycle["second_encoder_s"] < cycle["job_s"]
    assert cycle["scale_down_s"] is not None, "the GPU nodes outlived the job"

    work = tmp_path / "cluster-batch" / "run0"
    names = sorted(p.name for p in (work / "in").iterdir())
    assert len(names) == cycle["images"]
    table = pa.concat_tables([pq.read_table(p) for p in sorted((work / "out").glob("part-*.parquet"))])
    rows = {r["id"]: r for r in table.to_pylist()}
    assert sorted(rows) == names and table.num_rows == len(names)  # every input, exactly once
    assert cycle["summary"]["processed"] == len(names) and cycle["summary"]["errors"] == {}
    assert all(r["error"] is None and r["model"] == str(tiny_ckpt) for r in rows.values())
    sample = names[::24]  # 15 images: transformers' reference is computed in this process
    images = [np.asarray(Image.open(work / "in" / name).convert("RGB")) for name in sample]
    for name, reference in zip(sample, reference_embeddings(hf_model, tiny_ckpt, images)):
        np.testing.assert_allclose(np.asarray(rows[name]["embedding"], np.float32),
                                   reference.float().mean(0).numpy(), atol=1e-5, rtol=0)
