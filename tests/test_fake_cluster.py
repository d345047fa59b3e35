"""Autoscaling on a fake multi-node cluster: Serve load brings GPU nodes up, idleness takes them away.

One cycle of `raypipe bench cluster` (see raypipe/bench/cluster.py) in a subprocess, so its Ray
driver joins the fake cluster without disturbing the session's local Ray: deploy the GPU-cluster
Serve config with the tiny preset on a head with no GPUs, push concurrent traffic until Serve has
added replicas and the autoscaler nodes, then trickle traffic until both went back down. Every
request is counted; none may fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pyarrow.parquet as pq
from PIL import Image

from raypipe.bench.cluster import BASE_GPU_NODES, MAX_GPU_NODES
from raypipe.bench.fake_cluster import AUTH_MODE, FakeCluster


def test_serve_scales_gpu_nodes_up_and_down_without_failed_requests(tmp_path):
    run = subprocess.run([sys.executable, "-m", "raypipe.cli", "bench", "cluster", "--quick", "--json",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((tmp_path / "cluster.json").read_text())
    [cycle] = summary["runs"]
    # the head has no GPUs: every GPU node counted here was started by the autoscaler
    assert cycle["gpu_nodes_after_deploy"] == BASE_GPU_NODES >= 1
    assert cycle["max_gpu_nodes"] == MAX_GPU_NODES > BASE_GPU_NODES
    assert cycle["gpu_nodes_after_scale_down"] == BASE_GPU_NODES
    assert cycle["requests_during_scale_up"] > 0 and cycle["requests_during_scale_down"] > 0
    assert cycle["failed_during_scale_up"] == 0 and cycle["failed_during_scale_down"] == 0, cycle["errors"]
    assert summary["failed"] == 0


def test_fake_cluster_stops_only_its_own_processes():
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    cluster = FakeCluster({"gpu_1x": {"resources": {"GPU": 1}, "max_workers": 1}}).start()
    try:
        own = cluster.own_pids()
        assert own and bystander.pid not in own
    finally:
        cluster.stop()
    assert cluster.own_pids() == set() and not cluster.temp_dir.exists()
    assert bystander.poll() is None, "a process outside the cluster was stopped"
    bystander.kill()
    bystander.wait()


def test_batch_encoder_pool_grows_onto_new_nodes_and_writes_every_input_once(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(48):
        Image.fromarray(rng.integers(0, 256, (336, 448, 3), dtype=np.uint8)).save(images / f"img{i:03d}.png")
    out = tmp_path / "out"
    # The pool starts with one encoder on one GPU node; each further encoder needs a new node. The
    # `small` preset makes encoding, not PNG decoding on the head's CPUs, the bottleneck: Ray Data
    # grows a pool (and asks the cluster for GPUs) only when that pool is what holds the job back.
    cluster = FakeCluster({"gpu_1x": {"resources": {"CPU": 0, "GPU": 1}, "max_workers": 3}}).start()
    peak = {"gpu_nodes": 0}
    done = threading.Event()

    def watch():
        while not done.wait(0.5):
            peak["gpu_nodes"] = max(peak["gpu_nodes"], cluster.node_count() - 1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        env = {**os.environ, "RAY_ADDRESS": cluster.address, "RAY_AUTH_MODE": AUTH_MODE}
        # --encoder-gpus 1: the head has no GPU, so "1 if the cluster has GPUs" would mean 0 here
        run = subprocess.run([sys.executable, "-m", "raypipe.cli", "batch", "--model", "small", "--input", str(images),
                              "--output", str(out), "--task", "embed", "--num-encoders", "1:3", "--encoder-gpus", "1",
                              "--batching", "count", "--batch-images", "1", "--read-batch", "4", "--json"],
                             env=env, capture_output=True, text=True, timeout=600)
    finally:
        done.set()
        watcher.join()
        cluster.stop()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert peak["gpu_nodes"] == 3, f"the encoder pool did not grow to 3 actors on 3 GPU nodes: {peak}"
    ids = pq.read_table(out).column("id").to_pylist()
    assert sorted(ids) == sorted(str(images / f"img{i:03d}.png") for i in range(48))  # each exactly once
