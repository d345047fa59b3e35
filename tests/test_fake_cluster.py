"""Autoscaling on a fake multi-node cluster: load brings GPU nodes up, idleness takes them away.

Serve: one cycle of `raypipe bench cluster` (see raypipe/bench/cluster.py): deploy the GPU-cluster
Serve config with the tiny preset on a head with no GPUs, push concurrent traffic until Serve has
added replicas and the autoscaler nodes, then trickle traffic until both went back down. Every
request is counted; none may fail.

The batch counterpart (a job's encoder pool growing onto new GPU nodes) is `raypipe bench
cluster-batch`; its test was taken out of CI: on a quiet machine Ray Data cancelled a pending pool
actor while resizing the pool and failed the job on every attempt (README "Scaling out").

The Serve cycle runs in a subprocess, so its Ray driver joins its own fake cluster without disturbing the
session's local Ray.
"""

from __future__ import annotations

import json
import subprocess
import sys

from raypipe.bench.cluster import BASE_GPU_NODES, MAX_GPU_NODES
from raypipe.bench.fake_cluster import FakeCluster


def test_serve_scales_gpu_nodes_up_and_down_without_failed_requests(tmp_path):
    run = subprocess.run([sys.executable, "-m", "raypipe.cli", "bench", "cluster", "--quick", "--json",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((tmp_path / "cluster.json").read_text())
    [cycle] = summary["runs"]
    print(json.dumps(cycle))  # the measured times, with -s
    # the head has no GPUs: every GPU node counted here was started by the autoscaler
    assert cycle["gpu_nodes_after_deploy"] == BASE_GPU_NODES >= 1
    assert cycle["max_gpu_nodes"] == MAX_GPU_NODES > BASE_GPU_NODES
    assert cycle["gpu_nodes_after_scale_down"] == BASE_GPU_NODES
    assert cycle["requests_during_scale_up"] > 0 and cycle["requests_during_scale_down"] > 0
    assert cycle["failed_during_scale_up"] == 0 and cycle["failed_during_scale_down"] == 0, cycle["errors"]
    assert summary["failed"] == 0


def test_fake_cluster_stops_only_its_own_processes():
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    cluster = FakeCluster({"gpu_1x": {"resources": {"GPU": 1}, "max_workers": 1}}).start()
    try:
        own = cluster.own_pids()
        assert own and bystander.pid not in own
        assert cluster.node_count() == 1, "only the head until something asks for a GPU"
    finally:
        cluster.stop()
    assert cluster.own_pids() == set() and not cluster.temp_dir.exists()
    assert bystander.poll() is None, "a process outside the cluster was stopped"
    bystander.kill()
    bystander.wait()



