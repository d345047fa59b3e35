"""Joining Ray, and what the cluster says about resources: GPU shares and decode threads by default."""

from __future__ import annotations

import logging
import os

import ray


def connect_ray(address: str | None = None) -> None:
    """Join `address`, else the cluster named by RAY_ADDRESS or started with `ray start` on this
    machine, else start a local one.

    Not `address="auto"`: besides `ray start` clusters, "auto" also joins any Ray it finds in the
    process table, e.g. another program's private `ray.init()` cluster.
    """
    if ray.is_initialized():
        return
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=os.environ.get("RAYPIPE_RAY_LOGS") == "1")


def decode_threads(cores: int, *, encoders_on_cpu: bool) -> int:
    """torch threads for the decode engine: every core when it has the CPU to itself; half when
    encoder workers share it (they run niced, so decode wins contention, and the engine's prefill
    thread needs cores of its own too)."""
    return max(1, cores // 2) if encoders_on_cpu else cores


def default_encoder_gpus() -> float:
    """The GPU share of an encoder (and decode) actor when none is given: 1 when the cluster has GPUs
    or its autoscaler can start GPU nodes, else 0 (a CPU-only cluster).

    A cluster that scales GPU nodes from zero has no GPU when a job starts: counting only the GPUs
    present would give 0, the actors would never ask for a GPU, and no GPU node would ever start.
    The node types come from the cluster config the autoscaler publishes in the GCS (autoscaler v2,
    e.g. KubeRay with `autoscalerOptions.version: v2`). Ray's v1 autoscaler (`ray up`) publishes
    none: pass the share explicitly there (`--encoder-gpus 1`, `encoder_gpus: 1`).
    """
    if ray.cluster_resources().get("GPU", 0) >= 1:
        return 1.0
    from ray._private.state import state  # the GCS view that Ray Train and Ray Data read the same bound from

    can_scale_to = state.get_max_resources_from_cluster_config() or {}
    return 1.0 if can_scale_to.get("GPU", 0) >= 1 else 0.0
